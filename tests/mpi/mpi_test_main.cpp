// main() of the MPI test programs, run as `mpirun -np N <test>`: MPI is initialised once for
// every test; rank 0 prints GoogleTest's usual report, the other ranks only their failures
// (prefixed with the rank), and each rank's exit status says whether its checks passed.
#include <cstdio>

#include <gtest/gtest.h>

#include "tests/mpi/mpi_test_env.h"

namespace {

class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: %s\n", rank_,
                 result.file_name() != nullptr ? result.file_name() : "?", result.line_number(),
                 result.summary());
  }

 private:
  int rank_;
};

}  // namespace

int main(int argc, char** argv) {
  pf::comm::MpiSession session(&argc, &argv);
  pf::testing::set_mpi_session(session);
  ::testing::InitGoogleTest(&argc, argv);
  if (session.world_rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(session.world_rank()));
  }
  return RUN_ALL_TESTS();
}
