#pragma once
// The runtime: executes a compiled schedule's per-worker instruction streams for real — the
// streams the simulator replays and the PipeFisher pass fills. One Worker per (data-parallel
// replica, pipeline worker) walks its own stream in order, running forward and backward (fused,
// or split into backward-input and backward-weight) of its BERT chunks, sends and receives
// matched by pair id, Chimera's replica and data-parallel gradient reductions, the tied
// word-embedding gradient sum, every K-FAC kind where the pass put it, and the optimizer step.
// Workers talk only through a comm::Communicator: ThreadedExecutor runs them on threads of one
// process; an MPI or NCCL communicator runs one Worker per process.
//
// Ranks: rank = replica * workers + worker (a replica's pipeline neighbours are adjacent ranks).
// A multi-step schedule (the PipeFisher pass's k steps) is one "round": global step t runs
// stream step (t - o) mod k of round (t - o) / k, o the options' window_origin (usually 0).
#include <chrono>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kfac/inverse.h"
#include "kfac/layer_state.h"
#include "kfac/state_placement.h"
#include "runtime/checkpoint/safetensors.h"
#include "runtime/comm/communicator.h"
#include "runtime/device/device_runtime.h"
#include "runtime/executor/batch_source.h"
#include "runtime/model/bert_chunk.h"
#include "runtime/model/bert_config.h"
#include "runtime/optim/optimizer.h"
#include "scheduler/schedule.h"

