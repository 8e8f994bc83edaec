#pragma once
// The first-order optimizers share this interface so that the trainer can choose one at run time
// (and K-FAC can put its preconditioned gradients in front of any of them).
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/checkpoint/safetensors.h"
#include "runtime/optim/param_view.h"

namespace pf::optim {

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  Optimizer() = default;
  Optimizer(const Optimizer&) = default;
  Optimizer& operator=(const Optimizer&) = default;
  Optimizer(Optimizer&&) = default;
  Optimizer& operator=(Optimizer&&) = default;

  // One update of every parameter from its current gradient (gradients are read, not changed).
  virtual void step(std::span<const ParamView> params, float learning_rate) = 0;
  // Updates taken so far (restored by load_state).
  virtual std::int64_t steps_taken() const = 0;
  // The state as safetensors records named "<prefix>.step" and "<prefix>.<param>.<buffer>".
  virtual std::vector<ckpt::TensorRecord> state_records(std::string_view prefix) const = 0;
  // Restores what state_records wrote, checking every buffer against the parameter's shape;
  // throws std::runtime_error naming the record that is missing or mis-shaped.
  virtual void load_state(const ckpt::SafetensorsFile& file, std::span<const ParamView> params,
                          std::string_view prefix) = 0;
  virtual std::string_view name() const = 0;
};

}  // namespace pf::optim
