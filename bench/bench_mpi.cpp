// MPI processes against worker threads, the same configuration side by side in one job
// (docs/benchmarks.md, "Runtime on MPI"): run as
//
//   mpirun -np <stages x data-parallel> bench_mpi [--model mini] [--vocab N] [--stages 2]
//          [--data-parallel 1] [--microbatches 8] [--micro-batch-size 8] [--seq-len 128]
//          [--steps 5] [--repeats 3]
//   mpirun -np 2 bench_mpi --smoke     (a tiny model, for the test suite)
//
// Each repeat runs the configuration twice: on threads (ThreadedExecutor in rank 0's process,
// one thread per rank, while the other processes wait at a barrier) and on MPI processes
// (MpiExecutor, one rank per process). 1F1B, LAMB, synthetic batches, one OpenMP thread per
// worker. Step time is the steady-state window's (steps 2..; the first allocates), and every
// figure is the median over the repeats; the ratio is MPI / threads.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "runtime/comm/mpi_communicator.h"
#include "runtime/executor/batch_source.h"
#include "runtime/executor/measured.h"
#include "runtime/executor/mpi_executor.h"
#include "runtime/optim/lamb.h"
#include "scheduler/compile.h"

namespace {

using namespace pf;

struct Settings {
  std::string model = "mini";
  int vocab = 0;  // 0: the preset's
  int stages = 2;
  int data_parallel = 1;
  int microbatches = 8;
  std::int64_t micro_batch_size = 8;
  std::int64_t seq_len = 128;
  int steps = 5;
  int repeats = 3;
};

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const std::size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

int parse_count(const std::string& flag, const char* value) {
  char* end = nullptr;
  const long parsed = std::strtol(value, &end, 10);
  if (end == value || *end != '\0' || parsed < 1 || parsed > 1 << 20) {
    throw std::invalid_argument(flag + " " + value + ": not a count >= 1");
  }
  return static_cast<int>(parsed);
}

Settings parse(int argc, char** argv) {
  Settings s;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--smoke") {
      s.model = "tiny";
      s.micro_batch_size = 2;
      s.seq_len = 16;
      s.microbatches = 4;
      s.steps = 2;
      s.repeats = 1;
      continue;
    }
    if (i + 1 >= argc) throw std::invalid_argument(flag + ": needs a value (see the header)");
    const char* value = argv[++i];
    if (flag == "--model") {
      s.model = value;
    } else if (flag == "--vocab") {
      s.vocab = parse_count(flag, value);
    } else if (flag == "--stages") {
      s.stages = parse_count(flag, value);
    } else if (flag == "--data-parallel") {
      s.data_parallel = parse_count(flag, value);
    } else if (flag == "--microbatches") {
      s.microbatches = parse_count(flag, value);
    } else if (flag == "--micro-batch-size") {
      s.micro_batch_size = parse_count(flag, value);
    } else if (flag == "--seq-len") {
      s.seq_len = parse_count(flag, value);
    } else if (flag == "--steps") {
      s.steps = std::max(2, parse_count(flag, value));
    } else if (flag == "--repeats") {
      s.repeats = parse_count(flag, value);
    } else {
      throw std::invalid_argument("unknown flag " + flag + " (see the header of bench_mpi.cpp)");
    }
  }
  return s;
}

exec::RunSetup<float> make_setup(const model::BertConfig& config, const sched::Schedule& schedule,
                                 exec::BatchSource& batches) {
  exec::RunSetup<float> setup;
  setup.config = config;
  setup.schedule = schedule;
  setup.options.threads_per_worker = 1;
  setup.options.init_seed = 1;
  setup.options.dropout_seed = 2;
  setup.options.record_events = true;
  setup.options.wait_timeout = std::chrono::minutes(10);
  setup.make_optimizer = [] { return std::make_unique<optim::Lamb>(); };
  setup.learning_rate = [](std::int64_t) { return 1e-3; };
  setup.batches = &batches;
  return setup;
}

int run(int argc, char** argv, comm::MpiCommunicator& comm) {
  const Settings s = parse(argc, argv);
  auto config = model::bert_preset(s.model);
  if (s.vocab > 0) config.vocab_size = s.vocab;
  sched::ScheduleParams params;
  params.kind = sched::ScheduleKind::kOneFOneB;
  params.workers = s.stages;
  params.microbatches = s.microbatches;
  params.num_layers = config.num_layers;
  params.data_parallel = s.data_parallel;
  const auto schedule = sched::compile(params);
  const int ranks = s.stages * s.data_parallel;
  if (comm.size() != ranks) {
    throw std::invalid_argument(exec::mpi_layout_error(comm.size(), s.stages, s.data_parallel));
  }
  const bool root = comm.rank() == 0;
  const auto predictions = std::max<std::int64_t>(1, (s.seq_len * 15 + 50) / 100);
  const auto far = [] { return comm::Clock::now() + std::chrono::hours(1); };
  std::vector<double> threads_s, mpi_s;
  for (int repeat = 0; repeat < s.repeats; ++repeat) {
    comm.barrier(far());
    if (root) {
      exec::SyntheticBatches batches(config, s.micro_batch_size, s.seq_len, predictions, 3);
      exec::ThreadedExecutor<float> executor(make_setup(config, schedule, batches));
      executor.run(0, s.steps);
      threads_s.push_back(exec::summarize_run(executor.take_events(), ranks, 1).step_time_s);
    }
    comm.barrier(far());
    exec::SyntheticBatches batches(config, s.micro_batch_size, s.seq_len, predictions, 3);
    exec::MpiExecutor<float> executor(make_setup(config, schedule, batches), comm);
    executor.run(0, s.steps, {});
    const auto events = executor.take_events();
    if (root) {
      mpi_s.push_back(exec::summarize_run(events, ranks, 1).step_time_s);
      std::printf("repeat %d: threads %.4f s/step, MPI %.4f s/step\n", repeat + 1, threads_s.back(),
                  mpi_s.back());
      std::fflush(stdout);
    }
  }
  if (root) {
    std::printf(
        "BERT %s (vocab %d), 1F1B p = %d, DP = %d, %d micro-batches of %lld x %lld, steps 2-%d, "
        "median of %d\n",
        s.model.c_str(), config.vocab_size, s.stages, s.data_parallel, s.microbatches,
        static_cast<long long>(s.micro_batch_size), static_cast<long long>(s.seq_len), s.steps,
        s.repeats);
    const double threads = median(threads_s), mpi = median(mpi_s);
    std::printf("threads: %.4f s/step\nMPI:     %.4f s/step\nratio MPI / threads: %.3f\n", threads,
                mpi, mpi / threads);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::optional<comm::MpiSession> session;
  try {
    session.emplace(&argc, &argv);
  } catch (const std::exception& error) {
    std::cerr << "bench_mpi: " << error.what() << "\n";
    return 2;
  }
  comm::MpiCommunicator comm(*session);
  try {
    return run(argc, argv, comm);
  } catch (const std::invalid_argument& error) {
    if (comm.rank() == 0) std::cerr << "bench_mpi: error: " << error.what() << "\n";
    return 2;
  } catch (const std::exception& error) {
    comm.abort(std::string("bench_mpi: ") + error.what());
  }
}
