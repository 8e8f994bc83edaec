#include "runtime/executor/executor.h"

#include <omp.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

#include "kernels/rng.h"
#include "kfac/factors.h"
#include "kfac/inverse_chain.h"
#include "kfac/precondition.h"
#include "runtime/comm/device_communicator.h"
#include "runtime/comm/in_process.h"
#include "runtime/device/buffer_pool.h"
#include "runtime/device/stream_timeline.h"
#include "runtime/executor/host_kfac_state.h"
#include "runtime/executor/pinned_kfac_state.h"
#include "runtime/tensor/cpu_backend.h"
#include "runtime/tensor/tensor.h"
#include "scheduler/grid.h"
#include "scheduler/validate.h"

namespace pf::exec {

using sched::Instruction;
using sched::LinearKind;
using sched::OpKind;

namespace {

using Seconds = std::chrono::duration<double>;

// Hugging Face name of a preconditioned Linear's weight (its bias replaces "weight").
std::string linear_weight_name(int layer, LinearKind linear) {
  static constexpr std::array<const char*, sched::kNumLinearKinds> kNames = {
      "attention.self.query",   "attention.self.key", "attention.self.value",
      "attention.output.dense", "intermediate.dense", "output.dense"};
  return "bert.encoder.layer." + std::to_string(layer) + "." +
         kNames[static_cast<std::size_t>(linear)] + ".weight";
}

std::string bias_name_of(const std::string& weight_name) {
  return weight_name.substr(0, weight_name.size() - std::string("weight").size()) + "bias";
}

Lane lane_of(OpKind kind) {
  if (sched::is_kfac_transfer(kind)) return Lane::kHostLink;
  if (sched::is_kfac(kind) && !sched::is_kfac_collective(kind)) return Lane::kKfac;
  if (sched::is_point_to_point(kind) || sched::is_reduction(kind)) return Lane::kCommunication;
  return Lane::kCompute;
}

// A micro-batch's data at one chunk: (stream step, pipeline, chunk, micro-batch).
struct MicroKey {
  int step = 0, pipeline = 0, chunk = 0, microbatch = 0;
  friend auto operator<=>(const MicroKey&, const MicroKey&) = default;
};

// Captured K-FAC data of one Linear for one micro-batch of one stream step.
struct CaptureKey {
  int step = 0, pipeline = 0, microbatch = 0, layer = 0;
  LinearKind linear = LinearKind::kQuery;
  friend auto operator<=>(const CaptureKey&, const CaptureKey&) = default;
};
struct Captured {
  std::shared_ptr<std::vector<float>> data;  // rows x cols, row-major (shared by q/k/v inputs)
  tensor::Tensor device;                     // the same on a device (rows x cols, contiguous)
  std::int64_t rows = 0;
  std::int64_t sequences = 0;  // of the micro-batch
};

// A chunk's gradients in one stream step (data-parallel buckets).
struct ChunkStepKey {
  int step = 0, pipeline = 0, chunk = 0;
  friend auto operator<=>(const ChunkStepKey&, const ChunkStepKey&) = default;
};

struct FactorKey {
  int pipeline = 0, layer = 0;
  LinearKind linear = LinearKind::kQuery;
  friend auto operator<=>(const FactorKey&, const FactorKey&) = default;
};

// K-FAC bookkeeping of one Linear held by this worker, per round.
struct KfacSlot {
  int expected_a = 0, expected_b = 0;  // curvature tasks of one round in this stream
  int done_a = 0, done_b = 0;
  bool inverted_a = false, inverted_b = false;             // in the current round
  Eigen::MatrixXf previous_a_inverse, previous_b_inverse;  // before this round's inversion
  // An inversion divided into pieces: its chain between the first piece and the last.
  std::shared_ptr<kfac::InverseChain> chain_a, chain_b;
  // A preconditioning divided into pieces reads the whole gradient in every piece: the
  // gradient as it was before the first piece, kept until the last (weight, then bias).
  std::vector<float> gradient_before, bias_before;
  // The same on the device path: the weight's gradient, then the bias's, in one device buffer.
  tensor::Tensor device_gradient_before;
  // Across the data-parallel replicas (kfac/state_placement.h).
  kfac::LayerPlacement placement;
  bool broadcasts_inverses = false;  // the stream holds this Linear's inverse broadcast
  bool broadcasts_gradient = false;  // ... and its preconditioned-gradient broadcasts
  // Offloaded to host memory (the stream holds its offload copies; docs/offload.md).
  bool offloaded = false;
  // ... factors only (its factor copies are marked sched::is_factors_only): the inverses stay
  // on the device as a kept Linear's; a write-back moves the factors alone.
  bool factors_only = false;
  // Device path: the copy stream's prefetch of this Linear's matrices, which the compute stream
  // waits for before the first instruction that reads them (null: none outstanding).
  std::shared_ptr<tensor::Event> prefetched;
  // A pipelined refresh (Schedule::kfac_pipelined_refresh): the previous refresh's factor sums,
  // set aside at the window's start while its inversion (run in this window) has not finalized
  // them; this window's curvature accumulates into the layer's own sums meanwhile (the second
  // accumulator of each factor).
  Eigen::MatrixXf previous_a_sum, previous_b_sum;
  std::int64_t previous_a_microbatches = 0, previous_b_microbatches = 0;
};

struct Flight {
  int position = 0;
  std::int64_t global_step = 0;
  std::string label;
  const char* phase = "";
  double time_s = 0.0;
};

}  // namespace

void check_run_setup(const model::BertConfig& config, const sched::Schedule& schedule) {
  config.validate();
  if (schedule.placement.num_layers != config.num_layers) {
    throw std::invalid_argument("schedule places " + std::to_string(schedule.placement.num_layers) +
                                " encoder layers, the model has " +
                                std::to_string(config.num_layers));
  }
  if (schedule.num_workers() < 1 || schedule.num_steps < 1) {
    throw std::invalid_argument("schedule has no workers or no steps");
  }
  if (schedule.params.data_parallel < 1) {
    throw std::invalid_argument("schedule: data_parallel must be >= 1");
  }
  if (schedule.params.microbatches < 1) {
    throw std::invalid_argument("schedule: micro-batches must be >= 1");
  }
  bool has_step = false;
  for (const auto& stream : schedule.streams) {
    for (const auto& in : stream) has_step |= in.kind == OpKind::kOptimizerStep;
  }
  if (!has_step) {
    throw std::invalid_argument(
        "schedule has no optimizer step: compile it with communication and steps (a "
        "compute-only schedule cannot be executed)");
  }
}

// ---------------------------------------------------------------------------------------------
// Worker
// ---------------------------------------------------------------------------------------------

template <typename T>
struct Worker<T>::Impl final : model::KfacCapture<T> {
  const RunSetup<T>& setup;
  const sched::Schedule& schedule;
  comm::Communicator& comm;
  int workers = 1, replicas = 1, rank = 0, replica = 0, self = 0;
  int microbatches_total = 1;  // per step and replica, all pipelines
  int per_pipeline = 1;        // micro-batches per pipeline and step
  int last_chunk = 0;          // chunks per pipeline - 1
  const std::vector<Instruction>* stream = nullptr;
  // Declared before the chunks, which allocate from it.
  std::unique_ptr<tensor::Backend> cpu_backend = std::make_unique<tensor::CpuBackend>();
  // A device run (RunSetup::device): the shared backend's streams of this worker, compute (the
  // chunks' ops, K-FAC, the optimizer) and communication (outgoing copies). Null on the CPU.
  std::shared_ptr<device::DeviceRuntime> runtime;
  std::unique_ptr<tensor::Stream> compute_stream, comm_stream;
  // A device run whose communicator moves device memory itself (NCCL, one GPU per process):
  // messages and gradient reductions go through it, ordered with the streams by events, instead
  // of the in-process exchange and host staging. Null otherwise.
  comm::DeviceCommunicator* device_comm = nullptr;
  std::unique_ptr<device::StreamTimeline> timeline;
  struct PendingEvent {
    InstructionEvent event;
    std::size_t span = 0;
  };
  std::vector<PendingEvent> pending_events;  // timed on the device, resolved at the step's end
  std::optional<std::size_t> current_span;   // of the instruction executing
  // Device buffers no longer needed once the stream work issued so far has run.
  struct Retired {
    tensor::Tensor buffer;
    std::unique_ptr<tensor::Event> done;
  };
  std::vector<Retired> retired;
  std::unique_ptr<device::BufferPool> pool;  // message and capture buffers, reused (device path)
  // K-FAC offload on a device: the copy stream (host <-> device copies, ordered with the compute
  // stream by events) and the device buffers of offloaded matrices, reused from step to step
  // (between steps an offloaded Linear's layer holds no value or inverse; the pool keeps what a
  // step's copies had out at once for the next step's).
  std::unique_ptr<tensor::Stream> copy_stream;
  std::unique_ptr<device::BufferPool> staging;

  struct Slot {
    int pipeline = 0, chunk = 0;
    std::unique_ptr<model::BertChunk<T>> model;
  };
  std::vector<Slot> slots;
  std::unique_ptr<optim::BasicOptimizer<T>> optimizer;
  std::vector<optim::BasicParamView<T>> param_views;
  std::vector<std::size_t> unique_params;        // indices counted in the global gradient norm
  std::vector<std::size_t> optimizer_positions;  // stream position of each step's optimizer step

  // Messages and local hand-offs.
  struct Incoming {
    tensor::Tensor buffer;                  // host path and device communicator: the received data
    std::unique_ptr<std::uint64_t> ticket;  // device path: the MessageExchange ticket
    std::unique_ptr<comm::Request> request;
    std::int64_t pair_id = -1;
    int peer = -1;
    double posted_s = 0.0;
  };
  std::map<MicroKey, Incoming> incoming_activations, incoming_gradients;
  std::map<MicroKey, kernels::ConstMatrixView<T>> outputs;  // forward outputs awaiting their send
  std::map<MicroKey, kernels::ConstMatrixView<T>> local_activations;  // next chunk, same worker
  std::map<MicroKey, tensor::Tensor> gradients_out;    // input gradients awaiting their send
  std::map<MicroKey, tensor::Tensor> local_gradients;  // previous chunk, same worker
  struct PendingSend {
    tensor::Tensor buffer;  // alive until the send completes (host path, device communicator)
    std::unique_ptr<std::uint64_t> ticket;  // device path: what the message carries
    std::unique_ptr<comm::Request> request;
  };
  std::vector<PendingSend> pending_sends;

  // K-FAC.
  std::map<int, kfac::KfacState> kfac_states;  // per pipeline
  std::map<FactorKey, KfacSlot> kfac_slots;
  std::map<FactorKey, std::unique_ptr<device::DeviceKfacLayer>> device_kfac;  // device path
  std::map<FactorKey, HostKfacState> host_kfac;      // offloaded Linears' host copies (CPU path)
  std::map<FactorKey, PinnedKfacState> pinned_kfac;  // ... in pinned memory (device path)
  kernels::BackendOps<T>* capture_ops = nullptr;     // the capturing chunk's ops (device copies)
  tensor::Tensor last_input_device;
  std::set<CaptureKey> wanted_a, wanted_b;
  std::map<CaptureKey, Captured> captures;
  std::size_t capture_bytes = 0;
  int capture_step = 0, capture_pipeline = 0;
  const T* last_input = nullptr;  // q, k and v share their input: one copy
  std::shared_ptr<std::vector<float>> last_input_copy;
  int curvature_steps_seen = 0;
  bool has_kfac = false;
  std::int64_t kfac_sent = 0;        // payload bytes of K-FAC collectives (counting communicators)
  std::int64_t peak_stash = 0;       // Worker::peak_stash_bytes
  std::int64_t peak_stash_from = 0;  // of the steps from this one on
  std::int64_t executing_step = 0;   // the global step of the instruction executing
  std::int64_t released_stash = 0;   // the executing backward's stash_bytes (InstructionEvent)
  // Per preconditioned Linear, the most bytes its K-FAC state held after any of its K-FAC
  // instructions (Worker::memory): the state grows over the first refresh (sums, then values,
  // then inverses) and a refresh sets matrices aside, so its largest, not its last, is what the
  // worker must fit.
  std::map<FactorKey, std::int64_t> kfac_peak;
  // The most K-FAC memory the worker held at once after any K-FAC instruction
  // (Worker::kfac_peak_resident_bytes): not the sum of the Linears' peaks above, which never
  // coincide where offload moves the state in and out.
  std::int64_t kfac_peak_resident = 0;

  // Bytes the K-FAC state of one Linear holds now, from its allocated matrices: on the CPU the
  // factors' sums, values and inverses, the inverses a refresh replaced and the sums a pipelined
  // refresh set aside, the gradients a divided preconditioning keeps and inversion chains in
  // progress; on a device the layer's device memory (DeviceKfacLayer::device_bytes) and the
  // kept gradients. Host copies of an offloaded Linear are not the worker's memory: left out.
  std::int64_t linear_kfac_bytes(const FactorKey& key) const {
    const auto slot_it = kfac_slots.find(key);
    if (slot_it == kfac_slots.end()) return 0;
    const KfacSlot& slot = slot_it->second;
    constexpr auto kFloat = static_cast<std::int64_t>(sizeof(float));
    std::int64_t bytes = 0;
    if (runtime) {
      if (const auto layer = device_kfac.find(key); layer != device_kfac.end()) {
        bytes += layer->second->device_bytes();
      }
      return bytes + static_cast<std::int64_t>(slot.device_gradient_before.nbytes());
    }
    if (const auto state = kfac_states.find(key.pipeline); state != kfac_states.end()) {
      if (state->second.contains({key.layer, key.linear})) {
        const auto& layer = state->second.at({key.layer, key.linear});
        for (const auto* factor : {&layer.a, &layer.b}) {
          bytes += kFloat * (factor->sum.size() + factor->value.size() + factor->inverse.size());
        }
      }
    }
    bytes += kFloat * (slot.previous_a_inverse.size() + slot.previous_b_inverse.size() +
                       slot.previous_a_sum.size() + slot.previous_b_sum.size());
    bytes +=
        kFloat * static_cast<std::int64_t>(slot.gradient_before.size() + slot.bias_before.size());
    for (const auto* chain : {&slot.chain_a, &slot.chain_b}) {
      if (*chain) bytes += (*chain)->bytes();
    }
    return bytes;
  }

  void sample_kfac(const Instruction& in) {
    const FactorKey key{in.pipeline, in.layer, in.linear};
    if (!kfac_slots.contains(key)) return;
    auto& peak = kfac_peak[key];
    peak = std::max(peak, linear_kfac_bytes(key));
    kfac_peak_resident = std::max(kfac_peak_resident, kfac_resident_bytes());
  }
  // The worker's K-FAC memory now: every Linear's, and on a device the offload staging pool's
  // free buffers, which stay allocated for the next copies (device memory all the same).
  std::int64_t kfac_resident_bytes() const {
    std::int64_t bytes = staging ? static_cast<std::int64_t>(staging->free_bytes()) : 0;
    for (const auto& [key, slot] : kfac_slots) bytes += linear_kfac_bytes(key);
    return bytes;
  }

  // The chunks' live stash arenas now, plus `released` (an arena just given back).
  void sample_stash(std::int64_t released) {
    if (executing_step < peak_stash_from) return;
    std::int64_t live = released;
    for (const auto& slot : slots)
      live += static_cast<std::int64_t>(slot.model->live_stash_bytes());
    peak_stash = std::max(peak_stash, live);
  }

  // Data-parallel gradient buckets (ExecutorOptions::dp_bucket_bytes): per stream position of
  // a chunk's last weight-gradient backward before its DP reduction, that reduction's position
  // (-1 elsewhere, and everywhere when buckets are off); the buckets in flight per chunk.
  std::vector<int> dp_reduction_of;
  struct DpBucket {
    std::unique_ptr<comm::Request> request;
    std::int64_t begin = 0, end = 0;  // elements of the chunk's flat gradients
    bool done = false;
    double issued_s = 0.0;
    std::int64_t global_step = 0;
    int reduction_position = 0;  // the DP reduction that waits for it
  };
  std::map<ChunkStepKey, std::vector<DpBucket>> dp_buckets;

  // Step accounting.
  double mlm_sum = 0.0, nsp_sum = 0.0;
  bool refreshed_this_step = false;
  std::int64_t current_round = 0;  // the window of k steps being run
  Worker<T>::Impl* self_ptr = nullptr;

  // Flight recorder and events.
  std::vector<Flight> flights;
  std::size_t flight_next = 0;
  comm::Clock::time_point epoch;
  std::vector<InstructionEvent> events;
  double last_step_end_s = 0.0;

