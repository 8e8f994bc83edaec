// The executor: a worker's construction and its dispatch loop (Worker<T>::Impl's constructor,
// execute and run; the instruction kinds' work is in the worker_*.cpp files, see worker_impl.h),
// Worker's public methods and ThreadedExecutor.
#include "runtime/executor/executor.h"

#include <omp.h>

#include <algorithm>
#include <exception>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

#include "runtime/comm/in_process.h"
#include "runtime/executor/worker_impl.h"
#include "scheduler/grid.h"
#include "scheduler/validate.h"

namespace pf::exec {

namespace {

Lane lane_of(OpKind kind) {
  if (sched::is_kfac_transfer(kind)) return Lane::kHostLink;
  if (sched::is_kfac(kind) && !sched::is_kfac_collective(kind)) return Lane::kKfac;
  if (sched::is_point_to_point(kind) || sched::is_reduction(kind)) return Lane::kCommunication;
  return Lane::kCompute;
}

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
Worker<T>::Impl::Impl(const RunSetup<T>& setup_, comm::Communicator& comm_,
                      comm::Clock::time_point clock_origin)
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

template <typename T>
optim::BasicParamView<T>* Worker<T>::Impl::find_param(const std::string& name) {
  for (auto& view : param_views) {
    if (view.name == name) return &view;
  }
  return nullptr;
}

template <typename T>
typename Worker<T>::Impl::Slot& Worker<T>::Impl::slot_of(int pipeline, int chunk) {
  for (auto& slot : slots) {
    if (slot.pipeline == pipeline && slot.chunk == chunk) return slot;
  }
  throw std::runtime_error("this worker does not hold chunk " + std::to_string(chunk) +
                           " of pipeline " + std::to_string(pipeline));
}

template <typename T>
void Worker<T>::Impl::record(int position, std::int64_t global_step, const Instruction& in,
                             const char* phase) {
  auto& f = flights[flight_next % flights.size()];
  f = {position, global_step, sched::short_label(in), phase, now_s()};
  ++flight_next;
}

template <typename T>
std::string Worker<T>::Impl::history() const {
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

template <typename T>
void Worker<T>::Impl::execute(const Instruction& in, int position, std::int64_t global_step,
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
template <typename T>
void Worker<T>::Impl::resolve_device_events() {
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

// One instruction, in the worker's history; a failure names the worker, step, stream position
// and instruction (WorkerError).
template <typename T>
void Worker<T>::Impl::execute_recorded(const Instruction& in, int position,
                                       std::int64_t global_step,
                                       const std::function<void(const StepResult&)>& on_step) {
  record(position, global_step, in, "started");
  if (device_comm) device_comm->set_activity(position, sched::short_label(in));
  try {
    execute(in, position, global_step, on_step);
  } catch (const comm::AbortedError&) {
    record(position, global_step, in, "aborted");
    throw;
  } catch (const std::exception& error) {
    record(position, global_step, in, "FAILED");
    throw WorkerError(
        "worker " + std::to_string(self) + " (replica " + std::to_string(replica) + ", rank " +
            std::to_string(rank) + "), step " + std::to_string(global_step) + ", stream position " +
            std::to_string(position) + ", " + sched::short_label(in) + ": " + error.what(),
        rank, position);
  }
  record(position, global_step, in, "done");
}

// The window starting at `step`, its wrapped K-FAC work only (what run() would do of it first:
// the window's start sets the previous refresh's sums aside, then its wrapped tasks in stream
// order, each step's at its place).
template <typename T>
void Worker<T>::Impl::finish_refresh(std::int64_t step) {
  const std::int64_t k = schedule.num_steps;
  const std::int64_t origin = setup.options.window_origin;
  if (step < origin || (step - origin) % k != 0) {
    throw std::logic_error("finish_refresh at step " + std::to_string(step) +
                           ": not the start of a refresh window (windows of " + std::to_string(k) +
                           " step(s) from step " + std::to_string(origin) + ")");
  }
  const std::int64_t round = (step - origin) / k;
  if (round == 0) return;  // no refresh before the schedule's first window
  omp_set_num_threads(std::max(1, setup.options.threads_per_worker));
  if (runtime) runtime->bind_thread();
  current_round = round;
  begin_round();
  for (std::size_t x = 0; x < stream->size(); ++x) {
    const Instruction& in = (*stream)[x];
    if (!sched::is_kfac(in.kind) || !sched::is_wrapped(in)) continue;
    execute_recorded(in, static_cast<int>(x), step + std::max<std::int64_t>(in.step, 0), {});
  }
  if (runtime) synchronize_device();
}

// A range of steps is cut at optimizer steps, not by the instructions' step fields: K-FAC work
// on one step's data may sit after that step's optimizer step (in the next step's bubbles), so
// run(a, b) + run(b, c) executes exactly the instructions, in exactly the order, of run(a, c).
template <typename T>
void Worker<T>::Impl::run(std::int64_t first_step, std::int64_t last_step,
                          const std::function<void(const StepResult&)>& on_step) {
  omp_set_num_threads(std::max(1, setup.options.threads_per_worker));
  const std::int64_t k = schedule.num_steps;
  const std::int64_t origin = setup.options.window_origin;
  if (first_step < origin) {
    throw std::logic_error("run from step " + std::to_string(first_step) +
                           ": the schedule's refresh windows start at step " +
                           std::to_string(origin) + " (ExecutorOptions::window_origin)");
  }
  if (runtime) {
    runtime->bind_thread();
    synchronize_device();
    pending_events.clear();
    current_span.reset();
    timeline->set_epoch(*compute_stream, [this] { return now_s(); });
  }
  last_step_end_s = now_s();
  for (std::int64_t round = (first_step - origin) / k; origin + round * k < last_step; ++round) {
    const std::int64_t round_start = origin + round * k;
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
      execute_recorded(in, static_cast<int>(x), round_start + std::max<std::int64_t>(in.step, 0),
                       on_step);
    }
    if (setup.batches != nullptr && self == 0 && replica == 0) {
      // Batches of finished steps are no longer needed (all ranks passed the step's
      // all-reduce at its optimizer step, so none will ask again).
      setup.batches->release_before(std::min(round_start + k, last_step) - 1);
    }
  }
  if (runtime && !pending_events.empty()) resolve_device_events();
}

#define PF_INSTANTIATE(T)                                                                         \
  template Worker<T>::Impl::Impl(const RunSetup<T>&, comm::Communicator&,                         \
                                 comm::Clock::time_point);                                        \
  template optim::BasicParamView<T>* Worker<T>::Impl::find_param(const std::string&);             \
  template typename Worker<T>::Impl::Slot& Worker<T>::Impl::slot_of(int, int);                    \
  template void Worker<T>::Impl::record(int, std::int64_t, const Instruction&, const char*);      \
  template std::string Worker<T>::Impl::history() const;                                          \
  template void Worker<T>::Impl::execute(const Instruction&, int, std::int64_t,                   \
                                         const std::function<void(const StepResult&)>&);          \
  template void Worker<T>::Impl::resolve_device_events();                                         \
  template void Worker<T>::Impl::execute_recorded(const Instruction&, int, std::int64_t,          \
                                                  const std::function<void(const StepResult&)>&); \
  template void Worker<T>::Impl::finish_refresh(std::int64_t);                                    \
  template void Worker<T>::Impl::run(std::int64_t, std::int64_t,                                  \
                                     const std::function<void(const StepResult&)>&);
PF_INSTANTIATE(float)
PF_INSTANTIATE(double)
#undef PF_INSTANTIATE

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
void Worker<T>::finish_refresh(std::int64_t step) {
  impl_->finish_refresh(step);
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
  impl_->drop_unheld_kfac_state(pipeline);
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
  on_every_worker([&](Worker<T>& worker, int r) {
    worker.run(first_step, last_step, r == 0 ? on_step : std::function<void(const StepResult&)>{});
  });
}

template <typename T>
void ThreadedExecutor<T>::finish_refresh(std::int64_t step) {
  on_every_worker([step](Worker<T>& worker, int) { worker.finish_refresh(step); });
}

template <typename T>
void ThreadedExecutor<T>::on_every_worker(const std::function<void(Worker<T>&, int)>& body) {
  const int ranks = num_ranks();
  std::mutex mutex;
  std::exception_ptr first_error;
  int failed_rank = -1, failed_position = -1;
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(ranks));
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      try {
        body(*impl_->workers[static_cast<std::size_t>(r)], r);
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
