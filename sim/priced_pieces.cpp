#include "sim/priced_pieces.h"

#include <stdexcept>
#include <string>

namespace pf::sim {

using sched::OpKind;

PricedPiece price_piece(const DeviceSpec& device, const PieceKernels& kernels) {
  Kernels fused = kernels.backward_input;
  fused.insert(fused.end(), kernels.backward_weight.begin(), kernels.backward_weight.end());
  return {price(device, kernels.forward), price(device, kernels.backward_input),
          price(device, kernels.backward_weight), price(device, fused)};
}

ChunkParts chunk_parts(const sched::ChunkPlacement& placed, OpKind kind,
                       const PricedPiece& embeddings, const PricedPiece& layer,
                       const PricedPiece& heads) {
  const auto piece = [kind](const PricedPiece& p) -> const PricedKernels& {
    switch (kind) {
      case OpKind::kForward:
        return p.forward;
      case OpKind::kBackwardInput:
        return p.backward_input;
      case OpKind::kBackwardWeight:
        return p.backward_weight;
      default:
        return p.backward;
    }
  };
  ChunkParts out;
  const auto add = [&](const PricedPiece& p, int repeat) {
    out.parts[out.count++] = {&piece(p), repeat, -1.0};
  };
  const bool forward = kind == OpKind::kForward;
  if (forward && placed.has_embeddings) add(embeddings, 1);
  if (!forward && placed.has_head) add(heads, 1);
  if (placed.num_layers > 0) add(layer, placed.num_layers);
  if (forward && placed.has_head) add(heads, 1);
  if (!forward && placed.has_embeddings) add(embeddings, 1);
  return out;
}

const sched::ChunkPlacement& chunk_at(const sched::Schedule& schedule, int pipeline, int chunk,
                                      std::string_view model) {
  const auto& placement = schedule.placement;
  const long index = static_cast<long>(pipeline) * placement.chunks_per_pipeline + chunk;
  if (chunk < 0 || chunk >= placement.chunks_per_pipeline || pipeline < 0 ||
      index >= static_cast<long>(placement.chunks.size())) {
    throw std::invalid_argument(std::string(model) + ": no placement for pipeline " +
                                std::to_string(pipeline) + " chunk " + std::to_string(chunk));
  }
  return placement.chunks[static_cast<std::size_t>(index)];
}

}  // namespace pf::sim
