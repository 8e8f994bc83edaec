#include "runtime/optim/lamb.h"

#include <cmath>
#include <stdexcept>

#include "runtime/optim/state_io.h"

namespace pf::optim {

Lamb::Lamb(LambOptions options) : options_(options) {
  if (!(options.beta1 >= 0 && options.beta1 < 1) || !(options.beta2 >= 0 && options.beta2 < 1) ||
      !(options.eps > 0) || !(options.weight_decay >= 0)) {
    throw std::invalid_argument("LAMB: betas must lie in [0, 1), eps > 0, weight_decay >= 0");
  }
}

void Lamb::step(std::span<const ParamView> params, float learning_rate) {
  validate_params(params);
  last_grad_norm_ = global_grad_norm(params);
  if (!std::isfinite(last_grad_norm_)) {
    throw std::runtime_error("LAMB: the global gradient norm is not finite (" +
                             std::to_string(last_grad_norm_) + "); refusing to update");
  }
  const double clip = options_.max_grad_norm > 0 && last_grad_norm_ > options_.max_grad_norm
                          ? last_grad_norm_ / options_.max_grad_norm
                          : 1.0;
  const auto grad_scale = static_cast<float>(1.0 / clip);
  ++steps_;
  const double t = static_cast<double>(steps_);
  const auto inv_bc1 = static_cast<float>(1.0 / (1.0 - std::pow(double{options_.beta1}, t)));
  const auto inv_bc2 = static_cast<float>(1.0 / (1.0 - std::pow(double{options_.beta2}, t)));
  const float b1 = options_.beta1, b2 = options_.beta2, eps = options_.eps;
  last_trust_ratios_.assign(params.size(), 1.0);

  for (std::size_t index = 0; index < params.size(); ++index) {
    const auto& param = params[index];
    auto [it, inserted] = state_.try_emplace(param.name);
    auto& moments = it->second;
    if (inserted) {
      moments.exp_avg.assign(param.size, 0.0F);
      moments.exp_avg_sq.assign(param.size, 0.0F);
      moments.shape = param.shape;
    } else if (moments.exp_avg.size() != param.size) {
      throw std::invalid_argument("LAMB: parameter '" + param.name + "' changed size from " +
                                  std::to_string(moments.exp_avg.size()) + " to " +
                                  std::to_string(param.size));
    }
    const float wd = param.no_weight_decay ? 0.0F : options_.weight_decay;
    float* p = param.value;
    const float* g = param.grad;
    float* m = moments.exp_avg.data();
    float* v = moments.exp_avg_sq.data();
    // The update u is a pure function of (m, v, p), so the second pass recomputes it instead of
    // keeping a scratch copy of every tensor.
    const auto update = [=](std::size_t i) {
      return (m[i] * inv_bc1) / (std::sqrt(v[i] * inv_bc2) + eps) + wd * p[i];
    };
    // Pass 1: moments, then the two norms of the trust ratio from the updated moments.
    const auto [param_sq, update_sq] =
        parallel_sum_pair(param.size, [=](std::size_t begin, std::size_t end) {
          double param_partial = 0.0, update_partial = 0.0;
#pragma omp simd reduction(+ : param_partial, update_partial)
          for (std::size_t i = begin; i < end; ++i) {
            const float grad = g[i] * grad_scale;
            m[i] = b1 * m[i] + (1.0F - b1) * grad;
            v[i] = b2 * v[i] + (1.0F - b2) * grad * grad;
            const double u = update(i);
            param_partial += double{p[i]} * p[i];
            update_partial += u * u;
          }
          return std::pair<double, double>{param_partial, update_partial};
        });
    double ratio = 1.0;
    if ((wd != 0.0F || options_.trust_ratio_without_decay) && param_sq > 0 && update_sq > 0) {
      ratio = std::sqrt(param_sq) / std::sqrt(update_sq);
    }
    last_trust_ratios_[index] = ratio;
    const auto scaled_lr = static_cast<float>(learning_rate * ratio);
    // Pass 2: apply.
    parallel_chunks(param.size, [=](std::size_t begin, std::size_t end) {
#pragma omp simd
      for (std::size_t i = begin; i < end; ++i) p[i] -= scaled_lr * update(i);
    });
  }
}

std::vector<ckpt::TensorRecord> Lamb::state_records(std::string_view prefix) const {
  return adam_moment_records(prefix, steps_, state_);
}

void Lamb::load_state(const ckpt::SafetensorsFile& file, std::span<const ParamView> params,
                      std::string_view prefix) {
  validate_params(params);
  std::int64_t steps = 0;
  auto state = read_adam_moments(file, params, prefix, steps);
  steps_ = steps;
  state_ = std::move(state);
}

}  // namespace pf::optim
