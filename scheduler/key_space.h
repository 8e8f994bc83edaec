#pragma once
// Dense indexing of (step, pipeline, chunk, micro-batch) for flat per-key arrays (no maps).
#include <cstddef>

namespace pf::sched {

struct KeySpace {
  int steps = 1;
  int pipelines = 1;
  int chunks = 1;        // per pipeline
  int microbatches = 1;  // per pipeline

  std::size_t size() const {
    return static_cast<std::size_t>(steps) * static_cast<std::size_t>(pipelines) *
           static_cast<std::size_t>(chunks) * static_cast<std::size_t>(microbatches);
  }
  std::size_t index(int step, int pipeline, int chunk, int microbatch) const {
    return ((static_cast<std::size_t>(step) * static_cast<std::size_t>(pipelines) +
             static_cast<std::size_t>(pipeline)) *
                static_cast<std::size_t>(chunks) +
            static_cast<std::size_t>(chunk)) *
               static_cast<std::size_t>(microbatches) +
           static_cast<std::size_t>(microbatch);
  }
  // Index of (step, pipeline, chunk) for per-chunk arrays.
  std::size_t chunk_index(int step, int pipeline, int chunk) const {
    return (static_cast<std::size_t>(step) * static_cast<std::size_t>(pipelines) +
            static_cast<std::size_t>(pipeline)) *
               static_cast<std::size_t>(chunks) +
           static_cast<std::size_t>(chunk);
  }
  std::size_t num_chunk_keys() const {
    return static_cast<std::size_t>(steps) * static_cast<std::size_t>(pipelines) *
           static_cast<std::size_t>(chunks);
  }
  bool in_range(int step, int pipeline, int chunk, int microbatch) const {
    return step >= 0 && step < steps && pipeline >= 0 && pipeline < pipelines && chunk >= 0 &&
           chunk < chunks && microbatch >= 0 && microbatch < microbatches;
  }
};

}  // namespace pf::sched