namespace pf::exec {

struct KfacSettings {
  float damping = 1e-3F;  // lambda of the Tikhonov damping (pi-adjusted between A and B)
  bool pi_adjusted = true;
  kfac::InverseMethod method = kfac::InverseMethod::kCholesky;
  float running_average = 0.0F;  // 0: each refresh replaces the factors (PipeFisher)
  // Where the K-FAC state lives across the data-parallel replicas (kfac/state_placement.h);
  // the schedule must come from the PipeFisher pass run with the same placement (its
  // broadcasts). Every placement gives the parameters replication gives, bit for bit.
  kfac::StatePlacement placement;
};

template <typename T>
using OptimizerFactory = std::function<std::unique_ptr<optim::BasicOptimizer<T>>()>;
// Learning rate of the update that ends global step `step` (0-based).
using LearningRate = std::function<double(std::int64_t step)>;

struct ExecutorOptions {
  int threads_per_worker = 1;  // OpenMP threads of each worker's kernels
  std::chrono::milliseconds wait_timeout = std::chrono::minutes(10);  // every wait's deadline
  std::uint64_t init_seed = 0;     // weights (identical on every replica)
  std::uint64_t dropout_seed = 0;  // dropout streams, per (step, micro-batch)
  KfacSettings kfac;
  // The step at which the schedule's first refresh window starts: windows of k =
  // schedule.num_steps steps run [origin + r k, origin + (r + 1) k). A run on this schedule
  // starts at or after it: after a K-FAC warm-up the main schedule's windows start where the
  // warm-up ended, and a run resumed on another schedule starts them at the checkpoint's step.
  std::int64_t window_origin = 0;
  // > 0: this executor runs a K-FAC warm-up (a refresh every step) that ends at this step. Its
  // checkpoints record it (state.kfac.warmup_end), so that a resume plans the warm-up's and
  // the main schedule again rather than continue the warm-up's for good.
  std::int64_t kfac_warmup_end = 0;
  bool record_events = false;  // keep a timed event per executed instruction (traces, profiles)
  // Events only of global steps before this one (bounds the memory of a long run's summary).
  std::int64_t record_events_before_step = std::numeric_limits<std::int64_t>::max();
  bool check_finite = true;  // non-finite loss or gradient stops the run naming the tensor
  // Data-parallel gradient buckets (CPU path): during the step's last backward (or
  // backward-weight) of a chunk, each run of finished parameter gradients of up to this many
  // bytes starts its non-blocking all-reduce over the data-parallel group as soon as the model
  // reports it finished (model::GradientsReady), overlapping the rest of that backward; the
  // chunk's DP-reduction instruction then waits for its buckets. The sums are bit-identical to
  // the whole-chunk all-reduce. 0: no buckets, the instruction reduces the whole chunk. With a
  // device communicator (NCCL) each bucket is enqueued on its stream after the compute stream's
  // work so far (no host wait) and the instruction orders the compute stream after them; a
  // device without one keeps the whole-chunk reduction staged through host memory.
  std::int64_t dp_bucket_bytes = std::int64_t{4} << 20;
};

// What every rank learns at the end of a step (all-reduced at the optimizer step).
struct StepResult {
  std::int64_t step = 0;
  double mlm_loss = 0.0;  // mean over the step's micro-batches (global batch)
  double nsp_loss = 0.0;
  double loss() const { return mlm_loss + nsp_loss; }
  double grad_norm = 0.0;  // of the whole model's gradients entering the optimizer
  double learning_rate = 0.0;
  bool kfac_refresh = false;  // new inverses were used in this step's preconditioning
  double seconds = 0.0;       // rank's time from the previous step's end to this one's
};

// kHostLink: K-FAC offload copies between device and host memory (docs/offload.md).
enum class Lane : std::uint8_t { kCompute, kCommunication, kKfac, kHostLink };

// One executed instruction, timed on the executor's steady clock (seconds since its start).
struct InstructionEvent {
  int rank = 0;
  int position = 0;  // in the worker's stream
  std::int64_t global_step = 0;
  sched::Instruction instruction;
  Lane lane = Lane::kCompute;
  double start_s = 0.0;
  double end_s = 0.0;
  // end - start less the time spent waiting for other workers (data to arrive, collectives to
  // gather): the instruction's own work, what a cost model should predict.
  double busy_s = 0.0;
  std::int64_t bytes = 0;  // payload moved (communication)
  // >= 0: not the instruction itself but bucket `bucket` of its data-parallel gradient
  // all-reduce (a kReduceGradDataParallel instruction with ExecutorOptions::dp_bucket_bytes),
  // from its start inside the chunk's last backward to when the worker saw it complete.
  int bucket = -1;
  // A backward or backward-weight: the bytes its micro-batch's stash arena held when it was
  // released (BertChunk::released_stash_bytes: the forward's buffers and the output gradients
  // backward_input kept, as the pooled arena holds them); 0 otherwise.
  std::int64_t stash_bytes = 0;
};

// Live bytes a worker holds beyond its parameters and optimizer/K-FAC state.
struct TransientMemory {
  std::size_t activation_stash = 0;  // chunks' in-flight micro-batches
  std::size_t message_buffers = 0;   // received or to-be-sent activations and gradients
  std::size_t kfac_captures = 0;     // a and g awaiting their curvature task
  std::size_t total() const { return activation_stash + message_buffers + kfac_captures; }
};

// What one chunk of a worker allocated for its parameters, their gradients and the optimizer's
// state of them (BertChunk::parameter_bytes, gradient_bytes; BasicOptimizer::state_bytes).
struct ChunkMemory {
  int pipeline = 0;
  int chunk = 0;
  std::int64_t parameter_bytes = 0;
  std::int64_t gradient_bytes = 0;
  std::int64_t optimizer_bytes = 0;
  std::int64_t total() const { return parameter_bytes + gradient_bytes + optimizer_bytes; }
};

// The K-FAC state one preconditioned Linear held on a worker at its largest.
struct LinearKfacMemory {
  int pipeline = 0;
  int layer = 0;
  sched::LinearKind linear = sched::LinearKind::kQuery;
  std::int64_t peak_bytes = 0;
};

// A worker's memory beyond its stash arenas (Worker::memory).
struct WorkerMemory {
  int rank = 0;
  std::vector<ChunkMemory> chunks;     // by (pipeline, chunk)
  std::vector<LinearKfacMemory> kfac;  // by (pipeline, layer, linear); empty without K-FAC
  std::int64_t static_bytes() const {
    std::int64_t bytes = 0;
    for (const auto& chunk : chunks) bytes += chunk.total();
    return bytes;
  }
  std::int64_t kfac_bytes() const {
    std::int64_t bytes = 0;
    for (const auto& linear : kfac) bytes += linear.peak_bytes;
    return bytes;
  }
};

// Where a worker's optimizer-step instruction spends its host time, per phase, summed over
// global steps >= 1 (the first allocates). Workers wait for each other and, on a device, for
// their streams inside it; the measured optimizer time (InstructionEvent) counts only the update
// (from the statistics' all-reduce on), so these are what a step's end costs beyond it.
struct StepEndTimes {
  std::int64_t steps = 0;
  double sends_s = 0.0;           // this step's sends taken by their receivers
  double tied_embedding_s = 0.0;  // the tied word-embedding gradient summed with the other end
  double gradient_norm_s = 0.0;   // the gradients' squares (on a device: one wait for them)
  double statistics_s = 0.0;      // norm and losses summed over every rank: waits for the last
  double update_s = 0.0;          // the optimizer's update and zeroed gradients (enqueued)
  double synchronize_s = 0.0;     // the streams drained and retired buffers reclaimed (device)
};

// Thrown by a worker; the message names the rank, stream position and instruction.
class WorkerError : public std::runtime_error {
 public:
  WorkerError(const std::string& message, int rank, int position)
      : std::runtime_error(message), rank_(rank), position_(position) {}
  int rank() const { return rank_; }
  int position() const { return position_; }

