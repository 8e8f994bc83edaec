// The device-independent decisions of the NCCL communicator, on the CPU: the issue order of a
// batch of point-to-point operations, and which GPU a rank drives.
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "runtime/comm/p2p_order.h"
#include "runtime/comm/rank_device.h"

namespace pf::comm {
namespace {

TEST(P2pOrder, IssuesInAscendingPairIdWhateverThePostingOrder) {
  // Worker 1 of 1F1B posts the receive of the next activation before sending the gradient of
  // an earlier micro-batch; its peers issue by pair id, so must it.
  const std::vector<P2pOperation> batch = {
      {false, 0, 9, 64},  // receive activation, pair 9
      {true, 0, 7, 64},   // send gradient, pair 7
      {true, 2, 8, 128},  // send activation onwards, pair 8
  };
  EXPECT_EQ(p2p_issue_order(batch), (std::vector<std::size_t>{1, 2, 0}));
}

TEST(P2pOrder, EqualPairIdsKeepTheirPostingOrder) {
  // Pair ids repeat from one step to the next: FIFO among equals.
  const std::vector<P2pOperation> batch = {
      {true, 1, 3, 8}, {false, 1, 2, 8}, {true, 1, 3, 16}, {false, 2, 3, 8}};
  EXPECT_EQ(p2p_issue_order(batch), (std::vector<std::size_t>{1, 0, 2, 3}));
}

TEST(P2pOrder, BothSidesOfEveryPairAgreeOnTheMatch) {
  // Rank 0 and rank 1 exchange three pairs, each side posting in a different order. NCCL
  // matches the k-th send of one side with the k-th receive of the other, per direction: after
  // ordering, the k-th operations carry the same pair id.
  const std::vector<P2pOperation> rank0 = {{true, 1, 5, 8}, {false, 1, 4, 8}, {true, 1, 6, 8}};
  const std::vector<P2pOperation> rank1 = {{false, 0, 6, 8}, {false, 0, 5, 8}, {true, 0, 4, 8}};
  auto sequence = [](const std::vector<P2pOperation>& batch, bool send) {
    std::vector<std::int64_t> tags;
    for (auto index : p2p_issue_order(batch)) {
      if (batch[index].send == send) tags.push_back(batch[index].tag);
    }
    return tags;
  };
  EXPECT_EQ(sequence(rank0, true), sequence(rank1, false));
  EXPECT_EQ(sequence(rank0, false), sequence(rank1, true));
  EXPECT_EQ(sequence(rank0, true), (std::vector<std::int64_t>{5, 6}));
}

TEST(P2pOrder, DescribesAndChecksOperations) {
  EXPECT_EQ(to_string(P2pOperation{true, 1, 7, 64}), "send of 64 bytes to rank 1 (pair 7)");
  EXPECT_EQ(to_string(P2pOperation{false, 0, 2, 8}), "receive of 8 bytes from rank 0 (pair 2)");
  const std::vector<P2pOperation> fine = {{true, 0, 0, 8}, {false, 1, 3, 8}};
  EXPECT_NO_THROW(check_p2p_batch(fine, 0, 2));
  try {
    check_p2p_batch(std::vector<P2pOperation>{{true, 2, 1, 8}}, 0, 2);
    FAIL();
  } catch (const std::invalid_argument& error) {
    EXPECT_EQ(std::string(error.what()),
              "rank 0: send of 8 bytes to rank 2 (pair 1): peer out of range [0, 2)");
  }
  EXPECT_THROW(check_p2p_batch(std::vector<P2pOperation>{{false, 1, -1, 8}}, 0, 2),
               std::invalid_argument);
}

TEST(RankDevice, LocalRankIsTheGpu) {
  for (int local = 0; local < 8; ++local) {
    EXPECT_EQ(device_for_local_rank(8 + local, local, 8, false), local);
  }
}

TEST(RankDevice, MoreRanksThanGpusIsAnErrorUnlessShared) {
  try {
    device_for_local_rank(9, 1, 1, false);
    FAIL();
  } catch (const std::invalid_argument& error) {
    EXPECT_EQ(std::string(error.what()),
              "rank 9 (local rank 1 on its node): only 1 GPU(s) visible on its node; start at "
              "most one rank per GPU (mpirun -np <nodes x GPUs per node>)");
  }
  EXPECT_EQ(device_for_local_rank(1, 1, 1, true), 0);
  EXPECT_EQ(device_for_local_rank(5, 5, 4, true), 1);
  EXPECT_THROW(device_for_local_rank(0, 0, 0, true), std::invalid_argument);
  EXPECT_THROW(device_for_local_rank(0, -1, 2, false), std::invalid_argument);
}

}  // namespace
}  // namespace pf::comm
