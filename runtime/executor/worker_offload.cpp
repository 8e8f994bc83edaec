// Worker<T>::Impl's K-FAC offload copies between the live state and host memory (docs/offload.md).
#include "runtime/executor/worker_impl.h"

namespace pf::exec {

// --- K-FAC offload (docs/offload.md): the copies between the live state and host memory.
template <typename T>
HostKfacState& Worker<T>::Impl::host_state(const Instruction& in) {
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
template <typename T>
bool Worker<T>::Impl::moves_here(const Instruction& in, const KfacSlot& slot) const {
  return in.kind == OpKind::kPrefetchFactors || slot.factors_only
             ? slot.placement.holds_factors(replica)
             : slot.placement.holds_inverses(replica);
}

template <typename T>
typename Worker<T>::Impl::WriteBack Worker<T>::Impl::write_back_of(const Instruction& in,
                                                                   const KfacSlot& slot,
                                                                   bool written_a, bool written_b,
                                                                   bool live_a, bool live_b) const {
  WriteBack out;
  out.this_round = !sched::is_wrapped(in);
  out.new_a = out.this_round ? slot.inverted_a && !written_a : live_a;
  out.new_b = out.this_round ? slot.inverted_b && !written_b : live_b;
  if (!out.new_a && !out.new_b && !schedule.kfac_pipelined_refresh) {
    throw std::runtime_error("write-back without a new inverse");
  }
  return out;
}

template <typename T>
void Worker<T>::Impl::offload_copy(const Instruction& in) {
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
      const auto moved = write_back_of(in, slot, host.written_back(true), host.written_back(false),
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
template <typename T>
PinnedKfacState& Worker<T>::Impl::pinned_state(const Instruction& in) {
  const auto it = pinned_kfac.find({in.pipeline, in.layer, in.linear});
  if (it == pinned_kfac.end()) {
    throw std::runtime_error("offload copy for a Linear this worker does not offload");
  }
  return it->second;
}

template <typename T>
void Worker<T>::Impl::mark_prefetched(KfacSlot& slot) {
  if (!slot.prefetched) slot.prefetched = backend().create_event();
  slot.prefetched->record(*copy_stream);
}

// The compute stream waits for the Linear's outstanding prefetch (before reading its
// matrices); nothing to wait for without one.
template <typename T>
void Worker<T>::Impl::await_prefetch(KfacSlot& slot) {
  if (!slot.prefetched) return;
  compute_stream->wait(*slot.prefetched);
  slot.prefetched.reset();
}

template <typename T>
void Worker<T>::Impl::offload_copy_on_device(const Instruction& in) {
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
template <typename T>
void Worker<T>::Impl::release_inverses(const Instruction& in) {
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

#define PF_INSTANTIATE(T)                                                               \
  template HostKfacState& Worker<T>::Impl::host_state(const Instruction&);              \
  template bool Worker<T>::Impl::moves_here(const Instruction&, const KfacSlot&) const; \
  template typename Worker<T>::Impl::WriteBack Worker<T>::Impl::write_back_of(          \
      const Instruction&, const KfacSlot&, bool, bool, bool, bool) const;               \
  template void Worker<T>::Impl::offload_copy(const Instruction&);                      \
  template PinnedKfacState& Worker<T>::Impl::pinned_state(const Instruction&);          \
  template void Worker<T>::Impl::mark_prefetched(KfacSlot&);                            \
  template void Worker<T>::Impl::await_prefetch(KfacSlot&);                             \
  template void Worker<T>::Impl::offload_copy_on_device(const Instruction&);            \
  template void Worker<T>::Impl::release_inverses(const Instruction&);
PF_INSTANTIATE(float)
PF_INSTANTIATE(double)
#undef PF_INSTANTIATE

}  // namespace pf::exec