  Impl(const RunSetup<T>& setup_, comm::Communicator& comm_, comm::Clock::time_point clock_origin)
      : setup(setup_),
        schedule(setup_.schedule),
        comm(comm_),
        runtime(setup_.device),
        epoch(clock_origin) {
    workers = schedule.num_workers();
    if (runtime) {
      open_device();
      device_comm = dynamic_cast<comm::DeviceCommunicator*>(&comm);
    }
    replicas = schedule.params.data_parallel;
    if (comm.size() != workers * replicas) {
      throw std::invalid_argument("executor: the communicator has " + std::to_string(comm.size()) +
                                  " ranks, the schedule needs " + std::to_string(workers) +
                                  " workers x " + std::to_string(replicas) +
                                  " data-parallel replicas");
    }
    rank = comm.rank();
    replica = rank / workers;
    self = rank % workers;
    stream = &schedule.streams[static_cast<std::size_t>(self)];
    microbatches_total = schedule.params.microbatches;
    per_pipeline = microbatches_total / schedule.placement.num_pipelines;
    last_chunk = schedule.placement.chunks_per_pipeline - 1;
    flights.resize(24);

    for (const auto& placed : schedule.placement.chunks) {
      if (placed.worker != self) continue;
      Slot slot;
      slot.pipeline = placed.pipeline;
      slot.chunk = placed.chunk;
      slot.model = std::make_unique<model::BertChunk<T>>(
          setup.config, model::chunk_spec(placed), backend(), compute_stream.get(),
          runtime ? runtime->precision() : kernels::GemmPrecision::kFp32,
          runtime ? runtime->attention() : kernels::AttentionAlgorithm::kBatchedGemm);
      slot.model->init_weights(setup.options.init_seed);
      slots.push_back(std::move(slot));
    }
    std::sort(slots.begin(), slots.end(), [](const Slot& a, const Slot& b) {
      return std::pair(a.pipeline, a.chunk) < std::pair(b.pipeline, b.chunk);
    });
    const auto tied = model::tied_parameter_names();
    for (auto& slot : slots) {
      for (auto& p : slot.model->parameters()) {
        // Chimera's pipeline 1 holds replicas of pipeline 0's chunks, and a split model's head
        // holds a copy of the word embeddings: neither counts again in the gradient norm.
        const bool duplicate = slot.pipeline > 0 || p.name == tied.second;
        if (!duplicate) unique_params.push_back(param_views.size());
        param_views.push_back({p.name, p.value, p.grad, static_cast<std::size_t>(p.size), p.shape,
                               p.is_bias_or_layernorm});
      }
    }
    // Chimera: two replicas on one worker would share names (never with its placement).
    {
      std::set<std::string> names;
      for (const auto& view : param_views) {
        if (!names.insert(view.name).second) {
          throw std::invalid_argument("executor: worker " + std::to_string(self) +
                                      " holds parameter '" + view.name + "' twice");
        }
      }
    }
    optimizer = make_optimizer();
    if (!optimizer) throw std::invalid_argument("executor: no optimizer");
    for (std::size_t x = 0; x < stream->size(); ++x) {
      if ((*stream)[x].kind != OpKind::kOptimizerStep) continue;
      if ((*stream)[x].step != static_cast<int>(optimizer_positions.size())) {
        throw std::invalid_argument("executor: worker " + std::to_string(self) +
                                    "'s optimizer steps are out of step order at position " +
                                    std::to_string(x));
      }
      optimizer_positions.push_back(x);
    }
    if (optimizer_positions.size() != static_cast<std::size_t>(schedule.num_steps)) {
      throw std::invalid_argument("executor: worker " + std::to_string(self) + "'s stream has " +
                                  std::to_string(optimizer_positions.size()) +
                                  " optimizer steps for a schedule of " +
                                  std::to_string(schedule.num_steps) + " step(s) (one each)");
    }
    prepare_kfac();
    find_dp_bucket_launches();
  }

  // The last weight-gradient backward of each (step, pipeline, chunk) before its DP reduction.
  void find_dp_bucket_launches() {
    dp_reduction_of.assign(stream->size(), -1);
    // A device stages its reductions through host memory at the instruction, unless its
    // communicator moves device memory itself (NCCL): then buckets are enqueued on its stream.
    if (replicas < 2 || (runtime && !device_comm) || setup.options.dp_bucket_bytes <= 0) return;
    for (std::size_t r = 0; r < stream->size(); ++r) {
      const Instruction& reduction = (*stream)[r];
      if (reduction.kind != OpKind::kReduceGradDataParallel) continue;
      for (std::size_t x = r; x-- > 0;) {
        const Instruction& in = (*stream)[x];
        if ((in.kind == OpKind::kBackward || in.kind == OpKind::kBackwardWeight) &&
            in.step == reduction.step && in.pipeline == reduction.pipeline &&
            in.chunk == reduction.chunk) {
          dp_reduction_of[x] = static_cast<int>(r);
          break;
        }
      }
    }
  }

  tensor::Backend& backend() { return runtime ? runtime->backend() : *cpu_backend; }

  void open_device() {
    if constexpr (!std::is_same_v<T, float>) {
      throw std::invalid_argument(
          "executor: device " + tensor::to_string(runtime->device()) +
          " runs float models (fp32, tf32, bf16 or bf16-operands products); this model "
          "is double (fp64 runs on the CPU only)");
    }
    runtime->bind_thread();
    compute_stream = runtime->backend().create_stream();
    comm_stream = runtime->backend().create_stream();
    pool = std::make_unique<device::BufferPool>(runtime->backend());
    timeline = std::make_unique<device::StreamTimeline>(
        [runtime_ = runtime.get()] { return runtime_->create_timing_mark(); });
  }

  std::unique_ptr<optim::BasicOptimizer<T>> make_optimizer() {
    if (!runtime) return setup.make_optimizer ? setup.make_optimizer() : nullptr;
    if constexpr (std::is_same_v<T, float>) {
      return runtime->make_optimizer(setup.device_optimizer, compute_stream.get());
    } else {
      return nullptr;  // refused by open_device
    }
  }

  // Buffers for messages and hand-offs, on the worker's device. `zeroed` clears them in stream
  // order (a host memset on the CPU, as the std::vector they replace did).
  tensor::Tensor new_buffer(std::int64_t rows, std::int64_t cols, bool zeroed) {
    auto buffer = pool ? pool->acquire({rows, cols}, tensor::dtype_of<T>)
                       : tensor::Tensor::empty(backend(), {rows, cols}, tensor::dtype_of<T>);
    if (zeroed) backend().fill_zero(buffer.raw_data(), buffer.nbytes(), compute_stream.get());
    return buffer;
  }
  static kernels::ConstMatrixView<T> matrix_of(const tensor::Tensor& buffer, std::int64_t cols) {
    return {buffer.template data<T>(), buffer.numel() / cols, cols};
  }
  // A device buffer read by work issued on the compute stream is handed back once that work has
  // run (device memory is never reused under running kernels); on the CPU it goes right away.
  void retire(tensor::Tensor buffer) {
    if (!runtime || buffer.numel() == 0) return;
    reclaim_retired(false);
    Retired entry{std::move(buffer), backend().create_event()};
    entry.done->record(*compute_stream);
    retired.push_back(std::move(entry));
  }
  // Retired buffers whose work has run (all of them when the streams are idle): the last holder
  // of a buffer gives it to the pool, since captures recur every step with the same shapes and
  // a cudaFree would wait for the whole device; a buffer still shared (one input captured for
  // Q, K and V) is only dropped here, and pooled by whichever holder retires last.
  void reclaim_retired(bool streams_idle) {
    for (auto& entry : retired) {
      if (!streams_idle && !entry.done->completed()) continue;
      if (pool && entry.buffer.sole_owner()) {
        pool->release(std::move(entry.buffer), *compute_stream);
      }
      entry.buffer = {};
      entry.done.reset();
    }
    std::erase_if(retired, [](const Retired& entry) { return entry.done == nullptr; });
  }
  // A message buffer this worker holds the only reference to, read by work issued on the compute
  // stream: back to the pool on a device (reused once that work has run); freed on the CPU.
  void recycle(tensor::Tensor buffer) {
    if (pool) pool->release(std::move(buffer), *compute_stream);
  }
  // The step's end on a device: every stream idle, retired buffers pooled or freed. The offload
  // staging pool keeps, per matrix size, as many buffers as the step's copies had out at once,
  // for the next step: emptying it here cost a cudaFree per buffer, each waiting for the whole
  // device (every worker sharing it), and a cudaMalloc per copy in the next step (BERT-Large
  // bf16, 1F1B p = 4 on an H200: 2.2x the step time without offload). The trim frees what the
  // layers allocated themselves (a new inverse) and gave to the pool at a write-back.
  void synchronize_device() {
    if (!runtime) return;
    compute_stream->synchronize();
    comm_stream->synchronize();
    if (copy_stream) copy_stream->synchronize();
    reclaim_retired(true);
    if (staging) staging->trim_to_peak_use();
  }

  // --- K-FAC preparation: what to capture and how many curvature tasks a round holds.
  void prepare_kfac() {
    for (const auto& in : *stream) {
      if (!sched::is_kfac(in.kind)) continue;
      has_kfac = true;
      const FactorKey key{in.pipeline, in.layer, in.linear};
      auto& slot = kfac_slots[key];
      const CaptureKey capture{in.step, in.pipeline, in.microbatch, in.layer, in.linear};
      // A divided task counts once, at its last piece.
      const bool completes = in.piece_end == sched::kPieceUnits;
      if (in.kind == OpKind::kCurvatureA) {
        if (completes) ++slot.expected_a;
        wanted_a.insert(capture);
      } else if (in.kind == OpKind::kCurvatureB) {
        if (completes) ++slot.expected_b;
        wanted_b.insert(capture);
      } else if (in.kind == OpKind::kBroadcastInverses) {
        slot.broadcasts_inverses = true;
      } else if (in.kind == OpKind::kBroadcastGradient) {
        slot.broadcasts_gradient = true;
      } else if (sched::is_kfac_transfer(in.kind)) {
        slot.offloaded = true;
        if (sched::is_factors_only(in)) slot.factors_only = true;
      }
    }
    if (!has_kfac) return;
    if constexpr (!std::is_same_v<T, float>) {
      throw std::invalid_argument("executor: K-FAC runs in float; this model is " +
                                  std::string(sizeof(T) == 8 ? "double" : "another type"));
    } else {
      const std::int64_t H = setup.config.hidden_size, I = setup.config.intermediate_size;
      for (auto& [key, slot] : kfac_slots) {
        const bool ffn_in = key.linear == LinearKind::kFfnIn;
        const bool ffn_out = key.linear == LinearKind::kFfnOut;
        const std::int64_t d_in = ffn_out ? I : H;
        const std::int64_t d_out = ffn_in ? I : H;
        kfac_states[key.pipeline].add_layer({key.layer, key.linear}, d_in, d_out);
        if (runtime) {
          device_kfac[key] =
              runtime->make_kfac_layer(compute_stream.get(), d_in, d_out,
                                       "layer " + std::to_string(key.layer) + " " +
                                           std::string(sched::to_string(key.linear)));
        }
        if (!find_param(linear_weight_name(key.layer, key.linear))) {
          throw std::invalid_argument("executor: worker " + std::to_string(self) +
                                      " has K-FAC work for layer " + std::to_string(key.layer) +
                                      " " + std::string(sched::to_string(key.linear)) +
                                      " but does not hold that layer");
        }
      }
      place_kfac_state();
      for (const auto& [key, slot] : kfac_slots) {
        if (!slot.offloaded) continue;
        if (runtime) {
          pinned_kfac.try_emplace(key);
        } else {
          host_kfac.try_emplace(key);
        }
      }
      if (runtime && !pinned_kfac.empty()) {
        copy_stream = runtime->backend().create_stream();
        staging = std::make_unique<device::BufferPool>(runtime->backend());
        // The offloaded Linears' layers take their new buffers from the pool their detached
        // ones go back to (written on the compute stream once their last use has run).
        for (auto& [key, host] : pinned_kfac) {
          device_kfac.at(key)->allocate_with([this](std::int64_t dim) {
            return staging->acquire({dim, dim}, tensor::DType::kF32, *compute_stream);
          });
          // Its pinned memory before the first step (PinnedKfacState::reserve): the values
          // where this replica holds the factors, the newest and previous inverses where it
          // holds the inverses of a Linear offloaded whole.
          const auto& slot = kfac_slots.at(key);
          const auto& layer = kfac_states.at(key.pipeline).at({key.layer, key.linear});
          const bool factors = slot.placement.holds_factors(replica);
          host.reserve(offload_streams(), layer.d_in, layer.d_out, factors,
                       !slot.factors_only && (factors || slot.placement.holds_inverses(replica)));
        }
      }
    }
  }

  // Each Linear's owner replica and holders: the plan every replica of this worker computes
  // alike from the same Linears in the same (map) order, as the PipeFisher pass's report does.
  void place_kfac_state() {
    const auto& placement = setup.options.kfac.placement;
    kfac::validate_placement(placement, replicas);
    std::vector<kfac::LinearDims> dims;
    for (const auto& [key, slot] : kfac_slots) {
      const auto& layer = kfac_states.at(key.pipeline).at({key.layer, key.linear});
      dims.push_back({layer.d_in, layer.d_out});
    }
    const auto plan = kfac::plan_state(dims, replicas, placement);
    std::size_t i = 0;
    for (auto& [key, slot] : kfac_slots) {
      slot.placement = plan.layers[i++];
      const bool sharded =
          slot.placement.factor_count < replicas || slot.placement.inverse_count < replicas;
      if (sharded && schedule.placement.num_pipelines > 1) {
        throw std::invalid_argument("executor: --kfac-sharding " + kfac::to_string(placement) +
                                    " needs a schedule with one pipeline (use replicate)");
      }
      const bool wants_inverses = slot.placement.broadcasts_inverses();
      const bool wants_gradient = slot.placement.broadcasts_gradient(replicas);
      if (wants_inverses != slot.broadcasts_inverses ||
          wants_gradient != slot.broadcasts_gradient) {
        throw std::invalid_argument(
            "executor: K-FAC placement " + kfac::to_string(placement) + " over " +
            std::to_string(replicas) + " replica(s) " +
            (wants_inverses || wants_gradient ? "needs" : "has no") + " broadcasts of layer " +
            std::to_string(key.layer) + " " + std::string(sched::to_string(key.linear)) +
            ", but worker " + std::to_string(self) + "'s stream " +
            (slot.broadcasts_inverses || slot.broadcasts_gradient ? "has" : "lacks") +
            " them: run the PipeFisher pass with the same --kfac-sharding");
      }
    }
  }

  optim::BasicParamView<T>* find_param(const std::string& name) {
    for (auto& view : param_views) {
      if (view.name == name) return &view;
    }
    return nullptr;
  }

  Slot& slot_of(int pipeline, int chunk) {
    for (auto& slot : slots) {
      if (slot.pipeline == pipeline && slot.chunk == chunk) return slot;
    }
    throw std::runtime_error("this worker does not hold chunk " + std::to_string(chunk) +
                             " of pipeline " + std::to_string(pipeline));
  }

  comm::Deadline deadline() const { return comm::Clock::now() + setup.options.wait_timeout; }
  double now_s() const { return Seconds(comm::Clock::now() - epoch).count(); }
  int rank_of(int replica_index, int worker_index) const {
    return replica_index * workers + worker_index;
  }

  void record(int position, std::int64_t global_step, const Instruction& in, const char* phase) {
    auto& f = flights[flight_next % flights.size()];
    f = {position, global_step, sched::short_label(in), phase, now_s()};
    ++flight_next;
  }

  std::string history() const {
    std::ostringstream out;
    const std::size_t count = std::min(flight_next, flights.size());
    for (std::size_t i = flight_next - count; i < flight_next; ++i) {
      const auto& f = flights[i % flights.size()];
      out << "    t=" << f.time_s << "s step " << f.global_step << " position " << f.position << " "
          << f.label << " " << f.phase << "\n";
    }
    if (count == 0) out << "    (nothing executed)\n";
    return out.str();
  }

  // --- KfacCapture: copies what the stream's curvature tasks will need, nothing else.
  // The chunk numbers micro-batches by stash id (micro-batch + stream step * micro-batches).
  int stream_microbatch(int stash_id) const { return stash_id - capture_step * microbatches_total; }
  void on_input(int layer, LinearKind linear, int microbatch,
                kernels::ConstMatrixView<T> a) override {
    const CaptureKey key{capture_step, capture_pipeline, stream_microbatch(microbatch), layer,
                         linear};
    if (!wanted_a.contains(key)) return;
    if (runtime) {
      if (a.data != last_input || last_input_device.numel() == 0) {
        last_input_device = device_copy(a);
        last_input = a.data;
      }
      store_device(key, false, last_input_device, a.rows);
      return;
    }
    if (a.data != last_input || !last_input_copy) {
      last_input_copy = copy_matrix(a);
      last_input = a.data;
    }
    store(key, false, last_input_copy, a.rows);
  }
  void on_output_grad(int layer, LinearKind linear, int microbatch,
                      kernels::ConstMatrixView<T> g) override {
    const CaptureKey key{capture_step, capture_pipeline, stream_microbatch(microbatch), layer,
                         linear};
    if (!wanted_b.contains(key)) return;
    if (runtime) {
      store_device(key, true, device_copy(g), g.rows);
      return;
    }
    store(key, true, copy_matrix(g), g.rows);
  }
  // A contiguous device copy of a captured view, in stream order: one copy when the view is
  // contiguous, else (a q/k/v block of the fused QKV) zero + accumulate, which is exact.
  tensor::Tensor device_copy(kernels::ConstMatrixView<T> m) {
    auto copy = new_buffer(m.rows, m.cols, !m.contiguous());
    if (m.contiguous()) {
      backend().copy(copy.raw_data(), m.data, copy.nbytes(), tensor::CopyKind::kDeviceToDevice,
                     compute_stream.get());
    } else {
      capture_ops->accumulate(m, {copy.template data<T>(), m.rows, m.cols});
    }
    return copy;
  }
  void store_device(const CaptureKey& key, bool is_b, tensor::Tensor data, std::int64_t rows) {
    Captured captured;
    captured.device = std::move(data);
    captured.rows = rows;
    captured.sequences = capture_sequences;
    (is_b ? captures_b : captures)[key] = std::move(captured);
    recount_captures();
  }
  static std::shared_ptr<std::vector<float>> copy_matrix(kernels::ConstMatrixView<T> m) {
    auto copy = std::make_shared<std::vector<float>>(static_cast<std::size_t>(m.rows * m.cols));
    for (std::int64_t r = 0; r < m.rows; ++r) {
      const T* row = m.row(r);
      for (std::int64_t c = 0; c < m.cols; ++c) {
        (*copy)[static_cast<std::size_t>(r * m.cols + c)] = static_cast<float>(row[c]);
      }
    }
    return copy;
  }
  std::map<CaptureKey, Captured> captures_b;
  std::int64_t capture_sequences = 0;  // sequences of the micro-batch being captured
  void store(const CaptureKey& key, bool is_b, std::shared_ptr<std::vector<float>> data,
             std::int64_t rows) {
    Captured captured;
    captured.data = std::move(data);
    captured.rows = rows;
    captured.sequences = capture_sequences;
    (is_b ? captures_b : captures)[key] = std::move(captured);
    recount_captures();
  }
  void recount_captures() {
    std::set<const void*> seen;
    std::size_t bytes = 0;
    for (const auto* map : {&captures, &captures_b}) {
      for (const auto& [key, value] : *map) {
        if (value.data && seen.insert(value.data.get()).second) {
          bytes += value.data->size() * sizeof(float);
        }
        if (value.device.numel() > 0 && seen.insert(value.device.raw_data()).second) {
          bytes += value.device.nbytes();
        }
      }
    }
    capture_bytes = bytes;
  }

