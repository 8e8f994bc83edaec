#pragma once
// What a device K-FAC layer (device_runtime.h's DeviceKfacLayer) keeps beside its
// kfac::KfacLayerState, as the executor's CPU path keeps it in its per-Linear bookkeeping: the
// inverses the latest inversions replaced (a refresh's earlier steps precondition with them),
// and in a pipelined refresh the previous refresh's factor sums set aside at a window's start
// until its inversion (run in that window) finalizes them. Checkpoints taken inside a refresh
// window save and restore it (Worker::kfac_progress_records).
#include <cstdint>
#include <string>

#include "kfac/eigen_core.h"

namespace pf::device {

struct KfacLayerExtras {
  Eigen::MatrixXf previous_a_inverse, previous_b_inverse;  // empty: none
  // Set-aside sums (lower triangles, as kfac::FactorState::sum) and their micro-batches; a
  // count of 0: nothing set aside (the sum is then empty).
  Eigen::MatrixXf set_aside_a_sum, set_aside_b_sum;
  std::int64_t set_aside_a_microbatches = 0, set_aside_b_microbatches = 0;
  // A Cholesky inversion divided into pieces, between two of them (kfac/inverse_chain.h): the
  // factor it inverts, its damping and the unit its next piece starts at. Next unit 0: none in
  // progress (the factor is then empty). A chain rebuilt from these and run up to the next unit
  // is the original bit for bit (a piece runs whole steps).
  Eigen::MatrixXf chain_a_factor, chain_b_factor;
  float chain_a_damping = 0.0F, chain_b_damping = 0.0F;
  int chain_a_next_unit = 0, chain_b_next_unit = 0;
};

// Throws std::invalid_argument naming `layer` and the field unless every matrix is empty or of
// its factor's size (d_in x d_in for A, d_out x d_out for B), every set-aside count is
// non-negative, with its sum present exactly when it is not 0, and every chain's next unit is 0
// (no factor) or inside (0, kPieceUnits) with its factor and a damping >= 0.
void check_extras(const KfacLayerExtras& extras, std::int64_t d_in, std::int64_t d_out,
                  const std::string& layer);

}  // namespace pf::device
