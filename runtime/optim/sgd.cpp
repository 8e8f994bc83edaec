#include "runtime/optim/sgd.h"

#include <stdexcept>

#include "runtime/optim/state_io.h"

namespace pf::optim {

Sgd::Sgd(SgdOptions options) : options_(options) {
  if (!(options.momentum >= 0) || !(options.weight_decay >= 0)) {
    throw std::invalid_argument("SGD: momentum and weight_decay must be >= 0");
  }
  if (options.nesterov && (options.momentum <= 0 || options.dampening != 0)) {
    throw std::invalid_argument("SGD: Nesterov momentum needs momentum > 0 and dampening 0");
  }
}

void Sgd::step(std::span<const ParamView> params, float learning_rate) {
  validate_params(params);
  ++steps_;
  const float mu = options_.momentum;
  const float keep = 1.0F - options_.dampening;
  const bool nesterov = options_.nesterov;
  for (const auto& param : params) {
    const float wd = param.no_weight_decay ? 0.0F : options_.weight_decay;
    float* p = param.value;
    const float* g = param.grad;
    if (mu == 0.0F) {
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
      buffer.momentum.assign(param.size, 0.0F);
      buffer.shape = param.shape;
    }
    float* b = buffer.momentum.data();
    // torch starts the buffer at the first gradient itself (no dampening on that step).
    const float buf_decay = inserted ? 0.0F : mu;
    const float grad_keep = inserted ? 1.0F : keep;
    parallel_chunks(param.size, [=](std::size_t begin, std::size_t end) {
#pragma omp simd
      for (std::size_t i = begin; i < end; ++i) {
        const float d = g[i] + wd * p[i];
        b[i] = buf_decay * b[i] + grad_keep * d;
        p[i] -= learning_rate * (nesterov ? d + mu * b[i] : b[i]);
      }
    });
  }
}

std::vector<ckpt::TensorRecord> Sgd::state_records(std::string_view prefix) const {
  std::vector<ckpt::TensorRecord> records{step_record(prefix, steps_)};
  for (const auto& [name, buffer] : state_) {
    records.push_back(ckpt::make_f32_record(state_record_name(prefix, name, "momentum_buffer"),
                                            buffer.shape, buffer.momentum));
  }
  return records;
}

void Sgd::load_state(const ckpt::SafetensorsFile& file, std::span<const ParamView> params,
                     std::string_view prefix) {
  validate_params(params);
  const auto steps = read_step(file, prefix);
  decltype(state_) state;
  if (steps > 0 && options_.momentum != 0.0F) {
    for (const auto& param : params) {
      state[param.name] =
          Buffer{read_state_buffer(file, prefix, param, "momentum_buffer"), param.shape};
    }
  }
  steps_ = steps;
  state_ = std::move(state);
}

}  // namespace pf::optim
