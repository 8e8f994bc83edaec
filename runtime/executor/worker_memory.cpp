// Worker<T>::Impl's memory accounting: K-FAC bytes per Linear, K-FAC and stash peaks.
#include "runtime/executor/worker_impl.h"

#include <algorithm>

namespace pf::exec {

// Bytes the K-FAC state of one Linear holds now, from its allocated matrices: on the CPU the
// factors' sums, values and inverses, the inverses a refresh replaced and the sums a pipelined
// refresh set aside, the gradients a divided preconditioning keeps and inversion chains in
// progress; on a device the layer's device memory (DeviceKfacLayer::device_bytes) and the
// kept gradients. Host copies of an offloaded Linear are not the worker's memory: left out.
template <typename T>
std::int64_t Worker<T>::Impl::linear_kfac_bytes(const FactorKey& key) const {
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

template <typename T>
void Worker<T>::Impl::sample_kfac(const Instruction& in) {
  const FactorKey key{in.pipeline, in.layer, in.linear};
  if (!kfac_slots.contains(key)) return;
  auto& peak = kfac_peak[key];
  peak = std::max(peak, linear_kfac_bytes(key));
  kfac_peak_resident = std::max(kfac_peak_resident, kfac_resident_bytes());
}

// The worker's K-FAC memory now: every Linear's, and on a device the offload staging pool's
// free buffers, which stay allocated for the next copies (device memory all the same).
template <typename T>
std::int64_t Worker<T>::Impl::kfac_resident_bytes() const {
  std::int64_t bytes = staging ? static_cast<std::int64_t>(staging->free_bytes()) : 0;
  for (const auto& [key, slot] : kfac_slots) bytes += linear_kfac_bytes(key);
  return bytes;
}

// The chunks' live stash arenas now, plus `released` (an arena just given back).
template <typename T>
void Worker<T>::Impl::sample_stash(std::int64_t released) {
  if (executing_step < peak_stash_from) return;
  std::int64_t live = released;
  for (const auto& slot : slots) live += static_cast<std::int64_t>(slot.model->live_stash_bytes());
  peak_stash = std::max(peak_stash, live);
}

#define PF_INSTANTIATE(T)                                                           \
  template std::int64_t Worker<T>::Impl::linear_kfac_bytes(const FactorKey&) const; \
  template void Worker<T>::Impl::sample_kfac(const Instruction&);                   \
  template std::int64_t Worker<T>::Impl::kfac_resident_bytes() const;               \
  template void Worker<T>::Impl::sample_stash(std::int64_t);
PF_INSTANTIATE(float)
PF_INSTANTIATE(double)
#undef PF_INSTANTIATE

}  // namespace pf::exec
