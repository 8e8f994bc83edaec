#include "runtime/optim/adamw.h"

#include <cmath>
#include <stdexcept>

#include "runtime/optim/state_io.h"

namespace pf::optim {

AdamW::AdamW(AdamWOptions options) : options_(options) {
  if (!(options.beta1 >= 0 && options.beta1 < 1) || !(options.beta2 >= 0 && options.beta2 < 1) ||
      !(options.eps > 0) || !(options.weight_decay >= 0)) {
    throw std::invalid_argument("AdamW: betas must lie in [0, 1), eps > 0, weight_decay >= 0");
  }
}

void AdamW::step(std::span<const ParamView> params, float learning_rate) {
  validate_params(params);
  ++steps_;
  const double t = static_cast<double>(steps_);
  const auto step_size =
      static_cast<float>(learning_rate / (1.0 - std::pow(double{options_.beta1}, t)));
  const auto inv_sqrt_bc2 =
      static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(double{options_.beta2}, t)));
  const float b1 = options_.beta1, b2 = options_.beta2, eps = options_.eps;
  for (const auto& param : params) {
    auto [it, inserted] = state_.try_emplace(param.name);
    auto& moments = it->second;
    if (inserted) {
      moments.exp_avg.assign(param.size, 0.0F);
      moments.exp_avg_sq.assign(param.size, 0.0F);
      moments.shape = param.shape;
    } else if (moments.exp_avg.size() != param.size) {
      throw std::invalid_argument("AdamW: parameter '" + param.name + "' changed size from " +
                                  std::to_string(moments.exp_avg.size()) + " to " +
                                  std::to_string(param.size));
    }
    const float decay = param.no_weight_decay ? 1.0F : 1.0F - learning_rate * options_.weight_decay;
    float* p = param.value;
    const float* g = param.grad;
    float* m = moments.exp_avg.data();
    float* v = moments.exp_avg_sq.data();
    parallel_chunks(param.size, [=](std::size_t begin, std::size_t end) {
#pragma omp simd
      for (std::size_t i = begin; i < end; ++i) {
        m[i] = b1 * m[i] + (1.0F - b1) * g[i];
        v[i] = b2 * v[i] + (1.0F - b2) * g[i] * g[i];
        p[i] = p[i] * decay - step_size * m[i] / (std::sqrt(v[i]) * inv_sqrt_bc2 + eps);
      }
    });
  }
}

std::vector<ckpt::TensorRecord> AdamW::state_records(std::string_view prefix) const {
  return adam_moment_records(prefix, steps_, state_);
}

void AdamW::load_state(const ckpt::SafetensorsFile& file, std::span<const ParamView> params,
                       std::string_view prefix) {
  validate_params(params);
  std::int64_t steps = 0;
  auto state = read_adam_moments(file, params, prefix, steps);
  steps_ = steps;
  state_ = std::move(state);
}

}  // namespace pf::optim