  // --- The micro-batch of (stream step, pipeline, micro-batch).
  int global_index(int pipeline, int microbatch) const {
    return replica * microbatches_total + pipeline * per_pipeline + microbatch;
  }
  std::uint64_t dropout_seed(std::int64_t global_step, int index) const {
    return kernels::derive_seed(
        kernels::derive_seed(setup.options.dropout_seed, static_cast<std::uint64_t>(global_step)),
        static_cast<std::uint64_t>(index));
  }
  T loss_scale() const { return T(1) / static_cast<T>(microbatches_total * replicas); }

  // --- Instructions.
  void forward(const Instruction& in, std::int64_t global_step, int position) {
    auto& slot = slot_of(in.pipeline, in.chunk);
    const int index = global_index(in.pipeline, in.microbatch);
    const auto batch = setup.batches->batch(global_step, index);
    const MicroKey key{in.step, in.pipeline, in.chunk, in.microbatch};
    kernels::ConstMatrixView<T> input;
    tensor::Tensor received;
    if (in.chunk > 0) {
      if (auto local = local_activations.find(key); local != local_activations.end()) {
        input = local->second;
        local_activations.erase(local);
      } else {
        auto it = incoming_activations.find(key);
        if (it == incoming_activations.end()) {
          throw std::runtime_error(
              "forward has no input: no receive of its activation was "
              "posted before it and the previous chunk is on another worker");
        }
        await(it->second, "the activation", position, global_step, in);
        received = take_incoming(it->second, batch->tokens());
        incoming_activations.erase(it);
        input = matrix_of(received, setup.config.hidden_size);
      }
    }
    model::ForwardOptions options;
    options.seed = dropout_seed(global_step, index);
    capture_step = in.step;
    capture_pipeline = in.pipeline;
    capture_sequences = batch->batch_size;
    capture_ops = &slot.model->ops();
    last_input = nullptr;
    last_input_copy.reset();
    last_input_device = {};
    auto result = slot.model->forward(in.microbatch + in.step * microbatches_total, *batch, input,
                                      options, has_kfac ? this : nullptr);
    last_input_copy.reset();
    last_input_device = {};
    sample_stash(0);
    recycle(std::move(received));
    if (result.losses) {
      if (setup.options.check_finite) model::check_finite_loss(*result.losses, global_step);
      mlm_sum += result.losses->mlm;
      nsp_sum += result.losses->nsp;
    } else {
      const MicroKey next{in.step, in.pipeline, in.chunk + 1, in.microbatch};
      if (schedule.placement.worker_of(in.pipeline, in.chunk + 1) == self) {
        local_activations[next] = result.output;
      } else {
        outputs[key] = result.output;
      }
    }
  }

  void backward(const Instruction& in, std::int64_t global_step, int position) {
    auto& slot = slot_of(in.pipeline, in.chunk);
    const MicroKey key{in.step, in.pipeline, in.chunk, in.microbatch};
    const int stash_id = in.microbatch + in.step * microbatches_total;
    std::optional<BucketLauncher> launcher;
    const int reduction = dp_reduction_of[static_cast<std::size_t>(position)];
    if (reduction >= 0) {
      launcher.emplace(*this, ChunkStepKey{in.step, in.pipeline, in.chunk},
                       slot.model->flat_grads(), global_step, reduction, position);
    }
    model::GradientsReady* ready = launcher ? &*launcher : nullptr;
    if (in.kind == OpKind::kBackwardWeight) {
      slot.model->backward_weight(stash_id, ready);
      released_stash = static_cast<std::int64_t>(slot.model->released_stash_bytes());
      sample_stash(released_stash);
      if (launcher) launcher->finish();
      return;
    }
    const auto batch = setup.batches->batch(global_step, global_index(in.pipeline, in.microbatch));
    const std::int64_t rows = batch->tokens(), H = setup.config.hidden_size;
    kernels::ConstMatrixView<T> grad_output;
    tensor::Tensor received;
    if (in.chunk < last_chunk) {
      if (auto local = local_gradients.find(key); local != local_gradients.end()) {
        received = std::move(local->second);
        local_gradients.erase(local);
      } else {
        auto it = incoming_gradients.find(key);
        if (it == incoming_gradients.end()) {
          throw std::runtime_error(
              "backward has no output gradient: no receive was posted "
              "before it and the next chunk is on another worker");
        }
        await(it->second, "the output gradient", position, global_step, in);
        received = take_incoming(it->second, rows);
        incoming_gradients.erase(it);
      }
      grad_output = matrix_of(received, H);
    }
    tensor::Tensor grad_input;
    kernels::MatrixView<T> grad_input_view;
    if (in.chunk > 0) {
      grad_input = new_buffer(rows, H, true);
      grad_input_view = {grad_input.template data<T>(), rows, H};
    }
    capture_step = in.step;
    capture_pipeline = in.pipeline;
    capture_sequences = batch->batch_size;
    capture_ops = &slot.model->ops();
    auto* capture = has_kfac ? this : nullptr;
    if (in.kind == OpKind::kBackward) {
      slot.model->backward(stash_id, grad_output, grad_input_view, loss_scale(), capture, ready);
      released_stash = static_cast<std::int64_t>(slot.model->released_stash_bytes());
      sample_stash(released_stash);
      if (launcher) launcher->finish();
    } else {
      slot.model->backward_input(stash_id, grad_output, grad_input_view, loss_scale(), capture);
      sample_stash(0);
    }
    recycle(std::move(received));
    if (in.chunk > 0) {
      const MicroKey previous{in.step, in.pipeline, in.chunk - 1, in.microbatch};
      if (schedule.placement.worker_of(in.pipeline, in.chunk - 1) == self) {
        local_gradients[previous] = std::move(grad_input);
      } else {
        gradients_out[key] = std::move(grad_input);
      }
    }
  }

  void await(Incoming& incoming, const char* what, int position, std::int64_t global_step,
             const Instruction& in) {
    if (device_comm) {
      // The compute stream waits for the receive on the device; the host goes on (the
      // communicator's watchdog guards the receive's deadline).
      device_comm->order_before(*incoming.request, *compute_stream);
      return;
    }
    if (incoming.request->test()) return;
    record(position, global_step, in, "waiting");
    const WaitTimer timer(*this);
    try {
      incoming.request->wait(deadline());
    } catch (const comm::TimeoutError& error) {
      throw std::runtime_error(
          std::string("waited ") + std::to_string(setup.options.wait_timeout.count() / 1000.0) +
          " s for " + what + " from worker " + std::to_string(incoming.peer % workers) + " (pair " +
          std::to_string(incoming.pair_id) + "): " + error.what());
    }
  }

  // The received data: the host buffer, or on a device the message behind the ticket, with the
  // compute stream made to wait until its copy has landed. A wrong size is an error.
  tensor::Tensor take_incoming(Incoming& incoming, std::int64_t rows) {
    tensor::Tensor data;
    if (!runtime || device_comm) {
      data = std::move(incoming.buffer);  // a device communicator's receive: ordered by await
    } else {
      auto message = runtime->exchange().take(*incoming.ticket);
      compute_stream->wait(*message.ready);
      // The instruction's own time starts once its input is there (not while it waits).
      if (current_span) timeline->restart(*current_span, *compute_stream);
      data = std::move(message.data);
    }
    const std::int64_t expected = rows * setup.config.hidden_size;
    if (data.numel() != expected) {
      throw std::runtime_error("received " + std::to_string(data.numel()) +
                               " elements from worker " + std::to_string(incoming.peer % workers) +
                               " (pair " + std::to_string(incoming.pair_id) + "), expected " +
                               std::to_string(expected));
    }
    return data;
  }

  void send(const Instruction& in, std::int64_t& bytes) {
    const MicroKey key{in.step, in.pipeline, in.chunk, in.microbatch};
    const int peer = rank_of(replica, in.peer);
    if (in.kind == OpKind::kSendActivation) {
      auto it = outputs.find(key);
      if (it == outputs.end()) {
        throw std::runtime_error(
            "nothing to send: the forward of this micro-batch has not run "
            "on this worker");
      }
      const auto& view = it->second;
      tensor::Tensor packed = pack(view);
      bytes = static_cast<std::int64_t>(packed.nbytes());
      outputs.erase(it);
      post_send(peer, in.pair_id, std::move(packed));
    } else {
      auto it = gradients_out.find(key);
      if (it == gradients_out.end()) {
        throw std::runtime_error(
            "nothing to send: the backward of this micro-batch has not run "
            "on this worker");
      }
      bytes = static_cast<std::int64_t>(it->second.nbytes());
      tensor::Tensor buffer = std::move(it->second);
      gradients_out.erase(it);
      if (runtime) after_compute(*comm_stream);
      post_send(peer, in.pair_id, std::move(buffer));
    }
  }

  // Sends complete in the background; finished ones are dropped as new ones are posted, and all
  // are awaited at the optimizer step.
  // A forward output packed into a message buffer. On a device: a device-to-device copy on the
  // communication stream once the compute stream has produced the output (a strided view, never
  // produced by the model today, is packed on the compute stream instead).
  tensor::Tensor pack(kernels::ConstMatrixView<T> view) {
    tensor::Tensor packed = new_buffer(view.rows, view.cols, runtime && !view.contiguous());
    T* to = packed.template data<T>();
    if (!runtime) {
      for (std::int64_t r = 0; r < view.rows; ++r) {
        std::copy_n(view.row(r), view.cols, to + r * view.cols);
      }
    } else if (view.contiguous()) {
      after_compute(*comm_stream);
      backend().copy(to, view.data, packed.nbytes(), tensor::CopyKind::kDeviceToDevice,
                     comm_stream.get());
    } else {
      capture_ops->accumulate(view, {to, view.rows, view.cols});
      after_compute(*comm_stream);
    }
    return packed;
  }
  // `waiting`'s later work waits for everything issued on the compute stream so far.
  void after_compute(tensor::Stream& waiting) {
    const auto produced = backend().create_event();
    produced->record(*compute_stream);
    waiting.wait(*produced);
  }

  // The host path hands the buffer to the communicator; a device posts it to the exchange with
  // an event recorded after the communication stream's copy, and sends the ticket.
  void post_send(int peer, std::int64_t tag, tensor::Tensor buffer) {
    PendingSend pending;
    if (!runtime || device_comm) {
      if (device_comm) {
        // The communicator's stream starts the send once the communication stream's copy (or
        // the compute stream's output, which that stream already waits for) is there.
        const auto ready = backend().create_event();
        ready->record(*comm_stream);
        device_comm->wait_on_device(*ready);
      }
      pending.buffer = std::move(buffer);
      pending.request = comm.isend(
          peer, tag,
          std::as_bytes(std::span<const T>(pending.buffer.template data<T>(),
                                           static_cast<std::size_t>(pending.buffer.numel()))));
    } else {
      std::shared_ptr<tensor::Event> ready = backend().create_event();
      ready->record(*comm_stream);
      pending.ticket =
          std::make_unique<std::uint64_t>(runtime->exchange().post({std::move(buffer), ready}));
      pending.request = comm.isend(
          peer, tag, std::as_bytes(std::span<const std::uint64_t>(pending.ticket.get(), 1)));
    }
    if (!pending.request->test()) {
      pending_sends.push_back(std::move(pending));
    } else {
      recycle_sent(pending);
    }
    std::erase_if(pending_sends, [this](PendingSend& p) {
      if (!p.request->test()) return false;
      recycle_sent(p);
      return true;
    });
  }
  void finish_sends() {
    for (auto& pending : pending_sends) {
      pending.request->wait(deadline());
      recycle_sent(pending);
    }
    pending_sends.clear();
  }
  // A device communicator's sent buffer goes back to the pool (its send has completed).
  void recycle_sent(PendingSend& pending) {
    if (device_comm && pending.buffer.numel() > 0) recycle(std::move(pending.buffer));
  }

  void receive(const Instruction& in, std::int64_t global_step) {
    const MicroKey key{in.step, in.pipeline, in.chunk, in.microbatch};
    const auto batch = setup.batches->batch(global_step, global_index(in.pipeline, in.microbatch));
    Incoming incoming;
    incoming.pair_id = in.pair_id;
    incoming.peer = rank_of(replica, in.peer);
    incoming.posted_s = now_s();
    if (!runtime || device_comm) {
      incoming.buffer = new_buffer(batch->tokens(), setup.config.hidden_size, false);
      incoming.request = comm.irecv(
          incoming.peer, in.pair_id,
          std::as_writable_bytes(std::span<T>(incoming.buffer.template data<T>(),
                                              static_cast<std::size_t>(incoming.buffer.numel()))));
    } else {
      incoming.ticket = std::make_unique<std::uint64_t>(0);
      incoming.request =
          comm.irecv(incoming.peer, in.pair_id,
                     std::as_writable_bytes(std::span<std::uint64_t>(incoming.ticket.get(), 1)));
    }
    auto& target = in.kind == OpKind::kRecvActivation ? incoming_activations : incoming_gradients;
    if (target.contains(key)) {
      throw std::runtime_error("a receive for this micro-batch is already posted");
    }
    target[key] = std::move(incoming);
  }

  void reduce(std::span<T> data, const std::vector<int>& group) {
    const WaitTimer timer(*this);
    comm.all_reduce_sum(data, group, deadline());
  }

  // Gathers the finished ranges the model reports during a chunk's last backward into buckets
  // of up to dp_bucket_bytes (adjacent ranges only, so a bucket is one span of the flat
  // gradients) and starts each bucket's all-reduce as soon as it is full or the next range
  // does not fit. Every replica's model reports the same ranges, so every member of the
  // data-parallel group starts the same buckets in the same order.
  class BucketLauncher final : public model::GradientsReady {
   public:
    BucketLauncher(Impl& impl, ChunkStepKey key, std::span<T> grads, std::int64_t global_step,
                   int reduction_position, int backward_position)
        : impl_(&impl),
          key_(key),
          grads_(grads),
          global_step_(global_step),
          reduction_position_(reduction_position),
          backward_position_(backward_position),
          cap_elements_(std::max<std::int64_t>(
              1, impl.setup.options.dp_bucket_bytes / static_cast<std::int64_t>(sizeof(T)))) {
      if (impl.dp_buckets.contains(key)) {
        throw std::runtime_error("data-parallel buckets of this chunk are already in flight");
      }
      impl.dp_buckets[key];  // the chunk has buckets from now on, even if none is started yet
    }

    void on_gradients_ready(std::int64_t begin, std::int64_t end) override {
      if (begin < 0 || end > static_cast<std::int64_t>(grads_.size()) || begin > end) {
        throw std::logic_error("model reported gradients [" + std::to_string(begin) + ", " +
                               std::to_string(end) + ") outside its " +
                               std::to_string(grads_.size()) + " gradients");
      }
      impl_->poll_dp_buckets();
      if (pending_begin_ < pending_end_ &&
          (end != pending_begin_ || pending_end_ - begin > cap_elements_)) {
        flush();
      }
      if (pending_begin_ == pending_end_) pending_end_ = end;
      pending_begin_ = begin;
      if (pending_end_ - pending_begin_ >= cap_elements_) flush();
    }

    // After the backward: the last bucket, and any gradients the model did not report.
    void finish() {
      flush();
      std::sort(started_.begin(), started_.end());
      std::int64_t covered = 0;
      std::vector<std::pair<std::int64_t, std::int64_t>> gaps;
      for (const auto& [begin, end] : started_) {
        if (begin > covered) gaps.emplace_back(covered, begin);
        covered = std::max(covered, end);
      }
      const auto total = static_cast<std::int64_t>(grads_.size());
      if (covered < total) gaps.emplace_back(covered, total);
      // Descending, as the model reports: every replica starts them in the same order.
      for (auto it = gaps.rbegin(); it != gaps.rend(); ++it) start(it->first, it->second);
    }

   private:
    void flush() {
      if (pending_begin_ < pending_end_) start(pending_begin_, pending_end_);
      pending_begin_ = pending_end_ = 0;
    }
    void start(std::int64_t begin, std::int64_t end) {
      started_.emplace_back(begin, end);
      DpBucket bucket;
      bucket.begin = begin;
      bucket.end = end;
      bucket.issued_s = impl_->now_s();
      bucket.global_step = global_step_;
      bucket.reduction_position = reduction_position_;
      const auto slice =
          grads_.subspan(static_cast<std::size_t>(begin), static_cast<std::size_t>(end - begin));
      const auto group = impl_->data_parallel_group(impl_->self);
      auto& buckets = impl_->dp_buckets[key_];
      if (impl_->device_comm != nullptr) {
        start_on_device(slice, group, buckets.size());
        bucket.done = true;  // enqueued: the reduction orders the compute stream after it
      } else {
        bucket.request = impl_->comm.iall_reduce_sum(slice, group, impl_->deadline());
      }
      buckets.push_back(std::move(bucket));
    }
    // On the device communicator's stream, after the compute stream's work so far (this
    // range's weight gradients); the host does not wait. The watchdog names the bucket.
    void start_on_device(std::span<T> slice, const std::vector<int>& group, std::size_t index) {
      if constexpr (std::is_same_v<T, float>) {
        auto& device_comm = *impl_->device_comm;
        const auto produced = impl_->backend().create_event();
        produced->record(*impl_->compute_stream);
        device_comm.wait_on_device(*produced);
        const auto& reduction = (*impl_->stream)[static_cast<std::size_t>(reduction_position_)];
        const auto& backward = (*impl_->stream)[static_cast<std::size_t>(backward_position_)];
        device_comm.set_activity(reduction_position_, sched::short_label(reduction) + " bucket " +
                                                          std::to_string(index));
        device_comm.all_reduce_sum_async(slice, group, impl_->deadline());
        device_comm.set_activity(backward_position_, sched::short_label(backward));
      } else {
        (void)slice;
        (void)group;
        (void)index;
        throw std::logic_error("device runs are float");
      }
    }

