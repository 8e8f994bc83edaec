#include "runtime/train/self_profile.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <random>

#include "kfac/factors.h"
#include "kfac/layer_state.h"
#include "kfac/precondition.h"
#include "runtime/executor/measured.h"
#include "runtime/optim/sgd.h"

namespace pf::train {

namespace {

template <typename F>
double median_seconds(int repeats, F&& body) {
  std::vector<double> times;
  for (int i = 0; i < repeats; ++i) {
    const auto start = std::chrono::steady_clock::now();
    body();
    times.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// K-FAC kernel times for a Linear of d_in -> d_out on `tokens` rows.
sim::KfacProfile time_kfac(std::int64_t d_in, std::int64_t d_out, std::int64_t tokens,
                           float damping) {
  std::mt19937 rng(5);
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
  sim::KfacProfile profile;
  profile.curvature_a_s = median_seconds(3, [&] { kfac::accumulate_a(layer, a.data(), tokens); });
  profile.curvature_b_s =
      median_seconds(3, [&] { kfac::accumulate_b(layer, g.data(), tokens, 1.0F); });
  kfac::finalize_a(layer);
  kfac::finalize_b(layer);
  const auto d = kfac::layer_damping(layer, damping);
  profile.invert_a_s = median_seconds(3, [&] { kfac::invert_a(layer, d.a); });
  profile.invert_b_s = median_seconds(3, [&] { kfac::invert_b(layer, d.b); });
  profile.precondition_s = median_seconds(3, [&] {
    kfac::precondition(layer.a.inverse, layer.b.inverse, grad.data(), bias.data(), d_out, d_in,
                       grad.data(), bias.data());
  });
  profile.bytes = static_cast<double>(2 * (d_in * d_in + d_out * d_out) * sizeof(float));
  return profile;
}

}  // namespace

sim::Profile profile_schedule(const model::BertConfig& config, const sched::Schedule& base,
                              const ProfileShape& shape, const exec::ExecutorOptions& options,
                              int steps) {
  exec::SyntheticBatches batches(config, shape.micro_batch_size, shape.seq_len,
                                 shape.max_predictions, 99);
  exec::RunSetup<float> setup;
  setup.config = config;
  setup.schedule = base;
  setup.options = options;
  setup.options.record_events = true;
  setup.make_optimizer = [] { return std::make_unique<optim::Sgd>(); };
  setup.learning_rate = [](std::int64_t) { return 0.0; };
  setup.batches = &batches;
  exec::ThreadedExecutor<float> executor(setup);
  executor.run(0, std::max(2, steps));
  auto profile = exec::measured_profile(
      base, executor.take_events(), 1,
      "pipefisher_train self-profile of " + std::string(sched::to_string(base.params.kind)));
  omp_set_num_threads(std::max(1, options.threads_per_worker));
  const std::int64_t H = config.hidden_size, I = config.intermediate_size;
  const std::int64_t tokens = shape.micro_batch_size * shape.seq_len;
  const auto square = time_kfac(H, H, tokens, options.kfac.damping);
  const auto ffn_in = time_kfac(H, I, tokens, options.kfac.damping);
  const auto ffn_out = time_kfac(I, H, tokens, options.kfac.damping);
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

}  // namespace pf::train
