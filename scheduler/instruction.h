#pragma once
// The instruction IR: one entry of a worker's ordered stream. Everything in the project consumes
// these streams: the PipeFisher pass adds K-FAC work to them, the simulator replays them, the
// runtime executes them and the traces draw them.
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace pf::sched {

enum class OpKind : std::uint8_t {
  // Compute on one model chunk for one micro-batch.
  kForward,
  kBackward,        // full backward: input gradient and weight gradient together
  kBackwardInput,   // zero-bubble split: input gradient only ("I" in torch's CSV)
  kBackwardWeight,  // zero-bubble split: weight gradient only ("W")
  // Point-to-point communication between neighbouring chunks.
  kSendActivation,
  kRecvActivation,
  kSendGradient,
  kRecvGradient,
  // Collective gradient reductions and the step.
  kReduceGradPipelines,     // all-reduce between Chimera's two replicas of a stage
  kReduceGradDataParallel,  // all-reduce across data-parallel replicas
  kOptimizerStep,
  // K-FAC work inserted by the PipeFisher pass.
  kCurvatureA,     // A = a^T a for one micro-batch
  kCurvatureB,     // B = g^T g for one micro-batch
  kCurvatureSync,  // all-reduce of the factors across replicas
  kInvertA,
  kInvertB,
  kPrecondition,  // dW = B^-1 G A^-1
  // K-FAC state sharded across data-parallel replicas (kfac/state_placement.h): the layer's
  // owner replica sends to the others of its data-parallel group; `bytes` is what the owner
  // sends in all (payload x receivers).
  kBroadcastInverses,  // A^-1 and B^-1 to the inverse holders without factors
  kBroadcastGradient,  // the preconditioned gradient (weight and bias) to replicas without inverses
  // K-FAC state offloaded to host memory (ZeRO-Infinity; docs/offload.md), emitted by the offload
  // pass (scheduler/pipefisher/offload_pass.h) on the worker's host link (PCIe). `bytes` is the
  // payload. An offloaded Linear keeps its factors and inverses in host memory between uses:
  kPrefetchFactors,   // host -> device: factors A and B, before the refresh's first inversion
                      // (finalize blends the running average into them; damping reads both)
  kWriteBackState,    // device -> host: factors and new inverses after the refresh's last
                      // inversion; the device copies are freed
  kPrefetchInverses,  // host -> device: the inverses one preconditioning uses (freed after it)
  // A Linear offloaded "factors only" (--kfac-offload factors; is_factors_only) has only the
  // first two: its inverses stay on the device, the write-back moves the factors alone.
};
inline constexpr int kNumOpKinds = static_cast<int>(OpKind::kPrefetchInverses) + 1;

// The Linear layers of a BERT encoder layer that K-FAC preconditions.
enum class LinearKind : std::uint8_t { kQuery, kKey, kValue, kAttentionOut, kFfnIn, kFfnOut };
inline constexpr int kNumLinearKinds = 6;

// A K-FAC task divided by the PipeFisher pass runs as pieces; each piece is one instruction doing
// the share [piece_begin, piece_end) of kPieceUnits equal shares of its task's work (curvature:
// token rows; curvature sync: row ranges of both factors, an all-reduce per range that every
// member posts alike; inversion: steps of its chain; precondition: gradient rows; kfac/pieces.h).
inline constexpr int kPieceUnits = 4096;

struct Instruction {
  OpKind kind = OpKind::kForward;
  std::int8_t pipeline = 0;  // 0, or 1 for Chimera's second (up) pipeline
  // Training step (within a multi-step schedule, PipeFisher's k) whose data this instruction
  // works on. For compute and communication that is also the step it runs in; a K-FAC task may
  // run in a later step's bubble (its position in the stream says when) while still referring
  // to the micro-batch of the step it was taken from.
  std::int16_t step = 0;
  std::int32_t chunk = -1;                 // model chunk (virtual stage) within its pipeline
  std::int32_t microbatch = -1;            // -1 where the instruction covers the whole step
  std::int32_t peer = -1;                  // worker at the other end of a send/receive or reduction
  std::int64_t pair_id = -1;               // equal on a send and its matching receive
  std::int64_t bytes = 0;                  // payload of communication instructions
  std::int16_t layer = -1;                 // K-FAC kinds: encoder layer index (global)
  LinearKind linear = LinearKind::kQuery;  // K-FAC kinds: which Linear of that layer
  // A forward that may run concurrently with the next instruction of its stream, a backward on
  // another chunk (torch's composite OVERLAP_F_B, DualPipeV). Running the two one after the
  // other is always correct; a runtime that can overlap them may.
  bool overlap_next = false;
  // Curvature, curvature sync, inversion, precondition: the piece of the task this instruction
  // runs (the whole task by default). The pieces of one task run in order on their worker; the
  // members of a divided sync post the same pieces in the same order.
  std::uint16_t piece_begin = 0;
  std::uint16_t piece_end = kPieceUnits;

  friend bool operator==(const Instruction&, const Instruction&) = default;
};

static_assert(sizeof(Instruction) <= 40, "the instruction stays small: streams hold millions");

// True when the instruction runs only part of its task.
inline bool is_piece(const Instruction& in) {
  return in.piece_begin != 0 || in.piece_end != kPieceUnits;
}
// The K-FAC kinds the pass may divide: curvature, curvature sync, inversion, precondition (not
// the inverse and gradient broadcasts).
bool is_divisible(OpKind kind);
// A pipelined refresh's work run in the next window (Schedule::kfac_pipelined_refresh): a K-FAC
// instruction whose step is negative works on the data of step `step + num_steps` of the
// previous window (only inversions are placed there by the pass).
inline bool is_wrapped(const Instruction& in) {
  return in.step < 0;
}
// A factor prefetch or write-back of a Linear offloaded factors only (--kfac-offload factors,
// docs/offload.md): its inverses stay on the device (no prefetch_inverses), and the write-back
// moves the factors alone. Marked in `microbatch`, which the copies do not use otherwise (-1);
// every factor prefetch and write-back of such a Linear carries the mark (validated).
inline constexpr std::int32_t kFactorsOnlyCopy = 0;
inline bool is_factors_only(const Instruction& in) {
  return (in.kind == OpKind::kPrefetchFactors || in.kind == OpKind::kWriteBackState) &&
         in.microbatch == kFactorsOnlyCopy;
}
// Share of its task's work, piece_end - piece_begin over kPieceUnits.
inline double piece_share(const Instruction& in) {
  return static_cast<double>(in.piece_end - in.piece_begin) / kPieceUnits;
}
inline constexpr int kMaxKfacLayer = 32767;  // the largest Instruction::layer (16-bit)

std::string_view to_string(OpKind kind);
std::optional<OpKind> op_kind_from_string(std::string_view name);
std::string_view to_string(LinearKind kind);
std::optional<LinearKind> linear_kind_from_string(std::string_view name);

bool is_compute(OpKind kind);         // forward / backward / backward-input / backward-weight
bool is_backward(OpKind kind);        // backward / backward-input / backward-weight
bool is_point_to_point(OpKind kind);  // the four send/receive kinds
bool is_send(OpKind kind);
bool is_receive(OpKind kind);
bool is_reduction(OpKind kind);  // gradient reductions, curvature sync, K-FAC broadcasts
// Curvature sync and the K-FAC broadcasts: K-FAC's collectives.
bool is_kfac_collective(OpKind kind);
bool is_kfac(OpKind kind);
// The three K-FAC offload kinds: copies between device and host memory on the host link.
bool is_kfac_transfer(OpKind kind);

// Short human-readable form used by the grid and error messages, e.g. "F3", "B0.c1", "SA2->w1".
std::string short_label(const Instruction& instruction);

}  // namespace pf::sched
