#pragma once
// Momentum SGD as torch.optim.SGD computes it (PipeFisher puts it behind K-FAC):
//   d = g + wd * p                      (no decay where no_weight_decay)
//   buf <- d on the first step, else mu * buf + (1 - dampening) * d
//   d <- nesterov ? d + mu * buf : buf
//   p <- p - lr * d
#include <map>

#include "runtime/optim/optimizer.h"

namespace pf::optim {

struct SgdOptions {
  float momentum = 0.9F;
  float dampening = 0.0F;
  float weight_decay = 0.0F;
  bool nesterov = false;
};

class Sgd final : public Optimizer {
 public:
  explicit Sgd(SgdOptions options = {});
  void step(std::span<const ParamView> params, float learning_rate) override;
  std::int64_t steps_taken() const override { return steps_; }
  std::vector<ckpt::TensorRecord> state_records(std::string_view prefix) const override;
  void load_state(const ckpt::SafetensorsFile& file, std::span<const ParamView> params,
                  std::string_view prefix) override;
  std::string_view name() const override { return "sgd"; }

 private:
  struct Buffer {
    std::vector<float> momentum;
    std::vector<std::int64_t> shape;
  };
  SgdOptions options_;
  std::int64_t steps_ = 0;
  std::map<std::string, Buffer, std::less<>> state_;
};

}  // namespace pf::optim
