#include "runtime/optim/param_view.h"

#include <cmath>
#include <set>
#include <stdexcept>

#include "runtime/checkpoint/safetensors.h"
#include "runtime/optim/state_io.h"

namespace pf::optim {

void validate_params(std::span<const ParamView> params) {
  std::set<std::string_view> names;
  for (const auto& param : params) {
    if (param.size > 0 && (param.value == nullptr || param.grad == nullptr)) {
      throw std::invalid_argument("optimizer: parameter '" + param.name +
                                  "' has a null value or gradient pointer");
    }
    const auto count = ckpt::element_count(param.shape);
    if (static_cast<std::uint64_t>(count) != param.size) {
      throw std::invalid_argument("optimizer: parameter '" + param.name + "' has size " +
                                  std::to_string(param.size) + " but shape " +
                                  ckpt::shape_to_string(param.shape));
    }
    if (!names.insert(param.name).second) {
      throw std::invalid_argument("optimizer: parameter name '" + param.name + "' is repeated");
    }
  }
}

double global_grad_norm(std::span<const ParamView> params) {
  double sum = 0.0;
  for (const auto& param : params) {
    const float* grad = param.grad;
    sum += parallel_sum(param.size, [grad](std::size_t begin, std::size_t end) {
      double partial = 0.0;
#pragma omp simd reduction(+ : partial)
      for (std::size_t i = begin; i < end; ++i) partial += double{grad[i]} * grad[i];
      return partial;
    });
  }
  return std::sqrt(sum);
}

}  // namespace pf::optim