    Impl* impl_;
    ChunkStepKey key_;
    std::span<T> grads_;
    std::int64_t global_step_;
    int reduction_position_;
    int backward_position_;
    std::int64_t cap_elements_;
    std::int64_t pending_begin_ = 0, pending_end_ = 0;  // gathered, not started
    std::vector<std::pair<std::int64_t, std::int64_t>> started_;
  };

  // Completes the buckets whose all-reduce has finished (their sums land in the gradients),
  // without waiting; on MPI this is also what moves their second phase on.
  void poll_dp_buckets() {
    for (auto& [key, buckets] : dp_buckets) {
      for (std::size_t i = 0; i < buckets.size(); ++i) {
        auto& bucket = buckets[i];
        if (!bucket.done && bucket.request->test()) complete_bucket(bucket, i);
      }
    }
  }

  void complete_bucket(DpBucket& bucket, std::size_t index) {
    bucket.done = true;
    bucket.request.reset();
    if (!setup.options.record_events ||
        bucket.global_step >= setup.options.record_events_before_step) {
      return;
    }
    InstructionEvent event;
    event.rank = rank;
    event.position = bucket.reduction_position;
    event.global_step = bucket.global_step;
    event.instruction = (*stream)[static_cast<std::size_t>(bucket.reduction_position)];
    event.lane = Lane::kCommunication;
    event.start_s = bucket.issued_s;
    event.end_s = now_s();
    event.busy_s = event.end_s - event.start_s;
    event.bytes = (bucket.end - bucket.begin) * static_cast<std::int64_t>(sizeof(T));
    event.bucket = static_cast<int>(index);
    events.push_back(event);
  }

  // The DP reduction of a chunk whose buckets were started by its last backward: waits for
  // them (each with the run's deadline). Returns the bytes reduced.
  std::int64_t finish_dp_buckets(std::vector<DpBucket>& buckets) {
    std::int64_t bytes = 0;
    // Buckets on a device communicator's stream: the compute stream's later work (the
    // optimizer, preconditioning) waits for them on the device.
    if (device_comm != nullptr) device_comm->order_before(*compute_stream);
    for (std::size_t i = 0; i < buckets.size(); ++i) {
      auto& bucket = buckets[i];
      const std::int64_t bucket_bytes =
          (bucket.end - bucket.begin) * static_cast<std::int64_t>(sizeof(T));
      bytes += bucket_bytes;
      if (bucket.done) continue;
      {
        const WaitTimer timer(*this);
        try {
          bucket.request->wait(deadline());
        } catch (const comm::TimeoutError& error) {
          throw std::runtime_error(
              "waited " + std::to_string(setup.options.wait_timeout.count() / 1000.0) +
              " s for data-parallel gradient bucket " + std::to_string(i) + " of " +
              std::to_string(buckets.size()) + " (gradient elements [" +
              std::to_string(bucket.begin) + ", " + std::to_string(bucket.end) + "), " +
              std::to_string(bucket_bytes) + " bytes): " + error.what());
        }
      }
      complete_bucket(bucket, i);
    }
    return bytes;
  }

  // Gradients in the worker's memory: in place on the host; a device stages them through host
  // memory (enough for workers sharing one GPU; NCCL is the multi-GPU answer).
  void reduce_gradients(std::span<T> data, const std::vector<int>& group) {
    if (!runtime) {
      reduce(data, group);
      return;
    }
    if constexpr (std::is_same_v<T, float>) {
      if (device_comm) {
        // In place on the device: after the compute stream's gradients, before its next use
        // of them; no host wait.
        const auto produced = backend().create_event();
        produced->record(*compute_stream);
        device_comm->wait_on_device(*produced);
        device_comm->all_reduce_sum_async(data, group, deadline());
        device_comm->order_before(*compute_stream);
        return;
      }
    }
    std::vector<T> host(data.size());
    backend().copy(host.data(), data.data(), data.size_bytes(), tensor::CopyKind::kDeviceToHost,
                   compute_stream.get());
    compute_stream->synchronize();
    reduce(host, group);
    backend().copy(data.data(), host.data(), data.size_bytes(), tensor::CopyKind::kHostToDevice,
                   compute_stream.get());
    compute_stream->synchronize();  // `host` goes out of scope
  }

  // Time blocked on other workers, excluded from instructions' busy time.
  double waited_s = 0.0;
  StepEndTimes step_end;  // Worker::step_end_times
  struct WaitTimer {
    explicit WaitTimer(Impl& impl_) : impl(impl_), start(impl_.now_s()) {}
    ~WaitTimer() { impl.waited_s += impl.now_s() - start; }
    WaitTimer(const WaitTimer&) = delete;
    WaitTimer& operator=(const WaitTimer&) = delete;
    Impl& impl;
    double start;
  };

  std::vector<int> pipeline_pair_group(const Instruction& in) const {
    std::vector<int> group = {rank_of(replica, schedule.placement.worker_of(0, in.chunk)),
                              rank_of(replica, schedule.placement.worker_of(1, in.chunk))};
    std::sort(group.begin(), group.end());
    group.erase(std::unique(group.begin(), group.end()), group.end());
    return group;
  }
  std::vector<int> data_parallel_group(int worker_index) const {
    std::vector<int> group;
    for (int r = 0; r < replicas; ++r) group.push_back(rank_of(r, worker_index));
    return group;
  }

  // The word embeddings' gradient and the head's copy: summed, then equal on both.
  void tied_embedding_sum() {
    const auto [word, decoder] = model::tied_parameter_names();
    for (int pipeline = 0; pipeline < schedule.placement.num_pipelines; ++pipeline) {
      const int embedding_worker = schedule.placement.worker_of(pipeline, 0);
      const int head_worker = schedule.placement.worker_of(pipeline, last_chunk);
      if (last_chunk == 0) continue;  // one chunk holds one tensor
      if (embedding_worker != self && head_worker != self) continue;
      if (embedding_worker == self && head_worker == self) {
        auto word_view = slot_of(pipeline, 0).model->parameter(word);
        auto decoder_view = slot_of(pipeline, last_chunk).model->parameter(decoder);
        if (runtime) {
          // The same sum through the ops, then the copy, on the compute stream.
          const std::int64_t count = word_view->size;
          slot_of(pipeline, 0)
              .model->ops()
              .accumulate({decoder_view->grad, 1, count}, {word_view->grad, 1, count});
          backend().copy(decoder_view->grad, word_view->grad,
                         static_cast<std::size_t>(count) * sizeof(T),
                         tensor::CopyKind::kDeviceToDevice, compute_stream.get());
          continue;
        }
        for (std::int64_t i = 0; i < word_view->size; ++i) {
          word_view->grad[i] += decoder_view->grad[i];
          decoder_view->grad[i] = word_view->grad[i];
        }
        continue;
      }
      const bool holds_embedding = embedding_worker == self;
      auto view = slot_of(pipeline, holds_embedding ? 0 : last_chunk)
                      .model->parameter(holds_embedding ? word : decoder);
      std::vector<int> group = {rank_of(replica, embedding_worker), rank_of(replica, head_worker)};
      std::sort(group.begin(), group.end());
      reduce_gradients({view->grad, static_cast<std::size_t>(view->size)}, group);
    }
  }

  void optimizer_step(const Instruction& in, std::int64_t global_step,
                      const std::function<void(const StepResult&)>& on_step) {
    double mark = now_s();
    const bool counted = global_step >= 1;
    const auto phase = [&](double StepEndTimes::*field) {
      const double t = now_s();
      if (counted) step_end.*field += t - mark;
      mark = t;
    };
    {
      const WaitTimer timer(*this);
      finish_sends();
    }
    phase(&StepEndTimes::sends_s);
    tied_embedding_sum();
    phase(&StepEndTimes::tied_embedding_s);
    double square_sum = 0.0;
    if (replica == 0 && runtime) {
      // Every tensor's squares into one double on the device, one wait for all (a wait per
      // tensor took ~20 ms of a BERT-Large step's 104 on an H200: 390 tensors).
      std::vector<std::span<const T>> grads;
      grads.reserve(unique_params.size());
      for (std::size_t index : unique_params) {
        const auto& view = param_views[index];
        grads.emplace_back(view.grad, view.size);
      }
      square_sum = slots.front().model->ops().sum_of_squares_total(grads);
    } else if (replica == 0) {
      for (std::size_t index : unique_params) {
        const auto& view = param_views[index];
        for (std::size_t i = 0; i < view.size; ++i) {
          const double g = static_cast<double>(view.grad[i]);
          square_sum += g * g;
        }
      }
    }
    std::array<double, 4> stats = {square_sum, mlm_sum, nsp_sum, refreshed_this_step ? 1.0 : 0.0};
    std::vector<int> world(static_cast<std::size_t>(comm.size()));
    for (int r = 0; r < comm.size(); ++r) world[static_cast<std::size_t>(r)] = r;
    phase(&StepEndTimes::gradient_norm_s);
    {
      const WaitTimer timer(*this);
      comm.all_reduce_sum(std::span<double>(stats), world, deadline());
    }
    phase(&StepEndTimes::statistics_s);
    // On a device the instruction's span opened before the waits above (for the other ranks,
    // the sends' receivers, the gradients' squares): it holds the update from here on, as the
    // CPU path's busy time leaves the waits out.
    if (runtime && current_span) timeline->restart(*current_span, *compute_stream);
    const double norm = std::sqrt(stats[0]);
    // The squares of finite floats add up to a finite double, so a finite norm means every
    // gradient is finite (copies of a tensor on other ranks and replicas equal the one counted):
    // the tensors are scanned, to name the culprit, only when it is not (on a device a scan
    // waits once per tensor). Every rank sees the same norm, so every rank stops.
    if (setup.options.check_finite && !std::isfinite(norm)) {
      for (auto& slot : slots) slot.model->check_finite_gradients(global_step);
      throw std::runtime_error("non-finite gradient norm at step " + std::to_string(global_step) +
                               ": the non-finite gradient is on another rank");
    }
    const double lr = setup.learning_rate(global_step);
    optimizer->step(param_views, static_cast<T>(lr), norm);
    for (auto& slot : slots) slot.model->zero_grad();
    phase(&StepEndTimes::update_s);
    synchronize_device();  // the step's time includes its device work
    phase(&StepEndTimes::synchronize_s);
    if (counted) ++step_end.steps;
    StepResult result;
    result.step = global_step;
    const double count = static_cast<double>(microbatches_total * replicas);
    result.mlm_loss = stats[1] / count;
    result.nsp_loss = stats[2] / count;
    result.grad_norm = norm;
    result.learning_rate = lr;
    result.kfac_refresh = stats[3] > 0;
    const double end = now_s();
    result.seconds = end - last_step_end_s;
    last_step_end_s = end;
    mlm_sum = nsp_sum = 0.0;
    refreshed_this_step = false;
    (void)in;
    if (on_step) on_step(result);
  }

  // --- K-FAC kinds (float models only; checked at construction).
  kfac::KfacLayerState& kfac_layer(const Instruction& in) {
    return kfac_states.at(in.pipeline).at({in.layer, in.linear});
  }
  KfacSlot& kfac_slot(const Instruction& in) {
    return kfac_slots.at({in.pipeline, in.layer, in.linear});
  }

  void curvature(const Instruction& in) {
    if constexpr (std::is_same_v<T, float>) {
      const CaptureKey key{in.step, in.pipeline, in.microbatch, in.layer, in.linear};
      const bool is_a = in.kind == OpKind::kCurvatureA;
      auto& store_map = is_a ? captures : captures_b;
      auto it = store_map.find(key);
      if (it == store_map.end()) {
        throw std::runtime_error(std::string("no captured ") +
                                 (is_a ? "input" : "output gradient") +
                                 " for this micro-batch: its " + (is_a ? "forward" : "backward") +
                                 " has not run on this worker");
      }
      auto& slot = kfac_slot(in);
      // A piece adds its token rows' partial sum; the capture is held until the last piece.
      const bool last_piece = in.piece_end == sched::kPieceUnits;
      if (runtime) {
        const auto& captured = it->second;
        const std::int64_t cols = captured.device.numel() / captured.rows;
        const float scale = is_a ? 1.0F
                                 : kfac::output_grad_scale(captured.sequences, captured.rows,
                                                           microbatches_total * replicas);
        device_kfac.at({in.pipeline, in.layer, in.linear})
            ->accumulate(is_a, {captured.device.template data<float>(), captured.rows, cols}, scale,
                         in.piece_begin, in.piece_end);
        if (!last_piece) return;
        ++(is_a ? slot.done_a : slot.done_b);
        retire(std::move(it->second.device));
        store_map.erase(it);
        recount_captures();
        return;
      }
      auto& layer = kfac_layer(in);
      if (is_a) {
        kfac::accumulate_a(layer, it->second.data->data(), it->second.rows, in.piece_begin,
                           in.piece_end);
        if (last_piece) ++slot.done_a;
      } else {
        // B = s g^T g undoes the loss's means (over the micro-batch's sequences and over the
        // global batch's micro-batches) so that B is a per-example Fisher (factors.h).
        const float scale = kfac::output_grad_scale(it->second.sequences, it->second.rows,
                                                    microbatches_total * replicas);
        kfac::accumulate_b(layer, it->second.data->data(), it->second.rows, scale, in.piece_begin,
                           in.piece_end);
        if (last_piece) ++slot.done_b;
      }
      if (!last_piece) return;
      store_map.erase(it);
      recount_captures();
    }
  }

  void curvature_sync(const Instruction& in) {
    std::vector<int> group = data_parallel_group(self);
    if (in.peer >= 0) {
      for (int member : data_parallel_group(in.peer)) group.push_back(member);
    }
    std::sort(group.begin(), group.end());
    if (runtime) {
      sync_sums_on_device(in, group);
      return;
    }
    auto& layer = kfac_layer(in);
    // The previous refresh's sync run in this window (pipelined, sched::is_wrapped): it reduces
    // the sums set aside at the window's start (begin_round), which its wrapped inversion then
    // finalizes; this window's sums, accumulating meanwhile, are not touched.
    if (sched::is_wrapped(in)) {
      auto& slot = kfac_slot(in);
      const auto swap_set_aside = [&] {
        std::swap(layer.a.sum, slot.previous_a_sum);
        std::swap(layer.b.sum, slot.previous_b_sum);
        std::swap(layer.a.microbatches, slot.previous_a_microbatches);
        std::swap(layer.b.microbatches, slot.previous_b_microbatches);
      };
      swap_set_aside();
      try {
        sync_sums(in, layer, group);
      } catch (...) {
        swap_set_aside();
        throw;
      }
      swap_set_aside();
      return;
    }
    sync_sums(in, layer, group);
  }

  // A piece all-reduces its range of both factors' sums (kfac::sync_piece); the micro-batch
  // counts and the sharded release come with the last. Every member posts the same pieces in
  // the same order (validated) and the members add in rank order, element by element, so the
  // pieces give the whole sync's bits.
  void sync_sums(const Instruction& in, kfac::KfacLayerState& layer,
                 const std::vector<int>& group) {
    const bool last_piece = in.piece_end == sched::kPieceUnits;
    for (auto* factor : {&layer.a, &layer.b}) {
      if (factor->sum.size() == 0) {
        throw std::runtime_error(sched::is_wrapped(in)
                                     ? "curvature sync of the previous refresh (pipelined) "
                                       "without its set-aside factor sums"
                                     : "curvature sync before any curvature of this refresh");
      }
      const std::span<float> range = kfac::sync_piece(*factor, in.piece_begin, in.piece_end);
      if (!range.empty()) comm.all_reduce_sum(range, group, deadline());
      if (!last_piece) continue;
      std::array<double, 1> count = {static_cast<double>(factor->microbatches)};
      comm.all_reduce_sum(std::span<double>(count), group, deadline());
      factor->microbatches = static_cast<std::int64_t>(count[0]);
    }
    if (!last_piece) return;
    // Sharded factors: only their holders keep (and invert) the synced sums.
    if (!kfac_slot(in).placement.holds_factors(replica)) {
      for (auto* factor : {&layer.a, &layer.b}) {
        factor->sum = Eigen::MatrixXf();
        factor->microbatches = 0;
      }
    }
  }

  // The same on a device: each piece's range of the device sums (the set-aside ones for a
  // wrapped sync) all-reduced as the data-parallel gradients are (a device communicator in
  // place on its stream after the compute stream's curvature; otherwise staged through host
  // memory), the counts on the host with the last piece. The members add in rank order as on
  // the CPU path, so the bits are the CPU path's; a replica that does not hold the factors
  // (sharded) drops its sums after the last piece.
  void sync_sums_on_device(const Instruction& in, const std::vector<int>& group) {
    if constexpr (std::is_same_v<T, float>) {
      auto& layer = *device_kfac.at({in.pipeline, in.layer, in.linear});
      const bool set_aside = sched::is_wrapped(in);
      const bool last_piece = in.piece_end == sched::kPieceUnits;
      for (const bool a : {true, false}) {
        std::span<float> range;
        try {
          range = layer.sync_piece(a, set_aside, in.piece_begin, in.piece_end);
        } catch (const std::logic_error&) {
          throw std::runtime_error(set_aside ? "curvature sync of the previous refresh "
                                               "(pipelined) without its set-aside factor sums"
                                             : "curvature sync before any curvature of this "
                                               "refresh");
        }
        if (!range.empty()) reduce_gradients(range, group);
        if (!last_piece) continue;
        std::array<double, 1> count = {static_cast<double>(
            set_aside ? layer.set_aside_microbatches(a) : layer.pending_microbatches(a))};
        comm.all_reduce_sum(std::span<double>(count), group, deadline());
        layer.set_microbatches(a, set_aside, static_cast<std::int64_t>(count[0]));
      }
      // Sharded factors: only their holders keep (and invert) the synced sums.
      if (last_piece && !kfac_slot(in).placement.holds_factors(replica)) {
        for (const bool a : {true, false}) retire(layer.drop_sums(a, set_aside));
      }
    }
  }

