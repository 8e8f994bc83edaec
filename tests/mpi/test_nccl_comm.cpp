// The NCCL communicator under mpirun, one GPU per rank: `mpirun -np 1` on the lent machine's
// one GPU (communicator of one rank, send/receive to itself, an all-reduce of one rank, the
// watchdog's abort path), and with more ranks where there are GPUs for them (or where NCCL
// accepts several ranks on one GPU: PF_NCCL_SHARE_GPU=1, scripts/gpu_session.sh asks).
// Skipped without a CUDA device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_backend.h"
#include "runtime/comm/nccl_communicator.h"
#include "tests/mpi/mpi_test_env.h"

namespace pf::comm {
namespace {

using namespace std::chrono_literals;

bool share_gpu() {
  const char* value = std::getenv("PF_NCCL_SHARE_GPU");  // NOLINT(concurrency-mt-unsafe)
  return value != nullptr && std::string(value) == "1";
}

// Every rank must take the same decision: a skip on one rank and a collective on another hangs.
#define SKIP_WITHOUT_GPUS()                                                   \
  do {                                                                        \
    if (kernels::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device"; \
  } while (false)

Deadline soon() {
  return Clock::now() + 60s;
}

std::vector<int> world_of(const Communicator& comm) {
  std::vector<int> world(static_cast<std::size_t>(comm.size()));
  std::iota(world.begin(), world.end(), 0);
  return world;
}

// Device memory for a test, freed at scope end.
template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(std::size_t n) : n_(n) {
    EXPECT_EQ(cudaMalloc(&data_, n * sizeof(T)), cudaSuccess);
  }
  ~DeviceArray() { cudaFree(data_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  T* get() const { return data_; }
  std::span<T> span() const { return {data_, n_}; }
  void upload(const std::vector<T>& values) {
    ASSERT_EQ(cudaMemcpy(data_, values.data(), n_ * sizeof(T), cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  std::vector<T> download() const {
    std::vector<T> values(n_);
    EXPECT_EQ(cudaMemcpy(values.data(), data_, n_ * sizeof(T), cudaMemcpyDeviceToHost),
              cudaSuccess);
    return values;
  }

 private:
  T* data_ = nullptr;
  std::size_t n_;
};

NcclOptions test_options() {
  NcclOptions options;
  options.operation_timeout = 60s;
  options.share_devices = share_gpu();
  return options;
}

TEST(NcclComm, WorldOfEveryRankOnItsGpu) {
  SKIP_WITHOUT_GPUS();
  MpiCommunicator mpi(pf::testing::mpi_session());
  NcclCommunicator nccl(mpi, test_options());
  EXPECT_EQ(nccl.rank(), mpi.rank());
  EXPECT_EQ(nccl.size(), mpi.size());
  EXPECT_GE(nccl.device(), 0);
  EXPECT_EQ(nccl.payload_bytes_sent(), 0);
}

TEST(NcclComm, SendsToTheNextRankAndReceivesFromThePreviousInOneGroup) {
  // With one rank: a send to itself and the matching receive, grouped (NCCL needs both in one
  // group). With N: a ring, where ungrouped blocking sends would deadlock.
  SKIP_WITHOUT_GPUS();
  MpiCommunicator mpi(pf::testing::mpi_session());
  NcclCommunicator nccl(mpi, test_options());
  const int rank = nccl.rank(), size = nccl.size();
  const int next = (rank + 1) % size, previous = (rank + size - 1) % size;
  constexpr std::size_t n = 1000;
  DeviceArray<float> outgoing(n), incoming(n);
  std::vector<float> values(n);
  for (std::size_t i = 0; i < n; ++i) values[i] = static_cast<float>(rank * 10000 + i);
  outgoing.upload(values);
  nccl.begin_batch();
  // Posted receive-first with a later pair id on the send: the batch issues by pair id.
  auto receive = nccl.irecv(previous, 11, std::as_writable_bytes(incoming.span()));
  auto send = nccl.isend(next, 11, std::as_bytes(outgoing.span()));
  nccl.end_batch();
  receive->wait(soon());
  send->wait(soon());
  EXPECT_TRUE(send->test());
  const auto got = incoming.download();
  for (std::size_t i = 0; i < n; i += 97) {
    EXPECT_EQ(got[i], static_cast<float>(previous * 10000 + i)) << i;
  }
  EXPECT_EQ(nccl.payload_bytes_sent(), static_cast<std::int64_t>(n * sizeof(float)));
}

TEST(NcclComm, HostBuffersAreStaged) {
  SKIP_WITHOUT_GPUS();
  MpiCommunicator mpi(pf::testing::mpi_session());
  NcclCommunicator nccl(mpi, test_options());
  const int rank = nccl.rank(), size = nccl.size();
  std::vector<std::int64_t> outgoing = {rank, rank * 2, 7};
  std::vector<std::int64_t> incoming(3, -1);
  nccl.begin_batch();
  auto send = nccl.isend((rank + 1) % size, 0, std::as_bytes(std::span(outgoing)));
  auto receive =
      nccl.irecv((rank + size - 1) % size, 0, std::as_writable_bytes(std::span(incoming)));
  nccl.end_batch();
  receive->wait(soon());
  send->wait(soon());
  const int previous = (rank + size - 1) % size;
  EXPECT_EQ(incoming, (std::vector<std::int64_t>{previous, previous * 2, 7}));
}

TEST(NcclComm, AllReduceSumsOverTheWorldOnDeviceAndHost) {
  SKIP_WITHOUT_GPUS();
  MpiCommunicator mpi(pf::testing::mpi_session());
  NcclCommunicator nccl(mpi, test_options());
  const int rank = nccl.rank(), size = nccl.size();
  const auto world = world_of(nccl);
  // Integers in floats: every order of summation gives the exact sum.
  constexpr std::size_t n = 4097;
  std::vector<float> values(n);
  for (std::size_t i = 0; i < n; ++i) values[i] = static_cast<float>((rank + 1) * (i % 100));
  DeviceArray<float> device(n);
  device.upload(values);
  nccl.all_reduce_sum(device.span(), world, soon());
  const float ranks_sum = static_cast<float>(size * (size + 1) / 2);
  const auto reduced = device.download();
  for (std::size_t i = 0; i < n; i += 101) {
    EXPECT_EQ(reduced[i], ranks_sum * static_cast<float>(i % 100)) << i;
  }
  std::vector<double> host = {1.5 * rank, 0.25, -1.0};
  nccl.all_reduce_sum(std::span(host), world, soon());
  EXPECT_DOUBLE_EQ(host[0], 1.5 * size * (size - 1) / 2);
  EXPECT_DOUBLE_EQ(host[1], 0.25 * size);
  EXPECT_DOUBLE_EQ(host[2], -1.0 * size);
}

TEST(NcclComm, BroadcastAndSubgroups) {
  SKIP_WITHOUT_GPUS();
  MpiCommunicator mpi(pf::testing::mpi_session());
  NcclCommunicator nccl(mpi, test_options());
  const int rank = nccl.rank(), size = nccl.size();
  const int root = size - 1;
  std::vector<std::int32_t> payload(33, rank == root ? 42 : 0);
  nccl.broadcast(std::as_writable_bytes(std::span(payload)), root, world_of(nccl), soon());
  EXPECT_EQ(payload, std::vector<std::int32_t>(33, 42));
  // A group of the even ranks gets its own communicator, created by its members only.
  if (rank % 2 == 0) {
    std::vector<int> evens;
    for (int r = 0; r < size; r += 2) evens.push_back(r);
    std::vector<float> data = {static_cast<float>(rank)};
    nccl.all_reduce_sum(std::span(data), evens, soon());
    float expected = 0;
    for (int r : evens) expected += static_cast<float>(r);
    EXPECT_EQ(data[0], expected);
    // A group of this rank alone: nothing moves.
    std::vector<float> alone = {3.0F};
    nccl.all_reduce_sum(std::span(alone), std::vector<int>{rank}, soon());
    EXPECT_EQ(alone[0], 3.0F);
  }
  mpi.barrier(soon());
}

TEST(NcclComm, AsyncAllReduceIsOrderedWithAComputeStreamByEvents) {
  // The executor's gradient path: compute writes, the communicator's stream waits for its
  // event, reduces, and the compute stream waits for the reduction; the host does not wait
  // until it reads the result.
  SKIP_WITHOUT_GPUS();
  MpiCommunicator mpi(pf::testing::mpi_session());
  NcclCommunicator nccl(mpi, test_options());
  const int size = nccl.size();
  kernels::cuda::CudaStream compute;
  kernels::cuda::CudaEvent produced;
  constexpr std::size_t n = 1 << 20;
  DeviceArray<float> gradient(n);
  std::vector<float> ones(n, 1.0F);
  // Written on the compute stream (asynchronously, from pinned memory would be faster; the
  // order is what matters).
  ASSERT_EQ(cudaMemcpyAsync(gradient.get(), ones.data(), n * sizeof(float), cudaMemcpyHostToDevice,
                            compute.get()),
            cudaSuccess);
  produced.record(compute);
  nccl.wait_on_device(produced);
  nccl.set_activity(3, "RG0.c0");
  nccl.all_reduce_sum_async(gradient.span(), world_of(nccl), soon());
  nccl.order_before(compute);
  std::vector<float> result(n);
  ASSERT_EQ(cudaMemcpyAsync(result.data(), gradient.get(), n * sizeof(float),
                            cudaMemcpyDeviceToHost, compute.get()),
            cudaSuccess);
  compute.synchronize();
  EXPECT_EQ(result.front(), static_cast<float>(size));
  EXPECT_EQ(result.back(), static_cast<float>(size));
}

TEST(NcclComm, AStuckReceiveFailsNamingThePositionAndAbortsTheCommunicator) {
  // A receive nobody sends to (from this rank itself: every rank alone, no peer involved)
  // never completes: the watchdog aborts the NCCL communicator at its deadline (TimeoutError),
  // or NCCL refuses a lone receive from self at issue (an asynchronous error, AbortedError).
  // Either way the waiting thread throws naming the rank, the stream position and the
  // instruction, and the communicator is gone.
  SKIP_WITHOUT_GPUS();
  MpiCommunicator mpi(pf::testing::mpi_session());
  NcclOptions options = test_options();
  options.operation_timeout = 300ms;
  NcclCommunicator nccl(mpi, options);
  const int rank = nccl.rank();
  DeviceArray<float> buffer(16);
  nccl.set_activity(7, "RA3.c1<-w0");
  const auto start = Clock::now();
  std::string message;
  try {
    auto receive = nccl.irecv(rank, 5, std::as_writable_bytes(buffer.span()));
    receive->wait(soon());
    FAIL() << "a receive without a send completed";
  } catch (const TimeoutError& error) {
    message = error.what();
    std::printf("[rank %d] the stuck receive timed out: %s\n", rank, error.what());
  } catch (const AbortedError& error) {
    message = error.what();
    std::printf("[rank %d] NCCL refused the lone receive: %s\n", rank, error.what());
  }
  EXPECT_NE(message.find("rank " + std::to_string(rank) +
                         ", stream position 7 (RA3.c1<-w0): ncclGroup of 1: receive of 64 "
                         "bytes from rank " +
                         std::to_string(rank) + " (pair 5)"),
            std::string::npos)
      << message;
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 30.0);
  // The communicator is gone: every later call reports the same failure.
  std::vector<float> data = {1.0F};
  EXPECT_ANY_THROW(nccl.all_reduce_sum(std::span(data), world_of(nccl), soon()));
  EXPECT_ANY_THROW(nccl.isend(rank, 6, std::as_bytes(buffer.span())));
  mpi.barrier(soon());
}

TEST(NcclComm, AbortLocalFailsEveryLaterCall) {
  SKIP_WITHOUT_GPUS();
  MpiCommunicator mpi(pf::testing::mpi_session());
  NcclCommunicator nccl(mpi, test_options());
  nccl.abort_local("rank " + std::to_string(nccl.rank()) + " gave up on purpose");
  std::vector<double> data = {1.0};
  try {
    nccl.all_reduce_sum(std::span(data), world_of(nccl), soon());
    FAIL();
  } catch (const AbortedError& error) {
    EXPECT_NE(std::string(error.what()).find("gave up on purpose"), std::string::npos);
  }
  mpi.barrier(soon());
}

}  // namespace
}  // namespace pf::comm