 private:
  int rank_;
  int position_;
};

// Everything the workers share and read only.
template <typename T>
struct RunSetup {
  model::BertConfig config;
  sched::Schedule schedule;  // compiled (with communication), possibly k steps with K-FAC
  ExecutorOptions options;
  OptimizerFactory<T> make_optimizer;
  LearningRate learning_rate;
  BatchSource* batches = nullptr;
  // The device (device::open_device_runtime). Null: the CPU, where every worker owns a
  // CpuBackend and runs exactly as before. Set: float models only; all workers of this process
  // share its backend, each with a compute and a communication stream. With an in-process or
  // MPI communicator, sends and receives are device-to-device messages ordered by events
  // (device::MessageExchange; threads only) and reductions stage through host memory; with a
  // comm::DeviceCommunicator (NCCL, one GPU per MPI process) the communicator moves the device
  // buffers itself on its own stream, ordered with the worker's streams by events, and
  // gradient reductions are device all-reduces with no host wait (runtime/comm/
  // device_communicator.h). K-FAC runs on device::DeviceKfacLayer (divided
  // inversion and preconditioning tasks run whole at their last piece); K-FAC offload copies
  // (--kfac-offload) run on a copy stream per worker between the device layers and pinned host
  // memory (runtime/executor/pinned_kfac_state.h); instruction times come from timing marks on
  // the streams; make_optimizer is not used, device_optimizer is.
  std::shared_ptr<device::DeviceRuntime> device;
  device::OptimizerChoice device_optimizer;
};

// One rank's worker. Not thread-safe: one thread calls run().
template <typename T>
class Worker {
 public:
  // The worker's clock (instruction events, traces) counts from `clock_origin`: the workers of
  // one process share one origin so that their events line up (constructing a worker takes
  // time: BERT-Large's chunks take seconds). Without one, the clock starts at construction
  // (MPI ranks align theirs with a barrier before constructing).
  Worker(const RunSetup<T>& setup, comm::Communicator& comm);
  Worker(const RunSetup<T>& setup, comm::Communicator& comm, comm::Clock::time_point clock_origin);
  ~Worker();
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  int rank() const;
  int replica() const;
  int worker() const;
  comm::Clock::time_point clock_origin() const;

  // Runs global steps [first_step, last_step), cut at optimizer steps: a first step inside a
  // round resumes that round after its previous step's optimizer step (restore the K-FAC
  // progress first, load_kfac_progress), and run(a, b) then run(b, c) executes what run(a, c)
  // does, in the same order. on_step is called after each step's optimizer update.
  void run(std::int64_t first_step, std::int64_t last_step,
           const std::function<void(const StepResult&)>& on_step);
  // What run() from `step`, the start of one of the schedule's refresh windows, would do first
  // of the previous refresh and nothing else: a pipelined refresh's work placed in the next
  // window (curvature syncs, inversions whole or the rest of their chains, inverse broadcasts:
  // the wrapped K-FAC tasks). The K-FAC state is then whole at `step`, as at the end of a
  // window of a schedule that places nothing there (state to move to another schedule). Between
  // two run() calls; nothing to do at the schedule's first window. Throws std::logic_error when
  // `step` starts no window, WorkerError as run() does.
  void finish_refresh(std::int64_t step);

