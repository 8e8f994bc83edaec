#pragma once
// Measured costs: a profile JSON of per-chunk durations, link rates and (optionally) K-FAC task
// durations, as the runtime writes it after profiling a few steps. Format (version 1), every
// time in seconds, every size in bytes; docs/simulator.md has the full description:
// {
//   "format_version": 1,
//   "description": "optional free text",
//   "chunks": [ {"pipeline": 0 (optional: all pipelines), "chunk": 0,
//                "forward_s": ..., "backward_s": ...,
//                "backward_input_s": ..., "backward_weight_s": ...   (optional: backward_s / 2),
//                "activation_bytes": ..., "static_bytes": ..., "gradient_bytes": ... (optional: 0)}
//             ],       (activation_bytes: one stashed micro-batch, forward to (weight) backward;
//                       static_bytes: the chunk's parameters, gradients and optimizer state, held
//                       throughout; gradient_bytes: a reduction without a byte count;
//                       pipefisher_train writes its stash arena, what the chunk allocated for
//                       parameters, gradients and optimizer state, and its measured all-reduce
//                       payload)
//   "communication": {"bandwidth": B/s, "latency_s": ..., "message_bytes": ...},
//   "reduction": {"bandwidth": B/s, "latency_s": ...}      (optional: = communication),
//   "host_link": {"bandwidth": B/s, "latency_s": ...}      (optional: device <-> host copies of
//                                                            K-FAC offload; needed only by them),
//   "optimizer_step_s": ...                                  (optional: 0),
//   "shared_processor": {"capacity": ..., "replicas": d, "machines": [...]}  (optional: the
//                                  workers ran as threads sharing one processor, and every
//                                  duration is an instruction's time alone; the simulator then
//                                  shares the processor's throughput among the compute running
//                                  at once, SharedProcessors in sim/simulator.h. The capacity
//                                  is one of the run's d data-parallel replicas' share (replicas
//                                  optional: 1). machines (optional): the run's ranks spanned
//                                  several machines, each rank's machine (rank = replica x
//                                  workers + worker): a processor per machine,
//                                  sim/machine_processors.h. Absent: a processor per worker),
//   "kfac_task_overhead_s": ...   (optional: 1e-5; part of every measured K-FAC compute time, paid
//                                  again by each piece of a divided task),
//   "kfac_task_overheads": {"curvature_a_s", "curvature_b_s", "curvature_sync_s", "invert_a_s",
//                           "invert_b_s", "precondition_s"}   (optional, each optional: a kind's
//                                  own overhead in place of kfac_task_overhead_s),
//   "kfac": [ {"layer": 0 (optional: all), "linear": "query" (optional: all),
//              "curvature_a_s", "curvature_b_s", "invert_a_s", "invert_b_s", "precondition_s",
//              "curvature_sync_s" (optional: ring all-reduce of "bytes" / 2),
//              "bytes": factors + inverses (optional: 0)} ]     (optional; pipefisher_train
//                  writes the K-FAC state the Linear held at its largest: sums, values,
//                  inverses, the inverses a refresh replaced, kept gradients, chains)
// }
// The memory fields are optional so that older files, written when pipefisher_train left
// static_bytes and the K-FAC bytes at 0, load as before (0: the replay's peak memory then lacks
// them). Every field must be finite and >= 0; a bad memory field's error names the chunk
// ("chunks[1].static_bytes (pipeline any, chunk 1)") or the Linear ("kfac[0].bytes (layer 3,
// ffn_in)").
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "sim/cost_model.h"
#include "sim/simulator.h"

