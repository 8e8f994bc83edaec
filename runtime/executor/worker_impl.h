#pragma once
// Private to runtime/executor (not installed): Worker<T>::Impl, one rank's worker, and the keys
// of its maps. Its member functions are defined in files named for what they do (worker_*.cpp;
// executor.cpp holds its construction and dispatch), each explicitly instantiating what it
// defines for the element types Worker is instantiated for (float, double).
#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kfac/inverse_chain.h"
#include "runtime/comm/device_communicator.h"
#include "runtime/device/buffer_pool.h"
#include "runtime/device/stream_timeline.h"
#include "runtime/executor/executor.h"
#include "runtime/executor/host_kfac_state.h"
#include "runtime/executor/pinned_kfac_state.h"
#include "runtime/tensor/cpu_backend.h"
#include "runtime/tensor/tensor.h"

namespace pf::exec {

using sched::Instruction;
using sched::LinearKind;
using sched::OpKind;

using Seconds = std::chrono::duration<double>;

// Hugging Face name of a preconditioned Linear's weight (its bias replaces "weight").
inline std::string linear_weight_name(int layer, LinearKind linear) {
  static constexpr std::array<const char*, sched::kNumLinearKinds> kNames = {
      "attention.self.query",   "attention.self.key", "attention.self.value",
      "attention.output.dense", "intermediate.dense", "output.dense"};
  return "bert.encoder.layer." + std::to_string(layer) + "." +
         kNames[static_cast<std::size_t>(linear)] + ".weight";
}

inline std::string bias_name_of(const std::string& weight_name) {
  return weight_name.substr(0, weight_name.size() - std::string("weight").size()) + "bias";
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
  std::int64_t current_round = 0;  // the window of k steps being run (0: the first from the origin)
  Worker<T>::Impl* self_ptr = nullptr;

  // Flight recorder and events.
  std::vector<Flight> flights;
  std::size_t flight_next = 0;
  comm::Clock::time_point epoch;
  std::vector<InstructionEvent> events;
  double last_step_end_s = 0.0;

  std::map<CaptureKey, Captured> captures_b;
  std::int64_t capture_sequences = 0;  // sequences of the micro-batch being captured

  // Starts a chunk's data-parallel gradient buckets during its last backward
  // (worker_bucket_launcher.h).
  class BucketLauncher;

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

  struct OffloadProgress {
    bool written[2] = {false, false};
    OffloadedFactor host[2];
    Eigen::MatrixXf live_value[2], live_inverse[2];  // empty: not on the device
  };

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

  // --- Construction (executor.cpp).
  Impl(const RunSetup<T>& setup_, comm::Communicator& comm_, comm::Clock::time_point clock_origin);

  // --- Small helpers every part uses.
  tensor::Backend& backend() { return runtime ? runtime->backend() : *cpu_backend; }
  static kernels::ConstMatrixView<T> matrix_of(const tensor::Tensor& buffer, std::int64_t cols) {
    return {buffer.template data<T>(), buffer.numel() / cols, cols};
  }
  comm::Deadline deadline() const { return comm::Clock::now() + setup.options.wait_timeout; }
  double now_s() const { return Seconds(comm::Clock::now() - epoch).count(); }
  int rank_of(int replica_index, int worker_index) const {
    return replica_index * workers + worker_index;
  }
  // The chunk numbers micro-batches by stash id (micro-batch + stream step * micro-batches).
  int stream_microbatch(int stash_id) const { return stash_id - capture_step * microbatches_total; }
  // --- The micro-batch of (stream step, pipeline, micro-batch).
  int global_index(int pipeline, int microbatch) const {
    return replica * microbatches_total + pipeline * per_pipeline + microbatch;
  }
  T loss_scale() const { return T(1) / static_cast<T>(microbatches_total * replicas); }
  kfac::KfacLayerState& kfac_layer(const Instruction& in) {
    return kfac_states.at(in.pipeline).at({in.layer, in.linear});
  }
  KfacSlot& kfac_slot(const Instruction& in) {
    return kfac_slots.at({in.pipeline, in.layer, in.linear});
  }
  std::pair<std::int64_t, std::int64_t> dims_of(const FactorKey& key) const {
    const auto& layer = kfac_states.at(key.pipeline).at({key.layer, key.linear});
    return {layer.d_in, layer.d_out};
  }
  kfac::KfacLayerState& kfac_layer_of(const FactorKey& key) {
    return kfac_states.at(key.pipeline).at({key.layer, key.linear});
  }
  // The step's preconditioning reads the refresh's new inverses (see precondition).
  bool reads_newest(const Instruction& in) const {
    return in.step == schedule.num_steps - 1 && !schedule.kfac_pipelined_refresh;
  }
  OffloadStreams offload_streams() const {
    return {runtime.get(), compute_stream.get(), copy_stream.get(), staging.get()};
  }

  // --- executor.cpp.
  optim::BasicParamView<T>* find_param(const std::string& name);
  Slot& slot_of(int pipeline, int chunk);
  void record(int position, std::int64_t global_step, const Instruction& in, const char* phase);
  std::string history() const;
  void execute(const Instruction& in, int position, std::int64_t global_step,
               const std::function<void(const StepResult&)>& on_step);
  void resolve_device_events();
  void execute_recorded(const Instruction& in, int position, std::int64_t global_step,
                        const std::function<void(const StepResult&)>& on_step);
  void finish_refresh(std::int64_t step);
  void run(std::int64_t first_step, std::int64_t last_step,
           const std::function<void(const StepResult&)>& on_step);

  // --- worker_device.cpp.
  void open_device();
  std::unique_ptr<optim::BasicOptimizer<T>> make_optimizer();
  tensor::Tensor new_buffer(std::int64_t rows, std::int64_t cols, bool zeroed);
  void retire(tensor::Tensor buffer);
  void reclaim_retired(bool streams_idle);
  void recycle(tensor::Tensor buffer);
  void synchronize_device();

  // --- worker_memory.cpp.
  std::int64_t linear_kfac_bytes(const FactorKey& key) const;
  void sample_kfac(const Instruction& in);
  std::int64_t kfac_resident_bytes() const;
  void sample_stash(std::int64_t released);

  // --- worker_compute.cpp.
  void on_input(int layer, LinearKind linear, int microbatch,
                kernels::ConstMatrixView<T> a) override;
  void on_output_grad(int layer, LinearKind linear, int microbatch,
                      kernels::ConstMatrixView<T> g) override;
  tensor::Tensor device_copy(kernels::ConstMatrixView<T> m);
  void store_device(const CaptureKey& key, bool is_b, tensor::Tensor data, std::int64_t rows);
  static std::shared_ptr<std::vector<float>> copy_matrix(kernels::ConstMatrixView<T> m);
  void store(const CaptureKey& key, bool is_b, std::shared_ptr<std::vector<float>> data,
             std::int64_t rows);
  void recount_captures();
  std::uint64_t dropout_seed(std::int64_t global_step, int index) const;
  void forward(const Instruction& in, std::int64_t global_step, int position);
  void backward(const Instruction& in, std::int64_t global_step, int position);
  void optimizer_step(const Instruction& in, std::int64_t global_step,
                      const std::function<void(const StepResult&)>& on_step);

  // --- worker_p2p.cpp.
  void await(Incoming& incoming, const char* what, int position, std::int64_t global_step,
             const Instruction& in);
  tensor::Tensor take_incoming(Incoming& incoming, std::int64_t rows);
  void send(const Instruction& in, std::int64_t& bytes);
  tensor::Tensor pack(kernels::ConstMatrixView<T> view);
  void after_compute(tensor::Stream& waiting);
  void post_send(int peer, std::int64_t tag, tensor::Tensor buffer);
  void finish_sends();
  void recycle_sent(PendingSend& pending);
  void receive(const Instruction& in, std::int64_t global_step);

  // --- worker_reduce.cpp.
  void find_dp_bucket_launches();
  void reduce(std::span<T> data, const std::vector<int>& group);
  void poll_dp_buckets();
  void complete_bucket(DpBucket& bucket, std::size_t index);
  std::int64_t finish_dp_buckets(std::vector<DpBucket>& buckets);
  void reduce_gradients(std::span<T> data, const std::vector<int>& group);
  std::vector<int> pipeline_pair_group(const Instruction& in) const;
  std::vector<int> data_parallel_group(int worker_index) const;
  void tied_embedding_sum();

  // --- worker_kfac.cpp.
  void prepare_kfac();
  void place_kfac_state();
  void drop_unheld_kfac_state(int pipeline);
  void curvature(const Instruction& in);
  void curvature_sync(const Instruction& in);
  void sync_sums(const Instruction& in, kfac::KfacLayerState& layer, const std::vector<int>& group);
  void sync_sums_on_device(const Instruction& in, const std::vector<int>& group);
  void begin_round();

  // --- worker_kfac_inverse.cpp.
  std::vector<int> replica_ranks(const std::vector<int>& replica_group) const;
  void broadcast_inverses(const Instruction& in);
  void broadcast_inverses_on_device(const Instruction& in, KfacSlot& slot, bool owner,
                                    const std::vector<int>& ranks);
  template <typename U>
  void broadcast_on_device(std::span<U> data, int root, const std::vector<int>& ranks);
  void broadcast_gradient(const Instruction& in);
  static void require_complete_curvature(const KfacSlot& slot, bool a_factor);
  void invert_on_device(const Instruction& in);
  void invert(const Instruction& in);
  void precondition_on_device(const Instruction& in);
  void precondition(const Instruction& in);

  // --- worker_offload.cpp.
  HostKfacState& host_state(const Instruction& in);
  bool moves_here(const Instruction& in, const KfacSlot& slot) const;
  WriteBack write_back_of(const Instruction& in, const KfacSlot& slot, bool written_a,
                          bool written_b, bool live_a, bool live_b) const;
  void offload_copy(const Instruction& in);
  PinnedKfacState& pinned_state(const Instruction& in);
  void mark_prefetched(KfacSlot& slot);
  void await_prefetch(KfacSlot& slot);
  void offload_copy_on_device(const Instruction& in);
  void release_inverses(const Instruction& in);

  // --- worker_checkpoint.cpp.
  static std::string slot_name(std::string_view prefix, const FactorKey& key);
  static std::string capture_name(std::string_view prefix, bool is_b, const CaptureKey& key);
  static void add_matrix(std::vector<ckpt::TensorRecord>& records, std::string name,
                         const Eigen::MatrixXf& matrix);
  std::vector<float> download_capture(const tensor::Tensor& device) const;
  tensor::Tensor upload_capture(const std::vector<float>& values, std::int64_t rows,
                                std::int64_t cols);
  static device::KfacLayerExtras host_extras(const KfacSlot& slot);
  std::vector<ckpt::TensorRecord> kfac_progress_records(std::string_view prefix) const;
  void load_kfac_progress(const ckpt::SafetensorsFile& file, std::string_view prefix);

  // --- worker_checkpoint_offload.cpp.
  kfac::KfacLayerState live_layer(const FactorKey& key) const;
  OffloadedFactor host_factor(const FactorKey& key, bool a) const;
  bool host_written(const FactorKey& key, bool a) const;
  kfac::KfacState with_offloaded(int pipeline, kfac::KfacState state) const;
  void add_offload_records(std::vector<ckpt::TensorRecord>& records, const std::string& base,
                           const FactorKey& key) const;
  static Eigen::MatrixXf read_square(const ckpt::SafetensorsFile& file, const std::string& name,
                                     std::int64_t dim);
  OffloadProgress read_offload_records(const ckpt::SafetensorsFile& file, const std::string& base,
                                       const FactorKey& key, const KfacSlot& slot) const;
  void apply_offload_progress(const FactorKey& key, const OffloadProgress& progress);
  void offload_loaded_state(int pipeline);
};

}  // namespace pf::exec