  // The chunks this worker holds, and the model chunk of (pipeline, chunk) or nullptr.
  std::vector<model::BertChunk<T>*> chunks();
  model::BertChunk<T>* chunk(int pipeline, int chunk);
  optim::BasicOptimizer<T>& optimizer();
  // Per pipeline (Chimera holds two replicas). On a device: a host copy of the device layers,
  // refreshed by each call (statistics; changes to it do not reach the device).
  kfac::KfacState& kfac_state(int pipeline);
  // kfac_state(pipeline) with each offloaded Linear's value and newest inverse filled in from
  // host memory where the live state holds none (--kfac-offload): the state a run without
  // offload holds. What checkpoints and K-FAC statistics read.
  kfac::KfacState kfac_state_with_offloaded(int pipeline);
  // Restores the pipeline's K-FAC state from KfacState records (kfac::KfacState::load_state,
  // which throws naming a bad record), less what this replica does not hold under its K-FAC
  // placement (a Linear's factors or inverses held by other replicas: records of another
  // placement hold them); on a device into its K-FAC layers. An offloaded Linear's
  // value and inverse then move to host memory, as between two refreshes (load_kfac_progress
  // restores where they were inside one). Nothing to do for a pipeline this worker holds no
  // preconditioned Linear of.
  void load_kfac_state(int pipeline, const ckpt::SafetensorsFile& file, std::string_view prefix);
  // K-FAC work in progress inside a round, for checkpoints taken between two of its steps: per
  // Linear the curvature tasks done, whether it was inverted and the inverses before that, and
  // the captured inputs and output gradients whose curvature tasks have not run yet (on a
  // device: downloaded, and uploaded again by load), and for an offloaded Linear where its
  // state is (host copies, written-back flags, the matrices on the device). Records
  // "<prefix>.slot.<pipeline>.<layer>.<linear>.*" and "<prefix>.capture.*"; they describe this
  // worker's stream, so only a run of the same schedule restores them. load throws
  // std::runtime_error naming a record that is missing, mis-shaped or out of range.
  std::vector<ckpt::TensorRecord> kfac_progress_records(std::string_view prefix) const;
  void load_kfac_progress(const ckpt::SafetensorsFile& file, std::string_view prefix);

