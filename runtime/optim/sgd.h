#pragma once
// Momentum SGD as torch.optim.SGD computes it (PipeFisher puts it behind K-FAC):
//   d = g + wd * p                      (no decay where no_weight_decay)
//   buf <- d on the first step, else mu * buf + (1 - dampening) * d
//   d <- nesterov ? d + mu * buf : buf
//   p <- p - lr * d
#include <map>

#include "runtime/optim/optimizer.h"

namespace pf::optim {

// Hyper-parameters in double; an optimizer of precision T rounds each to T once, so a float
// optimizer computes with exactly the float constants (0.9F, ...).
struct SgdOptions {
  double momentum = 0.9;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
};

template <typename T>
class BasicSgd final : public BasicOptimizer<T> {
 public:
  using View = BasicParamView<T>;
  explicit BasicSgd(SgdOptions options = {});
  std::int64_t steps_taken() const override { return steps_; }
  std::vector<ckpt::TensorRecord> state_records(std::string_view prefix) const override;
  void load_state(const ckpt::SafetensorsFile& file, std::span<const View> params,
                  std::string_view prefix) override;
  std::int64_t state_bytes(std::string_view param) const override;
  std::string_view name() const override { return "sgd"; }

 private:
  void apply_step(std::span<const View> params, T learning_rate,
                  std::optional<double> global_norm) override;

  struct Buffer {
    std::vector<T> momentum;
    std::vector<std::int64_t> shape;
  };
  T momentum_, dampening_, weight_decay_;
  bool nesterov_;
  std::int64_t steps_ = 0;
  std::map<std::string, Buffer, std::less<>> state_;
};

using Sgd = BasicSgd<float>;

}  // namespace pf::optim