  std::vector<int> replica_ranks(const std::vector<int>& replica_group) const {
    std::vector<int> ranks;
    for (int r : replica_group) ranks.push_back(rank_of(r, self));
    return ranks;
  }

  // The owner's new inverses to the inverse holders without factors.
  void broadcast_inverses(const Instruction& in) {
    auto& slot = kfac_slot(in);
    const auto group = slot.placement.inverse_broadcast_group();
    if (std::find(group.begin(), group.end(), replica) == group.end()) return;
    const bool owner = replica == slot.placement.owner;
    if (runtime) {
      broadcast_inverses_on_device(in, slot, owner, replica_ranks(group));
      return;
    }
    auto& layer = kfac_layer(in);
    for (const bool is_a : {true, false}) {
      auto& factor = is_a ? layer.a : layer.b;
      const std::int64_t d = is_a ? layer.d_in : layer.d_out;
      if (!owner) {
        (is_a ? slot.previous_a_inverse : slot.previous_b_inverse) = factor.inverse;
        factor.inverse.resize(d, d);
      } else if (factor.inverse.rows() != d) {
        throw std::runtime_error("inverse broadcast before the owner's inversion");
      }
      const WaitTimer timer(*this);
      comm.broadcast(std::as_writable_bytes(std::span<float>(
                         factor.inverse.data(), static_cast<std::size_t>(factor.inverse.size()))),
                     rank_of(slot.placement.owner, self), replica_ranks(group), deadline());
      if (!owner) (is_a ? slot.inverted_a : slot.inverted_b) = true;
    }
  }

  // The same on a device: the owner's inverse buffers broadcast in place (a device communicator)
  // or staged through host memory; a receiver keeps the inverse it had as the previous one (the
  // refresh's earlier steps precondition with it) and takes the owner's as its new inverse.
  void broadcast_inverses_on_device(const Instruction& in, KfacSlot& slot, bool owner,
                                    const std::vector<int>& ranks) {
    using Matrix = device::DeviceKfacLayer::Matrix;
    auto& layer = *device_kfac.at({in.pipeline, in.layer, in.linear});
    const auto [d_in, d_out] = dims_of({in.pipeline, in.layer, in.linear});
    const int root = rank_of(slot.placement.owner, self);
    for (const bool is_a : {true, false}) {
      const std::int64_t d = is_a ? d_in : d_out;
      if (owner) {
        if (!layer.has_inverse(is_a, false)) {
          throw std::runtime_error("inverse broadcast before the owner's inversion");
        }
        auto inverse = layer.detach(is_a, Matrix::kInverse);
        broadcast_on_device(std::span<float>(inverse.template data<float>(),
                                             static_cast<std::size_t>(inverse.numel())),
                            root, ranks);
        retire(layer.attach(is_a, Matrix::kInverse, std::move(inverse)));
        continue;
      }
      auto current = layer.detach(is_a, Matrix::kInverse);
      if (current.numel() > 0) {
        retire(layer.attach(is_a, Matrix::kPreviousInverse, std::move(current)));
      } else {
        retire(layer.detach(is_a, Matrix::kPreviousInverse));
      }
      auto received = tensor::Tensor::empty(backend(), {d, d}, tensor::DType::kF32);
      broadcast_on_device(
          std::span<float>(received.template data<float>(), static_cast<std::size_t>(d * d)), root,
          ranks);
      retire(layer.attach(is_a, Matrix::kInverse, std::move(received)));
      (is_a ? slot.inverted_a : slot.inverted_b) = true;
    }
  }

  // A broadcast of device memory from `root` to `ranks`: in place through a device communicator
  // (after the compute stream's work on it; it returns once complete), else staged through host
  // memory on the compute stream.
  template <typename U>
  void broadcast_on_device(std::span<U> data, int root, const std::vector<int>& ranks) {
    const WaitTimer timer(*this);
    if (device_comm) {
      const auto produced = backend().create_event();
      produced->record(*compute_stream);
      device_comm->wait_on_device(*produced);
      comm.broadcast(std::as_writable_bytes(data), root, ranks, deadline());
      return;
    }
    std::vector<U> host(data.size());
    if (rank == root) {
      backend().copy(host.data(), data.data(), data.size_bytes(), tensor::CopyKind::kDeviceToHost,
                     compute_stream.get());
      compute_stream->synchronize();
    }
    comm.broadcast(std::as_writable_bytes(std::span<U>(host)), root, ranks, deadline());
    if (rank != root) {
      backend().copy(data.data(), host.data(), data.size_bytes(), tensor::CopyKind::kHostToDevice,
                     compute_stream.get());
      compute_stream->synchronize();  // `host` goes out of scope
    }
  }

  // The owner's preconditioned gradient (weight, bias) to the replicas without inverses.
  void broadcast_gradient(const Instruction& in) {
    auto& slot = kfac_slot(in);
    const auto group = slot.placement.gradient_broadcast_group(replicas);
    if (std::find(group.begin(), group.end(), replica) == group.end()) return;
    const std::string weight = linear_weight_name(in.layer, in.linear);
    for (auto* view : {find_param(weight), find_param(bias_name_of(weight))}) {
      if (view == nullptr) continue;
      if (runtime) {
        // Device gradients: read (root) or overwritten after the compute stream's work on them.
        broadcast_on_device(std::span<T>(view->grad, view->size),
                            rank_of(slot.placement.owner, self), replica_ranks(group));
        continue;
      }
      const WaitTimer timer(*this);
      comm.broadcast(std::as_writable_bytes(std::span<T>(view->grad, view->size)),
                     rank_of(slot.placement.owner, self), replica_ranks(group), deadline());
    }
  }

  // A refresh's factor is finalized only once all its curvature tasks of the refresh have run.
  static void require_complete_curvature(const KfacSlot& slot, bool a_factor) {
    const int done = a_factor ? slot.done_a : slot.done_b;
    const int expected = a_factor ? slot.expected_a : slot.expected_b;
    if (done < expected) {
      throw std::runtime_error(
          std::string("inversion before every curvature task of the refresh: factor ") +
          (a_factor ? "A" : "B") + " has " + std::to_string(done) + " of " +
          std::to_string(expected) +
          " micro-batches (pi-adjusted damping needs both factors complete)");
    }
  }

  // On a device as on the CPU path: a divided Cholesky inversion finalizes and fixes its damping
  // at its first piece, runs its chain (in the device layer) piece by piece and installs the
  // inverse at its last; whole tasks and the eigen method (no chain) run at the last piece. The
  // previous refresh's inversion run in this window (pipelined, `wrapped`) finalizes the sums
  // set aside at the window's start, and its inverses are not this window's new ones.
  void invert_on_device(const Instruction& in) {
    const bool chained =
        sched::is_piece(in) && setup.options.kfac.method == kfac::InverseMethod::kCholesky;
    if (!chained && in.piece_end != sched::kPieceUnits) return;
    auto& layer = *device_kfac.at({in.pipeline, in.layer, in.linear});
    auto& slot = kfac_slot(in);
    if (!slot.placement.holds_factors(replica)) return;  // the owner's group inverts
    await_prefetch(slot);
    const bool is_a = in.kind == OpKind::kInvertA;
    const bool wrapped = sched::is_wrapped(in);
    if (!chained || in.piece_begin == 0) {
      for (const bool a_factor : {true, false}) {
        if (wrapped) {
          // Finalized already (or, its inversion begun in its own window, never set aside).
          if (layer.set_aside_microbatches(a_factor) == 0) continue;
          layer.finalize_set_aside(a_factor, setup.options.kfac.running_average);
          continue;
        }
        if (layer.pending_microbatches(a_factor) == 0) continue;  // finalized already
        require_complete_curvature(slot, a_factor);
        layer.finalize(a_factor, setup.options.kfac.running_average);
      }
      const auto damping =
          layer.damping(setup.options.kfac.damping, setup.options.kfac.pi_adjusted);
      const float factor_damping = is_a ? damping.a : damping.b;
      if (!chained) {
        layer.invert(is_a, factor_damping, setup.options.kfac.method);
      } else {
        layer.begin_inverse_chain(is_a, factor_damping);
      }
    }
    if (chained) {
      try {
        layer.run_inverse_chain(is_a, in.piece_begin, in.piece_end);
      } catch (const std::logic_error& error) {
        throw std::runtime_error("inversion piece " + sched::short_label(in) + ": " + error.what());
      }
    }
    if (in.piece_end == sched::kPieceUnits && !wrapped) {
      (is_a ? slot.inverted_a : slot.inverted_b) = true;
    }
  }

  void invert(const Instruction& in) {
    if (runtime) {
      invert_on_device(in);
      return;
    }
    auto& layer = kfac_layer(in);
    auto& slot = kfac_slot(in);
    if (!slot.placement.holds_factors(replica)) return;  // the owner's group inverts
    const bool is_a = in.kind == OpKind::kInvertA;
    // The previous refresh's inversion run in this window (pipelined): it finalizes the sums
    // set aside at the window's start, and its inverses serve this window's preconditioning (it
    // precedes this window's inversions of the Linear: validated), so they are not this
    // window's new ones.
    const bool wrapped = sched::is_wrapped(in);
    auto finalize_previous = [&](bool a_factor) {
      auto& factor = a_factor ? layer.a : layer.b;
      auto& sum = a_factor ? slot.previous_a_sum : slot.previous_b_sum;
      auto& count = a_factor ? slot.previous_a_microbatches : slot.previous_b_microbatches;
      if (count == 0) return;  // finalized already (or in its own window)
      std::swap(factor.sum, sum);
      std::swap(factor.microbatches, count);
      if (a_factor) {
        kfac::finalize_a(layer, setup.options.kfac.running_average);
      } else {
        kfac::finalize_b(layer, setup.options.kfac.running_average);
      }
      std::swap(factor.sum, sum);  // this window's accumulation back; the set-aside is released
      std::swap(factor.microbatches, count);
    };
    auto finalize_if_complete = [&](bool a_factor) {
      if (wrapped) {
        finalize_previous(a_factor);
        return;
      }
      auto& factor = a_factor ? layer.a : layer.b;
      if (factor.microbatches == 0) return;  // finalized already this refresh
      require_complete_curvature(slot, a_factor);
      if (a_factor) {
        kfac::finalize_a(layer, setup.options.kfac.running_average);
      } else {
        kfac::finalize_b(layer, setup.options.kfac.running_average);
      }
    };
    // A divided inversion finalizes and fixes its damping at its first piece, runs its chain
    // piece by piece and installs the inverse at its last (the monolithic path stays for whole
    // tasks, and for the eigen method, which has no chain: its last piece does all the work).
    if (sched::is_piece(in) && setup.options.kfac.method == kfac::InverseMethod::kCholesky) {
      auto& chain = is_a ? slot.chain_a : slot.chain_b;
      auto& factor = is_a ? layer.a : layer.b;
      if (in.piece_begin == 0) {
        finalize_if_complete(true);
        finalize_if_complete(false);
        const auto damping =
            kfac::layer_damping(layer, setup.options.kfac.damping, setup.options.kfac.pi_adjusted);
        (is_a ? slot.previous_a_inverse : slot.previous_b_inverse) = factor.inverse;
        chain = std::make_shared<kfac::InverseChain>(factor.value, is_a ? damping.a : damping.b);
      }
      if (!chain) {
        throw std::runtime_error("inversion piece " + sched::short_label(in) +
                                 " without the chain's first piece");
      }
      chain->run(in.piece_begin, in.piece_end);
      if (in.piece_end == sched::kPieceUnits) {
        const float damping = chain->damping();
        kfac::set_inverse(factor, chain->take(), damping);
        chain.reset();
        if (!wrapped) (is_a ? slot.inverted_a : slot.inverted_b) = true;
      }
      return;
    }
    if (in.piece_end != sched::kPieceUnits) return;  // eigen: all at the last piece
    finalize_if_complete(true);
    finalize_if_complete(false);
    const auto damping =
        kfac::layer_damping(layer, setup.options.kfac.damping, setup.options.kfac.pi_adjusted);
    if (is_a) {
      slot.previous_a_inverse = layer.a.inverse;
      kfac::invert_a(layer, damping.a, setup.options.kfac.method);
      if (!wrapped) slot.inverted_a = true;
    } else {
      slot.previous_b_inverse = layer.b.inverse;
      kfac::invert_b(layer, damping.b, setup.options.kfac.method);
      if (!wrapped) slot.inverted_b = true;
    }
  }

  // On a device as on the CPU path: a whole preconditioning in place, a divided one by
  // gradient rows.
  void precondition_on_device(const Instruction& in) {
    if constexpr (std::is_same_v<T, float>) {
      auto& layer = *device_kfac.at({in.pipeline, in.layer, in.linear});
      auto& slot = kfac_slot(in);
      // As the CPU path picks them (see precondition): pipelined, every step of the window
      // preconditions with the previous refresh's inverses.
      const bool newest = reads_newest(in);
      const bool previous_a = !newest && slot.inverted_a;
      const bool previous_b = !newest && slot.inverted_b;
      // Sharded inverses: the owner's preconditioned gradient arrives by broadcast.
      if (!slot.placement.holds_inverses(replica)) return;
      if (!layer.has_inverse(true, previous_a) || !layer.has_inverse(false, previous_b)) return;
      if (schedule.kfac_pipelined_refresh ? in.step == 0 && current_round > 0 : newest) {
        refreshed_this_step = true;
      }
      await_prefetch(slot);
      const std::string weight = linear_weight_name(in.layer, in.linear);
      auto* w = find_param(weight);
      auto* b = find_param(bias_name_of(weight));
      float* bias = b != nullptr ? b->grad : nullptr;
      if (!sched::is_piece(in)) {
        layer.precondition(previous_a, previous_b, w->grad, bias);
        return;
      }
      // Pieces by gradient rows, as on the CPU path: each reads the whole gradient as it was
      // before the first piece (a device copy, kept until the last).
      auto& before = slot.device_gradient_before;
      const auto weight_size = static_cast<std::int64_t>(w->size);
      const auto bias_size = static_cast<std::int64_t>(b != nullptr ? b->size : 0);
      if (in.piece_begin == 0) {
        before = new_buffer(1, weight_size + bias_size, false);
        backend().copy(before.raw_data(), w->grad, static_cast<std::size_t>(w->size) * sizeof(T),
                       tensor::CopyKind::kDeviceToDevice, compute_stream.get());
        if (bias != nullptr) {
          backend().copy(before.template data<T>() + w->size, bias,
                         static_cast<std::size_t>(bias_size) * sizeof(T),
                         tensor::CopyKind::kDeviceToDevice, compute_stream.get());
        }
      }
      if (before.numel() != weight_size + bias_size) {
        throw std::runtime_error("precondition piece " + sched::short_label(in) +
                                 " without the task's first piece");
      }
      const T* gradient = before.template data<T>();
      layer.precondition_rows(previous_a, previous_b, gradient,
                              bias != nullptr ? gradient + w->size : nullptr, in.piece_begin,
                              in.piece_end, w->grad, bias);
      if (in.piece_end == sched::kPieceUnits) retire(std::exchange(before, tensor::Tensor()));
    }
  }

  void precondition(const Instruction& in) {
    if (runtime) {
      precondition_on_device(in);
      return;
    }
    if constexpr (std::is_same_v<T, float>) {
      auto& layer = kfac_layer(in);
      auto& slot = kfac_slot(in);
      // The refresh's last step uses the new inverses; earlier steps the previous refresh's.
      // Pipelined: every step of the window the previous refresh's (its inversion may have run
      // in this window, before this preconditioning: validated).
      const bool newest = reads_newest(in);
      const Eigen::MatrixXf& a_inv =
          newest || !slot.inverted_a ? layer.a.inverse : slot.previous_a_inverse;
      const Eigen::MatrixXf& b_inv =
          newest || !slot.inverted_b ? layer.b.inverse : slot.previous_b_inverse;
      // Sharded inverses: the owner's preconditioned gradient arrives by broadcast.
      if (!slot.placement.holds_inverses(replica)) return;
      if (a_inv.size() == 0 || b_inv.size() == 0) return;  // before the first refresh: identity
      // The step that first preconditions with a refresh's inverses (pipelined: the first step
      // of the window after it).
      if (schedule.kfac_pipelined_refresh ? in.step == 0 && current_round > 0 : newest) {
        refreshed_this_step = true;
      }
      const std::string weight = linear_weight_name(in.layer, in.linear);
      auto* w = find_param(weight);
      auto* b = find_param(bias_name_of(weight));
      float* bias = b != nullptr ? b->grad : nullptr;
      if (!sched::is_piece(in)) {
        kfac::precondition(a_inv, b_inv, w->grad, bias, w->shape[0], w->shape[1], w->grad, bias);
        return;
      }
      // Pieces by gradient rows: each reads the whole gradient as it was before the first piece.
      if (in.piece_begin == 0) {
        slot.gradient_before.assign(w->grad, w->grad + w->size);
        if (bias != nullptr) slot.bias_before.assign(bias, bias + b->size);
      }
      if (slot.gradient_before.size() != static_cast<std::size_t>(w->size)) {
        throw std::runtime_error("precondition piece " + sched::short_label(in) +
                                 " without the task's first piece");
      }
      kfac::precondition_rows(a_inv, b_inv, slot.gradient_before.data(),
                              bias != nullptr ? slot.bias_before.data() : nullptr, w->shape[0],
                              w->shape[1], in.piece_begin, in.piece_end, w->grad, bias);
      if (in.piece_end == sched::kPieceUnits) {
        slot.gradient_before = {};
        slot.bias_before = {};
      }
    }
  }

