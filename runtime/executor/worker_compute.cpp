// Worker<T>::Impl's compute: forward, backward, the K-FAC captures, the optimizer step.
#include "runtime/executor/worker_impl.h"

#include <cmath>

#include "kernels/rng.h"
#include "runtime/executor/worker_bucket_launcher.h"

namespace pf::exec {

// --- KfacCapture: copies what the stream's curvature tasks will need, nothing else.
template <typename T>
void Worker<T>::Impl::on_input(int layer, LinearKind linear, int microbatch,
                               kernels::ConstMatrixView<T> a) {
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

template <typename T>
void Worker<T>::Impl::on_output_grad(int layer, LinearKind linear, int microbatch,
                                     kernels::ConstMatrixView<T> g) {
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
template <typename T>
tensor::Tensor Worker<T>::Impl::device_copy(kernels::ConstMatrixView<T> m) {
  auto copy = new_buffer(m.rows, m.cols, !m.contiguous());
  if (m.contiguous()) {
    backend().copy(copy.raw_data(), m.data, copy.nbytes(), tensor::CopyKind::kDeviceToDevice,
                   compute_stream.get());
  } else {
    capture_ops->accumulate(m, {copy.template data<T>(), m.rows, m.cols});
  }
  return copy;
}

template <typename T>
void Worker<T>::Impl::store_device(const CaptureKey& key, bool is_b, tensor::Tensor data,
                                   std::int64_t rows) {
  Captured captured;
  captured.device = std::move(data);
  captured.rows = rows;
  captured.sequences = capture_sequences;
  (is_b ? captures_b : captures)[key] = std::move(captured);
  recount_captures();
}

template <typename T>
std::shared_ptr<std::vector<float>> Worker<T>::Impl::copy_matrix(kernels::ConstMatrixView<T> m) {
  auto copy = std::make_shared<std::vector<float>>(static_cast<std::size_t>(m.rows * m.cols));
  for (std::int64_t r = 0; r < m.rows; ++r) {
    const T* row = m.row(r);
    for (std::int64_t c = 0; c < m.cols; ++c) {
      (*copy)[static_cast<std::size_t>(r * m.cols + c)] = static_cast<float>(row[c]);
    }
  }
  return copy;
}

template <typename T>
void Worker<T>::Impl::store(const CaptureKey& key, bool is_b,
                            std::shared_ptr<std::vector<float>> data, std::int64_t rows) {
  Captured captured;
  captured.data = std::move(data);
  captured.rows = rows;
  captured.sequences = capture_sequences;
  (is_b ? captures_b : captures)[key] = std::move(captured);
  recount_captures();
}

template <typename T>
void Worker<T>::Impl::recount_captures() {
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

template <typename T>
std::uint64_t Worker<T>::Impl::dropout_seed(std::int64_t global_step, int index) const {
  return kernels::derive_seed(
      kernels::derive_seed(setup.options.dropout_seed, static_cast<std::uint64_t>(global_step)),
      static_cast<std::uint64_t>(index));
}

// --- Instructions.
template <typename T>
void Worker<T>::Impl::forward(const Instruction& in, std::int64_t global_step, int position) {
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

template <typename T>
void Worker<T>::Impl::backward(const Instruction& in, std::int64_t global_step, int position) {
  auto& slot = slot_of(in.pipeline, in.chunk);
  const MicroKey key{in.step, in.pipeline, in.chunk, in.microbatch};
  const int stash_id = in.microbatch + in.step * microbatches_total;
  std::optional<BucketLauncher> launcher;
  const int reduction = dp_reduction_of[static_cast<std::size_t>(position)];
  if (reduction >= 0) {
    launcher.emplace(*this, ChunkStepKey{in.step, in.pipeline, in.chunk}, slot.model->flat_grads(),
                     global_step, reduction, position);
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

template <typename T>
void Worker<T>::Impl::optimizer_step(const Instruction& in, std::int64_t global_step,
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

#define PF_INSTANTIATE(T)                                                                     \
  template void Worker<T>::Impl::on_input(int, LinearKind, int, kernels::ConstMatrixView<T>); \
  template void Worker<T>::Impl::on_output_grad(int, LinearKind, int,                         \
                                                kernels::ConstMatrixView<T>);                 \
  template tensor::Tensor Worker<T>::Impl::device_copy(kernels::ConstMatrixView<T>);          \
  template void Worker<T>::Impl::store_device(const CaptureKey&, bool, tensor::Tensor,        \
                                              std::int64_t);                                  \
  template std::shared_ptr<std::vector<float>> Worker<T>::Impl::copy_matrix(                  \
      kernels::ConstMatrixView<T>);                                                           \
  template void Worker<T>::Impl::store(const CaptureKey&, bool,                               \
                                       std::shared_ptr<std::vector<float>>, std::int64_t);    \
  template void Worker<T>::Impl::recount_captures();                                          \
  template std::uint64_t Worker<T>::Impl::dropout_seed(std::int64_t, int) const;              \
  template void Worker<T>::Impl::forward(const Instruction&, std::int64_t, int);              \
  template void Worker<T>::Impl::backward(const Instruction&, std::int64_t, int);             \
  template void Worker<T>::Impl::optimizer_step(const Instruction&, std::int64_t,             \
                                                const std::function<void(const StepResult&)>&);
PF_INSTANTIATE(float)
PF_INSTANTIATE(double)
#undef PF_INSTANTIATE

}  // namespace pf::exec
