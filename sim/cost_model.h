#pragma once
// Cost models give every instruction its duration (and every chunk its memory footprint).
// CONTRACT (first draft, see simulator.h): implementations are uniform, analytic and measured.
#include "scheduler/schedule.h"

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
};

}  // namespace pf::sim
