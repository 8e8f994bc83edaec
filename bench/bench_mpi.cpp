// MPI processes against worker threads, the same configuration side by side in one job
// (docs/benchmarks.md, "Runtime on MPI"): run as
//
//   mpirun -np <stages x data-parallel> bench_mpi [--model mini] [--vocab N] [--stages 2]
//          [--data-parallel 1] [--microbatches 8] [--micro-batch-size 8] [--seq-len 128]
//          [--steps 5] [--repeats 3]
//   mpirun -np 2 bench_mpi --smoke     (a tiny model, for the test suite)
//   mpirun -np 4 bench_mpi --data-parallel 2 --bucket-mb 4 ...   (buckets on against off)
//
// With --bucket-mb B (data parallelism only), each repeat instead runs four configurations,
// alternating: threads and MPI, each with data-parallel gradient buckets of B MiB started inside
// the last backward (ExecutorOptions::dp_bucket_bytes) and without (one all-reduce per chunk
// after it), and reports step times, the time the DP reductions still waited per step (mean over
// ranks) and the ratios on / off.
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
  double bucket_mb = -1;  // < 0: MPI against threads; else buckets of this size against none
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
    } else if (flag == "--bucket-mb") {
      char* end = nullptr;
      s.bucket_mb = std::strtod(value, &end);
      if (end == value || *end != '\0' || !(s.bucket_mb > 0) || s.bucket_mb > 1024) {
        throw std::invalid_argument(flag + " " + value + ": not a size in (0, 1024] MiB");
      }
    } else {
      throw std::invalid_argument("unknown flag " + flag + " (see the header of bench_mpi.cpp)");
    }
  }
  return s;
}

exec::RunSetup<float> make_setup(const model::BertConfig& config, const sched::Schedule& schedule,
                                 exec::BatchSource& batches, std::int64_t bucket_bytes = 0) {
  exec::RunSetup<float> setup;
  setup.options.dp_bucket_bytes = bucket_bytes;
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

// The time DP reductions still waited per step (their instructions' spans; with buckets only
// what the overlap did not hide), mean over ranks, steps 2...
double reduction_wait_per_step(const std::vector<exec::InstructionEvent>& events, int ranks,
                               int steps) {
  double total = 0.0;
  for (const auto& e : events) {
    if (e.global_step >= 1 && e.bucket < 0 &&
        e.instruction.kind == sched::OpKind::kReduceGradDataParallel) {
      total += e.end_s - e.start_s;
    }
  }
  return total / static_cast<double>(ranks) / static_cast<double>(steps - 1);
}

int compare_buckets(const Settings& s, const model::BertConfig& config,
                    const sched::Schedule& schedule, comm::MpiCommunicator& comm) {
  if (s.data_parallel < 2) throw std::invalid_argument("--bucket-mb needs --data-parallel >= 2");
  const int ranks = s.stages * s.data_parallel;
  const bool root = comm.rank() == 0;
  const auto predictions = std::max<std::int64_t>(1, (s.seq_len * 15 + 50) / 100);
  const auto far = [] { return comm::Clock::now() + std::chrono::hours(1); };
  const auto bucket_bytes = static_cast<std::int64_t>(s.bucket_mb * 1048576.0);
  // [threads off, threads on, MPI off, MPI on]: step time and reduction wait per repeat.
  std::vector<std::vector<double>> step_s(4), wait_s(4);
  const char* names[] = {"threads, no buckets", "threads, buckets", "MPI, no buckets",
                         "MPI, buckets"};
  for (int repeat = 0; repeat < s.repeats; ++repeat) {
    // Alternate which goes first, so that a drift in the machine's load favours neither.
    const bool on_first = repeat % 2 == 1;
    for (const bool mpi : {false, true}) {
      for (const bool on_pass : {false, true}) {
        const bool on = on_pass != on_first;
        const int index = (mpi ? 2 : 0) + (on ? 1 : 0);
        comm.barrier(far());
        exec::SyntheticBatches batches(config, s.micro_batch_size, s.seq_len, predictions, 3);
        auto setup = make_setup(config, schedule, batches, on ? bucket_bytes : 0);
        std::vector<exec::InstructionEvent> events;
        if (!mpi) {
          if (!root) continue;
          exec::ThreadedExecutor<float> executor(std::move(setup));
          executor.run(0, s.steps);
          events = executor.take_events();
        } else {
          exec::MpiExecutor<float> executor(std::move(setup), comm);
          executor.run(0, s.steps, {});
          events = executor.take_events();
        }
        if (!root) continue;
        step_s[static_cast<std::size_t>(index)].push_back(
            exec::summarize_run(events, ranks, 1).step_time_s);
        wait_s[static_cast<std::size_t>(index)].push_back(
            reduction_wait_per_step(events, ranks, s.steps));
        std::printf("repeat %d: %-20s %.4f s/step, DP reductions waited %.4f s/step\n", repeat + 1,
                    names[index], step_s[static_cast<std::size_t>(index)].back(),
                    wait_s[static_cast<std::size_t>(index)].back());
        std::fflush(stdout);
      }
    }
  }
  if (root) {
    std::printf(
        "BERT %s (vocab %d), 1F1B p = %d, DP = %d, %d micro-batches of %lld x %lld, steps 2-%d, "
        "buckets of %.3g MiB, median of %d\n",
        s.model.c_str(), config.vocab_size, s.stages, s.data_parallel, s.microbatches,
        static_cast<long long>(s.micro_batch_size), static_cast<long long>(s.seq_len), s.steps,
        s.bucket_mb, s.repeats);
    for (int i = 0; i < 4; ++i) {
      std::printf("%-20s %.4f s/step, DP reductions waited %.4f s/step\n", names[i],
                  median(step_s[static_cast<std::size_t>(i)]),
                  median(wait_s[static_cast<std::size_t>(i)]));
    }
    std::printf("ratio buckets / none, step time: threads %.3f, MPI %.3f\n",
                median(step_s[1]) / median(step_s[0]), median(step_s[3]) / median(step_s[2]));
  }
  return 0;
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
  if (s.bucket_mb >= 0) return compare_buckets(s, config, schedule, comm);
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
