// Worker<T>::Impl's point-to-point messages: activations and gradients sent and received.
#include "runtime/executor/worker_impl.h"

namespace pf::exec {

template <typename T>
void Worker<T>::Impl::await(Incoming& incoming, const char* what, int position,
                            std::int64_t global_step, const Instruction& in) {
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
template <typename T>
tensor::Tensor Worker<T>::Impl::take_incoming(Incoming& incoming, std::int64_t rows) {
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
    throw std::runtime_error("received " + std::to_string(data.numel()) + " elements from worker " +
                             std::to_string(incoming.peer % workers) + " (pair " +
                             std::to_string(incoming.pair_id) + "), expected " +
                             std::to_string(expected));
  }
  return data;
}

template <typename T>
void Worker<T>::Impl::send(const Instruction& in, std::int64_t& bytes) {
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
template <typename T>
tensor::Tensor Worker<T>::Impl::pack(kernels::ConstMatrixView<T> view) {
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
template <typename T>
void Worker<T>::Impl::after_compute(tensor::Stream& waiting) {
  const auto produced = backend().create_event();
  produced->record(*compute_stream);
  waiting.wait(*produced);
}

// The host path hands the buffer to the communicator; a device posts it to the exchange with
// an event recorded after the communication stream's copy, and sends the ticket.
template <typename T>
void Worker<T>::Impl::post_send(int peer, std::int64_t tag, tensor::Tensor buffer) {
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

template <typename T>
void Worker<T>::Impl::finish_sends() {
  for (auto& pending : pending_sends) {
    pending.request->wait(deadline());
    recycle_sent(pending);
  }
  pending_sends.clear();
}

// A device communicator's sent buffer goes back to the pool (its send has completed).
template <typename T>
void Worker<T>::Impl::recycle_sent(PendingSend& pending) {
  if (device_comm && pending.buffer.numel() > 0) recycle(std::move(pending.buffer));
}

template <typename T>
void Worker<T>::Impl::receive(const Instruction& in, std::int64_t global_step) {
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

#define PF_INSTANTIATE(T)                                                          \
  template void Worker<T>::Impl::await(Incoming&, const char*, int, std::int64_t,  \
                                       const Instruction&);                        \
  template tensor::Tensor Worker<T>::Impl::take_incoming(Incoming&, std::int64_t); \
  template void Worker<T>::Impl::send(const Instruction&, std::int64_t&);          \
  template tensor::Tensor Worker<T>::Impl::pack(kernels::ConstMatrixView<T>);      \
  template void Worker<T>::Impl::after_compute(tensor::Stream&);                   \
  template void Worker<T>::Impl::post_send(int, std::int64_t, tensor::Tensor);     \
  template void Worker<T>::Impl::finish_sends();                                   \
  template void Worker<T>::Impl::recycle_sent(PendingSend&);                       \
  template void Worker<T>::Impl::receive(const Instruction&, std::int64_t);
PF_INSTANTIATE(float)
PF_INSTANTIATE(double)
#undef PF_INSTANTIATE

}  // namespace pf::exec
