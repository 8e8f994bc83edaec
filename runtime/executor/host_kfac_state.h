#pragma once
// The K-FAC state of one offloaded Linear in host memory (ZeRO-Infinity for K-FAC;
// docs/offload.md), on the CPU backend: a buffer separate from the worker's live state
// (kfac::KfacLayerState, the "device" copy), filled and read with memcpy, so that a run with
// offload computes exactly what a run without it does while the live state holds the Linear's
// matrices only between a prefetch and its release (Worker::kfac_state_bytes falls by them).
//
// What the host holds: both factors' values (a running average blends into them at the next
// refresh), the newest inverses written back, and the inverses they replaced (the refresh's
// earlier steps precondition with those).
#include <cstdint>
#include <vector>

#include "kfac/eigen_core.h"
#include "kfac/layer_state.h"

namespace pf::exec {

// One factor's matrices in host memory as Eigen matrices (d x d, or empty: none held), for
// checkpoints of offloaded state: HostKfacState and PinnedKfacState give and take them.
struct OffloadedFactor {
  Eigen::MatrixXf value, inverse, previous_inverse;
};

class HostKfacState {
 public:
  // device -> host after an inversion: both factor values, and the new inverse of each factor
  // marked new (the host's inverse before it becomes the previous one); frees those on the
  // device. `this_round`: the new inverses are the current round's refresh's (written_back
  // says so); false for a pipelined refresh's previous-refresh inversions run in this round.
  void write_back(kfac::KfacLayerState& layer, bool new_a, bool new_b, bool this_round = true);
  // host -> device before an inversion: both factor values (none before the first
  // write-back).
  void prefetch_factors(kfac::KfacLayerState& layer) const;
  // host -> device: one factor's inverse into `into` (d x d): the newest written back, or the
  // one it replaced (`previous`). Leaves `into` empty when the host has none (before the first
  // refresh: preconditioning is the identity).
  void prefetch_inverse(bool a, bool previous, std::int64_t d, Eigen::MatrixXf& into) const;

  // True once the factor's new inverse of the current round's refresh is written back
  // (begin_round clears it).
  bool written_back(bool a) const { return a ? written_a_ : written_b_; }
  void begin_round() { written_a_ = written_b_ = false; }
  std::int64_t bytes() const;  // host memory held

  // Checkpoints: one factor's host copies (d x d) out, and back in with its written-back flag.
  // load throws std::invalid_argument for a matrix that is neither empty nor d x d.
  OffloadedFactor to_host(bool a, std::int64_t d) const;
  void load(bool a, std::int64_t d, const OffloadedFactor& factor, bool written);

 private:
  struct Factor {
    std::vector<float> value, inverse, previous_inverse;
  };
  Factor a_, b_;
  bool written_a_ = false, written_b_ = false;
};

}  // namespace pf::exec
