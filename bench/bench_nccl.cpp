// NCCL overheads of our communicator (docs/benchmarks.md, "NCCL one-rank overheads"): every
// operation through comm::NcclCommunicator side by side with the same operation in raw NCCL
// calls, in the same run, nccl-tests style (sizes from bytes to hundreds of MiB, warm-up, timed
// iterations, every result checked). Made for the lent machine's one GPU (NCCL there refuses two
// ranks on one GPU), so one rank; with one GPU per rank it runs on N ranks as well:
//
//   mpirun -np 1 bench_nccl [--min-bytes 4] [--max-bytes 268435456] [--factor 4] [--iters 20]
//          [--warmup 5] [--repeats 3] [--creations 3] [--max-host-bytes 67108864]
//   mpirun -np 1 bench_nccl --smoke   (sizes up to 64 KiB, few iterations: the test suite)
//
// What it measures (rank 0 prints one table per operation, then one summary line each):
// - creation: MPI_Init (the session, once); the CUDA context (once); the NCCL world: our
//   constructor (local rank, GPU choice agreed over MPI, stream, watchdog thread, unique id over
//   MPI, ncclCommInitRankConfig non-blocking, settled by polling) against raw
//   ncclGetUniqueId + MPI_Bcast + ncclCommInitRankConfig (same non-blocking config) + polling;
//   and their destruction (ncclCommFinalize + polling + ncclCommDestroy).
// - all-reduce (sum of floats, in place, device memory): blocking (ours: all_reduce_sum, which
//   waits on the host; raw: ncclAllReduce + cudaStreamSynchronize per call) and back to back
//   (ours: all_reduce_sum_async x iters, then synchronize(); raw: ncclAllReduce x iters, then
//   cudaStreamSynchronize: the nccl-tests figure, algorithm bandwidth = bytes / time).
// - broadcast (bytes from rank 0, in place, device memory; ours always waits on the host).
// - send/recv: a grouped send to the next rank and receive from the previous (with one rank,
//   to itself) as the pipeline issues them (ours: begin_batch, irecv, isend, end_batch, wait
//   both; raw: ncclGroupStart, ncclSend, ncclRecv, ncclGroupEnd, cudaStreamSynchronize).
// - host staging: all-reduce of a pageable host vector (ours: staged through stream-ordered
//   device scratch, cudaMallocAsync / copies / cudaFreeAsync; raw: cudaMemcpyAsync into a
//   device buffer allocated once, ncclAllReduce, cudaMemcpyAsync back, cudaStreamSynchronize),
//   up to --max-host-bytes; its cost is the host figure minus the device one.
// Times are wall-clock on the host around `iters` operations after `warmup`, per operation; each
// figure is the median over `repeats` rounds in which ours and raw alternate (who goes first
// swaps). The ratio is ours / raw time. Before timing, each operation and size runs once through
// each path on a known pattern and the result is compared element by element with the expected
// one (the sum over ranks of rank-dependent integers, exact in floats; the root's bytes; the
// previous rank's data); any mismatch fails the run (exit 1). The last line, "bench_nccl: every
// result verified", comes only when all checks passed.
//
// Without a CUDA device it prints "bench_nccl: no CUDA device, nothing measured" and exits 0
// (CI builds and smoke-runs it on CPUs). Fewer GPUs than ranks on a node: one error line, exit 2.
#include <cuda_runtime.h>
#include <mpi.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iostream>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "kernels/cuda/cuda_backend.h"
#include "runtime/comm/mpi_communicator.h"
#include "runtime/comm/nccl_communicator.h"

