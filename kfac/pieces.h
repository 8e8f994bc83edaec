#pragma once
// Pieces of a divisible K-FAC task. The PipeFisher pass may cut a curvature, inversion or
// precondition task into pieces that run in different bubbles; a piece is the part
// [unit_begin, unit_end) of kPieceUnits equal shares of its task's work. Each kind maps the
// shares onto its own items: curvature onto token rows, preconditioning onto gradient rows,
// inversion onto the steps of its chain (by cumulative FLOPs, inverse_chain.h).
#include <cstdint>
#include <string_view>

namespace pf::kfac {

// Whole task = [0, kPieceUnits). A power of two so that halving stays exact; small enough for
// the instruction's 16-bit fields.
inline constexpr int kPieceUnits = 4096;

struct ItemRange {
  std::int64_t begin = 0;
  std::int64_t end = 0;
  std::int64_t size() const { return end - begin; }
};

// Throws std::invalid_argument naming `what` unless 0 <= unit_begin < unit_end <= kPieceUnits.
void check_piece_units(int unit_begin, int unit_end, std::string_view what);

// The items [count * unit_begin / U, count * unit_end / U) of `count` items. Consecutive pieces
// cover every item exactly once; a piece narrower than one item may be empty.
ItemRange piece_items(std::int64_t count, int unit_begin, int unit_end);

}  // namespace pf::kfac
