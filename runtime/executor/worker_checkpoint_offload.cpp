// Worker<T>::Impl's checkpoint records of offloaded K-FAC state, saved and restored.
#include "runtime/executor/worker_impl.h"

namespace pf::exec {

// --- Checkpoints of offloaded K-FAC state (docs/offload.md, "Checkpoints").
// The matrices the live state (the device layer on a device) holds for a Linear.
template <typename T>
kfac::KfacLayerState Worker<T>::Impl::live_layer(const FactorKey& key) const {
  if (runtime) return device_kfac.at(key)->to_host();
  return kfac_states.at(key.pipeline).at({key.layer, key.linear});
}

template <typename T>
OffloadedFactor Worker<T>::Impl::host_factor(const FactorKey& key, bool a) const {
  const auto [d_in, d_out] = dims_of(key);
  if (runtime) return pinned_kfac.at(key).to_host(offload_streams(), a, a ? d_in : d_out);
  return host_kfac.at(key).to_host(a, a ? d_in : d_out);
}

template <typename T>
bool Worker<T>::Impl::host_written(const FactorKey& key, bool a) const {
  return runtime ? pinned_kfac.at(key).written_back(a) : host_kfac.at(key).written_back(a);
}

// A pipeline's K-FAC state as a run without offload holds it: each offloaded Linear's value
// and newest inverse from host memory where the live state has none (a live inverse is the
// newest: a new one not yet written back, or a prefetched copy of the host's).
template <typename T>
kfac::KfacState Worker<T>::Impl::with_offloaded(int pipeline, kfac::KfacState state) const {
  for (const auto& [key, slot] : kfac_slots) {
    if (!slot.offloaded || key.pipeline != pipeline) continue;
    auto& layer = state.at({key.layer, key.linear});
    for (const bool a : {true, false}) {
      auto& factor = a ? layer.a : layer.b;
      if (factor.value.size() != 0 && factor.inverse.size() != 0) continue;
      auto host = host_factor(key, a);
      if (factor.value.size() == 0) factor.value = std::move(host.value);
      if (factor.inverse.size() == 0) factor.inverse = std::move(host.inverse);
    }
  }
  return state;
}

// Where an offloaded Linear's state is between two steps, exactly: "<base>.offload" (I64 [6]:
// written back A, B; value A, B on the device; inverse A, B on the device), the host copies
// "<base>.offload.{A,B}_{value,inv,prev_inv}" and the live matrices
// "<base>.offload.{A,B}_live_{value,inv}" (those present). The live inverses an inversion
// replaced are the slot's "<base>.{A,B}_prev_inv" (the extras).
template <typename T>
void Worker<T>::Impl::add_offload_records(std::vector<ckpt::TensorRecord>& records,
                                          const std::string& base, const FactorKey& key) const {
  const auto live = live_layer(key);
  const std::int64_t flags[] = {
      host_written(key, true) ? 1 : 0,    host_written(key, false) ? 1 : 0,
      live.a.value.size() != 0 ? 1 : 0,   live.b.value.size() != 0 ? 1 : 0,
      live.a.inverse.size() != 0 ? 1 : 0, live.b.inverse.size() != 0 ? 1 : 0};
  records.push_back(ckpt::make_i64_record(base + ".offload", {6}, flags));
  for (const bool a : {true, false}) {
    const std::string factor = base + ".offload." + (a ? "A" : "B");
    const auto host = host_factor(key, a);
    add_matrix(records, factor + "_value", host.value);
    add_matrix(records, factor + "_inv", host.inverse);
    add_matrix(records, factor + "_prev_inv", host.previous_inverse);
    const auto& live_factor = a ? live.a : live.b;
    add_matrix(records, factor + "_live_value", live_factor.value);
    add_matrix(records, factor + "_live_inv", live_factor.inverse);
  }
}

template <typename T>
Eigen::MatrixXf Worker<T>::Impl::read_square(const ckpt::SafetensorsFile& file,
                                             const std::string& name, std::int64_t dim) {
  const std::int64_t shape[] = {dim, dim};
  const auto values = ckpt::read_f32(file, name, shape);
  return Eigen::Map<const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>(
      values.data(), dim, dim);
}

// Reads and checks what add_offload_records wrote; throws std::runtime_error naming the record.
template <typename T>
typename Worker<T>::Impl::OffloadProgress Worker<T>::Impl::read_offload_records(
    const ckpt::SafetensorsFile& file, const std::string& base, const FactorKey& key,
    const KfacSlot& slot) const {
  const std::string flags_name = base + ".offload";
  if (file.tensors.count(flags_name) == 0) {
    throw std::runtime_error("K-FAC progress '" + flags_name +
                             "' is missing: this run offloads the Linear to host memory "
                             "(--kfac-offload) and the checkpoint holds no record of where "
                             "its state was");
  }
  const std::int64_t six[] = {6};
  const auto flags = ckpt::read_i64(file, flags_name, six);
  for (const std::int64_t flag : flags) {
    if (flag != 0 && flag != 1) {
      throw std::runtime_error("K-FAC progress '" + flags_name + "' holds " + std::to_string(flag) +
                               " where a flag (0 or 1) belongs");
    }
  }
  const auto [d_in, d_out] = dims_of(key);
  OffloadProgress progress;
  for (const bool a : {true, false}) {
    const int f = a ? 0 : 1;
    const std::int64_t d = a ? d_in : d_out;
    const std::string factor = base + ".offload." + (a ? "A" : "B");
    const auto optional = [&](const std::string& name) {
      return file.tensors.count(name) != 0 ? read_square(file, name, d) : Eigen::MatrixXf();
    };
    progress.written[f] = flags[static_cast<std::size_t>(f)] != 0;
    progress.host[f] = {optional(factor + "_value"), optional(factor + "_inv"),
                        optional(factor + "_prev_inv")};
    // A live matrix flagged present must be there (read_f32 names it otherwise).
    if (flags[static_cast<std::size_t>(2 + f)] != 0) {
      progress.live_value[f] = read_square(file, factor + "_live_value", d);
    }
    if (flags[static_cast<std::size_t>(4 + f)] != 0) {
      progress.live_inverse[f] = read_square(file, factor + "_live_inv", d);
    }
    const bool inverted = a ? slot.inverted_a : slot.inverted_b;
    if (inverted && !progress.written[f] && progress.live_inverse[f].size() == 0) {
      throw std::runtime_error("K-FAC progress '" + flags_name + "': factor " + (a ? "A" : "B") +
                               "'s new inverse is neither written back nor on the device");
    }
  }
  return progress;
}

template <typename T>
void Worker<T>::Impl::apply_offload_progress(const FactorKey& key,
                                             const OffloadProgress& progress) {
  using Matrix = device::DeviceKfacLayer::Matrix;
  const auto [d_in, d_out] = dims_of(key);
  for (const bool a : {true, false}) {
    const int f = a ? 0 : 1;
    const std::int64_t d = a ? d_in : d_out;
    if (!runtime) {
      host_kfac.at(key).load(a, d, progress.host[f], progress.written[f]);
      auto& factor = a ? kfac_layer_of(key).a : kfac_layer_of(key).b;
      factor.value = progress.live_value[f];
      factor.inverse = progress.live_inverse[f];
      continue;
    }
    pinned_kfac.at(key).load(offload_streams(), a, d, progress.host[f], progress.written[f]);
    auto& layer = *device_kfac.at(key);
    for (const bool inverse : {false, true}) {
      const auto& live = inverse ? progress.live_inverse[f] : progress.live_value[f];
      const Matrix which = inverse ? Matrix::kInverse : Matrix::kValue;
      if (live.size() == 0) {
        (void)layer.detach(a, which);  // between runs: nothing reads it
        continue;
      }
      auto buffer = tensor::Tensor::empty(backend(), {d, d}, tensor::DType::kF32);
      backend().copy(buffer.raw_data(), live.data(), buffer.nbytes(),
                     tensor::CopyKind::kHostToDevice, compute_stream.get());
      compute_stream->synchronize();  // `live` may go
      (void)layer.attach(a, which, std::move(buffer));
    }
  }
}

// After a pipeline's K-FAC state was loaded (whole, as a run without offload holds it): each
// offloaded Linear's value and inverse move to host memory, as between two refreshes (what a
// checkpoint taken inside a refresh changes, its progress records restore).
template <typename T>
void Worker<T>::Impl::offload_loaded_state(int pipeline) {
  using Matrix = device::DeviceKfacLayer::Matrix;
  for (const auto& [key, slot] : kfac_slots) {
    if (!slot.offloaded || key.pipeline != pipeline) continue;
    auto& layer = kfac_layer_of(key);  // on a device: the host copy the layer was loaded from
    // Factors only: the value moves, the inverse stays on the device.
    const bool inverse_moves = !slot.factors_only;
    for (const bool a : {true, false}) {
      auto& factor = a ? layer.a : layer.b;
      const OffloadedFactor host{
          factor.value, inverse_moves ? factor.inverse : Eigen::MatrixXf(), {}};
      const std::int64_t d = a ? layer.d_in : layer.d_out;
      if (runtime) {
        pinned_kfac.at(key).load(offload_streams(), a, d, host, false);
        (void)device_kfac.at(key)->detach(a, Matrix::kValue);
        if (inverse_moves) (void)device_kfac.at(key)->detach(a, Matrix::kInverse);
      } else {
        host_kfac.at(key).load(a, d, host, false);
        factor.value = Eigen::MatrixXf();
        if (inverse_moves) factor.inverse = Eigen::MatrixXf();
      }
    }
  }
}

#define PF_INSTANTIATE(T)                                                                          \
  template kfac::KfacLayerState Worker<T>::Impl::live_layer(const FactorKey&) const;               \
  template OffloadedFactor Worker<T>::Impl::host_factor(const FactorKey&, bool) const;             \
  template bool Worker<T>::Impl::host_written(const FactorKey&, bool) const;                       \
  template kfac::KfacState Worker<T>::Impl::with_offloaded(int, kfac::KfacState) const;            \
  template void Worker<T>::Impl::add_offload_records(std::vector<ckpt::TensorRecord>&,             \
                                                     const std::string&, const FactorKey&) const;  \
  template Eigen::MatrixXf Worker<T>::Impl::read_square(const ckpt::SafetensorsFile&,              \
                                                        const std::string&, std::int64_t);         \
  template typename Worker<T>::Impl::OffloadProgress Worker<T>::Impl::read_offload_records(        \
      const ckpt::SafetensorsFile&, const std::string&, const FactorKey&, const KfacSlot&) const;  \
  template void Worker<T>::Impl::apply_offload_progress(const FactorKey&, const OffloadProgress&); \
  template void Worker<T>::Impl::offload_loaded_state(int);
PF_INSTANTIATE(float)
PF_INSTANTIATE(double)
#undef PF_INSTANTIATE

}  // namespace pf::exec
