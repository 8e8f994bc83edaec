#include "runtime/optim/lr_schedule.h"

#include <cmath>
#include <stdexcept>
#include <string>

namespace pf::optim {

float PolyWarmupSchedule::learning_rate(std::int64_t step) const {
  if (total_steps <= 0) {
    throw std::invalid_argument("learning-rate schedule: total_steps must be positive, got " +
                                std::to_string(total_steps));
  }
  if (!(warmup_fraction >= 0.0 && warmup_fraction < 1.0)) {
    throw std::invalid_argument("learning-rate schedule: warmup_fraction must lie in [0, 1), got " +
                                std::to_string(warmup_fraction));
  }
  if (step < 0) {
    throw std::invalid_argument("learning-rate schedule: negative step " + std::to_string(step));
  }
  const double progress = static_cast<double>(step + 1) / static_cast<double>(total_steps);
  if (progress < warmup_fraction) {
    return static_cast<float>(base_lr * progress / warmup_fraction);
  }
  if (progress >= 1.0) return 0.0F;
  return static_cast<float>(base_lr * std::pow(1.0 - progress, power));
}

}  // namespace pf::optim
