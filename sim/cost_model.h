#pragma once
// Cost models give every instruction its duration (and every chunk its memory footprint).
// CONTRACT (first draft, see simulator.h): implementations are uniform, analytic and measured.
#include <algorithm>

#include "scheduler/schedule.h"
#include "sim/kfac_overheads.h"

namespace pf::sim {

class CostModel {
 public:
  virtual ~CostModel() = default;
  // Seconds the instruction occupies its lane on `worker`. For a send: the transfer time of its
  // bytes over the link to the peer. Must be defined for every OpKind, K-FAC kinds included.
  virtual double duration(const sched::Schedule& schedule, int worker,
                          const sched::Instruction& instruction) const = 0;
  // Bytes held while a micro-batch's activations are stashed on (pipeline, chunk).
  virtual double activation_bytes(const sched::Schedule& schedule, int pipeline,
                                  int chunk) const = 0;
  // Weights + gradients + optimizer state of (pipeline, chunk).
  virtual double static_bytes(const sched::Schedule& schedule, int pipeline, int chunk) const = 0;
  // K-FAC factors and inverses of one Linear (layer, linear kind), fp32.
  virtual double kfac_bytes(const sched::Schedule& schedule, int layer,
                            sched::LinearKind linear) const = 0;
  // The accumulator of one factor (A: `a_factor`, else B) that a refresh's curvature fills from
  // its first piece to the factor's finalize (kfac::FactorState::sum, a d x d fp32 matrix, as
  // large as the factor). The simulator counts it while it exists (docs/simulator.md). By
  // default a quarter of kfac_bytes (the two factors and their inverses, taken as alike in size).
  virtual double kfac_sum_bytes(const sched::Schedule& schedule, int layer,
                                sched::LinearKind linear, bool a_factor) const {
    (void)a_factor;
    return kfac_bytes(schedule, layer, linear) / 4.0;
  }
  // Seconds every K-FAC task of `kind` pays whatever its size (kernel launches, synchronization),
  // included in duration(): each piece of a divided task pays it again, so splitting is never
  // free. Per kind (sim/kfac_overheads.h): the PipeFisher pass cuts no piece of a task smaller
  // than KfacOptions::min_piece_overheads times its own kind's overhead.
  virtual double kfac_task_overhead_s(sched::OpKind /*kind*/) const { return 0.0; }
};

// A piece of a divided K-FAC task (sched::is_piece) from its whole task's duration (overhead
// included): the piece's share of the work plus the overhead again.
inline double kfac_piece_seconds(double whole_s, double overhead_s, const sched::Instruction& in) {
  if (!sched::is_piece(in)) return whole_s;
  return sched::piece_share(in) * std::max(0.0, whole_s - overhead_s) + overhead_s;
}

// The whole task of a piece (its piece fields reset), which the models price before taking the
// piece's share. A curvature-sync piece's `bytes` are its own rows' payload: the whole sync is
// priced from the factor sizes (bytes 0), as the pass emits it whole.
inline sched::Instruction whole_task(const sched::Instruction& in) {
  sched::Instruction whole = in;
  if (!sched::is_piece(in)) return whole;
  whole.piece_begin = 0;
  whole.piece_end = sched::kPieceUnits;
  if (in.kind == sched::OpKind::kCurvatureSync) whole.bytes = 0;
  return whole;
}

}  // namespace pf::sim
