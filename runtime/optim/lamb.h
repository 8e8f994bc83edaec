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
#include <map>

#include "runtime/optim/optimizer.h"
#include "runtime/optim/state_io.h"

namespace pf::optim {

struct LambOptions {
  float beta1 = 0.9F;
  float beta2 = 0.999F;
  float eps = 1e-6F;
  float weight_decay = 0.01F;
  float max_grad_norm = 1.0F;  // <= 0 disables clipping
  bool trust_ratio_without_decay = false;
};

class Lamb final : public Optimizer {
 public:
  explicit Lamb(LambOptions options = {});
  void step(std::span<const ParamView> params, float learning_rate) override;
  std::int64_t steps_taken() const override { return steps_; }
  std::vector<ckpt::TensorRecord> state_records(std::string_view prefix) const override;
  void load_state(const ckpt::SafetensorsFile& file, std::span<const ParamView> params,
                  std::string_view prefix) override;
  std::string_view name() const override { return "lamb"; }

  // Diagnostics of the last step: the global gradient norm before clipping and each tensor's
  // trust ratio (in the order of the parameters passed).
  double last_grad_norm() const { return last_grad_norm_; }
  const std::vector<double>& last_trust_ratios() const { return last_trust_ratios_; }

 private:
  LambOptions options_;
  std::int64_t steps_ = 0;
  AdamMomentsMap state_;
  double last_grad_norm_ = 0.0;
  std::vector<double> last_trust_ratios_;
};

}  // namespace pf::optim
