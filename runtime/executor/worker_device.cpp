// Worker<T>::Impl's device: streams, optimizer, message buffers pooled and retired in order.
#include "runtime/executor/worker_impl.h"

namespace pf::exec {

template <typename T>
void Worker<T>::Impl::open_device() {
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

template <typename T>
std::unique_ptr<optim::BasicOptimizer<T>> Worker<T>::Impl::make_optimizer() {
  if (!runtime) return setup.make_optimizer ? setup.make_optimizer() : nullptr;
  if constexpr (std::is_same_v<T, float>) {
    return runtime->make_optimizer(setup.device_optimizer, compute_stream.get());
  } else {
    return nullptr;  // refused by open_device
  }
}

// Buffers for messages and hand-offs, on the worker's device. `zeroed` clears them in stream
// order (a host memset on the CPU, as the std::vector they replace did).
template <typename T>
tensor::Tensor Worker<T>::Impl::new_buffer(std::int64_t rows, std::int64_t cols, bool zeroed) {
  auto buffer = pool ? pool->acquire({rows, cols}, tensor::dtype_of<T>)
                     : tensor::Tensor::empty(backend(), {rows, cols}, tensor::dtype_of<T>);
  if (zeroed) backend().fill_zero(buffer.raw_data(), buffer.nbytes(), compute_stream.get());
  return buffer;
}

// A device buffer read by work issued on the compute stream is handed back once that work has
// run (device memory is never reused under running kernels); on the CPU it goes right away.
template <typename T>
void Worker<T>::Impl::retire(tensor::Tensor buffer) {
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
template <typename T>
void Worker<T>::Impl::reclaim_retired(bool streams_idle) {
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
template <typename T>
void Worker<T>::Impl::recycle(tensor::Tensor buffer) {
  if (pool) pool->release(std::move(buffer), *compute_stream);
}

// The step's end on a device: every stream idle, retired buffers pooled or freed. The offload
// staging pool keeps, per matrix size, as many buffers as the step's copies had out at once,
// for the next step: emptying it here cost a cudaFree per buffer, each waiting for the whole
// device (every worker sharing it), and a cudaMalloc per copy in the next step (BERT-Large
// bf16, 1F1B p = 4 on an H200: 2.2x the step time without offload). The trim frees what the
// layers allocated themselves (a new inverse) and gave to the pool at a write-back.
template <typename T>
void Worker<T>::Impl::synchronize_device() {
  if (!runtime) return;
  compute_stream->synchronize();
  comm_stream->synchronize();
  if (copy_stream) copy_stream->synchronize();
  reclaim_retired(true);
  if (staging) staging->trim_to_peak_use();
}

#define PF_INSTANTIATE(T)                                                                \
  template void Worker<T>::Impl::open_device();                                          \
  template std::unique_ptr<optim::BasicOptimizer<T>> Worker<T>::Impl::make_optimizer();  \
  template tensor::Tensor Worker<T>::Impl::new_buffer(std::int64_t, std::int64_t, bool); \
  template void Worker<T>::Impl::retire(tensor::Tensor);                                 \
  template void Worker<T>::Impl::reclaim_retired(bool);                                  \
  template void Worker<T>::Impl::recycle(tensor::Tensor);                                \
  template void Worker<T>::Impl::synchronize_device();
PF_INSTANTIATE(float)
PF_INSTANTIATE(double)
#undef PF_INSTANTIATE

}  // namespace pf::exec
