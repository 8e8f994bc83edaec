#include "runtime/optim/lamb.h"

#include <cmath>
#include <stdexcept>

#include "runtime/optim/state_io.h"

namespace pf::optim {

template <typename T>
BasicLamb<T>::BasicLamb(LambOptions options)
    : beta1_(static_cast<T>(options.beta1)),
      beta2_(static_cast<T>(options.beta2)),
      eps_(static_cast<T>(options.eps)),
      weight_decay_(static_cast<T>(options.weight_decay)),
      max_grad_norm_(static_cast<T>(options.max_grad_norm)),
      trust_ratio_without_decay_(options.trust_ratio_without_decay) {
  if (!(beta1_ >= 0 && beta1_ < 1) || !(beta2_ >= 0 && beta2_ < 1) || !(eps_ > 0) ||
      !(weight_decay_ >= 0)) {
    throw std::invalid_argument("LAMB: betas must lie in [0, 1), eps > 0, weight_decay >= 0");
  }
}

template <typename T>
void BasicLamb<T>::apply_step(std::span<const View> params, T learning_rate,
                              std::optional<double> global_norm) {
  const double grad_norm = global_norm.has_value() ? *global_norm : global_grad_norm(params);
  last_grad_norm_ = grad_norm;
  if (!std::isfinite(grad_norm)) {
    throw std::runtime_error("LAMB: the global gradient norm is not finite (" +
                             std::to_string(grad_norm) + "); refusing to update");
  }
  const auto max_norm = static_cast<double>(max_grad_norm_);
  const double clip = max_norm > 0 && grad_norm > max_norm ? grad_norm / max_norm : 1.0;
  const auto grad_scale = static_cast<T>(1.0 / clip);
  ++steps_;
  const double t = static_cast<double>(steps_);
  const auto inv_bc1 = static_cast<T>(1.0 / (1.0 - std::pow(static_cast<double>(beta1_), t)));
  const auto inv_bc2 = static_cast<T>(1.0 / (1.0 - std::pow(static_cast<double>(beta2_), t)));
  const T b1 = beta1_, b2 = beta2_, eps = eps_;
  last_trust_ratios_.assign(params.size(), 1.0);

  for (std::size_t index = 0; index < params.size(); ++index) {
    const auto& param = params[index];
    auto& moments = moments_for(state_, param, "LAMB");
    const T wd = param.no_weight_decay ? T{0} : weight_decay_;
    T* p = param.value;
    const T* g = param.grad;
    T* m = moments.exp_avg.data();
    T* v = moments.exp_avg_sq.data();
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
            const T grad = g[i] * grad_scale;
            m[i] = b1 * m[i] + (T{1} - b1) * grad;
            v[i] = b2 * v[i] + (T{1} - b2) * grad * grad;
            const double u = update(i);
            param_partial += static_cast<double>(p[i]) * p[i];
            update_partial += u * u;
          }
          return std::pair<double, double>{param_partial, update_partial};
        });
    double ratio = 1.0;
    if ((wd != T{0} || trust_ratio_without_decay_) && param_sq > 0 && update_sq > 0) {
      ratio = std::sqrt(param_sq) / std::sqrt(update_sq);
    }
    last_trust_ratios_[index] = ratio;
    const auto scaled_lr = static_cast<T>(static_cast<double>(learning_rate) * ratio);
    // Pass 2: apply.
    parallel_chunks(param.size, [=](std::size_t begin, std::size_t end) {
#pragma omp simd
      for (std::size_t i = begin; i < end; ++i) p[i] -= scaled_lr * update(i);
    });
  }
}

template <typename T>
std::int64_t BasicLamb<T>::state_bytes(std::string_view param) const {
  return adam_moment_bytes(state_, param);
}

template <typename T>
std::vector<ckpt::TensorRecord> BasicLamb<T>::state_records(std::string_view prefix) const {
  return adam_moment_records(prefix, steps_, state_);
}

template <typename T>
void BasicLamb<T>::load_state(const ckpt::SafetensorsFile& file, std::span<const View> params,
                              std::string_view prefix) {
  validate_params(params);
  std::int64_t steps = 0;
  auto state = read_adam_moments(file, params, prefix, steps);
  steps_ = steps;
  state_ = std::move(state);
}

template class BasicLamb<float>;
template class BasicLamb<double>;

}  // namespace pf::optim
