#pragma once
// K-FAC state of the preconditioned Linear layers, and the per-instruction operations the
// PipeFisher pass schedules separately: curvature A and B per micro-batch, then (once per refresh)
// finalize + invert, and precondition after every step's gradient reduction.
//
// A refresh takes the factors from the micro-batches accumulated since the last one: the refresh's
// factor is their mean, (1/m) sum_i A_i with A_i = a_i^T a_i / T_i (and the same for B), then it
// replaces the previous factor (running_average = 0, PipeFisher) or is blended into it:
// factor <- alpha * factor + (1 - alpha) * mean (kfac-pytorch, alpha ~ 0.95).
#include <compare>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>
#include "kfac/eigen_core.h"

#include "kfac/damping.h"
#include "kfac/inverse.h"
#include "kfac/pieces.h"
#include "runtime/checkpoint/safetensors.h"
#include "scheduler/instruction.h"

namespace pf::kfac {

// One Kronecker factor: its accumulator for the refresh in progress, its value, its inverse.
struct FactorState {
  Eigen::MatrixXf sum;  // lower triangle of the sum of micro-batch factors; empty when idle
  std::int64_t microbatches = 0;  // accumulated into sum since the last finalize
  Eigen::MatrixXf value;       // the factor of the last refresh (symmetric); empty before the first
  std::int64_t refreshes = 0;  // finalizes done
  Eigen::MatrixXf inverse;     // (value + damping I)^-1 of the last inversion; empty before it
  float damping = 0.0F;        // the damping that inverse was computed with
  std::int64_t inverted_refresh = 0;    // value of `refreshes` when inverse was computed
  std::int64_t cholesky_fallbacks = 0;  // inversions where Cholesky failed and eigen took over
};

struct KfacLayerState {
  KfacLayerState() = default;
  // Throws std::invalid_argument unless both dimensions are positive.
  KfacLayerState(std::int64_t d_in, std::int64_t d_out);

  std::int64_t d_in = 0;
  std::int64_t d_out = 0;
  FactorState a;  // d_in x d_in, from the layer's inputs
  FactorState b;  // d_out x d_out, from the gradients of its outputs
};

// Curvature of one micro-batch: a is tokens x d_in row-major; adds a^T a / tokens.
// A piece [unit_begin, unit_end) of the task (pieces.h) adds only its token rows' partial sum
// (still scaled by the whole micro-batch's 1 / tokens); the piece ending at kPieceUnits counts
// the micro-batch. Pieces of one micro-batch must run in order for a reproducible sum.
void accumulate_a(KfacLayerState& layer, const float* a, std::int64_t tokens, int unit_begin = 0,
                  int unit_end = kPieceUnits);
// g is tokens x d_out row-major; adds output_grad_scale * g^T g (see factors.h for the scale).
void accumulate_b(KfacLayerState& layer, const float* g, std::int64_t tokens,
                  float output_grad_scale, int unit_begin = 0, int unit_end = kPieceUnits);

// Ends the refresh of one factor: mean of the accumulated micro-batches, symmetrized, then
// replaces (running_average == 0 or first refresh) or blends into the factor. Releases the
// accumulator. Throws std::logic_error when nothing was accumulated, std::invalid_argument for
// running_average outside [0, 1).
// The part of a factor's accumulator that a curvature-sync piece [unit_begin, unit_end) of the
// refresh's all-reduce carries: the columns piece_items(d, unit_begin, unit_end) of the d x d
// column-major sum (the factor is symmetric: they are its rows of that range too), contiguous.
// Consecutive pieces cover the sum exactly once; a piece may be empty. Elementwise sums over
// the ranges give the bits of the whole sum's all-reduce. Throws std::logic_error on an empty
// (idle) sum, std::invalid_argument on bad units.
std::span<float> sync_piece(FactorState& factor, int unit_begin, int unit_end);

void finalize_a(KfacLayerState& layer, float running_average = 0.0F);
void finalize_b(KfacLayerState& layer, float running_average = 0.0F);

// The damping for both factors from the current values (pi-adjusted unless disabled).
// Throws std::logic_error before both factors have been finalized.
FactorDamping layer_damping(const KfacLayerState& layer, float lambda, bool pi_adjusted = true);

// Inverts one factor's current value with the given damping. Throws std::logic_error before the
// factor's first finalize.
void invert_a(KfacLayerState& layer, float damping,
              InverseMethod method = InverseMethod::kCholesky);
void invert_b(KfacLayerState& layer, float damping,
              InverseMethod method = InverseMethod::kCholesky);

// Installs an inverse computed elsewhere (an InverseChain run piece by piece) as invert_a/b
// would: inverse, damping, inverted_refresh, cholesky_fallbacks. Throws std::logic_error before
// the factor's first finalize, std::invalid_argument for an inverse of the wrong size.
void set_inverse(FactorState& factor, InverseResult result, float damping);

// dW = B_inv G A_inv and db = B_inv g_b (see precondition.h); grad_b/out_b may be null.
// Throws std::logic_error before both inverses exist.
void precondition_layer(const KfacLayerState& layer, const float* grad_w, const float* grad_b,
                        float* out_w, float* out_b);

// The preconditioned Linear layers of the model, keyed by (encoder layer, which Linear).
struct LayerKey {
  std::int32_t layer = 0;
  sched::LinearKind linear = sched::LinearKind::kQuery;
  friend auto operator<=>(const LayerKey&, const LayerKey&) = default;
};

// "query", "key", "value", "attention_out", "ffn_in", "ffn_out" (the spellings of
// sched::to_string(LinearKind), kept here so pf_kfac does not depend on the scheduler library).
std::string_view linear_name(sched::LinearKind kind);
// "kfac.layer.3.query" for prefix "kfac".
std::string layer_record_prefix(std::string_view prefix, LayerKey key);

class KfacState {
 public:
  // Throws std::invalid_argument when the key exists with other dimensions.
  KfacLayerState& add_layer(LayerKey key, std::int64_t d_in, std::int64_t d_out);
  // Throws std::out_of_range naming the layer when it was never added.
  KfacLayerState& at(LayerKey key);
  const KfacLayerState& at(LayerKey key) const;
  bool contains(LayerKey key) const { return layers_.count(key) > 0; }
  const std::map<LayerKey, KfacLayerState>& layers() const { return layers_; }
  std::map<LayerKey, KfacLayerState>& layers() { return layers_; }

  // Records "<prefix>.layer.<i>.<linear>.{A,B,A_inv,B_inv,A_sum,B_sum}" (F32; only those that
  // exist), ".counters" (I64 [2, 4]: rows A and B; microbatches, refreshes, inverted_refresh,
  // cholesky_fallbacks) and ".damping" (F32 [2]: A's, B's) for every layer.
  std::vector<ckpt::TensorRecord> state_records(std::string_view prefix = "kfac") const;
  // Restores the layers already added (their dimensions define the expected shapes). Throws
  // pf::InputError (a std::runtime_error) naming the record that is missing, mis-shaped or
  // inconsistent.
  void load_state(const ckpt::SafetensorsFile& file, std::string_view prefix = "kfac");

 private:
  std::map<LayerKey, KfacLayerState> layers_;
};

}  // namespace pf::kfac
