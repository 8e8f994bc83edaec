#pragma once
// Naming and checking of optimizer-state records shared by the optimizers:
// "<prefix>.step" (I64 [1]) and "<prefix>.<param name>.<buffer>" (the parameter's shape; F32 for
// float state, F64 for double state).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kernels/cpu/ordered_sum.h"
#include "runtime/checkpoint/safetensors.h"
#include "runtime/optim/param_view.h"

namespace pf::optim {

std::string state_record_name(std::string_view prefix, std::string_view param,
                              std::string_view buffer);
ckpt::TensorRecord step_record(std::string_view prefix, std::int64_t steps);
std::int64_t read_step(const ckpt::SafetensorsFile& file, std::string_view prefix);

// "<prefix>.<param>.<buffer>" holding `values` as F32 (float) or F64 (double).
template <typename T>
ckpt::TensorRecord state_buffer_record(std::string_view prefix, std::string_view param,
                                       std::string_view buffer, std::vector<std::int64_t> shape,
                                       std::span<const T> values);
// Throws pf::InputError (a std::runtime_error) naming the record when it is missing, does not match
// the shape, or has another dtype (float reads F32 only; double reads F64, and F32 widened
// exactly).
template <typename T>
std::vector<T> read_state_buffer(const ckpt::SafetensorsFile& file, std::string_view prefix,
                                 const BasicParamView<T>& param, std::string_view buffer);

// First and second moments of one parameter, shared by AdamW and LAMB, keyed by parameter name.
template <typename T>
struct AdamMoments {
  std::vector<T> exp_avg, exp_avg_sq;
  std::vector<std::int64_t> shape;
};
template <typename T>
using AdamMomentsMap = std::map<std::string, AdamMoments<T>, std::less<>>;

// The moments of `param`, zero on its first step; throws std::invalid_argument (naming
// `optimizer` and the parameter) when the parameter changed size since.
template <typename T>
AdamMoments<T>& moments_for(AdamMomentsMap<T>& moments, const BasicParamView<T>& param,
                            std::string_view optimizer);

// Bytes the moments of `param` hold (optimizer::BasicOptimizer::state_bytes); 0 without them.
template <typename T>
std::int64_t adam_moment_bytes(const AdamMomentsMap<T>& moments, std::string_view param) {
  const auto it = moments.find(param);
  if (it == moments.end()) return 0;
  return static_cast<std::int64_t>(sizeof(T) *
                                   (it->second.exp_avg.size() + it->second.exp_avg_sq.size()));
}

// "<prefix>.step" and "<prefix>.<param>.exp_avg" / ".exp_avg_sq" records.
template <typename T>
std::vector<ckpt::TensorRecord> adam_moment_records(std::string_view prefix, std::int64_t steps,
                                                    const AdamMomentsMap<T>& moments);
// Reads what adam_moment_records wrote; `steps` receives the step count (no moments when 0).
template <typename T>
AdamMomentsMap<T> read_adam_moments(const ckpt::SafetensorsFile& file,
                                    std::span<const BasicParamView<T>> params,
                                    std::string_view prefix, std::int64_t& steps);

// Runs body(begin, end) over [0, size) split across the OpenMP threads; small sizes run inline
// so that tiny tensors (biases, LayerNorm) do not pay for a parallel region.
template <typename Body>
void parallel_chunks(std::size_t size, Body&& body) {
  constexpr std::size_t kMinParallel = 1 << 15;
  if (size < kMinParallel) {
    body(std::size_t{0}, size);
    return;
  }
  const auto chunks = static_cast<std::int64_t>((size + kMinParallel / 2 - 1) / (kMinParallel / 2));
#pragma omp parallel for schedule(static)
  for (std::int64_t chunk = 0; chunk < chunks; ++chunk) {
    const auto begin = static_cast<std::size_t>(chunk) * (kMinParallel / 2);
    const auto end = std::min(size, begin + kMinParallel / 2);
    body(begin, end);
  }
}

// The same with a double sum over the chunks (norms), the partials added in chunk order so that
// the bits do not depend on the thread count (the norms feed LAMB's clipping and trust ratios,
// so they reach the parameters).
template <typename Body>
double parallel_sum(std::size_t size, Body&& body) {
  constexpr std::size_t kMinParallel = 1 << 15;
  return kernels::cpu::ordered_chunk_sum<double>(size, kMinParallel / 2, kMinParallel,
                                                 std::forward<Body>(body));
}

// Two sums at once: body(begin, end) returns std::pair<double, double>.
template <typename Body>
std::pair<double, double> parallel_sum_pair(std::size_t size, Body&& body) {
  constexpr std::size_t kMinParallel = 1 << 15;
  return kernels::cpu::ordered_chunk_sum<std::pair<double, double>>(
      size, kMinParallel / 2, kMinParallel, std::forward<Body>(body));
}

}  // namespace pf::optim