namespace {

using namespace pf;
using SteadyClock = std::chrono::steady_clock;

struct Settings {
  std::size_t min_bytes = 4;
  std::size_t max_bytes = std::size_t{256} << 20;
  std::size_t factor = 4;
  int iters = 20;
  int warmup = 5;
  int repeats = 3;
  int creations = 3;
  std::size_t max_host_bytes = std::size_t{64} << 20;
};

std::size_t parse_size(const std::string& flag, const char* value, std::size_t low,
                       std::size_t high) {
  char* end = nullptr;
  const unsigned long long parsed = std::strtoull(value, &end, 10);
  if (end == value || *end != '\0' || parsed < low || parsed > high) {
    throw std::invalid_argument(flag + " " + value + ": not a number in [" + std::to_string(low) +
                                ", " + std::to_string(high) + "]");
  }
  return static_cast<std::size_t>(parsed);
}

Settings parse(int argc, char** argv) {
  Settings s;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--smoke") {
      s.max_bytes = std::size_t{64} << 10;
      s.factor = 16;
      s.iters = 3;
      s.warmup = 1;
      s.repeats = 1;
      s.creations = 1;
      continue;
    }
    if (i + 1 >= argc) throw std::invalid_argument(flag + ": needs a value (see the header)");
    const char* value = argv[++i];
    constexpr std::size_t kGiB = std::size_t{1} << 30;
    if (flag == "--min-bytes") {
      s.min_bytes = parse_size(flag, value, 4, 4 * kGiB);
    } else if (flag == "--max-bytes") {
      s.max_bytes = parse_size(flag, value, 4, 4 * kGiB);
    } else if (flag == "--factor") {
      s.factor = parse_size(flag, value, 2, 1024);
    } else if (flag == "--iters") {
      s.iters = static_cast<int>(parse_size(flag, value, 1, 100000));
    } else if (flag == "--warmup") {
      s.warmup = static_cast<int>(parse_size(flag, value, 0, 100000));
    } else if (flag == "--repeats") {
      s.repeats = static_cast<int>(parse_size(flag, value, 1, 1000));
    } else if (flag == "--creations") {
      s.creations = static_cast<int>(parse_size(flag, value, 1, 100));
    } else if (flag == "--max-host-bytes") {
      s.max_host_bytes = parse_size(flag, value, 0, 4 * kGiB);
    } else {
      throw std::invalid_argument("unknown flag " + flag + " (see the header of bench_nccl.cpp)");
    }
  }
  if (s.min_bytes > s.max_bytes) throw std::invalid_argument("--min-bytes above --max-bytes");
  return s;
}