  TransientMemory transient_memory() const;
  // The most bytes this worker's chunks' stash arenas held at once (BertChunk::live_stash_bytes
  // summed over its chunks after each forward and backward-input, and just before each
  // backward's release), over the instructions of global steps >= from_step of the last
  // reset_peak_stash_bytes (0 by default). Leave the first step out for the steady state: a
  // first cycle's arena grows block by block, and then holds one block of exactly its bytes.
  std::int64_t peak_stash_bytes() const;
  void reset_peak_stash_bytes(std::int64_t from_step = 0);
  // Host time of this worker's optimizer steps by phase (StepEndTimes).
  StepEndTimes step_end_times() const;
  // Bytes of K-FAC state this rank holds: factor accumulators, values and inverses of every
  // preconditioned Linear (kfac::state_cost's memory_bytes between refreshes). On a device the
  // device memory its K-FAC layers hold (accumulators, values, inverses, the inverses a refresh
  // replaced and set-aside sums, as allocated).
  std::int64_t kfac_state_bytes() const;
  // The most K-FAC memory this rank held at once, sampled after each of its K-FAC instructions
  // (offload copies included): kfac_state_bytes' matrices plus, on a device, the offload
  // staging pool's free buffers. What offload's plan bounds (docs/offload.md), where the end of
  // a run (kfac_state_bytes) shows only what is left between steps.
  std::int64_t kfac_peak_resident_bytes() const;
  // What this worker allocated, counted from the buffers: per chunk its parameters, gradients
  // and optimizer state (0 before the optimizer's first step allocates it), and per
  // preconditioned Linear the most bytes its K-FAC state held after any of its K-FAC
  // instructions so far (linear_kfac_bytes in worker_memory.cpp says what counts). The profile's
  // static_bytes and K-FAC bytes (exec::add_measured_memory).
  WorkerMemory memory() const;
  // Bytes of K-FAC state this rank keeps in host memory for its offloaded Linears
  // (--kfac-offload; the schedule's offload copies; pinned memory on a device); 0 without
  // offload.
  std::int64_t kfac_host_bytes() const;
  // Payload bytes this rank sent in K-FAC collectives (curvature sync, broadcasts) so far, as
  // counted by the communicator (comm::Communicator::payload_bytes_sent); -1 where it counts
  // none (threads).
  std::int64_t kfac_bytes_sent() const;
  std::vector<InstructionEvent> take_events();
  // The worker's last instructions, newest last, one per line (the flight recorder).
  std::string history() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// One rank's K-FAC state (Worker::kfac_state_bytes, Worker::kfac_bytes_sent,
// Worker::kfac_host_bytes, Worker::kfac_peak_resident_bytes).
struct RankKfacState {
  std::int64_t state_bytes = 0;
  std::int64_t sent_bytes = -1;
  std::int64_t host_bytes = 0;  // offloaded to host memory (--kfac-offload)
  std::int64_t peak_resident_bytes = 0;
};

// What the trainer drives: all ranks' workers, wherever they run (threads of this process, or
// one process per rank with MPI, where each process holds one and some calls are collective).
template <typename T>
class Executor {
 public:
  virtual ~Executor() = default;
  Executor() = default;
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  virtual int num_ranks() const = 0;
  virtual const RunSetup<T>& setup() const = 0;
  // This process prints progress and writes metrics, traces and profiles (rank 0's process).
  virtual bool is_root() const = 0;
  // Runs [first_step, last_step) on every rank; on_step is called in the root process.
  virtual void run(std::int64_t first_step, std::int64_t last_step,
                   const std::function<void(const StepResult&)>& on_step) = 0;
  // Worker::finish_refresh on every rank (collective), between two run() calls.
  virtual void finish_refresh(std::int64_t step) = 0;
  // Every rank's events in the root process (elsewhere empty).
  virtual std::vector<InstructionEvent> take_events() = 0;
  // Every rank's K-FAC state in the root process, by rank (elsewhere empty). Collective.
  virtual std::vector<RankKfacState> kfac_state_per_rank() = 0;
  // The workers of this process (threads: every rank's; MPI: its own), between two run() calls.
  virtual std::vector<Worker<T>*> local_workers() = 0;
  // Collectives between the processes (checkpoints), with the run's wait deadline: every
  // process's text in the root process, by process (elsewhere empty); the root's text in every
  // process. One process (threads): the text itself.
  virtual std::vector<std::string> gather_to_root(const std::string& text) { return {text}; }
  virtual std::string broadcast_from_root(const std::string& text) { return text; }
};

// Workers on threads of this process, talking through an in-process communicator.
template <typename T>
class ThreadedExecutor final : public Executor<T> {
 public:
  // Validates the schedule (sched::validate) and the configuration; throws
  // std::invalid_argument naming what is wrong before anything runs.
  explicit ThreadedExecutor(RunSetup<T> setup);
  ~ThreadedExecutor() override;

  int num_ranks() const override;
  Worker<T>& worker(int rank);
  const RunSetup<T>& setup() const override;
  bool is_root() const override { return true; }

  // Runs [first_step, last_step) on all workers; on_step is called on rank 0's thread. When a
  // worker fails (an error, a wait past its deadline), every worker stops and this throws
  // std::runtime_error with the failure, each worker's recent history and the schedule grid
  // around the failed instruction.
  void run(std::int64_t first_step, std::int64_t last_step,
           const std::function<void(const StepResult&)>& on_step) override;
  void run(std::int64_t first_step, std::int64_t last_step) { run(first_step, last_step, {}); }
  void finish_refresh(std::int64_t step) override;

  std::vector<InstructionEvent> take_events() override;
  std::vector<RankKfacState> kfac_state_per_rank() override;
  std::vector<Worker<T>*> local_workers() override;
  std::size_t pending_messages() const;

 private:
  // `body` on every worker, each on its own thread; failures reported as run() says.
  void on_every_worker(const std::function<void(Worker<T>&, int rank)>& body);
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Checks a configuration against a schedule before a run: layers, micro-batch counts, K-FAC
// with a non-float model, and so on. Throws std::invalid_argument.
void check_run_setup(const model::BertConfig& config, const sched::Schedule& schedule);

extern template class Worker<float>;
extern template class Worker<double>;
extern template class ThreadedExecutor<float>;
extern template class ThreadedExecutor<double>;

}  // namespace pf::exec
