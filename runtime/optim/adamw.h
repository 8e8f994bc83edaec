#pragma once
// AdamW (Loshchilov & Hutter) exactly as torch.optim.AdamW computes it:
//   p <- p * (1 - lr * wd)                          (decoupled decay; none where no_weight_decay)
//   m <- b1 m + (1 - b1) g,   v <- b2 v + (1 - b2) g^2
//   p <- p - (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
#include <map>

#include "runtime/optim/optimizer.h"
#include "runtime/optim/state_io.h"

namespace pf::optim {

struct AdamWOptions {
  float beta1 = 0.9F;
  float beta2 = 0.999F;
  float eps = 1e-8F;
  float weight_decay = 0.01F;
};

class AdamW final : public Optimizer {
 public:
  explicit AdamW(AdamWOptions options = {});
  void step(std::span<const ParamView> params, float learning_rate) override;
  std::int64_t steps_taken() const override { return steps_; }
  std::vector<ckpt::TensorRecord> state_records(std::string_view prefix) const override;
  void load_state(const ckpt::SafetensorsFile& file, std::span<const ParamView> params,
                  std::string_view prefix) override;
  std::string_view name() const override { return "adamw"; }

 private:
  AdamWOptions options_;
  std::int64_t steps_ = 0;
  AdamMomentsMap state_;
};

}  // namespace pf::optim
