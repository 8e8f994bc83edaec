#pragma once
// AdamW (Loshchilov & Hutter) exactly as torch.optim.AdamW computes it:
//   p <- p * (1 - lr * wd)                          (decoupled decay; none where no_weight_decay)
//   m <- b1 m + (1 - b1) g,   v <- b2 v + (1 - b2) g^2
//   p <- p - (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
#include "runtime/optim/optimizer.h"
#include "runtime/optim/state_io.h"

namespace pf::optim {

// Hyper-parameters in double; an optimizer of precision T rounds each to T once, so a float
// optimizer computes with exactly the float constants (0.9F, ...).
struct AdamWOptions {
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
};

template <typename T>
class BasicAdamW final : public BasicOptimizer<T> {
 public:
  using View = BasicParamView<T>;
  explicit BasicAdamW(AdamWOptions options = {});
  std::int64_t steps_taken() const override { return steps_; }
  std::vector<ckpt::TensorRecord> state_records(std::string_view prefix) const override;
  void load_state(const ckpt::SafetensorsFile& file, std::span<const View> params,
                  std::string_view prefix) override;
  std::int64_t state_bytes(std::string_view param) const override;
  std::string_view name() const override { return "adamw"; }

 private:
  void apply_step(std::span<const View> params, T learning_rate,
                  std::optional<double> global_norm) override;

  T beta1_, beta2_, eps_, weight_decay_;
  std::int64_t steps_ = 0;
  AdamMomentsMap<T> state_;
};

using AdamW = BasicAdamW<float>;

}  // namespace pf::optim
