#pragma once
// LAMB (You et al.) as NVIDIA's BERT recipe runs it (apex FusedLAMB, adam_w_mode, grad_averaging,
// bias_correction on, max_grad_norm 1.0):
//   n = global L2 norm of all gradients;  c = n > max_norm ? n / max_norm : 1;  g <- g / c
//   m <- b1 m + (1 - b1) g,   v <- b2 v + (1 - b2) g^2,   t = steps taken including this one
//   u = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + wd * p
//   r = ||p|| / ||u|| per tensor (1 when either norm is 0)
//   p <- p - lr * r * u
// Tensors without weight decay (biases, LayerNorm) take r = 1 unless trust_ratio_without_decay
// (apex's use_nvlamb) is set, as FusedLAMB does.
// In a pipeline each worker steps only its own tensors, but n must be the norm over the whole
// model: pass it to step() (see BasicOptimizer::step); the trust ratios are per tensor anyway.

#include "runtime/optim/optimizer.h"
#include "runtime/optim/state_io.h"

namespace pf::optim {

// Hyper-parameters in double; an optimizer of precision T rounds each to T once, so a float
// optimizer computes with exactly the float constants (0.9F, ...).
struct LambOptions {
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-6;
  double weight_decay = 0.01;
  double max_grad_norm = 1.0;  // <= 0 disables clipping
  bool trust_ratio_without_decay = false;
};

template <typename T>
class BasicLamb final : public BasicOptimizer<T> {
 public:
  using View = BasicParamView<T>;
  explicit BasicLamb(LambOptions options = {});
  std::int64_t steps_taken() const override { return steps_; }
  std::vector<ckpt::TensorRecord> state_records(std::string_view prefix) const override;
  void load_state(const ckpt::SafetensorsFile& file, std::span<const View> params,
                  std::string_view prefix) override;
  std::int64_t state_bytes(std::string_view param) const override;
  std::string_view name() const override { return "lamb"; }

  // Diagnostics of the last step: the global gradient norm before clipping (the one given to
  // step(), or computed from its parameters) and each tensor's trust ratio (in the order of the
  // parameters passed).
  double last_grad_norm() const { return last_grad_norm_; }
  const std::vector<double>& last_trust_ratios() const { return last_trust_ratios_; }

 private:
  void apply_step(std::span<const View> params, T learning_rate,
                  std::optional<double> global_norm) override;

  T beta1_, beta2_, eps_, weight_decay_, max_grad_norm_;
  bool trust_ratio_without_decay_;
  std::int64_t steps_ = 0;
  AdamMomentsMap<T> state_;
  double last_grad_norm_ = 0.0;
  std::vector<double> last_trust_ratios_;
};

using Lamb = BasicLamb<float>;

}  // namespace pf::optim
