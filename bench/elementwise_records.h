#pragma once
// The element-wise kernels the calibration benches time (bench_sim_calibrate on the CPU,
// bench_device_kernels on a device), as `pipefisher_sim calibrate` "memory" records: the bytes
// each moves and its work per element, as sim/bert_kernels.cpp counts them. GELU reads x,
// writes y, 4 FLOPs and an erf; an add reads two and writes one, 1 FLOP; LayerNorm reads x,
// writes y, 8 FLOPs (the per-row statistics' bytes are negligible); the softmax rescales the
// scores in place, 4 FLOPs and an exp; dropout reads x, writes y, 2 FLOPs and a random number
// (the mask is regenerated, not stored).
#include <stdexcept>
#include <string_view>

#include <nlohmann/json.hpp>

namespace pf::bench {

// Per element: bytes, then the work (the fields of sim/kernel_costs.h's ElementWork).
struct ElementwiseKind {
  std::string_view name;
  double bytes = 0, flops = 0, exponentials = 0, error_functions = 0, random_numbers = 0;
};

inline const ElementwiseKind& elementwise_kind(std::string_view name) {
  static constexpr ElementwiseKind kinds[] = {
      {.name = "gelu", .bytes = 8, .flops = 4, .error_functions = 1},
      {.name = "add", .bytes = 12, .flops = 1},
      {.name = "layernorm", .bytes = 8, .flops = 8},
      {.name = "softmax", .bytes = 8, .flops = 4, .exponentials = 1},
      {.name = "dropout", .bytes = 8, .flops = 2, .random_numbers = 1}};
  for (const auto& kind : kinds) {
    if (kind.name == name) return kind;
  }
  throw std::invalid_argument("no element-wise kind '" + std::string(name) + "'");
}

// The "memory" record of the kind `name` over `elements` elements (without "seconds").
inline nlohmann::json elementwise_record(std::string_view name, double elements) {
  const ElementwiseKind& kind = elementwise_kind(name);
  nlohmann::json entry = {{"operation", "memory"},
                          {"name", std::string(name)},
                          {"bytes", kind.bytes * elements},
                          {"flops", kind.flops * elements}};
  if (kind.exponentials > 0) entry["exponentials"] = kind.exponentials * elements;
  if (kind.error_functions > 0) entry["error_functions"] = kind.error_functions * elements;
  if (kind.random_numbers > 0) entry["random_numbers"] = kind.random_numbers * elements;
  return entry;
}

}  // namespace pf::bench
