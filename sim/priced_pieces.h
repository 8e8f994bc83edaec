#pragma once
// What the analytic and the parallel cost models share: a BERT piece's kernels (an encoder layer,
// the embeddings, the heads: sim/bert_kernels.h) priced on a device, the parts a chunk's
// forward or backward queues, and the chunk an instruction runs.
#include <array>
#include <cstddef>
#include <span>
#include <string_view>

#include "scheduler/instruction.h"
#include "scheduler/schedule.h"
#include "sim/bert_kernels.h"
#include "sim/device.h"
#include "sim/kernel_costs.h"

namespace pf::sim {

// Priced kernels of one piece: forward, backward-input, backward-weight, and the fused backward
// (input then weight).
struct PricedPiece {
  PricedKernels forward, backward_input, backward_weight, backward;
};
PricedPiece price_piece(const DeviceSpec& device, const PieceKernels& kernels);

// K-FAC kernels of one Linear kind: curvature A, B; inversion A, B; precondition.
struct PricedKfac {
  PricedKernels curvature_a, curvature_b, invert_a, invert_b, precondition;
};

// The parts of a chunk's forward or backward (`kind`: forward, backward, backward-input or
// backward-weight) in issue order: forward embeddings -> layers -> heads, backward the reverse.
struct ChunkParts {
  std::array<QueuedPart, 3> parts{};
  std::size_t count = 0;
  std::span<const QueuedPart> span() const { return {parts.data(), count}; }
};
ChunkParts chunk_parts(const sched::ChunkPlacement& placed, sched::OpKind kind,
                       const PricedPiece& embeddings, const PricedPiece& layer,
                       const PricedPiece& heads);

// The placement of (pipeline, chunk) in `schedule`; std::invalid_argument naming `model` where
// the schedule has none.
const sched::ChunkPlacement& chunk_at(const sched::Schedule& schedule, int pipeline, int chunk,
                                      std::string_view model);

}  // namespace pf::sim