  // --- K-FAC work in progress between two steps of a round (checkpoints).
  static std::string slot_name(std::string_view prefix, const FactorKey& key) {
    return std::string(prefix) + ".slot." + std::to_string(key.pipeline) + "." +
           std::to_string(key.layer) + "." + std::string(sched::to_string(key.linear));
  }
  static std::string capture_name(std::string_view prefix, bool is_b, const CaptureKey& key) {
    return std::string(prefix) + ".capture." + (is_b ? "B." : "A.") + std::to_string(key.step) +
           "." + std::to_string(key.pipeline) + "." + std::to_string(key.microbatch) + "." +
           std::to_string(key.layer) + "." + std::to_string(static_cast<int>(key.linear));
  }
  static void add_matrix(std::vector<ckpt::TensorRecord>& records, std::string name,
                         const Eigen::MatrixXf& matrix) {
    if (matrix.size() == 0) return;
    const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> row_major = matrix;
    records.push_back(ckpt::make_f32_record(
        std::move(name), {row_major.rows(), row_major.cols()},
        std::span<const float>(row_major.data(), static_cast<std::size_t>(row_major.size()))));
  }

  // A device capture's values on the host (after the compute stream's work so far).
  std::vector<float> download_capture(const tensor::Tensor& device) const {
    std::vector<float> host(static_cast<std::size_t>(device.numel()));
    runtime->backend().copy(host.data(), device.raw_data(), host.size() * sizeof(float),
                            tensor::CopyKind::kDeviceToHost, compute_stream.get());
    compute_stream->synchronize();
    return host;
  }
  // A capture restored onto the device: a pooled buffer, uploaded on the compute stream.
  tensor::Tensor upload_capture(const std::vector<float>& values, std::int64_t rows,
                                std::int64_t cols) {
    auto buffer = new_buffer(rows, cols, false);
    backend().copy(buffer.raw_data(), values.data(), values.size() * sizeof(float),
                   tensor::CopyKind::kHostToDevice, compute_stream.get());
    compute_stream->synchronize();  // `values` may go
    return buffer;
  }

  // The CPU path's extras of a Linear (what a device layer keeps itself).
  static device::KfacLayerExtras host_extras(const KfacSlot& slot) {
    device::KfacLayerExtras extras;
    extras.previous_a_inverse = slot.previous_a_inverse;
    extras.previous_b_inverse = slot.previous_b_inverse;
    extras.set_aside_a_sum = slot.previous_a_sum;
    extras.set_aside_b_sum = slot.previous_b_sum;
    extras.set_aside_a_microbatches = slot.previous_a_microbatches;
    extras.set_aside_b_microbatches = slot.previous_b_microbatches;
    if (slot.chain_a) {
      extras.chain_a_factor = slot.chain_a->factor();
      extras.chain_a_damping = slot.chain_a->damping();
      extras.chain_a_next_unit = slot.chain_a->next_unit();
    }
    if (slot.chain_b) {
      extras.chain_b_factor = slot.chain_b->factor();
      extras.chain_b_damping = slot.chain_b->damping();
      extras.chain_b_next_unit = slot.chain_b->next_unit();
    }
    return extras;
  }

  // On a device the inverses a refresh replaced and the set-aside sums live in the device
  // layers (downloaded here); on the CPU in the slots.
  std::vector<ckpt::TensorRecord> kfac_progress_records(std::string_view prefix) const {
    std::vector<ckpt::TensorRecord> records;
    for (const auto& [key, slot] : kfac_slots) {
      const auto base = slot_name(prefix, key);
      const std::int64_t counters[] = {slot.done_a, slot.done_b, slot.inverted_a ? 1 : 0,
                                       slot.inverted_b ? 1 : 0};
      records.push_back(ckpt::make_i64_record(base + ".counters", {4}, counters));
      const auto extras = runtime ? device_kfac.at(key)->extras_to_host() : host_extras(slot);
      // A divided inversion whose pieces straddle the checkpoint: its factor, damping and
      // progress, to rebuild it (the same records on the CPU and the device path).
      for (const bool a : {true, false}) {
        const int next_unit = a ? extras.chain_a_next_unit : extras.chain_b_next_unit;
        if (next_unit == 0) continue;
        const std::string name = base + (a ? ".A_chain" : ".B_chain");
        add_matrix(records, name + "_factor", a ? extras.chain_a_factor : extras.chain_b_factor);
        const std::int64_t progress[] = {
            next_unit,
            std::bit_cast<std::uint32_t>(a ? extras.chain_a_damping : extras.chain_b_damping)};
        records.push_back(ckpt::make_i64_record(name, {2}, progress));
      }
      add_matrix(records, base + ".A_prev_inv", extras.previous_a_inverse);
      add_matrix(records, base + ".B_prev_inv", extras.previous_b_inverse);
      if (extras.set_aside_a_microbatches != 0 || extras.set_aside_b_microbatches != 0) {
        // Pipelined refresh: the previous refresh's sums its wrapped inversion has yet to read.
        add_matrix(records, base + ".A_prev_sum", extras.set_aside_a_sum);
        add_matrix(records, base + ".B_prev_sum", extras.set_aside_b_sum);
        const std::int64_t counts[] = {extras.set_aside_a_microbatches,
                                       extras.set_aside_b_microbatches};
        records.push_back(ckpt::make_i64_record(base + ".prev_counts", {2}, counts));
      }
      if (slot.offloaded) add_offload_records(records, base, key);
    }
    for (const bool is_b : {false, true}) {
      for (const auto& [key, value] : is_b ? captures_b : captures) {
        const auto name = capture_name(prefix, is_b, key);
        std::vector<float> downloaded;
        if (!value.data) downloaded = download_capture(value.device);
        const std::vector<float>& data = value.data ? *value.data : downloaded;
        const std::int64_t cols = static_cast<std::int64_t>(data.size()) / value.rows;
        records.push_back(ckpt::make_f32_record(name, {value.rows, cols}, data));
        const std::int64_t sequences[] = {value.sequences};
        records.push_back(ckpt::make_i64_record(name + ".sequences", {1}, sequences));
      }
    }
    return records;
  }

  void load_kfac_progress(const ckpt::SafetensorsFile& file, std::string_view prefix) {
    auto restored_slots = kfac_slots;
    std::map<FactorKey, device::KfacLayerExtras> restored_extras;  // device path
    std::map<FactorKey, OffloadProgress> restored_offload;
    for (auto& [key, slot] : restored_slots) {
      const auto base = slot_name(prefix, key);
      const std::int64_t shape[] = {4};
      const auto counters = ckpt::read_i64(file, base + ".counters", shape);
      if (counters[0] < 0 || counters[0] > slot.expected_a || counters[1] < 0 ||
          counters[1] > slot.expected_b || counters[2] < 0 || counters[2] > 1 || counters[3] < 0 ||
          counters[3] > 1) {
        throw std::runtime_error("K-FAC progress '" + base +
                                 ".counters' does not fit this schedule's refresh");
      }
      slot.done_a = static_cast<int>(counters[0]);
      slot.done_b = static_cast<int>(counters[1]);
      slot.inverted_a = counters[2] != 0;
      slot.inverted_b = counters[3] != 0;
      const auto& layer = kfac_states.at(key.pipeline).at({key.layer, key.linear});
      const auto read_matrix = [&](const std::string& name, std::int64_t dim) {
        if (file.tensors.count(name) == 0) return Eigen::MatrixXf();
        const std::int64_t matrix_shape[] = {dim, dim};
        const auto values = ckpt::read_f32(file, name, matrix_shape);
        return Eigen::MatrixXf(
            Eigen::Map<const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>(
                values.data(), dim, dim));
      };
      device::KfacLayerExtras extras;
      extras.previous_a_inverse = read_matrix(base + ".A_prev_inv", layer.d_in);
      extras.previous_b_inverse = read_matrix(base + ".B_prev_inv", layer.d_out);
      if (file.tensors.count(base + ".prev_counts") != 0) {
        const std::int64_t two[] = {2};
        const auto counts = ckpt::read_i64(file, base + ".prev_counts", two);
        if (counts[0] < 0 || counts[1] < 0) {
          throw std::runtime_error("K-FAC progress '" + base + ".prev_counts' is negative");
        }
        extras.set_aside_a_microbatches = counts[0];
        extras.set_aside_b_microbatches = counts[1];
        extras.set_aside_a_sum = read_matrix(base + ".A_prev_sum", layer.d_in);
        extras.set_aside_b_sum = read_matrix(base + ".B_prev_sum", layer.d_out);
      }
      for (const bool a : {true, false}) {
        const std::string name = base + (a ? ".A_chain" : ".B_chain");
        if (file.tensors.count(name) == 0) continue;
        const std::int64_t two[] = {2};
        const auto progress = ckpt::read_i64(file, name, two);
        if (progress[0] <= 0 || progress[0] >= kfac::kPieceUnits || progress[1] < 0 ||
            progress[1] > std::numeric_limits<std::uint32_t>::max()) {
          throw std::runtime_error("K-FAC progress '" + name + "' is not a chain in progress");
        }
        auto factor = read_matrix(name + "_factor", a ? layer.d_in : layer.d_out);
        if (factor.size() == 0 || !factor.allFinite()) {
          throw std::runtime_error("K-FAC progress '" + name + "_factor' is " +
                                   (factor.size() == 0 ? "missing" : "not finite"));
        }
        (a ? extras.chain_a_factor : extras.chain_b_factor) = std::move(factor);
        (a ? extras.chain_a_damping : extras.chain_b_damping) =
            std::bit_cast<float>(static_cast<std::uint32_t>(progress[1]));
        (a ? extras.chain_a_next_unit : extras.chain_b_next_unit) = static_cast<int>(progress[0]);
      }
      try {
        device::check_extras(extras, layer.d_in, layer.d_out, base);
      } catch (const std::invalid_argument& error) {
        throw std::runtime_error(error.what());
      }
      if (slot.offloaded) restored_offload[key] = read_offload_records(file, base, key, slot);
      if (runtime) {
        restored_extras[key] = std::move(extras);
        continue;
      }
      for (const bool a : {true, false}) {
        auto& chain = a ? slot.chain_a : slot.chain_b;
        chain.reset();
        const int next_unit = a ? extras.chain_a_next_unit : extras.chain_b_next_unit;
        if (next_unit == 0) continue;
        try {
          chain = std::make_shared<kfac::InverseChain>(
              a ? extras.chain_a_factor : extras.chain_b_factor,
              a ? extras.chain_a_damping : extras.chain_b_damping);
          chain->run(0, next_unit);
        } catch (const std::exception& error) {
          throw std::runtime_error(std::string("K-FAC progress '") + base +
                                   (a ? ".A_chain" : ".B_chain") + "': " + error.what());
        }
      }
      slot.previous_a_inverse = std::move(extras.previous_a_inverse);
      slot.previous_b_inverse = std::move(extras.previous_b_inverse);
      slot.previous_a_sum = std::move(extras.set_aside_a_sum);
      slot.previous_b_sum = std::move(extras.set_aside_b_sum);
      slot.previous_a_microbatches = extras.set_aside_a_microbatches;
      slot.previous_b_microbatches = extras.set_aside_b_microbatches;
    }
    std::map<CaptureKey, Captured> restored_a, restored_b;
    for (const bool is_b : {false, true}) {
      for (const auto& key : is_b ? wanted_b : wanted_a) {
        const auto name = capture_name(prefix, is_b, key);
        auto it = file.tensors.find(name);
        if (it == file.tensors.end()) continue;
        const auto& shape = it->second.shape;
        if (shape.size() != 2 || shape[0] < 1) {
          throw std::runtime_error("K-FAC progress '" + name + "' is not a [rows, columns] matrix");
        }
        const auto& layer = kfac_states.at(key.pipeline).at({key.layer, key.linear});
        const std::int64_t width = is_b ? layer.d_out : layer.d_in;
        if (shape[1] != width) {
          throw std::runtime_error("K-FAC progress '" + name + "' has " + std::to_string(shape[1]) +
                                   " columns, the layer's " +
                                   (is_b ? "output gradients have " : "inputs have ") +
                                   std::to_string(width));
        }
        Captured captured;
        captured.rows = shape[0];
        auto values = ckpt::read_f32(file, name, shape);
        if (runtime) {
          captured.device = upload_capture(values, shape[0], shape[1]);
        } else {
          captured.data = std::make_shared<std::vector<float>>(std::move(values));
        }
        const std::int64_t one[] = {1};
        captured.sequences = ckpt::read_i64(file, name + ".sequences", one).at(0);
        (is_b ? restored_b : restored_a)[key] = std::move(captured);
      }
    }
    for (auto& [key, extras] : restored_extras) device_kfac.at(key)->load_extras(extras);
    for (const auto& [key, progress] : restored_offload) apply_offload_progress(key, progress);
    kfac_slots = std::move(restored_slots);
    captures = std::move(restored_a);
    captures_b = std::move(restored_b);
    recount_captures();
  }

  // --- Checkpoints of offloaded K-FAC state (docs/offload.md, "Checkpoints").
  std::pair<std::int64_t, std::int64_t> dims_of(const FactorKey& key) const {
    const auto& layer = kfac_states.at(key.pipeline).at({key.layer, key.linear});
    return {layer.d_in, layer.d_out};
  }
  // The matrices the live state (the device layer on a device) holds for a Linear.
  kfac::KfacLayerState live_layer(const FactorKey& key) const {
    if (runtime) return device_kfac.at(key)->to_host();
    return kfac_states.at(key.pipeline).at({key.layer, key.linear});
  }
  OffloadedFactor host_factor(const FactorKey& key, bool a) const {
    const auto [d_in, d_out] = dims_of(key);
    if (runtime) return pinned_kfac.at(key).to_host(offload_streams(), a, a ? d_in : d_out);
    return host_kfac.at(key).to_host(a, a ? d_in : d_out);
  }
  bool host_written(const FactorKey& key, bool a) const {
    return runtime ? pinned_kfac.at(key).written_back(a) : host_kfac.at(key).written_back(a);
  }

  // A pipeline's K-FAC state as a run without offload holds it: each offloaded Linear's value
  // and newest inverse from host memory where the live state has none (a live inverse is the
  // newest: a new one not yet written back, or a prefetched copy of the host's).
  kfac::KfacState with_offloaded(int pipeline, kfac::KfacState state) const {
    for (const auto& [key, slot] : kfac_slots) {
      if (!slot.offloaded || key.pipeline != pipeline) continue;
      auto& layer = state.at({key.layer, key.linear});
      for (const bool a : {true, false}) {
        auto& factor = a ? layer.a : layer.b;
        if (factor.value.size() != 0 && factor.inverse.size() != 0) continue;
        auto host = host_factor(key, a);
        if (factor.value.size() == 0) factor.value = std::move(host.value);
        if (factor.inverse.size() == 0) factor.inverse = std::move(host.inverse);
      }
    }
    return state;
  }

  // Where an offloaded Linear's state is between two steps, exactly: "<base>.offload" (I64 [6]:
  // written back A, B; value A, B on the device; inverse A, B on the device), the host copies
  // "<base>.offload.{A,B}_{value,inv,prev_inv}" and the live matrices
  // "<base>.offload.{A,B}_live_{value,inv}" (those present). The live inverses an inversion
  // replaced are the slot's "<base>.{A,B}_prev_inv" (the extras).
  void add_offload_records(std::vector<ckpt::TensorRecord>& records, const std::string& base,
                           const FactorKey& key) const {
    const auto live = live_layer(key);
    const std::int64_t flags[] = {
        host_written(key, true) ? 1 : 0,    host_written(key, false) ? 1 : 0,
        live.a.value.size() != 0 ? 1 : 0,   live.b.value.size() != 0 ? 1 : 0,
        live.a.inverse.size() != 0 ? 1 : 0, live.b.inverse.size() != 0 ? 1 : 0};
    records.push_back(ckpt::make_i64_record(base + ".offload", {6}, flags));
    for (const bool a : {true, false}) {
      const std::string factor = base + ".offload." + (a ? "A" : "B");
      const auto host = host_factor(key, a);
      add_matrix(records, factor + "_value", host.value);
      add_matrix(records, factor + "_inv", host.inverse);
      add_matrix(records, factor + "_prev_inv", host.previous_inverse);
      const auto& live_factor = a ? live.a : live.b;
      add_matrix(records, factor + "_live_value", live_factor.value);
      add_matrix(records, factor + "_live_inv", live_factor.inverse);
    }
  }

