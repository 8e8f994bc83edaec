#pragma once
// A schedule: where the model's chunks live, and one ordered instruction stream per worker.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "scheduler/instruction.h"

namespace pf::sched {

// New kinds are appended (files and other components store the numeric value).
enum class ScheduleKind : std::uint8_t {
  kGPipe,
  kOneFOneB,
  kInterleaved,
  kChimera,
  kCustom,
  kZeroBubbleH1,  // Qi et al.'s handcrafted ZB-H1: 1F1B memory, W passes deferred into bubbles
  kZeroBubbleH2,  // ZB-H2: 2p-1 micro-batches in flight, no bubble inside a worker's step
  kZeroBubbleV,   // ZB-V: two chunks per worker in a V (chunk i and 2p-1-i on worker i)
};
std::string_view to_string(ScheduleKind kind);  // "gpipe", "1f1b", "interleaved", "zbv", ...
ScheduleKind schedule_kind_from_string(std::string_view name);  // throws with the allowed names

struct ScheduleParams {
  ScheduleKind kind = ScheduleKind::kOneFOneB;
  int workers = 1;              // p (or D): pipeline workers
  int microbatches = 1;         // m (or N) per training step
  int chunks_per_worker = 1;    // v: model chunks per worker and pipeline (interleaved)
  int num_layers = 0;           // encoder layers to place; 0 means one per chunk
  int data_parallel = 1;        // replicas of the whole pipeline (adds the DP gradient reduction)
  bool split_backward = false;  // emit backward-input + backward-weight instead of backward
  // Zero-bubble H kinds: micro-batches a worker may hold between their forward and their
  // backward-weight (its activation memory); 0 = the kind's own (zbh1: p, zbh2: 2p - 1).
  int max_in_flight = 0;
  // One pipeline whose chunks zig-zag over the workers (V shape): chunk c in block c div p runs
  // on worker c mod p in even blocks and p-1 - c mod p in odd ones, so worker i holds chunks i
  // and 2p-1-i. Implied by zbv; set for imported files laid out that way (torch's "v" style).
  bool v_shape = false;
  // Encoder layers of each chunk of a pipeline, in chunk order (--layers-per-stage); empty means
  // balanced_layer_counts. Needs stages x chunks per worker entries, each >= 1, summing to
  // num_layers (or defining it when num_layers is 0). Chimera's two pipelines both use them.
  std::vector<int> layers_per_chunk;
  friend bool operator==(const ScheduleParams&, const ScheduleParams&) = default;
};

// One model chunk (virtual stage) of one pipeline and the layers it holds.
struct ChunkPlacement {
  int pipeline = 0;
  int chunk = 0;  // index along its pipeline: 0 holds the embeddings
  int worker = 0;
  int first_layer = 0;  // encoder layers [first_layer, first_layer + num_layers)
  int num_layers = 0;
  bool has_embeddings = false;
  bool has_head = false;  // pooler and the MLM/NSP heads
  friend bool operator==(const ChunkPlacement&, const ChunkPlacement&) = default;
};

struct Placement {
  int num_pipelines = 1;        // 2 for Chimera
  int chunks_per_pipeline = 1;  // p * v
  int num_layers = 0;
  std::vector<ChunkPlacement> chunks;  // indexed pipeline * chunks_per_pipeline + chunk

  const ChunkPlacement& at(int pipeline, int chunk) const;
  int worker_of(int pipeline, int chunk) const { return at(pipeline, chunk).worker; }
  friend bool operator==(const Placement&, const Placement&) = default;
};

struct Schedule {
  ScheduleParams params;
  Placement placement;
  int num_steps = 1;  // >1 when the PipeFisher pass spreads one K-FAC refresh over k steps
  std::vector<std::vector<Instruction>> streams;  // one per worker, in issue order
  // The K-FAC refresh is pipelined (--kfac-pipelined-refresh on, docs/pipefisher.md): the
  // inverses of the refresh of window w (the schedule's k steps, repeated) serve from window
  // w + 1's first step on, one step later than PipeFisher's refresh (which uses them in its own
  // last step), and part of that refresh's work may run in window w + 1's first gaps: the
  // instructions with a negative step (is_wrapped). Every preconditioning of a window then uses
  // the previous refresh's inverses.
  bool kfac_pipelined_refresh = false;

  int num_workers() const { return static_cast<int>(streams.size()); }
  std::size_t num_instructions() const;
  friend bool operator==(const Schedule&, const Schedule&) = default;
};

}  // namespace pf::sched
