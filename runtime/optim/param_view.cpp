#include "runtime/optim/param_view.h"

#include <cmath>
#include <set>
#include <stdexcept>

#include "runtime/checkpoint/safetensors.h"
#include "runtime/optim/state_io.h"

namespace pf::optim {
namespace {

template <typename T>
void validate(std::span<const BasicParamView<T>> params) {
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

template <typename T>
double square_sum(std::span<const BasicParamView<T>> params) {
  double sum = 0.0;
  for (const auto& param : params) {
    const T* grad = param.grad;
    sum += parallel_sum(param.size, [grad](std::size_t begin, std::size_t end) {
      double partial = 0.0;
#pragma omp simd reduction(+ : partial)
      for (std::size_t i = begin; i < end; ++i) {
        partial += static_cast<double>(grad[i]) * grad[i];
      }
      return partial;
    });
  }
  return sum;
}

}  // namespace

void validate_params(std::span<const BasicParamView<float>> params) {
  validate(params);
}
void validate_params(std::span<const BasicParamView<double>> params) {
  validate(params);
}

double grad_square_sum(std::span<const BasicParamView<float>> params) {
  return square_sum(params);
}
double grad_square_sum(std::span<const BasicParamView<double>> params) {
  return square_sum(params);
}

double global_grad_norm(std::span<const BasicParamView<float>> params) {
  return std::sqrt(grad_square_sum(params));
}
double global_grad_norm(std::span<const BasicParamView<double>> params) {
  return std::sqrt(grad_square_sum(params));
}

}  // namespace pf::optim
