// Worker<T>::Impl's K-FAC inverses: inversion, broadcasts to replicas, preconditioning.
#include "runtime/executor/worker_impl.h"

#include <algorithm>

#include "kfac/factors.h"
#include "kfac/precondition.h"

namespace pf::exec {

template <typename T>
std::vector<int> Worker<T>::Impl::replica_ranks(const std::vector<int>& replica_group) const {
  std::vector<int> ranks;
  for (int r : replica_group) ranks.push_back(rank_of(r, self));
  return ranks;
}

// The owner's new inverses to the inverse holders without factors.
template <typename T>
void Worker<T>::Impl::broadcast_inverses(const Instruction& in) {
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
template <typename T>
void Worker<T>::Impl::broadcast_inverses_on_device(const Instruction& in, KfacSlot& slot,
                                                   bool owner, const std::vector<int>& ranks) {
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
template <typename T>
template <typename U>
void Worker<T>::Impl::broadcast_on_device(std::span<U> data, int root,
                                          const std::vector<int>& ranks) {
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
template <typename T>
void Worker<T>::Impl::broadcast_gradient(const Instruction& in) {
  auto& slot = kfac_slot(in);
  const auto group = slot.placement.gradient_broadcast_group(replicas);
  if (std::find(group.begin(), group.end(), replica) == group.end()) return;
  const std::string weight = linear_weight_name(in.layer, in.linear);
  for (auto* view : {find_param(weight), find_param(bias_name_of(weight))}) {
    if (view == nullptr) continue;
    if (runtime) {
      // Device gradients: read (root) or overwritten after the compute stream's work on them.
      broadcast_on_device(std::span<T>(view->grad, view->size), rank_of(slot.placement.owner, self),
                          replica_ranks(group));
      continue;
    }
    const WaitTimer timer(*this);
    comm.broadcast(std::as_writable_bytes(std::span<T>(view->grad, view->size)),
                   rank_of(slot.placement.owner, self), replica_ranks(group), deadline());
  }
}

// A refresh's factor is finalized only once all its curvature tasks of the refresh have run.
template <typename T>
void Worker<T>::Impl::require_complete_curvature(const KfacSlot& slot, bool a_factor) {
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
template <typename T>
void Worker<T>::Impl::invert_on_device(const Instruction& in) {
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
    const auto damping = layer.damping(setup.options.kfac.damping, setup.options.kfac.pi_adjusted);
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

template <typename T>
void Worker<T>::Impl::invert(const Instruction& in) {
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
template <typename T>
void Worker<T>::Impl::precondition_on_device(const Instruction& in) {
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

template <typename T>
void Worker<T>::Impl::precondition(const Instruction& in) {
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

#define PF_INSTANTIATE(T)                                                                          \
  template std::vector<int> Worker<T>::Impl::replica_ranks(const std::vector<int>&) const;         \
  template void Worker<T>::Impl::broadcast_inverses(const Instruction&);                           \
  template void Worker<T>::Impl::broadcast_inverses_on_device(const Instruction&, KfacSlot&, bool, \
                                                              const std::vector<int>&);            \
  template void Worker<T>::Impl::broadcast_on_device<float>(std::span<float>, int,                 \
                                                            const std::vector<int>&);              \
  template void Worker<T>::Impl::broadcast_gradient(const Instruction&);                           \
  template void Worker<T>::Impl::require_complete_curvature(const KfacSlot&, bool);                \
  template void Worker<T>::Impl::invert_on_device(const Instruction&);                             \
  template void Worker<T>::Impl::invert(const Instruction&);                                       \
  template void Worker<T>::Impl::precondition_on_device(const Instruction&);                       \
  template void Worker<T>::Impl::precondition(const Instruction&);
PF_INSTANTIATE(float)
PF_INSTANTIATE(double)
#undef PF_INSTANTIATE
template void Worker<double>::Impl::broadcast_on_device<double>(std::span<double>, int,
                                                                const std::vector<int>&);

}  // namespace pf::exec