  struct OffloadProgress {
    bool written[2] = {false, false};
    OffloadedFactor host[2];
    Eigen::MatrixXf live_value[2], live_inverse[2];  // empty: not on the device
  };
  static Eigen::MatrixXf read_square(const ckpt::SafetensorsFile& file, const std::string& name,
                                     std::int64_t dim) {
    const std::int64_t shape[] = {dim, dim};
    const auto values = ckpt::read_f32(file, name, shape);
    return Eigen::Map<const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>(
        values.data(), dim, dim);
  }
  // Reads and checks what add_offload_records wrote; throws std::runtime_error naming the record.
  OffloadProgress read_offload_records(const ckpt::SafetensorsFile& file, const std::string& base,
                                       const FactorKey& key, const KfacSlot& slot) const {
    const std::string flags_name = base + ".offload";
    if (file.tensors.count(flags_name) == 0) {
      throw std::runtime_error("K-FAC progress '" + flags_name +
                               "' is missing: this run offloads the Linear to host memory "
                               "(--kfac-offload) and the checkpoint holds no record of where "
                               "its state was");
    }
    const std::int64_t six[] = {6};
    const auto flags = ckpt::read_i64(file, flags_name, six);
    for (const std::int64_t flag : flags) {
      if (flag != 0 && flag != 1) {
        throw std::runtime_error("K-FAC progress '" + flags_name + "' holds " +
                                 std::to_string(flag) + " where a flag (0 or 1) belongs");
      }
    }
    const auto [d_in, d_out] = dims_of(key);
    OffloadProgress progress;
    for (const bool a : {true, false}) {
      const int f = a ? 0 : 1;
      const std::int64_t d = a ? d_in : d_out;
      const std::string factor = base + ".offload." + (a ? "A" : "B");
      const auto optional = [&](const std::string& name) {
        return file.tensors.count(name) != 0 ? read_square(file, name, d) : Eigen::MatrixXf();
      };
      progress.written[f] = flags[static_cast<std::size_t>(f)] != 0;
      progress.host[f] = {optional(factor + "_value"), optional(factor + "_inv"),
                          optional(factor + "_prev_inv")};
      // A live matrix flagged present must be there (read_f32 names it otherwise).
      if (flags[static_cast<std::size_t>(2 + f)] != 0) {
        progress.live_value[f] = read_square(file, factor + "_live_value", d);
      }
      if (flags[static_cast<std::size_t>(4 + f)] != 0) {
        progress.live_inverse[f] = read_square(file, factor + "_live_inv", d);
      }
      const bool inverted = a ? slot.inverted_a : slot.inverted_b;
      if (inverted && !progress.written[f] && progress.live_inverse[f].size() == 0) {
        throw std::runtime_error("K-FAC progress '" + flags_name + "': factor " + (a ? "A" : "B") +
                                 "'s new inverse is neither written back nor on the device");
      }
    }
    return progress;
  }
  void apply_offload_progress(const FactorKey& key, const OffloadProgress& progress) {
    using Matrix = device::DeviceKfacLayer::Matrix;
    const auto [d_in, d_out] = dims_of(key);
    for (const bool a : {true, false}) {
      const int f = a ? 0 : 1;
      const std::int64_t d = a ? d_in : d_out;
      if (!runtime) {
        host_kfac.at(key).load(a, d, progress.host[f], progress.written[f]);
        auto& factor = a ? kfac_layer_of(key).a : kfac_layer_of(key).b;
        factor.value = progress.live_value[f];
        factor.inverse = progress.live_inverse[f];
        continue;
      }
      pinned_kfac.at(key).load(offload_streams(), a, d, progress.host[f], progress.written[f]);
      auto& layer = *device_kfac.at(key);
      for (const bool inverse : {false, true}) {
        const auto& live = inverse ? progress.live_inverse[f] : progress.live_value[f];
        const Matrix which = inverse ? Matrix::kInverse : Matrix::kValue;
        if (live.size() == 0) {
          (void)layer.detach(a, which);  // between runs: nothing reads it
          continue;
        }
        auto buffer = tensor::Tensor::empty(backend(), {d, d}, tensor::DType::kF32);
        backend().copy(buffer.raw_data(), live.data(), buffer.nbytes(),
                       tensor::CopyKind::kHostToDevice, compute_stream.get());
        compute_stream->synchronize();  // `live` may go
        (void)layer.attach(a, which, std::move(buffer));
      }
    }
  }
  kfac::KfacLayerState& kfac_layer_of(const FactorKey& key) {
    return kfac_states.at(key.pipeline).at({key.layer, key.linear});
  }
  // After a pipeline's K-FAC state was loaded (whole, as a run without offload holds it): each
  // offloaded Linear's value and inverse move to host memory, as between two refreshes (what a
  // checkpoint taken inside a refresh changes, its progress records restore).
  void offload_loaded_state(int pipeline) {
    using Matrix = device::DeviceKfacLayer::Matrix;
    for (const auto& [key, slot] : kfac_slots) {
      if (!slot.offloaded || key.pipeline != pipeline) continue;
      auto& layer = kfac_layer_of(key);  // on a device: the host copy the layer was loaded from
      // Factors only: the value moves, the inverse stays on the device.
      const bool inverse_moves = !slot.factors_only;
      for (const bool a : {true, false}) {
        auto& factor = a ? layer.a : layer.b;
        const OffloadedFactor host{
            factor.value, inverse_moves ? factor.inverse : Eigen::MatrixXf(), {}};
        const std::int64_t d = a ? layer.d_in : layer.d_out;
        if (runtime) {
          pinned_kfac.at(key).load(offload_streams(), a, d, host, false);
          (void)device_kfac.at(key)->detach(a, Matrix::kValue);
          if (inverse_moves) (void)device_kfac.at(key)->detach(a, Matrix::kInverse);
        } else {
          host_kfac.at(key).load(a, d, host, false);
          factor.value = Eigen::MatrixXf();
          if (inverse_moves) factor.inverse = Eigen::MatrixXf();
        }
      }
    }
  }

  void begin_round() {
    for (auto& [key, slot] : kfac_slots) {
      slot.done_a = slot.done_b = 0;
      slot.inverted_a = slot.inverted_b = false;
      if (!schedule.kfac_pipelined_refresh) continue;
      if (runtime) {
        // The same on the device layer (its second accumulator).
        auto& layer = *device_kfac.at(key);
        for (const bool is_a : {true, false}) {
          if (layer.pending_microbatches(is_a) == 0) continue;
          if (layer.set_aside_microbatches(is_a) != 0) {
            throw std::runtime_error(
                "pipelined K-FAC refresh: the factor sums of two earlier refreshes are both "
                "unfinalized at a window's start (an inversion of the previous refresh is "
                "missing)");
          }
          layer.set_aside(is_a);
        }
        continue;
      }
      // Sums the previous refresh's inversion has not finalized yet (it runs in this window):
      // set aside, and this window accumulates into fresh ones.
      auto& layer = kfac_states.at(key.pipeline).at({key.layer, key.linear});
      for (const bool is_a : {true, false}) {
        auto& factor = is_a ? layer.a : layer.b;
        if (factor.microbatches == 0) continue;
        auto& count = is_a ? slot.previous_a_microbatches : slot.previous_b_microbatches;
        if (count != 0) {
          throw std::runtime_error(
              "pipelined K-FAC refresh: the factor sums of two earlier refreshes are both "
              "unfinalized at a window's start (an inversion of the previous refresh is missing)");
        }
        (is_a ? slot.previous_a_sum : slot.previous_b_sum) = std::move(factor.sum);
        factor.sum = Eigen::MatrixXf();
        count = factor.microbatches;
        factor.microbatches = 0;
      }
    }
    for (auto& [key, host] : host_kfac) host.begin_round();
    for (auto& [key, host] : pinned_kfac) host.begin_round();
  }

  // --- K-FAC offload (docs/offload.md): the copies between the live state and host memory.
  HostKfacState& host_state(const Instruction& in) {
    const auto it = host_kfac.find({in.pipeline, in.layer, in.linear});
    if (it == host_kfac.end()) {
      throw std::runtime_error("offload copy for a Linear this worker does not offload");
    }
    return it->second;
  }

  // What one copy moves on this replica (sharded state, kfac/state_placement.h): a factor
  // prefetch only to the factor holders, a write-back and an inverse prefetch only on the
  // inverse holders (those without factors write back the inverses the owner broadcast);
  // nothing on the others, which hold neither.
  // A factors-only Linear's copies move the factors alone: only on the factor holders.
  bool moves_here(const Instruction& in, const KfacSlot& slot) const {
    return in.kind == OpKind::kPrefetchFactors || slot.factors_only
               ? slot.placement.holds_factors(replica)
               : slot.placement.holds_inverses(replica);
  }
  // The inverses a write-back moves, per factor (A, B), and whether they are the current
  // round's refresh's. A write-back of the window's own inversions moves the inverses computed
  // (or received by broadcast) this round and not written back yet. A pipelined refresh's
  // previous-refresh inversions run in this window (sched::is_wrapped, step < 0) write back in
  // a window of their own (validated), before this window's inverse prefetches: there the
  // device's inverses are theirs (`live`). Neither may be new where a chain of pieces stops at
  // its window's end (pipelined): that write-back moves the factors alone.
  struct WriteBack {
    bool new_a = false, new_b = false, this_round = true;
  };
  WriteBack write_back_of(const Instruction& in, const KfacSlot& slot, bool written_a,
                          bool written_b, bool live_a, bool live_b) const {
    WriteBack out;
    out.this_round = !sched::is_wrapped(in);
    out.new_a = out.this_round ? slot.inverted_a && !written_a : live_a;
    out.new_b = out.this_round ? slot.inverted_b && !written_b : live_b;
    if (!out.new_a && !out.new_b && !schedule.kfac_pipelined_refresh) {
      throw std::runtime_error("write-back without a new inverse");
    }
    return out;
  }
  // The step's preconditioning reads the refresh's new inverses (see precondition).
  bool reads_newest(const Instruction& in) const {
    return in.step == schedule.num_steps - 1 && !schedule.kfac_pipelined_refresh;
  }

  void offload_copy(const Instruction& in) {
    if (!moves_here(in, kfac_slot(in))) return;
    if (runtime) {
      offload_copy_on_device(in);
      return;
    }
    auto& layer = kfac_layer(in);
    auto& slot = kfac_slot(in);
    auto& host = host_state(in);
    switch (in.kind) {
      case OpKind::kPrefetchFactors:
        host.prefetch_factors(layer);
        break;
      case OpKind::kWriteBackState: {
        if (slot.factors_only) {  // the factors alone: the inverses stay on the device
          host.write_back(layer, false, false, !sched::is_wrapped(in));
          break;
        }
        const auto moved =
            write_back_of(in, slot, host.written_back(true), host.written_back(false),
                          layer.a.inverse.size() != 0, layer.b.inverse.size() != 0);
        host.write_back(layer, moved.new_a, moved.new_b, moved.this_round);
        break;
      }
      default: {  // prefetch_inverses: what this step's preconditioning reads (see precondition)
        const bool newest = reads_newest(in);
        for (const bool is_a : {true, false}) {
          const bool inverted = is_a ? slot.inverted_a : slot.inverted_b;
          const bool written = host.written_back(is_a);
          const std::int64_t d = is_a ? layer.d_in : layer.d_out;
          auto& factor = is_a ? layer.a : layer.b;
          if (newest) {
            // The refresh's new inverse: from the host once written back (the validator orders
            // this prefetch after every write-back of the round's inversions).
            if (written || !inverted) host.prefetch_inverse(is_a, false, d, factor.inverse);
          } else if (inverted) {
            // The inverse the refresh replaced: the host's previous one once the new one is
            // written back, its current one before.
            host.prefetch_inverse(is_a, written, d,
                                  is_a ? slot.previous_a_inverse : slot.previous_b_inverse);
          } else {
            host.prefetch_inverse(is_a, false, d, factor.inverse);
          }
        }
        break;
      }
    }
  }

  // The same on a device (the CPU path's choices, step by step): the copies run on the copy
  // stream; a prefetch's consumer waits for it (await_prefetch), a write-back waits for the
  // compute stream's work so far, and the device buffers go back to staging once the work that
  // reads them has run.
  OffloadStreams offload_streams() const {
    return {runtime.get(), compute_stream.get(), copy_stream.get(), staging.get()};
  }
  PinnedKfacState& pinned_state(const Instruction& in) {
    const auto it = pinned_kfac.find({in.pipeline, in.layer, in.linear});
    if (it == pinned_kfac.end()) {
      throw std::runtime_error("offload copy for a Linear this worker does not offload");
    }
    return it->second;
  }
  void mark_prefetched(KfacSlot& slot) {
    if (!slot.prefetched) slot.prefetched = backend().create_event();
    slot.prefetched->record(*copy_stream);
  }
  // The compute stream waits for the Linear's outstanding prefetch (before reading its
  // matrices); nothing to wait for without one.
  void await_prefetch(KfacSlot& slot) {
    if (!slot.prefetched) return;
    compute_stream->wait(*slot.prefetched);
    slot.prefetched.reset();
  }

  void offload_copy_on_device(const Instruction& in) {
    using Matrix = device::DeviceKfacLayer::Matrix;
    const FactorKey key{in.pipeline, in.layer, in.linear};
    auto& layer = *device_kfac.at(key);
    auto& slot = kfac_slot(in);
    auto& host = pinned_state(in);
    const auto on = offload_streams();
    const auto& dims = kfac_states.at(in.pipeline).at({in.layer, in.linear});
    switch (in.kind) {
      case OpKind::kPrefetchFactors:
        host.prefetch_factors(on, layer, dims.d_in, dims.d_out);
        mark_prefetched(slot);
        break;
      case OpKind::kWriteBackState: {
        WriteBack moved{false, false, !sched::is_wrapped(in)};  // factors only: the factors alone
        if (!slot.factors_only) {
          moved = write_back_of(in, slot, host.written_back(true), host.written_back(false),
                                layer.has_inverse(true, false), layer.has_inverse(false, false));
        }
        if (current_span) {
          // The span holds the copies, not the copy stream's wait for the inversion.
          const auto computed = backend().create_event();
          computed->record(*compute_stream);
          copy_stream->wait(*computed);
          timeline->restart(*current_span, *copy_stream);
        }
        host.write_back(on, layer, moved.new_a, moved.new_b, moved.this_round);
        // The sums finalized into the values written back leave too (the CUDA layer keeps their
        // buffer for its next accumulation: half the Linear's state on the device between
        // refreshes, which the plan does not count); a window's accumulation in progress stays.
        for (const bool is_a : {true, false}) {
          for (auto idle = layer.release_idle_sums(is_a); idle.numel() > 0;
               idle = layer.release_idle_sums(is_a)) {
            release_staging(on, std::move(idle), *compute_stream);
          }
        }
        break;
      }
      default: {  // prefetch_inverses: what this step's preconditioning reads
        const bool newest = reads_newest(in);
        for (const bool is_a : {true, false}) {
          const bool inverted = is_a ? slot.inverted_a : slot.inverted_b;
          const bool written = host.written_back(is_a);
          const std::int64_t d = is_a ? dims.d_in : dims.d_out;
          if (newest) {
            if (written || !inverted) {
              host.prefetch_inverse(on, layer, is_a, false, d, Matrix::kInverse);
            }
          } else if (inverted) {
            host.prefetch_inverse(on, layer, is_a, written, d, Matrix::kPreviousInverse);
          } else {
            host.prefetch_inverse(on, layer, is_a, false, d, Matrix::kInverse);
          }
        }
        mark_prefetched(slot);
        break;
      }
    }
  }

  // After an offloaded Linear's preconditioning: its prefetched inverses leave the device. The
  // refresh's new inverses stay until their write-back.
  void release_inverses(const Instruction& in) {
    auto& slot = kfac_slot(in);
    if (!slot.offloaded || slot.factors_only) return;  // factors only: the inverses stay
    if (runtime) {
      using Matrix = device::DeviceKfacLayer::Matrix;
      auto& layer = *device_kfac.at({in.pipeline, in.layer, in.linear});
      const auto& host = pinned_state(in);
      const auto on = offload_streams();
      for (const bool is_a : {true, false}) {
        release_staging(on, layer.detach(is_a, Matrix::kPreviousInverse), *compute_stream);
        if (!((is_a ? slot.inverted_a : slot.inverted_b) && !host.written_back(is_a))) {
          release_staging(on, layer.detach(is_a, Matrix::kInverse), *compute_stream);
        }
      }
      return;
    }
    auto& layer = kfac_layer(in);
    const auto& host = host_state(in);
    slot.previous_a_inverse = Eigen::MatrixXf();
    slot.previous_b_inverse = Eigen::MatrixXf();
    // A new inverse not yet written back is the only copy: it stays.
    if (!(slot.inverted_a && !host.written_back(true))) layer.a.inverse = Eigen::MatrixXf();
    if (!(slot.inverted_b && !host.written_back(false))) layer.b.inverse = Eigen::MatrixXf();
  }

