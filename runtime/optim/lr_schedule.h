#pragma once
// NVIDIA's BERT learning-rate schedule (PolyWarmUpScheduler): linear warm-up over the first
// warmup_fraction of the steps, then polynomial decay to 0 at total_steps.
//   progress = (step + 1) / total_steps        (step = updates already taken, from 0)
//   lr = base * progress / warmup_fraction     while progress < warmup_fraction
//   lr = base * (1 - progress)^power           afterwards (0 from total_steps on)
#include <cstdint>

namespace pf::optim {

struct PolyWarmupSchedule {
  float base_lr = 6e-3F;
  std::int64_t total_steps = 7038;
  double warmup_fraction = 0.2843;
  double power = 0.5;

  // Throws std::invalid_argument for non-positive total_steps, a warm-up fraction outside [0, 1)
  // or a negative step.
  float learning_rate(std::int64_t step) const;
};

}  // namespace pf::optim
