#pragma once
// What optimizers and K-FAC see of a model parameter: its Hugging Face name, its values and its
// gradient (both writable: K-FAC replaces a gradient by the preconditioned one in place).
#include <cstdint>
#include <string>
#include <vector>

namespace pf::model {

template <typename T>
struct ParameterView {
  std::string name;  // Hugging Face tensor name
  T* value = nullptr;
  T* grad = nullptr;
  std::int64_t size = 0;
  std::vector<std::int64_t> shape;    // Linear weights are [out, in]
  bool is_bias_or_layernorm = false;  // excluded from weight decay
};

}  // namespace pf::model