  void execute(const Instruction& in, int position, std::int64_t global_step,
               const std::function<void(const StepResult&)>& on_step) {
    if (!dp_buckets.empty()) poll_dp_buckets();  // buckets finished meanwhile (MPI: progress)
    const bool recording =
        setup.options.record_events && global_step < setup.options.record_events_before_step;
    const double start = recording ? now_s() : 0.0;
    const double waited_before = waited_s;
    const std::int64_t sent_before =
        sched::is_kfac_collective(in.kind) ? comm.payload_bytes_sent() : -1;
    std::int64_t bytes = 0;
    released_stash = 0;
    executing_step = global_step;
    // On a device the instruction is timed by marks in its stream (the communication stream for
    // sends, whose copies run there; the compute stream for everything else).
    tensor::Stream* timed_stream = nullptr;
    if (recording && runtime) {
      const bool on_comm = in.kind == OpKind::kSendActivation || in.kind == OpKind::kSendGradient;
      timed_stream = on_comm                                           ? comm_stream.get()
                     : sched::is_kfac_transfer(in.kind) && copy_stream ? copy_stream.get()
                                                                       : compute_stream.get();
      current_span = timeline->begin(*timed_stream);
    }
    switch (in.kind) {
      case OpKind::kForward:
        forward(in, global_step, position);
        break;
      case OpKind::kBackward:
      case OpKind::kBackwardInput:
      case OpKind::kBackwardWeight:
        backward(in, global_step, position);
        break;
      case OpKind::kSendActivation:
      case OpKind::kSendGradient:
        send(in, bytes);
        break;
      case OpKind::kRecvActivation:
      case OpKind::kRecvGradient:
        receive(in, global_step);
        break;
      case OpKind::kReduceGradPipelines: {
        auto grads = slot_of(in.pipeline, in.chunk).model->flat_grads();
        reduce_gradients(grads, pipeline_pair_group(in));
        bytes = static_cast<std::int64_t>(grads.size_bytes());
        break;
      }
      case OpKind::kReduceGradDataParallel: {
        const auto started = dp_buckets.find({in.step, in.pipeline, in.chunk});
        if (started != dp_buckets.end()) {
          bytes = finish_dp_buckets(started->second);
          dp_buckets.erase(started);
          break;
        }
        auto grads = slot_of(in.pipeline, in.chunk).model->flat_grads();
        reduce_gradients(grads, data_parallel_group(self));
        bytes = static_cast<std::int64_t>(grads.size_bytes());
        break;
      }
      case OpKind::kOptimizerStep:
        optimizer_step(in, global_step, on_step);
        break;
      case OpKind::kCurvatureA:
      case OpKind::kCurvatureB:
        curvature(in);
        break;
      case OpKind::kCurvatureSync:
        curvature_sync(in);
        break;
      case OpKind::kInvertA:
      case OpKind::kInvertB:
        invert(in);
        break;
      case OpKind::kPrecondition:
        precondition(in);
        if (in.piece_end == sched::kPieceUnits) release_inverses(in);
        break;
      case OpKind::kBroadcastInverses:
        broadcast_inverses(in);
        break;
      case OpKind::kBroadcastGradient:
        broadcast_gradient(in);
        break;
      case OpKind::kPrefetchFactors:
      case OpKind::kWriteBackState:
      case OpKind::kPrefetchInverses:
        offload_copy(in);
        bytes = moves_here(in, kfac_slot(in)) ? in.bytes : 0;  // nothing where it holds none
        break;
    }
    if (sched::is_kfac(in.kind) && in.layer >= 0) sample_kfac(in);
    if (sent_before >= 0) {
      bytes = comm.payload_bytes_sent() - sent_before;
      kfac_sent += bytes;
    }
    if (timed_stream != nullptr) {
      timeline->end(*current_span, *timed_stream);
      pending_events.push_back({{rank, position, global_step, in, lane_of(in.kind), 0.0, 0.0, 0.0,
                                 bytes, -1, released_stash},
                                *current_span});
      current_span.reset();
    } else if (recording) {
      const double end = now_s();
      const double waited = waited_s - waited_before;
      const Lane lane = lane_of(in.kind);
      // A reduction's own time cannot be told from waiting for its peers here: all of it counts.
      const double busy = lane == Lane::kCommunication ? end - start : end - start - waited;
      events.push_back(
          {rank, position, global_step, in, lane, start, end, busy, bytes, -1, released_stash});
    }
    // The optimizer step synchronized the streams: the step's marks can be read now.
    if (runtime && in.kind == OpKind::kOptimizerStep && !pending_events.empty()) {
      resolve_device_events();
    }
  }

  // Device-timed events of the step that just ended: spans on the device's clock pinned to the
  // executor's (busy = the span: it starts once the instruction's inputs have arrived).
  void resolve_device_events() {
    compute_stream->synchronize();
    comm_stream->synchronize();
    const auto spans = timeline->resolve();
    for (auto& pending : pending_events) {
      const auto& span = spans.at(pending.span);
      pending.event.start_s = span.start_s;
      pending.event.end_s = std::max(span.end_s, span.start_s);
      pending.event.busy_s = pending.event.end_s - pending.event.start_s;
      events.push_back(pending.event);
    }
    pending_events.clear();
  }

  // A range of steps is cut at optimizer steps, not by the instructions' step fields: K-FAC work
  // on one step's data may sit after that step's optimizer step (in the next step's bubbles), so
  // run(a, b) + run(b, c) executes exactly the instructions, in exactly the order, of run(a, c).
  void run(std::int64_t first_step, std::int64_t last_step,
           const std::function<void(const StepResult&)>& on_step) {
    omp_set_num_threads(std::max(1, setup.options.threads_per_worker));
    const std::int64_t k = schedule.num_steps;
    if (runtime) {
      runtime->bind_thread();
      synchronize_device();
      pending_events.clear();
      current_span.reset();
      timeline->set_epoch(*compute_stream, [this] { return now_s(); });
    }
    last_step_end_s = now_s();
    for (std::int64_t round = first_step / k; round * k < last_step; ++round) {
      const std::int64_t round_start = round * k;
      const std::int64_t from = std::max<std::int64_t>(first_step - round_start, 0);
      const std::int64_t to = std::min<std::int64_t>(last_step - round_start, k);
      current_round = round;
      if (from == 0) begin_round();
      const std::size_t begin =
          from == 0 ? 0 : optimizer_positions[static_cast<std::size_t>(from - 1)] + 1;
      const std::size_t end =
          to == k ? stream->size() : optimizer_positions[static_cast<std::size_t>(to - 1)] + 1;
      for (std::size_t x = begin; x < end; ++x) {
        const Instruction& in = (*stream)[x];
        // The first window's wrapped work belongs to a refresh that never ran (pipelined).
        if (round == 0 && sched::is_kfac(in.kind) && sched::is_wrapped(in)) continue;
        const std::int64_t global_step = round_start + std::max<std::int64_t>(in.step, 0);
        const int position = static_cast<int>(x);
        record(position, global_step, in, "started");
        if (device_comm) device_comm->set_activity(position, sched::short_label(in));
        try {
          execute(in, position, global_step, on_step);
        } catch (const comm::AbortedError&) {
          record(position, global_step, in, "aborted");
          throw;
        } catch (const std::exception& error) {
          record(position, global_step, in, "FAILED");
          throw WorkerError("worker " + std::to_string(self) + " (replica " +
                                std::to_string(replica) + ", rank " + std::to_string(rank) +
                                "), step " + std::to_string(global_step) + ", stream position " +
                                std::to_string(position) + ", " + sched::short_label(in) + ": " +
                                error.what(),
                            rank, position);
        }
        record(position, global_step, in, "done");
      }
      if (setup.batches != nullptr && self == 0 && replica == 0) {
        // Batches of finished steps are no longer needed (all ranks passed the step's
        // all-reduce at its optimizer step, so none will ask again).
        setup.batches->release_before(std::min(round_start + k, last_step) - 1);
      }
    }
    if (runtime && !pending_events.empty()) resolve_device_events();
  }
};

template <typename T>
Worker<T>::Worker(const RunSetup<T>& setup, comm::Communicator& comm)
    : Worker(setup, comm, comm::Clock::now()) {}
template <typename T>
Worker<T>::Worker(const RunSetup<T>& setup, comm::Communicator& comm,
                  comm::Clock::time_point clock_origin)
    : impl_(std::make_unique<Impl>(setup, comm, clock_origin)) {}
template <typename T>
comm::Clock::time_point Worker<T>::clock_origin() const {
  return impl_->epoch;
}
template <typename T>
Worker<T>::~Worker() = default;
template <typename T>
int Worker<T>::rank() const {
  return impl_->rank;
}
template <typename T>
int Worker<T>::replica() const {
  return impl_->replica;
}
template <typename T>
int Worker<T>::worker() const {
  return impl_->self;
}
template <typename T>
void Worker<T>::run(std::int64_t first_step, std::int64_t last_step,
                    const std::function<void(const StepResult&)>& on_step) {
  impl_->run(first_step, last_step, on_step);
}
template <typename T>
std::vector<model::BertChunk<T>*> Worker<T>::chunks() {
  std::vector<model::BertChunk<T>*> result;
  for (auto& slot : impl_->slots) result.push_back(slot.model.get());
  return result;
}
template <typename T>
model::BertChunk<T>* Worker<T>::chunk(int pipeline, int chunk) {
  for (auto& slot : impl_->slots) {
    if (slot.pipeline == pipeline && slot.chunk == chunk) return slot.model.get();
  }
  return nullptr;
}
template <typename T>
optim::BasicOptimizer<T>& Worker<T>::optimizer() {
  return *impl_->optimizer;
}
template <typename T>
kfac::KfacState& Worker<T>::kfac_state(int pipeline) {
  auto& state = impl_->kfac_states[pipeline];
  // On a device the state lives in the device layers: a host copy (statistics, checkpoints).
  for (const auto& [key, layer] : impl_->device_kfac) {
    if (key.pipeline == pipeline) state.at({key.layer, key.linear}) = layer->to_host();
  }
  return state;
}
template <typename T>
kfac::KfacState Worker<T>::kfac_state_with_offloaded(int pipeline) {
  return impl_->with_offloaded(pipeline, kfac_state(pipeline));
}
template <typename T>
void Worker<T>::load_kfac_state(int pipeline, const ckpt::SafetensorsFile& file,
                                std::string_view prefix) {
  auto& state = impl_->kfac_states[pipeline];
  if (state.layers().empty()) return;
  state.load_state(file, prefix);
  for (const auto& [key, layer] : impl_->device_kfac) {
    if (key.pipeline == pipeline) layer->load(state.at({key.layer, key.linear}));
  }
  impl_->offload_loaded_state(pipeline);
}
template <typename T>
std::vector<ckpt::TensorRecord> Worker<T>::kfac_progress_records(std::string_view prefix) const {
  return impl_->kfac_progress_records(prefix);
}
template <typename T>
void Worker<T>::load_kfac_progress(const ckpt::SafetensorsFile& file, std::string_view prefix) {
  impl_->load_kfac_progress(file, prefix);
}
template <typename T>
std::int64_t Worker<T>::kfac_state_bytes() const {
  std::int64_t bytes = 0;
  if (impl_->runtime) {  // the device layers' memory
    for (const auto& [key, layer] : impl_->device_kfac) bytes += layer->device_bytes();
    return bytes;
  }
  for (const auto& [pipeline, state] : impl_->kfac_states) {
    for (const auto& [key, layer] : state.layers()) {
      for (const auto* factor : {&layer.a, &layer.b}) {
        bytes += static_cast<std::int64_t>(sizeof(float)) *
                 (factor->sum.size() + factor->value.size() + factor->inverse.size());
      }
    }
  }
  return bytes;
}
template <typename T>
std::int64_t Worker<T>::kfac_peak_resident_bytes() const {
  return impl_->kfac_peak_resident;
}
template <typename T>
WorkerMemory Worker<T>::memory() const {
  WorkerMemory memory;
  memory.rank = impl_->rank;
  for (const auto& slot : impl_->slots) {
    ChunkMemory chunk;
    chunk.pipeline = slot.pipeline;
    chunk.chunk = slot.chunk;
    chunk.parameter_bytes = static_cast<std::int64_t>(slot.model->parameter_bytes());
    chunk.gradient_bytes = static_cast<std::int64_t>(slot.model->gradient_bytes());
    for (const auto& p : slot.model->parameters()) {
      chunk.optimizer_bytes += impl_->optimizer->state_bytes(p.name);
    }
    memory.chunks.push_back(chunk);
  }
  for (const auto& [key, peak] : impl_->kfac_peak) {
    memory.kfac.push_back({key.pipeline, key.layer, key.linear, peak});
  }
  return memory;
}
template <typename T>
std::int64_t Worker<T>::kfac_host_bytes() const {
  std::int64_t bytes = 0;
  for (const auto& [key, host] : impl_->host_kfac) bytes += host.bytes();
  for (const auto& [key, host] : impl_->pinned_kfac) bytes += host.bytes();
  return bytes;
}
template <typename T>
std::int64_t Worker<T>::kfac_bytes_sent() const {
  return impl_->comm.payload_bytes_sent() < 0 ? -1 : impl_->kfac_sent;
}
template <typename T>
TransientMemory Worker<T>::transient_memory() const {
  TransientMemory memory;
  for (const auto& slot : impl_->slots) memory.activation_stash += slot.model->stash_bytes();
  auto add = [&](const auto& map) {
    for (const auto& [key, value] : map) memory.message_buffers += value.buffer.nbytes();
  };
  add(impl_->incoming_activations);
  add(impl_->incoming_gradients);
  for (const auto& [key, value] : impl_->gradients_out) memory.message_buffers += value.nbytes();
  for (const auto& [key, value] : impl_->local_gradients) memory.message_buffers += value.nbytes();
  for (const auto& pending : impl_->pending_sends) {
    memory.message_buffers += pending.buffer.nbytes();
  }
  memory.kfac_captures = impl_->capture_bytes;
  return memory;
}
template <typename T>
std::int64_t Worker<T>::peak_stash_bytes() const {
  return impl_->peak_stash;
}
template <typename T>
StepEndTimes Worker<T>::step_end_times() const {
  return impl_->step_end;
}
template <typename T>
void Worker<T>::reset_peak_stash_bytes(std::int64_t from_step) {
  impl_->peak_stash = 0;
  impl_->peak_stash_from = from_step;
}
template <typename T>
std::vector<InstructionEvent> Worker<T>::take_events() {
  return std::exchange(impl_->events, {});
}
template <typename T>
std::string Worker<T>::history() const {
  return impl_->history();
}

// ---------------------------------------------------------------------------------------------
// ThreadedExecutor
// ---------------------------------------------------------------------------------------------

template <typename T>
struct ThreadedExecutor<T>::Impl {
  RunSetup<T> setup;
  std::unique_ptr<comm::InProcessWorld> world;
  std::vector<std::unique_ptr<Worker<T>>> workers;
};

template <typename T>
ThreadedExecutor<T>::ThreadedExecutor(RunSetup<T> setup) : impl_(std::make_unique<Impl>()) {
  check_run_setup(setup.config, setup.schedule);
  sched::validate(setup.schedule);
  if (setup.batches == nullptr) throw std::invalid_argument("executor: no batch source");
  if (!setup.learning_rate) throw std::invalid_argument("executor: no learning-rate schedule");
  impl_->setup = std::move(setup);
  const int ranks =
      impl_->setup.schedule.num_workers() * impl_->setup.schedule.params.data_parallel;
  impl_->world = std::make_unique<comm::InProcessWorld>(ranks);
  // One clock for every worker: each is built in turn (BERT-Large's chunks take seconds), and
  // clocks started at each one's construction put the ranks' events that far apart (the GPU's
  // first traces had rank 3's step 0 seconds before rank 0's, and per-rank busy time of 0%).
  const auto clock_origin = comm::Clock::now();
  for (int r = 0; r < ranks; ++r) {
    impl_->workers.push_back(
        std::make_unique<Worker<T>>(impl_->setup, impl_->world->rank(r), clock_origin));
  }
}

template <typename T>
ThreadedExecutor<T>::~ThreadedExecutor() = default;

template <typename T>
int ThreadedExecutor<T>::num_ranks() const {
  return static_cast<int>(impl_->workers.size());
}
template <typename T>
Worker<T>& ThreadedExecutor<T>::worker(int rank) {
  return *impl_->workers.at(static_cast<std::size_t>(rank));
}
template <typename T>
const RunSetup<T>& ThreadedExecutor<T>::setup() const {
  return impl_->setup;
}
template <typename T>
std::size_t ThreadedExecutor<T>::pending_messages() const {
  return impl_->world->pending_messages();
}

template <typename T>
void ThreadedExecutor<T>::run(std::int64_t first_step, std::int64_t last_step,
                              const std::function<void(const StepResult&)>& on_step) {
  if (first_step < 0 || last_step < first_step) {
    throw std::invalid_argument("executor: bad step range [" + std::to_string(first_step) + ", " +
                                std::to_string(last_step) + ")");
  }
  const int ranks = num_ranks();
  std::mutex mutex;
  std::exception_ptr first_error;
  int failed_rank = -1, failed_position = -1;
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(ranks));
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      try {
        impl_->workers[static_cast<std::size_t>(r)]->run(
            first_step, last_step, r == 0 ? on_step : std::function<void(const StepResult&)>{});
      } catch (const comm::AbortedError&) {
        // Stopped because another worker failed: that worker reports.
      } catch (...) {
        std::lock_guard lock(mutex);
        if (!first_error) {
          first_error = std::current_exception();
          try {
            throw;
          } catch (const WorkerError& error) {
            failed_rank = error.rank();
            failed_position = error.position();
          } catch (...) {
            failed_rank = r;
          }
          impl_->world->rank(r).abort("worker at rank " + std::to_string(r) + " failed");
        }
      }
    });
  }
  for (auto& thread : threads) thread.join();
  if (!first_error) return;
  std::string message;
  try {
    std::rethrow_exception(first_error);
  } catch (const std::exception& error) {
    message = error.what();
  }
  std::ostringstream report;
  report << message << "\nrecent instructions of every worker (newest last):\n";
  for (int r = 0; r < ranks; ++r) {
    report << "  rank " << r << (r == failed_rank ? " (failed)" : "") << ":\n"
           << impl_->workers[static_cast<std::size_t>(r)]->history();
  }
  if (failed_rank >= 0 && failed_position >= 0) {
    const int worker = failed_rank % impl_->setup.schedule.num_workers();
    report << "schedule around the failed instruction (worker " << worker << ", position "
           << failed_position << "):\n"
           << sched::render_grid_around(impl_->setup.schedule, worker, failed_position);
  }
  throw std::runtime_error(report.str());
}

template <typename T>
std::vector<RankKfacState> ThreadedExecutor<T>::kfac_state_per_rank() {
  std::vector<RankKfacState> out;
  for (auto& worker : impl_->workers) {
    out.push_back({worker->kfac_state_bytes(), worker->kfac_bytes_sent(), worker->kfac_host_bytes(),
                   worker->kfac_peak_resident_bytes()});
  }
  return out;
}

template <typename T>
std::vector<Worker<T>*> ThreadedExecutor<T>::local_workers() {
  std::vector<Worker<T>*> workers;
  for (auto& worker : impl_->workers) workers.push_back(worker.get());
  return workers;
}

template <typename T>
std::vector<InstructionEvent> ThreadedExecutor<T>::take_events() {
  std::vector<InstructionEvent> all;
  for (auto& worker : impl_->workers) {
    auto events = worker->take_events();
    all.insert(all.end(), events.begin(), events.end());
  }
  return all;
}

template class Worker<float>;
template class Worker<double>;
template class ThreadedExecutor<float>;
template class ThreadedExecutor<double>;

}  // namespace pf::exec
