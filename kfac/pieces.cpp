#include "kfac/pieces.h"

#include <stdexcept>
#include <string>

namespace pf::kfac {

void check_piece_units(int unit_begin, int unit_end, std::string_view what) {
  if (unit_begin < 0 || unit_begin >= unit_end || unit_end > kPieceUnits) {
    throw std::invalid_argument(
        std::string(what) + ": piece [" + std::to_string(unit_begin) + ", " +
        std::to_string(unit_end) + ") of a task's " + std::to_string(kPieceUnits) +
        " units must satisfy 0 <= begin < end <= " + std::to_string(kPieceUnits));
  }
}

ItemRange piece_items(std::int64_t count, int unit_begin, int unit_end) {
  check_piece_units(unit_begin, unit_end, "piece_items");
  if (count < 0) throw std::invalid_argument("piece_items: negative item count");
  return {count * unit_begin / kPieceUnits, count * unit_end / kPieceUnits};
}

}  // namespace pf::kfac