namespace pf::sim {

inline constexpr int kProfileFormatVersion = 1;
// Largest pipeline, chunk or layer index a profile may name.
inline constexpr int kMaxProfileIndex = 1 << 30;

struct ChunkProfile {
  int pipeline = -1;  // -1: every pipeline
  int chunk = 0;
  double forward_s = 0.0;
  double backward_s = 0.0;
  double backward_input_s = -1.0;   // < 0: backward_s / 2
  double backward_weight_s = -1.0;  // < 0: backward_s / 2
  double activation_bytes = 0.0;
  double static_bytes = 0.0;
  double gradient_bytes = 0.0;
};

struct LinkProfile {
  double bandwidth = 0.0;  // bytes/s
  double latency_s = 0.0;
  double message_bytes = 0.0;  // payload of a send whose instruction carries no byte count
};

struct KfacProfile {
  int layer = -1;                           // -1: every layer
  std::optional<sched::LinearKind> linear;  // empty: every Linear
  double curvature_a_s = 0.0;
  double curvature_b_s = 0.0;
  double invert_a_s = 0.0;
  double invert_b_s = 0.0;
  double precondition_s = 0.0;
  double curvature_sync_s = -1.0;  // < 0: ring all-reduce of bytes / 2 (the factors)
  double bytes = 0.0;
};

struct Profile {
  std::string description;
  std::vector<ChunkProfile> chunks;
  LinkProfile communication;
  LinkProfile reduction;
  LinkProfile host_link;  // bandwidth 0: not measured
  double optimizer_step_s = 0.0;
  // > 0: every worker shared one processor, of which one replica's workers had this capacity,
  // with shared_processor_replicas replicas on it ("shared_processor").
  double shared_processor_capacity = 0.0;
  int shared_processor_replicas = 1;
  // Each rank's machine when the run's ranks spanned several ("machines"); empty: one machine.
  std::vector<int> shared_processor_machines;
  double kfac_task_overhead_s = kDefaultKfacTaskOverheadS;
  KfacKindOverheads kfac_kind_overheads_s{};  // per kind; empty: kfac_task_overhead_s
  std::vector<KfacProfile> kfac;
};

// Throws std::invalid_argument naming `source`, the field (e.g. "chunks[2].forward_s") and the
// value when a field is missing, of the wrong type, negative, or not finite.
Profile profile_from_json(const nlohmann::json& json, const std::string& source);
Profile profile_from_json_file(const std::filesystem::path& path);
nlohmann::json profile_to_json(const Profile& profile);

// The profile's "shared_processor" as the simulator's option for a run of `replicas`
// data-parallel replicas on the same processor (0: the profile's own): every worker on one
// processor of one replica's share, the profile's capacity x its replicas / `replicas`; off (a
// processor each) without one. With "machines" and the profile's own replicas: a processor per
// machine (processors_by_machine, each machine of the profile's whole capacity); a run of
// another replica count has other ranks, and gets the one processor.
SharedProcessors shared_processors_of(const Profile& profile, int replicas = 0);

class MeasuredCostModel final : public CostModel {
 public:
  MeasuredCostModel(Profile profile, std::string source);

  double duration(const sched::Schedule& schedule, int worker,
                  const sched::Instruction& instruction) const override;
  double activation_bytes(const sched::Schedule& schedule, int pipeline, int chunk) const override;
  double static_bytes(const sched::Schedule& schedule, int pipeline, int chunk) const override;
  double kfac_bytes(const sched::Schedule& schedule, int layer,
                    sched::LinearKind linear) const override;
  // 0: a profile's K-FAC bytes are what pipefisher_train measured the Linear holding at its
  // largest, its factor sums included (counted from its first K-FAC instruction, not twice).
  double kfac_sum_bytes(const sched::Schedule&, int, sched::LinearKind, bool) const override {
    return 0.0;
  }

  double kfac_task_overhead_s(sched::OpKind kind) const override {
    return kfac_overhead_of(kind, profile_.kfac_task_overhead_s, profile_.kfac_kind_overheads_s);
  }
  const Profile& profile() const { return profile_; }

 private:
  const ChunkProfile& chunk(int pipeline, int chunk) const;
  const KfacProfile& kfac(int layer, sched::LinearKind linear) const;

  static constexpr int kAnyLinear = -1;

  Profile profile_;
  std::string source_;
  // Index of the profile entry for a key. Sparse: the indices come from the file, and a table
  // sized by the largest of them would let a 200-byte profile ask for gigabytes.
  std::map<std::pair<int, int>, std::size_t> chunk_any_pipeline_;  // (-1, chunk)
  std::map<std::pair<int, int>, std::size_t> chunk_exact_;         // (pipeline, chunk)
  std::map<std::pair<int, int>, std::size_t> kfac_table_;  // (layer or -1, Linear or kAnyLinear)
};

}  // namespace pf::sim
