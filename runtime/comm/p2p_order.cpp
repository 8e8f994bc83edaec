#include "runtime/comm/p2p_order.h"

#include <algorithm>
#include <numeric>
#include <stdexcept>

namespace pf::comm {

std::string to_string(const P2pOperation& operation) {
  return std::string(operation.send ? "send of " : "receive of ") +
         std::to_string(operation.bytes) + " bytes " + (operation.send ? "to" : "from") + " rank " +
         std::to_string(operation.peer) + " (pair " + std::to_string(operation.tag) + ")";
}

std::vector<std::size_t> p2p_issue_order(std::span<const P2pOperation> batch) {
  std::vector<std::size_t> order(batch.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return batch[a].tag < batch[b].tag; });
  return order;
}

void check_p2p_batch(std::span<const P2pOperation> batch, int rank, int size) {
  for (const auto& operation : batch) {
    if (operation.peer < 0 || operation.peer >= size) {
      throw std::invalid_argument("rank " + std::to_string(rank) + ": " + to_string(operation) +
                                  ": peer out of range [0, " + std::to_string(size) + ")");
    }
    if (operation.tag < 0) {
      throw std::invalid_argument("rank " + std::to_string(rank) + ": " + to_string(operation) +
                                  ": pair ids are non-negative");
    }
  }
}

}  // namespace pf::comm
