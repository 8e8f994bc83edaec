#pragma once
// Where the model lives: which worker holds each chunk (virtual stage) of each pipeline, and
// which encoder layers each chunk holds.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "scheduler/schedule.h"

namespace pf::sched {

// Sanity limits that keep bad input from exhausting memory: encoder layers per model, chunks per
// pipeline, and (micro-batches x chunks) forward units per pipeline and step.
inline constexpr int kMaxLayers = 1 << 20;
inline constexpr std::int64_t kMaxChunks = 1 << 20;
inline constexpr std::int64_t kMaxComputeUnits = std::int64_t{1} << 26;

// Pipelines the schedule kind runs side by side: 2 for Chimera, 1 otherwise.
int num_pipelines(ScheduleKind kind);

// Micro-batches each pipeline carries per step: m for one pipeline, m / 2 for Chimera (each
// pipeline numbers its own micro-batches from 0).
int microbatches_per_pipeline(const ScheduleParams& params);

// Balanced layer counts for `num_chunks` chunks: every chunk gets floor(L / C); the remainder goes
// to the chunks just before the last one (chunks C-1-r .. C-2), so that neither end chunk (which
// also carries the embeddings or the heads) is heavier than a middle one.
// 24/8 -> 3 each; 12/8 -> [1,1,1,2,2,2,2,1]. Throws when num_layers < num_chunks.
std::vector<int> balanced_layer_counts(int num_layers, int num_chunks);

// Parses the --layers-per-stage list "3,1" (decimal counts separated by commas, spaces around
// them allowed) into per-chunk layer counts: common/comma_list.h's parse_positive_int_list with
// the bound kMaxLayers. Throws std::invalid_argument naming the flag, the item and its position
// on an empty list, an empty or non-numeric item, or a count below 1 or above kMaxLayers.
std::vector<int> parse_layer_counts(std::string_view text);

// "3,1": the inverse of parse_layer_counts.
std::string format_layer_counts(const std::vector<int>& counts);

// Whether chunks zig-zag over the workers (V shape): zbv, or params.v_shape.
bool uses_v_shape(const ScheduleParams& params);

// The worker of chunk c of one pipeline over p workers: c mod p (looped), or in a V shape
// c mod p in even blocks of p chunks and p-1 - c mod p in odd ones.
int looped_worker(int chunk, int workers);
int v_shape_worker(int chunk, int workers);

// Chunk c of pipeline 0 lives on worker c mod p (V shape: v_shape_worker); Chimera's pipeline 1
// puts chunk i on worker D-1-i. Layers: params.layers_per_chunk when given, else
// balanced_layer_counts over the chunks of one pipeline; layers stay contiguous in chunk order.
// Both Chimera pipelines hold the whole model with the same counts per chunk index, so with
// D = 2 and "3,1" each worker holds 3 + 1 layers (chunk 0 of one pipeline, chunk 1 of the other).
// Throws std::invalid_argument on non-positive counts, more chunks than layers, or explicit
// counts of the wrong length, below 1, or not summing to num_layers (naming --layers-per-stage).
Placement make_placement(const ScheduleParams& params);

// The (pipeline, chunk) pairs held by each worker, in pipeline-then-chunk order.
struct ChunkRef {
  int pipeline = 0;
  int chunk = 0;
  friend bool operator==(const ChunkRef&, const ChunkRef&) = default;
};
std::vector<std::vector<ChunkRef>> chunks_by_worker(const Placement& placement, int num_workers);

}  // namespace pf::sched
