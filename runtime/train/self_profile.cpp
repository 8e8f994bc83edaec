#include "runtime/train/self_profile.h"

#include <omp.h>

#include <algorithm>
#include <array>
#include <barrier>
#include <chrono>
#include <cstring>
#include <exception>
#include <random>
#include <stdexcept>
#include <thread>
#include <utility>
#include <vector>

#include "kfac/factors.h"
#include "kfac/layer_state.h"
#include "kfac/precondition.h"
#include "runtime/executor/alone_times.h"
#include "runtime/executor/measured.h"
#include "runtime/optim/sgd.h"

namespace pf::train {

namespace {

// The middle value (the upper of the two middle ones of an even count); values non-empty.
double upper_median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

template <typename F>
double median_seconds(int repeats, F&& body) {
  std::vector<double> times;
  for (int i = 0; i < repeats; ++i) {
    const auto start = std::chrono::steady_clock::now();
    body();
    times.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return upper_median(std::move(times));
}

enum Kernel { kCurvatureA, kCurvatureB, kInvertA, kInvertB, kPrecondition, kKernels };

// Runs run(thread, timed) on `threads` threads (the caller's is thread 0), where timed(kernel,
// body) times body() three times, every call started on all threads together (a barrier) and
// timed from the barrier's release, and gives the medians over all threads' calls. (Timed from
// each thread's own start instead, a thread the cores could not take at once measured only its
// own run: 4 threads on 2 cores gave a capacity of 3.7.) One thread gives times alone, the
// profile's; as many as the run has workers, how much they slow each other down when they compute
// at once (shared_capacity). A thread that throws (a factorization that fails) leaves the barrier,
// so that the others finish rather than wait for it; its error is rethrown here.
template <typename Run>
sim::KfacProfile time_together(int threads, std::int64_t d_in, std::int64_t d_out, Run&& run) {
  constexpr int kRepeats = 3;
  std::vector<std::array<std::vector<double>, kKernels>> seconds(static_cast<std::size_t>(threads));
  // Written by the barrier's completion, once all threads arrived and before any leaves.
  std::chrono::steady_clock::time_point released;
  std::barrier start_together(
      threads, [&released]() noexcept { released = std::chrono::steady_clock::now(); });
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(threads));
  const auto guarded = [&](int thread) {
    try {
      auto& mine = seconds[static_cast<std::size_t>(thread)];
      const auto timed = [&](Kernel kernel, auto&& body) {
        for (int repeat = 0; repeat < kRepeats; ++repeat) {
          start_together.arrive_and_wait();
          const auto start = released;
          body();
          mine[kernel].push_back(
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
        }
      };
      run(thread, timed);
    } catch (...) {
      errors[static_cast<std::size_t>(thread)] = std::current_exception();
      start_together.arrive_and_drop();
    }
  };
  {
    std::vector<std::jthread> others;
    for (int thread = 1; thread < threads; ++thread) others.emplace_back(guarded, thread);
    guarded(0);
  }
  for (const auto& error : errors) {
    if (error) std::rethrow_exception(error);
  }
  const auto median_of = [&](Kernel kernel) {
    std::vector<double> all;
    for (const auto& thread : seconds) {
      all.insert(all.end(), thread[kernel].begin(), thread[kernel].end());
    }
    return upper_median(std::move(all));
  };
  sim::KfacProfile profile;
  profile.curvature_a_s = median_of(kCurvatureA);
  profile.curvature_b_s = median_of(kCurvatureB);
  profile.invert_a_s = median_of(kInvertA);
  profile.invert_b_s = median_of(kInvertB);
  profile.precondition_s = median_of(kPrecondition);
  profile.bytes = static_cast<double>(2 * (d_in * d_in + d_out * d_out) * sizeof(float));
  return profile;
}

// K-FAC kernel times for a Linear of d_in -> d_out on `tokens` rows, on `threads` threads at once
// (each with its own state and data, `threads_per_worker` OpenMP threads each).
sim::KfacProfile time_kfac(std::int64_t d_in, std::int64_t d_out, std::int64_t tokens,
                           float damping, int threads, int threads_per_worker) {
  return time_together(threads, d_in, d_out, [&](int thread, auto&& timed) {
    omp_set_num_threads(std::max(1, threads_per_worker));
    std::mt19937 rng(5 + static_cast<unsigned>(thread));
    std::normal_distribution<float> normal(0.0F, 1.0F);
    auto random = [&](std::int64_t count) {
      std::vector<float> values(static_cast<std::size_t>(count));
      for (auto& v : values) v = normal(rng);
      return values;
    };
    const auto a = random(tokens * d_in), g = random(tokens * d_out);
    auto grad = random(d_out * d_in);
    auto bias = random(d_out);
    kfac::KfacLayerState layer(d_in, d_out);
    timed(kCurvatureA, [&] { kfac::accumulate_a(layer, a.data(), tokens); });
    timed(kCurvatureB, [&] { kfac::accumulate_b(layer, g.data(), tokens, 1.0F); });
    kfac::finalize_a(layer);
    kfac::finalize_b(layer);
    const auto d = kfac::layer_damping(layer, damping);
    timed(kInvertA, [&] { kfac::invert_a(layer, d.a); });
    timed(kInvertB, [&] { kfac::invert_b(layer, d.b); });
    timed(kPrecondition, [&] {
      kfac::precondition(layer.a.inverse, layer.b.inverse, grad.data(), bias.data(), d_out, d_in,
                         grad.data(), bias.data());
    });
  });
}

// How many kernels the machine runs at full speed at once: `threads` times the median, over the
// kernels, of (time alone / time beside threads - 1 others). Between 1 (the others take as much
// as they get: one core's worth) and `threads` (no slowdown: a core each).
double shared_capacity(const std::vector<sim::KfacProfile>& alone,
                       const std::vector<sim::KfacProfile>& together, int threads) {
  std::vector<double> speed;
  for (std::size_t i = 0; i < alone.size(); ++i) {
    const auto& a = alone[i];
    const auto& t = together[i];
    for (const auto& [solo, shared] :
         {std::pair{a.curvature_a_s, t.curvature_a_s}, std::pair{a.curvature_b_s, t.curvature_b_s},
          std::pair{a.invert_a_s, t.invert_a_s}, std::pair{a.invert_b_s, t.invert_b_s},
          std::pair{a.precondition_s, t.precondition_s}}) {
      if (solo > 0.0 && shared > 0.0) speed.push_back(solo / shared);
    }
  }
  if (speed.empty()) return static_cast<double>(threads);
  return std::clamp(threads * upper_median(std::move(speed)), 1.0, static_cast<double>(threads));
}

// The same kernels on a device, through its K-FAC layer, on `threads` threads at once, each with
// a stream of its own (host time around each call and a wait for its stream): the workers of a
// run on one device share it as these threads do.
sim::KfacProfile time_kfac_on_device(device::DeviceRuntime& device, std::int64_t d_in,
                                     std::int64_t d_out, std::int64_t tokens, float damping,
                                     int threads) {
  return time_together(threads, d_in, d_out, [&](int thread, auto&& timed) {
    device.bind_thread();
    std::mt19937 rng(5 + static_cast<unsigned>(thread));
    std::normal_distribution<float> normal(0.0F, 1.0F);
    auto& backend = device.backend();
    const auto stream = backend.create_stream();
    std::vector<tensor::Tensor> keep;
    auto upload = [&](std::int64_t count) {
      std::vector<float> values(static_cast<std::size_t>(count));
      for (auto& v : values) v = normal(rng);
      auto tensor = tensor::Tensor::empty(backend, {count}, tensor::DType::kF32);
      backend.copy(tensor.raw_data(), values.data(), tensor.nbytes(),
                   tensor::CopyKind::kHostToDevice, stream.get());
      stream->synchronize();  // `values` goes out of scope
      keep.push_back(tensor);
      return tensor.data<float>();
    };
    const float* a = upload(tokens * d_in);
    const float* g = upload(tokens * d_out);
    float* grad = upload(d_out * d_in);
    float* bias = upload(d_out);
    const auto layer = device.make_kfac_layer(stream.get(), d_in, d_out, "self-profile");
    const auto waited = [&stream](auto body) {
      return [&stream, body] {
        body();
        stream->synchronize();
      };
    };
    timed(kCurvatureA, waited([&] {
            layer->accumulate(true, {a, tokens, d_in}, 1.0F, 0, kfac::kPieceUnits);
          }));
    timed(kCurvatureB, waited([&] {
            layer->accumulate(false, {g, tokens, d_out}, 1.0F, 0, kfac::kPieceUnits);
          }));
    layer->finalize(true, 0.0F);
    layer->finalize(false, 0.0F);
    const auto d = layer->damping(damping, true);
    timed(kInvertA, waited([&] { layer->invert(true, d.a, kfac::InverseMethod::kCholesky); }));
    timed(kInvertB, waited([&] { layer->invert(false, d.b, kfac::InverseMethod::kCholesky); }));
    timed(kPrecondition, waited([&] { layer->precondition(false, false, grad, bias); }));
  });
}

}  // namespace

sim::Profile profile_schedule(const model::BertConfig& config, const sched::Schedule& base,
                              const ProfileShape& shape, const exec::ExecutorOptions& options,
                              int steps, const std::shared_ptr<device::DeviceRuntime>& device,
                              const ProfileOptimizer& optimizer,
                              const SharedProcessorChoice& shared, const ProfileLaunch& launch) {
  exec::SyntheticBatches batches(config, shape.micro_batch_size, shape.seq_len,
                                 shape.max_predictions, 99);
  exec::RunSetup<float> setup;
  setup.config = config;
  setup.schedule = base;
  setup.options = options;
  setup.options.record_events = true;
  setup.make_optimizer =
      optimizer.make ? optimizer.make : [] { return std::make_unique<optim::Sgd>(); };
  setup.device = device;
  setup.device_optimizer = optimizer.device;
  setup.learning_rate = [](std::int64_t) { return 0.0; };
  setup.batches = &batches;
  const auto executor = launch.make_executor
                            ? launch.make_executor(std::move(setup))
                            : std::make_unique<exec::ThreadedExecutor<float>>(std::move(setup));
  executor->run(0, std::max(2, steps), {});
  auto events = executor->take_events();  // every rank's, in the root process
  if (!executor->is_root()) return {};
  const int concurrent = launch.ranks_sharing_root_processor > 0
                             ? std::min(launch.ranks_sharing_root_processor, executor->num_ranks())
                             : executor->num_ranks();
  omp_set_num_threads(std::max(1, options.threads_per_worker));
  const std::int64_t H = config.hidden_size, I = config.intermediate_size;
  const std::int64_t tokens = shape.micro_batch_size * shape.seq_len;
  const auto time = [&](std::int64_t d_in, std::int64_t d_out, int threads) {
    return device ? time_kfac_on_device(*device, d_in, d_out, tokens, options.kfac.damping, threads)
                  : time_kfac(d_in, d_out, tokens, options.kfac.damping, threads,
                              options.threads_per_worker);
  };
  // The workers are threads sharing this machine's cores, or with a device its streams: how much
  // throughput they have together, from the same kernels on one thread per worker at once. The
  // simulator then shares it among the compute running at once (docs/simulator.md "Shared
  // processors"), and the schedule's durations, measured with the workers beside each other,
  // become times alone. (On a device, not yet checked against a GPU run: docs/cuda.md.) Alone
  // and together in kCapacityRounds rounds, each kernel time and the capacity the median of the
  // rounds', so that a moment the machine held a thread back moves neither.
  const bool measure_capacity = concurrent > 1 && shared.measure;
  const int rounds = measure_capacity ? kCapacityRounds : 1;
  std::array<std::vector<sim::KfacProfile>, 3> alone;  // square, ffn_in, ffn_out
  std::vector<double> capacities;
  for (int round = 0; round < rounds; ++round) {
    const std::vector<sim::KfacProfile> solo = {time(H, H, 1), time(H, I, 1), time(I, H, 1)};
    for (std::size_t i = 0; i < alone.size(); ++i) alone[i].push_back(solo[i]);
    if (measure_capacity) {
      capacities.push_back(shared_capacity(
          solo, {time(H, H, concurrent), time(H, I, concurrent), time(I, H, concurrent)},
          concurrent));
    }
  }
  const auto square = median_of_rounds(alone[0]);
  const auto ffn_in = median_of_rounds(alone[1]);
  const auto ffn_out = median_of_rounds(alone[2]);
  double capacity = 0.0;
  if (concurrent > 1) {
    capacity = measure_capacity ? upper_median(std::move(capacities)) : shared.capacity;
    if (capacity > 0.0) {
      events = exec::alone_times_by_machine(std::move(events), capacity, launch.machine_of_rank);
    }
  }
  auto profile = exec::measured_profile(
      base, events, 1,
      "pipefisher_train self-profile of " + std::string(sched::to_string(base.params.kind)));
  // The simulator runs one replica: with d replicas beside it on the processor (symmetric, as
  // the data-parallel ranks run the same schedule) its workers have a d-th of the capacity.
  profile.shared_processor_replicas = std::max(1, base.params.data_parallel);
  profile.shared_processor_capacity = capacity / profile.shared_processor_replicas;
  for (int k = 0; k < sched::kNumLinearKinds; ++k) {
    const auto linear = static_cast<sched::LinearKind>(k);
    sim::KfacProfile entry = linear == sched::LinearKind::kFfnIn    ? ffn_in
                             : linear == sched::LinearKind::kFfnOut ? ffn_out
                                                                    : square;
    entry.layer = -1;
    entry.linear = linear;
    profile.kfac.push_back(entry);
  }
  return profile;
}

sim::KfacProfile median_of_rounds(const std::vector<sim::KfacProfile>& rounds) {
  if (rounds.empty()) throw std::invalid_argument("median_of_rounds: no rounds");
  sim::KfacProfile result = rounds.front();
  const auto median_field = [&rounds](double sim::KfacProfile::*field) {
    std::vector<double> values;
    for (const auto& round : rounds) values.push_back(round.*field);
    return upper_median(std::move(values));
  };
  for (const auto field : {&sim::KfacProfile::curvature_a_s, &sim::KfacProfile::curvature_b_s,
                           &sim::KfacProfile::invert_a_s, &sim::KfacProfile::invert_b_s,
                           &sim::KfacProfile::precondition_s}) {
    result.*field = median_field(field);
  }
  return result;
}

sim::LinkProfile measure_host_copy(std::size_t bytes,
                                   const std::shared_ptr<device::DeviceRuntime>& device) {
  if (device) return measure_device_host_link(*device, bytes);
  std::vector<char> from(bytes, 1), to(bytes, 0);
  std::vector<double> rates;
  for (int trial = 0; trial < 5; ++trial) {
    const auto start = std::chrono::steady_clock::now();
    std::memcpy(to.data(), from.data(), bytes);
    const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
    if (took.count() > 0.0) rates.push_back(static_cast<double>(bytes) / took.count());
    from[static_cast<std::size_t>(trial)] = to[bytes - 1];  // keeps the copies observable
  }
  sim::LinkProfile link;
  if (rates.empty()) {
    link.bandwidth = 1e12;  // below the clock's resolution: as good as free
  } else {
    link.bandwidth = upper_median(std::move(rates));
  }
  return link;
}

sim::LinkProfile measure_device_host_link(device::DeviceRuntime& device, std::size_t bytes) {
  device.bind_thread();
  auto& backend = device.backend();
  auto host = device.allocate_pinned_host(bytes);
  std::memset(host.data(), 1, bytes);
  auto on_device = tensor::Tensor::empty(backend, {static_cast<std::int64_t>((bytes + 3) / 4)},
                                         tensor::DType::kF32);
  const auto stream = backend.create_stream();
  // Seconds of one copy each way (issued on a stream, then waited for); the slower direction's
  // median, since the simulator prices both alike.
  const auto time_copies = [&](std::size_t size) {
    std::vector<double> to_device, to_host;
    for (int trial = 0; trial < 5; ++trial) {
      for (const bool up : {true, false}) {
        const auto start = std::chrono::steady_clock::now();
        if (up) {
          backend.copy(on_device.raw_data(), host.data(), size, tensor::CopyKind::kHostToDevice,
                       stream.get());
        } else {
          backend.copy(host.data(), on_device.raw_data(), size, tensor::CopyKind::kDeviceToHost,
                       stream.get());
        }
        stream->synchronize();
        const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
        (up ? to_device : to_host).push_back(took.count());
      }
    }
    return std::max(upper_median(std::move(to_device)), upper_median(std::move(to_host)));
  };
  time_copies(bytes);  // warm-up
  const double small_s = time_copies(std::min<std::size_t>(bytes, 4096));
  const double large_s = time_copies(bytes);
  sim::LinkProfile link;
  link.latency_s = std::max(0.0, small_s);
  link.bandwidth = large_s > link.latency_s
                       ? static_cast<double>(bytes) / (large_s - link.latency_s)
                       : 1e12;  // below the clock's resolution: as good as free
  return link;
}

}  // namespace pf::train
