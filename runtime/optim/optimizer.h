#pragma once
// The first-order optimizers share this interface so that the trainer can choose one at run time
// (and K-FAC can put its preconditioned gradients in front of any of them). T is the precision
// of the parameters and of the optimizer state: float or double.
#include <cmath>
#include <cstdint>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/checkpoint/safetensors.h"
#include "runtime/optim/param_view.h"

namespace pf::optim {

template <typename T>
class BasicOptimizer {
 public:
  using Scalar = T;
  using View = BasicParamView<T>;

  virtual ~BasicOptimizer() = default;
  BasicOptimizer() = default;
  BasicOptimizer(const BasicOptimizer&) = default;
  BasicOptimizer& operator=(const BasicOptimizer&) = default;
  BasicOptimizer(BasicOptimizer&&) = default;
  BasicOptimizer& operator=(BasicOptimizer&&) = default;

  // One update of every parameter in `params` from its gradient (gradients are read, not
  // changed).
  // global_norm is the L2 norm of the gradients of the whole model, for when `params` is only a
  // part of it (one pipeline worker's chunks): each worker all-reduces grad_square_sum() of its
  // own parameters (a parameter held by two workers, such as the tied word embedding, counted
  // once) and passes the square root here, so that every worker clips by the same factor. When
  // absent it is computed from `params`. Only algorithms that use the norm read it (LAMB's
  // clipping); AdamW and SGD do not clip.
  // Throws std::invalid_argument for inconsistent parameters or a negative norm; LAMB throws
  // std::runtime_error for a non-finite norm, given or computed, before changing anything.
  void step(std::span<const View> params, T learning_rate,
            std::optional<double> global_norm = std::nullopt) {
    validate_params(params);
    if (global_norm.has_value() && *global_norm < 0) {
      throw std::invalid_argument(std::string(name()) + ": the given global gradient norm " +
                                  std::to_string(*global_norm) + " is negative");
    }
    apply_step(params, learning_rate, global_norm);
  }
  // Updates taken so far (restored by load_state).
  virtual std::int64_t steps_taken() const = 0;
  // The state as safetensors records named "<prefix>.step" (I64) and "<prefix>.<param>.<buffer>"
  // (F32 for a float optimizer, F64 for a double one).
  virtual std::vector<ckpt::TensorRecord> state_records(std::string_view prefix) const = 0;
  // Restores what state_records wrote, checking every buffer against the parameter's shape;
  // throws std::runtime_error naming the record that is missing, mis-shaped or of another dtype.
  // A double optimizer also accepts F32 buffers (widened exactly: a float run continues in
  // double); a float optimizer refuses F64 ones (they would be rounded).
  virtual void load_state(const ckpt::SafetensorsFile& file, std::span<const View> params,
                          std::string_view prefix) = 0;
  virtual std::string_view name() const = 0;
  // Bytes of state this optimizer has allocated for the parameter named `param` (its moments or
  // momentum buffer, as held); 0 for a parameter it holds none for (before its first step). What
  // a worker's memory accounting counts, from the buffers themselves.
  virtual std::int64_t state_bytes(std::string_view param) const = 0;

 private:
  // The algorithm; `params` are validated and global_norm, when given, is not negative.
  virtual void apply_step(std::span<const View> params, T learning_rate,
                          std::optional<double> global_norm) = 0;
};

using Optimizer = BasicOptimizer<float>;

}  // namespace pf::optim
