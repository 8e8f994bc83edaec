// Worker<T>::Impl's K-FAC setup and curvature: captures wanted, state placed, sums synced.
#include "runtime/executor/worker_impl.h"

#include "kfac/factors.h"

namespace pf::exec {

// --- K-FAC preparation: what to capture and how many curvature tasks a round holds.
template <typename T>
void Worker<T>::Impl::prepare_kfac() {
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
        device_kfac[key] = runtime->make_kfac_layer(
            compute_stream.get(), d_in, d_out,
            "layer " + std::to_string(key.layer) + " " + std::string(sched::to_string(key.linear)));
      }
      if (!find_param(linear_weight_name(key.layer, key.linear))) {
        throw std::invalid_argument("executor: worker " + std::to_string(self) +
                                    " has K-FAC work for layer " + std::to_string(key.layer) + " " +
                                    std::string(sched::to_string(key.linear)) +
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
template <typename T>
void Worker<T>::Impl::place_kfac_state() {
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
    if (wants_inverses != slot.broadcasts_inverses || wants_gradient != slot.broadcasts_gradient) {
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

// What this replica does not hold of each Linear under its placement, reset to what a run of
// this placement leaves there: no factor values (nor their counters and damping, since the
// owner's group alone finalizes and inverts) where it holds no factors, no inverses where it
// holds none. A rank's own records hold nothing more; state moved from another placement or
// layout (the Linears' owners' records, restore_checkpoint) does. The sums of a refresh in
// progress stay: every replica accumulates its own until the curvature sync.
template <typename T>
void Worker<T>::Impl::drop_unheld_kfac_state(int pipeline) {
  for (const auto& [key, slot] : kfac_slots) {
    if (key.pipeline != pipeline) continue;
    auto& layer = kfac_states.at(pipeline).at({key.layer, key.linear});
    for (auto* factor : {&layer.a, &layer.b}) {
      if (!slot.placement.holds_factors(replica)) {
        factor->value = Eigen::MatrixXf();
        factor->refreshes = 0;
        factor->damping = 0.0F;
        factor->inverted_refresh = 0;
        factor->cholesky_fallbacks = 0;
      }
      if (!slot.placement.holds_inverses(replica)) factor->inverse = Eigen::MatrixXf();
    }
  }
}

// --- K-FAC kinds (float models only; checked at construction).
template <typename T>
void Worker<T>::Impl::curvature(const Instruction& in) {
  if constexpr (std::is_same_v<T, float>) {
    const CaptureKey key{in.step, in.pipeline, in.microbatch, in.layer, in.linear};
    const bool is_a = in.kind == OpKind::kCurvatureA;
    auto& store_map = is_a ? captures : captures_b;
    auto it = store_map.find(key);
    if (it == store_map.end()) {
      throw std::runtime_error(std::string("no captured ") + (is_a ? "input" : "output gradient") +
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

template <typename T>
void Worker<T>::Impl::curvature_sync(const Instruction& in) {
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
template <typename T>
void Worker<T>::Impl::sync_sums(const Instruction& in, kfac::KfacLayerState& layer,
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
template <typename T>
void Worker<T>::Impl::sync_sums_on_device(const Instruction& in, const std::vector<int>& group) {
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

template <typename T>
void Worker<T>::Impl::begin_round() {
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

#define PF_INSTANTIATE(T)                                                                          \
  template void Worker<T>::Impl::prepare_kfac();                                                   \
  template void Worker<T>::Impl::place_kfac_state();                                               \
  template void Worker<T>::Impl::drop_unheld_kfac_state(int);                                      \
  template void Worker<T>::Impl::curvature(const Instruction&);                                    \
  template void Worker<T>::Impl::curvature_sync(const Instruction&);                               \
  template void Worker<T>::Impl::sync_sums(const Instruction&, kfac::KfacLayerState&,              \
                                           const std::vector<int>&);                               \
  template void Worker<T>::Impl::sync_sums_on_device(const Instruction&, const std::vector<int>&); \
  template void Worker<T>::Impl::begin_round();
PF_INSTANTIATE(float)
PF_INSTANTIATE(double)
#undef PF_INSTANTIATE

}  // namespace pf::exec
