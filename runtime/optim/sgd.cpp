#include "runtime/optim/sgd.h"

#include <stdexcept>

#include "runtime/optim/state_io.h"

namespace pf::optim {

template <typename T>
BasicSgd<T>::BasicSgd(SgdOptions options)
    : momentum_(static_cast<T>(options.momentum)),
      dampening_(static_cast<T>(options.dampening)),
      weight_decay_(static_cast<T>(options.weight_decay)),
      nesterov_(options.nesterov) {
  if (!(momentum_ >= 0) || !(weight_decay_ >= 0)) {
    throw std::invalid_argument("SGD: momentum and weight_decay must be >= 0");
  }
  if (nesterov_ && (momentum_ <= 0 || dampening_ != 0)) {
    throw std::invalid_argument("SGD: Nesterov momentum needs momentum > 0 and dampening 0");
  }
}

template <typename T>
void BasicSgd<T>::apply_step(std::span<const View> params, T learning_rate,
                             std::optional<double> /*global_norm: SGD does not clip*/) {
  ++steps_;
  const T mu = momentum_;
  const T keep = T{1} - dampening_;
  const bool nesterov = nesterov_;
  for (const auto& param : params) {
    const T wd = param.no_weight_decay ? T{0} : weight_decay_;
    T* p = param.value;
    const T* g = param.grad;
    if (mu == T{0}) {
      parallel_chunks(param.size, [=](std::size_t begin, std::size_t end) {
#pragma omp simd
        for (std::size_t i = begin; i < end; ++i) p[i] -= learning_rate * (g[i] + wd * p[i]);
      });
      continue;
    }
    auto [it, inserted] = state_.try_emplace(param.name);
    auto& buffer = it->second;
    if (!inserted && buffer.momentum.size() != param.size) {
      throw std::invalid_argument("SGD: parameter '" + param.name + "' changed size from " +
                                  std::to_string(buffer.momentum.size()) + " to " +
                                  std::to_string(param.size));
    }
    if (inserted) {
      buffer.momentum.assign(param.size, T{0});
      buffer.shape = param.shape;
    }
    T* b = buffer.momentum.data();
    // torch starts the buffer at the first gradient itself (no dampening on that step).
    const T buf_decay = inserted ? T{0} : mu;
    const T grad_keep = inserted ? T{1} : keep;
    parallel_chunks(param.size, [=](std::size_t begin, std::size_t end) {
#pragma omp simd
      for (std::size_t i = begin; i < end; ++i) {
        const T d = g[i] + wd * p[i];
        b[i] = buf_decay * b[i] + grad_keep * d;
        p[i] -= learning_rate * (nesterov ? d + mu * b[i] : b[i]);
      }
    });
  }
}

template <typename T>
std::int64_t BasicSgd<T>::state_bytes(std::string_view param) const {
  const auto it = state_.find(param);
  return it == state_.end() ? 0 : static_cast<std::int64_t>(sizeof(T) * it->second.momentum.size());
}

template <typename T>
std::vector<ckpt::TensorRecord> BasicSgd<T>::state_records(std::string_view prefix) const {
  std::vector<ckpt::TensorRecord> records{step_record(prefix, steps_)};
  for (const auto& [name, buffer] : state_) {
    records.push_back(
        state_buffer_record<T>(prefix, name, "momentum_buffer", buffer.shape, buffer.momentum));
  }
  return records;
}

template <typename T>
void BasicSgd<T>::load_state(const ckpt::SafetensorsFile& file, std::span<const View> params,
                             std::string_view prefix) {
  validate_params(params);
  const auto steps = read_step(file, prefix);
  decltype(state_) state;
  if (steps > 0 && momentum_ != T{0}) {
    for (const auto& param : params) {
      state[param.name] =
          Buffer{read_state_buffer(file, prefix, param, "momentum_buffer"), param.shape};
    }
  }
  steps_ = steps;
  state_ = std::move(state);
}

template class BasicSgd<float>;
template class BasicSgd<double>;

}  // namespace pf::optim