double seconds_since(SteadyClock::time_point start) {
  return std::chrono::duration<double>(SteadyClock::now() - start).count();
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const std::size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

void cuda_check(cudaError_t code, const char* call) {
  if (code != cudaSuccess) {
    throw std::runtime_error(std::string(call) + " failed: " + cudaGetErrorName(code) + " (" +
                             cudaGetErrorString(code) + ")");
  }
}
#define BENCH_CUDA(call) cuda_check((call), #call)

// The raw path: a non-blocking NCCL communicator (the config ours uses) on its own stream, each
// call settled by polling ncclCommGetAsyncError, as NCCL's documentation asks; no watchdog, no
// events, no pointer checks, no locks.
class RawNccl {
 public:
  RawNccl(int rank, int size, int device) : rank_(rank), size_(size) {
    BENCH_CUDA(cudaSetDevice(device));
    BENCH_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    ncclUniqueId id{};
    if (rank == 0) check(ncclGetUniqueId(&id), "ncclGetUniqueId", nullptr);
    if (MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD) != MPI_SUCCESS) {
      throw std::runtime_error("raw: MPI_Bcast of the unique id failed");
    }
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    check(ncclCommInitRankConfig(&comm_, size, id, rank, &config), "ncclCommInitRankConfig", comm_);
    settle("ncclCommInitRankConfig");
  }
  ~RawNccl() {
    if (comm_ != nullptr) {
      ncclCommFinalize(comm_);
      ncclResult_t state = ncclInProgress;
      while (state == ncclInProgress && ncclCommGetAsyncError(comm_, &state) == ncclSuccess) {
        std::this_thread::yield();
      }
      ncclCommDestroy(comm_);
    }
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  RawNccl(const RawNccl&) = delete;
  RawNccl& operator=(const RawNccl&) = delete;

  cudaStream_t stream() const { return stream_; }
  int rank() const { return rank_; }
  int size() const { return size_; }

  void all_reduce(float* data, std::size_t count) {
    check(ncclAllReduce(data, data, count, ncclFloat, ncclSum, comm_, stream_), "ncclAllReduce",
          comm_);
    settle("ncclAllReduce");
  }
  void broadcast(void* data, std::size_t bytes, int root) {
    check(ncclBroadcast(data, data, bytes, ncclUint8, root, comm_, stream_), "ncclBroadcast",
          comm_);
    settle("ncclBroadcast");
  }
  void send_recv(const void* send, int to, void* receive, int from, std::size_t bytes) {
    check(ncclGroupStart(), "ncclGroupStart", comm_);
    check(ncclSend(send, bytes, ncclUint8, to, comm_, stream_), "ncclSend", comm_);
    check(ncclRecv(receive, bytes, ncclUint8, from, comm_, stream_), "ncclRecv", comm_);
    check(ncclGroupEnd(), "ncclGroupEnd", comm_);
    settle("ncclGroupEnd");
  }
  void synchronize() { BENCH_CUDA(cudaStreamSynchronize(stream_)); }

 private:
  static void check(ncclResult_t code, const char* call, ncclComm_t comm) {
    if (code == ncclSuccess || code == ncclInProgress) return;
    std::string text = std::string("raw: ") + call + " failed: " + ncclGetErrorString(code);
    const char* last = ncclGetLastError(comm);
    if (last != nullptr && last[0] != '\0') text += " (" + std::string(last) + ")";
    throw std::runtime_error(text);
  }
  void settle(const char* call) {
    const auto deadline = SteadyClock::now() + std::chrono::seconds(60);
    while (true) {
      ncclResult_t state = ncclInProgress;
      check(ncclCommGetAsyncError(comm_, &state), "ncclCommGetAsyncError", comm_);
      if (state == ncclSuccess) return;
      check(state, call, comm_);
      if (SteadyClock::now() > deadline) {
        throw std::runtime_error(std::string("raw: ") + call + " still in progress after 60 s");
      }
      std::this_thread::yield();
    }
  }

  int rank_ = 0, size_ = 1;
  cudaStream_t stream_ = nullptr;
  ncclComm_t comm_ = nullptr;
};

// Device memory freed at scope end.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(std::size_t bytes) {
    BENCH_CUDA(cudaMalloc(&data_, std::max<std::size_t>(bytes, 4)));
  }
  ~DeviceBuffer() { cudaFree(data_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  float* floats() const { return static_cast<float*>(data_); }
  std::byte* bytes() const { return static_cast<std::byte*>(data_); }
  void upload(const void* host, std::size_t bytes) {
    BENCH_CUDA(cudaMemcpy(data_, host, bytes, cudaMemcpyHostToDevice));
  }
  void download(void* host, std::size_t bytes) const {
    BENCH_CUDA(cudaMemcpy(host, data_, bytes, cudaMemcpyDeviceToHost));
  }

 private:
  void* data_ = nullptr;
};

// Rank-dependent small integers (exact in floats for any sum over ranks) and bytes.
float float_pattern(int rank, std::size_t i) {
  return static_cast<float>((rank + 1) * static_cast<int>(i % 251 + 1));
}
std::byte byte_pattern(int rank, std::size_t i) {
  return static_cast<std::byte>((i * 7 + static_cast<std::size_t>(rank) * 13 + 3) & 0xFF);
}

struct Row {
  std::size_t bytes = 0;
  double ours_s = 0, raw_s = 0;
};

class Bench {
 public:
  Bench(const Settings& settings, comm::MpiCommunicator& mpi, comm::NcclCommunicator& nccl,
        RawNccl& raw)
      : s_(settings),
        mpi_(mpi),
        nccl_(nccl),
        raw_(raw),
        rank_(nccl.rank()),
        size_(nccl.size()),
        a_(settings.max_bytes),
        b_(settings.max_bytes),
        scratch_(std::min(settings.max_bytes, settings.max_host_bytes)) {
    world_.resize(static_cast<std::size_t>(size_));
    std::iota(world_.begin(), world_.end(), 0);
    const std::size_t floats = s_.max_bytes / sizeof(float);
    input_.resize(floats);
    reduced_.resize(floats);
    const float ranks_sum = static_cast<float>(size_ * (size_ + 1) / 2);
    for (std::size_t i = 0; i < floats; ++i) {
      input_[i] = float_pattern(rank_, i);
      reduced_[i] = ranks_sum * float_pattern(0, i);
    }
    mine_.resize(s_.max_bytes);
    previous_.resize(s_.max_bytes);
    root_.resize(s_.max_bytes);
    const int previous = (rank_ + size_ - 1) % size_;
    for (std::size_t i = 0; i < s_.max_bytes; ++i) {
      mine_[i] = byte_pattern(rank_, i);
      previous_[i] = byte_pattern(previous, i);
      root_[i] = byte_pattern(0, i);
    }
    for (std::size_t bytes = s_.min_bytes; bytes <= s_.max_bytes; bytes *= s_.factor) {
      sizes_.push_back(bytes);
      if (bytes > s_.max_bytes / s_.factor) break;
    }
    if (sizes_.back() != s_.max_bytes) sizes_.push_back(s_.max_bytes);
  }

  bool root() const { return rank_ == 0; }
  int failures() const { return failures_; }
  int checks() const { return checks_; }

  void run() {
    table("all-reduce, device, blocking (ours: all_reduce_sum)", true, [&](std::size_t bytes) {
      return measure_pair(
          bytes, [&] { verify_all_reduce(bytes, true); }, [&] { verify_all_reduce(bytes, false); },
          [&] { nccl_.all_reduce_sum(span(a_, bytes), world_, deadline()); },
          [&] {
            raw_.all_reduce(a_.floats(), bytes / sizeof(float));
            raw_.synchronize();
          },
          nullptr, nullptr);
    });
    table("all-reduce, device, back to back (ours: all_reduce_sum_async; nccl-tests' figure)", true,
          [&](std::size_t bytes) {
            return measure_pair(
                bytes, nullptr, nullptr,
                [&] { nccl_.all_reduce_sum_async(span(a_, bytes), world_, deadline()); },
                [&] { raw_.all_reduce(a_.floats(), bytes / sizeof(float)); },
                [&] { nccl_.synchronize(); }, [&] { raw_.synchronize(); });
          });
    table("broadcast from rank 0, device (ours: broadcast)", false, [&](std::size_t bytes) {
      return measure_pair(
          bytes, [&] { verify_broadcast(bytes, true); }, [&] { verify_broadcast(bytes, false); },
          [&] { nccl_.broadcast(std::span(a_.bytes(), bytes), 0, world_, deadline()); },
          [&] {
            raw_.broadcast(a_.bytes(), bytes, 0);
            raw_.synchronize();
          },
          nullptr, nullptr);
    });
    table("grouped send to the next rank + receive from the previous (ours: begin_batch/end_batch)",
          false, [&](std::size_t bytes) {
            return measure_pair(
                bytes, [&] { verify_send_recv(bytes, true); },
                [&] { verify_send_recv(bytes, false); }, [&] { send_recv_ours(bytes); },
                [&] {
                  raw_.send_recv(a_.bytes(), next(), b_.bytes(), previous(), bytes);
                  raw_.synchronize();
                },
                nullptr, nullptr);
          });
    if (s_.max_host_bytes >= s_.min_bytes) {
      host_.resize(std::min(s_.max_bytes, s_.max_host_bytes) / sizeof(float));
      table("all-reduce of a pageable host vector (ours: staged through device scratch)", true,
            [&](std::size_t bytes) -> std::optional<Row> {
              if (bytes > s_.max_host_bytes) return std::nullopt;
              return measure_pair(
                  bytes, [&] { verify_host_all_reduce(bytes, true); },
                  [&] { verify_host_all_reduce(bytes, false); },
                  [&] {
                    nccl_.all_reduce_sum(std::span(host_.data(), bytes / sizeof(float)), world_,
                                         deadline());
                  },
                  [&] { raw_host_all_reduce(bytes); }, nullptr, nullptr);
            });
      if (root()) {
        std::printf(
            "#  host staging cost = this table's time minus the blocking device all-reduce's "
            "(same size)\n");
        for (const auto& [bytes, host_s] : host_ours_) {
          const auto device =
              std::find_if(device_blocking_ours_.begin(), device_blocking_ours_.end(),
                           [&](const auto& e) { return e.first == bytes; });
          if (device == device_blocking_ours_.end()) continue;
          const double staging = host_s - device->second;
          std::printf("#  %12zu B: ours %.1f us staging (%.2f GB/s both ways)\n", bytes,
                      1e6 * staging,
                      staging > 0 ? 2.0 * static_cast<double>(bytes) / staging / 1e9 : 0.0);
        }
      }
    }
  }

 private:
  static std::span<float> span(const DeviceBuffer& buffer, std::size_t bytes) {
    return {buffer.floats(), bytes / sizeof(float)};
  }
  static comm::Deadline deadline() { return comm::Clock::now() + std::chrono::seconds(60); }
  int next() const { return (rank_ + 1) % size_; }
  int previous() const { return (rank_ + size_ - 1) % size_; }

  void send_recv_ours(std::size_t bytes) {
    nccl_.begin_batch();
    auto receive = nccl_.irecv(previous(), 1, std::span(b_.bytes(), bytes));
    auto send = nccl_.isend(next(), 1, std::span<const std::byte>(a_.bytes(), bytes));
    nccl_.end_batch();
    receive->wait(deadline());
    send->wait(deadline());
  }
  void raw_host_all_reduce(std::size_t bytes) {
    BENCH_CUDA(cudaMemcpyAsync(scratch_.floats(), host_.data(), bytes, cudaMemcpyHostToDevice,
                               raw_.stream()));
    raw_.all_reduce(scratch_.floats(), bytes / sizeof(float));
    BENCH_CUDA(cudaMemcpyAsync(host_.data(), scratch_.floats(), bytes, cudaMemcpyDeviceToHost,
                               raw_.stream()));
    raw_.synchronize();
  }

  template <typename T>
  void expect_equal(const char* what, bool ours, const T* got, const T* expected, std::size_t count,
                    std::size_t bytes) {
    ++checks_;
    const auto mismatch = std::mismatch(got, got + count, expected);
    if (mismatch.first == got + count) return;
    ++failures_;
    std::fprintf(stderr, "bench_nccl: rank %d: %s (%s) of %zu bytes: wrong result at element %zu\n",
                 rank_, what, ours ? "ours" : "raw", bytes,
                 static_cast<std::size_t>(mismatch.first - got));
  }

  void verify_all_reduce(std::size_t bytes, bool ours) {
    const std::size_t count = bytes / sizeof(float);
    a_.upload(input_.data(), bytes);
    if (ours) {
      nccl_.all_reduce_sum(span(a_, bytes), world_, deadline());
    } else {
      raw_.all_reduce(a_.floats(), count);
      raw_.synchronize();
    }
    std::vector<float> got(count);
    a_.download(got.data(), bytes);
    expect_equal("all-reduce", ours, got.data(), reduced_.data(), count, bytes);
  }
  void verify_host_all_reduce(std::size_t bytes, bool ours) {
    const std::size_t count = bytes / sizeof(float);
    std::copy_n(input_.begin(), count, host_.begin());
    if (ours) {
      nccl_.all_reduce_sum(std::span(host_.data(), count), world_, deadline());
    } else {
      raw_host_all_reduce(bytes);
    }
    expect_equal("host all-reduce", ours, host_.data(), reduced_.data(), count, bytes);
  }
  void verify_broadcast(std::size_t bytes, bool ours) {
    std::vector<std::byte> initial(bytes, std::byte{0});
    if (root()) initial.assign(root_.begin(), root_.begin() + static_cast<std::ptrdiff_t>(bytes));
    a_.upload(initial.data(), bytes);
    if (ours) {
      nccl_.broadcast(std::span(a_.bytes(), bytes), 0, world_, deadline());
    } else {
      raw_.broadcast(a_.bytes(), bytes, 0);
      raw_.synchronize();
    }
    std::vector<std::byte> got(bytes);
    a_.download(got.data(), bytes);
    expect_equal("broadcast", ours, got.data(), root_.data(), bytes, bytes);
  }
  void verify_send_recv(std::size_t bytes, bool ours) {
    a_.upload(mine_.data(), bytes);
    std::vector<std::byte> cleared(bytes, std::byte{0});
    b_.upload(cleared.data(), bytes);
    if (ours) {
      send_recv_ours(bytes);
    } else {
      raw_.send_recv(a_.bytes(), next(), b_.bytes(), previous(), bytes);
      raw_.synchronize();
    }
    std::vector<std::byte> got(bytes);
    b_.download(got.data(), bytes);
    expect_equal("send/recv", ours, got.data(), previous_.data(), bytes, bytes);
  }

  // Seconds per operation: warm-up, then `iters` operations (and `finish`, if any) timed.
  double time_iterations(const std::function<void()>& op, const std::function<void()>& finish) {
    for (int i = 0; i < s_.warmup; ++i) op();
    if (finish) finish();
    mpi_.barrier(deadline());
    const auto start = SteadyClock::now();
    for (int i = 0; i < s_.iters; ++i) op();
    if (finish) finish();
    const double elapsed = seconds_since(start);
    // The slowest rank's time is the operation's (one rank: its own).
    std::vector<double> all(static_cast<std::size_t>(size_), 0.0);
    all[static_cast<std::size_t>(rank_)] = elapsed;
    mpi_.all_reduce_sum(std::span(all), world_, deadline());
    return *std::max_element(all.begin(), all.end()) / s_.iters;
  }

  std::optional<Row> measure_pair(std::size_t bytes, const std::function<void()>& verify_ours,
                                  const std::function<void()>& verify_raw,
                                  const std::function<void()>& ours,
                                  const std::function<void()>& raw,
                                  const std::function<void()>& finish_ours,
                                  const std::function<void()>& finish_raw) {
    if (verify_ours) verify_ours();
    if (verify_raw) verify_raw();
    std::vector<double> ours_s, raw_s;
    for (int r = 0; r < s_.repeats; ++r) {
      if (r % 2 == 0) {
        ours_s.push_back(time_iterations(ours, finish_ours));
        raw_s.push_back(time_iterations(raw, finish_raw));
      } else {
        raw_s.push_back(time_iterations(raw, finish_raw));
        ours_s.push_back(time_iterations(ours, finish_ours));
      }
    }
    return Row{bytes, median(ours_s), median(raw_s)};
  }

  // One operation over every size: a table (rank 0), then a summary line.
  void table(const std::string& title, bool floats,
             const std::function<std::optional<Row>(std::size_t)>& measure) {
    if (root()) {
      std::printf("\n# %s\n", title.c_str());
      std::printf("# %12s %12s %12s %8s %12s %12s\n", "bytes", "ours us", "raw us", "ratio",
                  "ours GB/s", "raw GB/s");
    }
    std::vector<double> small_ratios, large_ratios;
    for (const std::size_t bytes : sizes_) {
      if (floats && bytes % sizeof(float) != 0) continue;
      const auto row = measure(bytes);
      if (!row) continue;
      const double ratio = row->ours_s / row->raw_s;
      if (bytes <= (std::size_t{64} << 10)) small_ratios.push_back(ratio);
      if (bytes >= (std::size_t{16} << 20)) large_ratios.push_back(ratio);
      if (title.starts_with("all-reduce, device, blocking")) {
        device_blocking_ours_.emplace_back(bytes, row->ours_s);
      }
      if (title.starts_with("all-reduce of a pageable host")) {
        host_ours_.emplace_back(bytes, row->ours_s);
      }
      if (root()) {
        const auto gbps = [&](double s) { return static_cast<double>(bytes) / s / 1e9; };
        std::printf("  %12zu %12.2f %12.2f %8.3f %12.3f %12.3f\n", bytes, 1e6 * row->ours_s,
                    1e6 * row->raw_s, ratio, gbps(row->ours_s), gbps(row->raw_s));
      }
    }
    if (root()) {
      std::printf("# summary: ours / raw time, median over sizes <= 64 KiB %s, >= 16 MiB %s\n",
                  small_ratios.empty() ? "-" : std::to_string(median(small_ratios)).c_str(),
                  large_ratios.empty() ? "-" : std::to_string(median(large_ratios)).c_str());
    }
    std::fflush(stdout);
  }

  const Settings& s_;
  comm::MpiCommunicator& mpi_;
  comm::NcclCommunicator& nccl_;
  RawNccl& raw_;
  int rank_, size_;
  std::vector<int> world_;
  DeviceBuffer a_, b_, scratch_;
  std::vector<float> input_, reduced_, host_;
  std::vector<std::byte> mine_, previous_, root_;
  std::vector<std::size_t> sizes_;
  std::vector<std::pair<std::size_t, double>> device_blocking_ours_, host_ours_;
  int checks_ = 0, failures_ = 0;
};

// Creation and destruction of the NCCL world, ours against raw, alternating; medians.
void measure_creation(const Settings& s, comm::MpiCommunicator& mpi,
                      const comm::NcclOptions& options, int device) {
  std::vector<double> ours_create, ours_destroy, raw_create, raw_destroy;
  auto ours = [&] {
    mpi.barrier(comm::Clock::now() + std::chrono::seconds(60));
    auto start = SteadyClock::now();
    std::optional<comm::NcclCommunicator> nccl(std::in_place, mpi, options);
    ours_create.push_back(seconds_since(start));
    start = SteadyClock::now();
    nccl.reset();
    ours_destroy.push_back(seconds_since(start));
  };
  auto raw = [&] {
    mpi.barrier(comm::Clock::now() + std::chrono::seconds(60));
    auto start = SteadyClock::now();
    std::optional<RawNccl> comm(std::in_place, mpi.rank(), mpi.size(), device);
    raw_create.push_back(seconds_since(start));
    start = SteadyClock::now();
    comm.reset();
    raw_destroy.push_back(seconds_since(start));
  };
  for (int r = 0; r < s.creations; ++r) {
    if (r % 2 == 0) {
      ours();
      raw();
    } else {
      raw();
      ours();
    }
  }
  if (mpi.rank() == 0) {
    const auto list = [](const std::vector<double>& values) {
      std::string text;
      for (double v : values) text += (text.empty() ? "" : ", ") + std::to_string(v);
      return text;
    };
    std::printf("# NCCL world of %d rank(s), non-blocking ncclCommInitRankConfig, median of %d:\n",
                mpi.size(), s.creations);
    std::printf("#   create: ours %.4f s, raw %.4f s, ratio %.3f (ours: %s; raw: %s)\n",
                median(ours_create), median(raw_create), median(ours_create) / median(raw_create),
                list(ours_create).c_str(), list(raw_create).c_str());
    std::printf("#   destroy: ours %.4f s, raw %.4f s, ratio %.3f\n", median(ours_destroy),
                median(raw_destroy), median(ours_destroy) / median(raw_destroy));
    std::fflush(stdout);
  }
}

// Everything after MPI_Init; throws on failure.
int run(comm::MpiSession& session, int argc, char** argv, SteadyClock::time_point start) {
  const double mpi_init_s = seconds_since(start);
  const Settings settings = parse(argc, argv);
  const bool root = session.world_rank() == 0;
  if (kernels::cuda::device_count() == 0) {
    if (root) std::printf("bench_nccl: no CUDA device, nothing measured\n");
    return 0;
  }
  comm::MpiCommunicator mpi(session);
  comm::NcclOptions options;
  options.operation_timeout = std::chrono::seconds(120);
  // The CUDA context, once, before anything is timed against it.
  const auto context_start = SteadyClock::now();
  std::optional<comm::NcclCommunicator> first(std::in_place, mpi, options);
  const int device = first->device();
  BENCH_CUDA(cudaFree(nullptr));
  const double first_s = seconds_since(context_start);
  first.reset();
  if (root) {
    cudaDeviceProp properties{};
    BENCH_CUDA(cudaGetDeviceProperties(&properties, device));
    int version = 0;
    ncclGetVersion(&version);
    std::printf(
        "# bench_nccl: %d rank(s); rank 0 on GPU %d (%s); NCCL %d; iters %d, warm-up %d, "
        "medians of %d alternating repeats; sizes %zu B to %zu B (x%zu)\n",
        mpi.size(), device, properties.name, version, settings.iters, settings.warmup,
        settings.repeats, settings.min_bytes, settings.max_bytes, settings.factor);
    std::printf(
        "# MPI_Init (MPI_THREAD_MULTIPLE) %.4f s; first NCCL world (with the CUDA context) "
        "%.4f s\n",
        mpi_init_s, first_s);
  }
  measure_creation(settings, mpi, options, device);
  comm::NcclCommunicator nccl(mpi, options);
  RawNccl raw(nccl.rank(), nccl.size(), nccl.device());
  Bench bench(settings, mpi, nccl, raw);
  bench.run();
  std::vector<double> failures = {static_cast<double>(bench.failures())};
  std::vector<int> world(static_cast<std::size_t>(mpi.size()));
  std::iota(world.begin(), world.end(), 0);
  mpi.all_reduce_sum(std::span(failures), world, comm::Clock::now() + std::chrono::seconds(60));
  if (failures[0] > 0) {
    if (root) {
      std::printf("bench_nccl: FAILED: %.0f wrong result(s) (stderr names them)\n", failures[0]);
    }
    return 1;
  }
  if (root) {
    std::printf("bench_nccl: every result verified (%d checks on rank 0), %.1f s in all\n",
                bench.checks(), seconds_since(start));
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const auto start = SteadyClock::now();
  std::optional<comm::MpiSession> session;
  try {
    session.emplace(&argc, &argv);
  } catch (const std::exception& error) {
    std::fprintf(stderr, "bench_nccl: error: %s\n", error.what());
    return 1;
  }
  int code = 0;
  bool thrown = false;
  try {
    code = run(*session, argc, argv, start);
  } catch (const std::invalid_argument& error) {
    std::fprintf(stderr, "bench_nccl: error: %s\n", error.what());
    code = 2;
  } catch (const std::exception& error) {
    thrown = true;
    std::fprintf(stderr, "bench_nccl: rank %d: error: %s\n", session->world_rank(), error.what());
    code = 1;
  }
  // A rank that failed alone must not leave the others waiting in a collective.
  if (thrown && session->world_size() > 1) MPI_Abort(MPI_COMM_WORLD, code);
  return code;
}
