#include "runtime/optim/adamw.h"

#include <cmath>
#include <stdexcept>

#include "runtime/optim/state_io.h"

namespace pf::optim {

template <typename T>
BasicAdamW<T>::BasicAdamW(AdamWOptions options)
    : beta1_(static_cast<T>(options.beta1)),
      beta2_(static_cast<T>(options.beta2)),
      eps_(static_cast<T>(options.eps)),
      weight_decay_(static_cast<T>(options.weight_decay)) {
  if (!(beta1_ >= 0 && beta1_ < 1) || !(beta2_ >= 0 && beta2_ < 1) || !(eps_ > 0) ||
      !(weight_decay_ >= 0)) {
    throw std::invalid_argument("AdamW: betas must lie in [0, 1), eps > 0, weight_decay >= 0");
  }
}

template <typename T>
void BasicAdamW<T>::apply_step(std::span<const View> params, T learning_rate,
                               std::optional<double> /*global_norm: AdamW does not clip*/) {
  ++steps_;
  const double t = static_cast<double>(steps_);
  // Bias corrections in double, then rounded to T (for float exactly what it always computed).
  const auto step_size = static_cast<T>(static_cast<double>(learning_rate) /
                                        (1.0 - std::pow(static_cast<double>(beta1_), t)));
  const auto inv_sqrt_bc2 =
      static_cast<T>(1.0 / std::sqrt(1.0 - std::pow(static_cast<double>(beta2_), t)));
  const T b1 = beta1_, b2 = beta2_, eps = eps_;
  for (const auto& param : params) {
    auto& moments = moments_for(state_, param, "AdamW");
    const T decay = param.no_weight_decay ? T{1} : T{1} - learning_rate * weight_decay_;
    T* p = param.value;
    const T* g = param.grad;
    T* m = moments.exp_avg.data();
    T* v = moments.exp_avg_sq.data();
    parallel_chunks(param.size, [=](std::size_t begin, std::size_t end) {
#pragma omp simd
      for (std::size_t i = begin; i < end; ++i) {
        m[i] = b1 * m[i] + (T{1} - b1) * g[i];
        v[i] = b2 * v[i] + (T{1} - b2) * g[i] * g[i];
        p[i] = p[i] * decay - step_size * m[i] / (std::sqrt(v[i]) * inv_sqrt_bc2 + eps);
      }
    });
  }
}

template <typename T>
std::int64_t BasicAdamW<T>::state_bytes(std::string_view param) const {
  return adam_moment_bytes(state_, param);
}

template <typename T>
std::vector<ckpt::TensorRecord> BasicAdamW<T>::state_records(std::string_view prefix) const {
  return adam_moment_records(prefix, steps_, state_);
}

template <typename T>
void BasicAdamW<T>::load_state(const ckpt::SafetensorsFile& file, std::span<const View> params,
                               std::string_view prefix) {
  validate_params(params);
  std::int64_t steps = 0;
  auto state = read_adam_moments(file, params, prefix, steps);
  steps_ = steps;
  state_ = std::move(state);
}

template class BasicAdamW<float>;
template class BasicAdamW<double>;

}  // namespace pf::optim
