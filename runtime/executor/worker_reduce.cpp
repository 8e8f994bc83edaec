// Worker<T>::Impl's gradient reductions: data-parallel (buckets), pipeline pairs, tied embedding.
#include "runtime/executor/worker_impl.h"

#include <algorithm>

namespace pf::exec {

// The last weight-gradient backward of each (step, pipeline, chunk) before its DP reduction.
template <typename T>
void Worker<T>::Impl::find_dp_bucket_launches() {
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

template <typename T>
void Worker<T>::Impl::reduce(std::span<T> data, const std::vector<int>& group) {
  const WaitTimer timer(*this);
  comm.all_reduce_sum(data, group, deadline());
}

// Completes the buckets whose all-reduce has finished (their sums land in the gradients),
// without waiting; on MPI this is also what moves their second phase on.
template <typename T>
void Worker<T>::Impl::poll_dp_buckets() {
  for (auto& [key, buckets] : dp_buckets) {
    for (std::size_t i = 0; i < buckets.size(); ++i) {
      auto& bucket = buckets[i];
      if (!bucket.done && bucket.request->test()) complete_bucket(bucket, i);
    }
  }
}

template <typename T>
void Worker<T>::Impl::complete_bucket(DpBucket& bucket, std::size_t index) {
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
template <typename T>
std::int64_t Worker<T>::Impl::finish_dp_buckets(std::vector<DpBucket>& buckets) {
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
        throw std::runtime_error("waited " +
                                 std::to_string(setup.options.wait_timeout.count() / 1000.0) +
                                 " s for data-parallel gradient bucket " + std::to_string(i) +
                                 " of " + std::to_string(buckets.size()) + " (gradient elements [" +
                                 std::to_string(bucket.begin) + ", " + std::to_string(bucket.end) +
                                 "), " + std::to_string(bucket_bytes) + " bytes): " + error.what());
      }
    }
    complete_bucket(bucket, i);
  }
  return bytes;
}

// Gradients in the worker's memory: in place on the host; a device stages them through host
// memory (enough for workers sharing one GPU; NCCL is the multi-GPU answer).
template <typename T>
void Worker<T>::Impl::reduce_gradients(std::span<T> data, const std::vector<int>& group) {
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

template <typename T>
std::vector<int> Worker<T>::Impl::pipeline_pair_group(const Instruction& in) const {
  std::vector<int> group = {rank_of(replica, schedule.placement.worker_of(0, in.chunk)),
                            rank_of(replica, schedule.placement.worker_of(1, in.chunk))};
  std::sort(group.begin(), group.end());
  group.erase(std::unique(group.begin(), group.end()), group.end());
  return group;
}

template <typename T>
std::vector<int> Worker<T>::Impl::data_parallel_group(int worker_index) const {
  std::vector<int> group;
  for (int r = 0; r < replicas; ++r) group.push_back(rank_of(r, worker_index));
  return group;
}

// The word embeddings' gradient and the head's copy: summed, then equal on both.
template <typename T>
void Worker<T>::Impl::tied_embedding_sum() {
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

#define PF_INSTANTIATE(T)                                                                   \
  template void Worker<T>::Impl::find_dp_bucket_launches();                                 \
  template void Worker<T>::Impl::reduce(std::span<T>, const std::vector<int>&);             \
  template void Worker<T>::Impl::poll_dp_buckets();                                         \
  template void Worker<T>::Impl::complete_bucket(DpBucket&, std::size_t);                   \
  template std::int64_t Worker<T>::Impl::finish_dp_buckets(std::vector<DpBucket>&);         \
  template void Worker<T>::Impl::reduce_gradients(std::span<T>, const std::vector<int>&);   \
  template std::vector<int> Worker<T>::Impl::pipeline_pair_group(const Instruction&) const; \
  template std::vector<int> Worker<T>::Impl::data_parallel_group(int) const;                \
  template void Worker<T>::Impl::tied_embedding_sum();
PF_INSTANTIATE(float)
PF_INSTANTIATE(double)
#undef PF_INSTANTIATE

}  // namespace pf::exec
