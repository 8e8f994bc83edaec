#pragma once
// A sum over [0, size) in fixed chunks spread over the OpenMP threads: each chunk's partial sum
// is kept and the partials are added in chunk order, so the result has the same bits on any
// number of threads (an OpenMP reduction combines per-thread partials, which depend on it).
// Sizes below min_parallel are one body call on the calling thread. body(begin, end) returns
// a double or a std::pair<double, double> (two sums at once).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace pf::kernels::cpu {

inline void add_partial(double& total, double partial) {
  total += partial;
}
inline void add_partial(std::pair<double, double>& total,
                        const std::pair<double, double>& partial) {
  total.first += partial.first;
  total.second += partial.second;
}

template <typename Result, typename Body>
Result ordered_chunk_sum(std::size_t size, std::size_t chunk, std::size_t min_parallel,
                         Body&& body) {
  if (size < min_parallel) return body(std::size_t{0}, size);
  const auto chunks = static_cast<std::int64_t>((size + chunk - 1) / chunk);
  std::vector<Result> partials(static_cast<std::size_t>(chunks));
#pragma omp parallel for schedule(static) if (chunks > 1)
  for (std::int64_t c = 0; c < chunks; ++c) {
    const auto begin = static_cast<std::size_t>(c) * chunk;
    partials[static_cast<std::size_t>(c)] = body(begin, std::min(size, begin + chunk));
  }
  Result total{};
  for (const Result& partial : partials) add_partial(total, partial);
  return total;
}

}  // namespace pf::kernels::cpu
