#pragma once
// The order in which a batch of point-to-point operations is handed to a transport that matches
// messages by issue order per peer rather than by tag (NCCL: the k-th ncclSend to a peer meets
// that peer's k-th ncclRecv from this rank).
//
// The lowering pass gives every send/receive pair a fresh pair id in one global order that each
// worker's stream follows (docs/scheduler.md), so issuing in ascending pair id makes both sides
// of every pair agree on the match, whatever order the executor posted a batch's operations in;
// grouping the batch (ncclGroupStart/End) lets all of them progress together, so no pair waits
// for one issued behind it. Pair ids repeat from one training step to the next, so the order is
// only defined within a batch: operations with equal ids keep their posting order (FIFO).
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace pf::comm {

struct P2pOperation {
  bool send = true;
  int peer = -1;
  std::int64_t tag = -1;  // the schedule's pair id
  std::size_t bytes = 0;
};

// "send of 64 bytes to rank 1 (pair 7)"
std::string to_string(const P2pOperation& operation);

// Indices into `batch` in issue order: ascending tag, stable.
std::vector<std::size_t> p2p_issue_order(std::span<const P2pOperation> batch);

// Checks a batch before it is issued: peers in [0, size), tags non-negative; throws
// std::invalid_argument naming the operation and the rank.
void check_p2p_batch(std::span<const P2pOperation> batch, int rank, int size);

}  // namespace pf::comm
