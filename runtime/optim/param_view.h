#pragma once
// A parameter as the optimizers see it: a view of a tensor's values and gradient that the model
// owns. Optimizer state is keyed by the name, so names must be unique and stable across runs.
// T is float or double (the model trains in either; double is the reference for equivalence).
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace pf::optim {

template <typename T>
struct BasicParamView {
  std::string name;
  T* value = nullptr;
  T* grad = nullptr;
  std::size_t size = 0;
  std::vector<std::int64_t> shape;
  bool no_weight_decay = false;  // biases and LayerNorm parameters (BERT's recipe)
};
using ParamView = BasicParamView<float>;

// The free functions are overloads rather than templates so that a std::vector of views converts
// to the span implicitly.

// Throws std::invalid_argument naming the parameter when a pointer is null, the size disagrees
// with the shape, or two parameters share a name.
void validate_params(std::span<const BasicParamView<float>> params);
void validate_params(std::span<const BasicParamView<double>> params);

// Sum of the squares of every gradient, accumulated in double. When the parameters are spread
// over workers (a pipeline), each worker all-reduces its own sum to get the global norm.
double grad_square_sum(std::span<const BasicParamView<float>> params);
double grad_square_sum(std::span<const BasicParamView<double>> params);

// sqrt(grad_square_sum(params)).
double global_grad_norm(std::span<const BasicParamView<float>> params);
double global_grad_norm(std::span<const BasicParamView<double>> params);

}  // namespace pf::optim
