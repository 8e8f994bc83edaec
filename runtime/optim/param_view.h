#pragma once
// A parameter as the optimizers see it: a view of a tensor's values and gradient that the model
// owns. Optimizer state is keyed by the name, so names must be unique and stable across runs.
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace pf::optim {

struct ParamView {
  std::string name;
  float* value = nullptr;
  float* grad = nullptr;
  std::size_t size = 0;
  std::vector<std::int64_t> shape;
  bool no_weight_decay = false;  // biases and LayerNorm parameters (BERT's recipe)
};

// Throws std::invalid_argument naming the parameter when a pointer is null, the size disagrees
// with the shape, or two parameters share a name.
void validate_params(std::span<const ParamView> params);

// sqrt(sum of squares) of every gradient, accumulated in double.
double global_grad_norm(std::span<const ParamView> params);

}  // namespace pf::optim
