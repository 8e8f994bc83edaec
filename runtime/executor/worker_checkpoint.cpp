// Worker<T>::Impl's K-FAC progress inside a round as checkpoint records, saved and restored.
#include "runtime/executor/worker_impl.h"

#include <bit>
#include <limits>

namespace pf::exec {

// --- K-FAC work in progress between two steps of a round (checkpoints).
template <typename T>
std::string Worker<T>::Impl::slot_name(std::string_view prefix, const FactorKey& key) {
  return std::string(prefix) + ".slot." + std::to_string(key.pipeline) + "." +
         std::to_string(key.layer) + "." + std::string(sched::to_string(key.linear));
}

template <typename T>
std::string Worker<T>::Impl::capture_name(std::string_view prefix, bool is_b,
                                          const CaptureKey& key) {
  return std::string(prefix) + ".capture." + (is_b ? "B." : "A.") + std::to_string(key.step) + "." +
         std::to_string(key.pipeline) + "." + std::to_string(key.microbatch) + "." +
         std::to_string(key.layer) + "." + std::to_string(static_cast<int>(key.linear));
}

template <typename T>
void Worker<T>::Impl::add_matrix(std::vector<ckpt::TensorRecord>& records, std::string name,
                                 const Eigen::MatrixXf& matrix) {
  if (matrix.size() == 0) return;
  const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> row_major = matrix;
  records.push_back(ckpt::make_f32_record(
      std::move(name), {row_major.rows(), row_major.cols()},
      std::span<const float>(row_major.data(), static_cast<std::size_t>(row_major.size()))));
}

// A device capture's values on the host (after the compute stream's work so far).
template <typename T>
std::vector<float> Worker<T>::Impl::download_capture(const tensor::Tensor& device) const {
  std::vector<float> host(static_cast<std::size_t>(device.numel()));
  runtime->backend().copy(host.data(), device.raw_data(), host.size() * sizeof(float),
                          tensor::CopyKind::kDeviceToHost, compute_stream.get());
  compute_stream->synchronize();
  return host;
}

// A capture restored onto the device: a pooled buffer, uploaded on the compute stream.
template <typename T>
tensor::Tensor Worker<T>::Impl::upload_capture(const std::vector<float>& values, std::int64_t rows,
                                               std::int64_t cols) {
  auto buffer = new_buffer(rows, cols, false);
  backend().copy(buffer.raw_data(), values.data(), values.size() * sizeof(float),
                 tensor::CopyKind::kHostToDevice, compute_stream.get());
  compute_stream->synchronize();  // `values` may go
  return buffer;
}

// The CPU path's extras of a Linear (what a device layer keeps itself).
template <typename T>
device::KfacLayerExtras Worker<T>::Impl::host_extras(const KfacSlot& slot) {
  device::KfacLayerExtras extras;
  extras.previous_a_inverse = slot.previous_a_inverse;
  extras.previous_b_inverse = slot.previous_b_inverse;
  extras.set_aside_a_sum = slot.previous_a_sum;
  extras.set_aside_b_sum = slot.previous_b_sum;
  extras.set_aside_a_microbatches = slot.previous_a_microbatches;
  extras.set_aside_b_microbatches = slot.previous_b_microbatches;
  if (slot.chain_a) {
    extras.chain_a_factor = slot.chain_a->factor();
    extras.chain_a_damping = slot.chain_a->damping();
    extras.chain_a_next_unit = slot.chain_a->next_unit();
  }
  if (slot.chain_b) {
    extras.chain_b_factor = slot.chain_b->factor();
    extras.chain_b_damping = slot.chain_b->damping();
    extras.chain_b_next_unit = slot.chain_b->next_unit();
  }
  return extras;
}

// On a device the inverses a refresh replaced and the set-aside sums live in the device
// layers (downloaded here); on the CPU in the slots.
template <typename T>
std::vector<ckpt::TensorRecord> Worker<T>::Impl::kfac_progress_records(
    std::string_view prefix) const {
  std::vector<ckpt::TensorRecord> records;
  for (const auto& [key, slot] : kfac_slots) {
    const auto base = slot_name(prefix, key);
    const std::int64_t counters[] = {slot.done_a, slot.done_b, slot.inverted_a ? 1 : 0,
                                     slot.inverted_b ? 1 : 0};
    records.push_back(ckpt::make_i64_record(base + ".counters", {4}, counters));
    const auto extras = runtime ? device_kfac.at(key)->extras_to_host() : host_extras(slot);
    // A divided inversion whose pieces straddle the checkpoint: its factor, damping and
    // progress, to rebuild it (the same records on the CPU and the device path).
    for (const bool a : {true, false}) {
      const int next_unit = a ? extras.chain_a_next_unit : extras.chain_b_next_unit;
      if (next_unit == 0) continue;
      const std::string name = base + (a ? ".A_chain" : ".B_chain");
      add_matrix(records, name + "_factor", a ? extras.chain_a_factor : extras.chain_b_factor);
      const std::int64_t progress[] = {
          next_unit,
          std::bit_cast<std::uint32_t>(a ? extras.chain_a_damping : extras.chain_b_damping)};
      records.push_back(ckpt::make_i64_record(name, {2}, progress));
    }
    add_matrix(records, base + ".A_prev_inv", extras.previous_a_inverse);
    add_matrix(records, base + ".B_prev_inv", extras.previous_b_inverse);
    if (extras.set_aside_a_microbatches != 0 || extras.set_aside_b_microbatches != 0) {
      // Pipelined refresh: the previous refresh's sums its wrapped inversion has yet to read.
      add_matrix(records, base + ".A_prev_sum", extras.set_aside_a_sum);
      add_matrix(records, base + ".B_prev_sum", extras.set_aside_b_sum);
      const std::int64_t counts[] = {extras.set_aside_a_microbatches,
                                     extras.set_aside_b_microbatches};
      records.push_back(ckpt::make_i64_record(base + ".prev_counts", {2}, counts));
    }
    if (slot.offloaded) add_offload_records(records, base, key);
  }
  for (const bool is_b : {false, true}) {
    for (const auto& [key, value] : is_b ? captures_b : captures) {
      const auto name = capture_name(prefix, is_b, key);
      std::vector<float> downloaded;
      if (!value.data) downloaded = download_capture(value.device);
      const std::vector<float>& data = value.data ? *value.data : downloaded;
      const std::int64_t cols = static_cast<std::int64_t>(data.size()) / value.rows;
      records.push_back(ckpt::make_f32_record(name, {value.rows, cols}, data));
      const std::int64_t sequences[] = {value.sequences};
      records.push_back(ckpt::make_i64_record(name + ".sequences", {1}, sequences));
    }
  }
  return records;
}

template <typename T>
void Worker<T>::Impl::load_kfac_progress(const ckpt::SafetensorsFile& file,
                                         std::string_view prefix) {
  auto restored_slots = kfac_slots;
  std::map<FactorKey, device::KfacLayerExtras> restored_extras;  // device path
  std::map<FactorKey, OffloadProgress> restored_offload;
  for (auto& [key, slot] : restored_slots) {
    const auto base = slot_name(prefix, key);
    const std::int64_t shape[] = {4};
    const auto counters = ckpt::read_i64(file, base + ".counters", shape);
    if (counters[0] < 0 || counters[0] > slot.expected_a || counters[1] < 0 ||
        counters[1] > slot.expected_b || counters[2] < 0 || counters[2] > 1 || counters[3] < 0 ||
        counters[3] > 1) {
      throw std::runtime_error("K-FAC progress '" + base +
                               ".counters' does not fit this schedule's refresh");
    }
    slot.done_a = static_cast<int>(counters[0]);
    slot.done_b = static_cast<int>(counters[1]);
    slot.inverted_a = counters[2] != 0;
    slot.inverted_b = counters[3] != 0;
    const auto& layer = kfac_states.at(key.pipeline).at({key.layer, key.linear});
    const auto read_matrix = [&](const std::string& name, std::int64_t dim) {
      if (file.tensors.count(name) == 0) return Eigen::MatrixXf();
      const std::int64_t matrix_shape[] = {dim, dim};
      const auto values = ckpt::read_f32(file, name, matrix_shape);
      return Eigen::MatrixXf(
          Eigen::Map<const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>(
              values.data(), dim, dim));
    };
    device::KfacLayerExtras extras;
    extras.previous_a_inverse = read_matrix(base + ".A_prev_inv", layer.d_in);
    extras.previous_b_inverse = read_matrix(base + ".B_prev_inv", layer.d_out);
    if (file.tensors.count(base + ".prev_counts") != 0) {
      const std::int64_t two[] = {2};
      const auto counts = ckpt::read_i64(file, base + ".prev_counts", two);
      if (counts[0] < 0 || counts[1] < 0) {
        throw std::runtime_error("K-FAC progress '" + base + ".prev_counts' is negative");
      }
      extras.set_aside_a_microbatches = counts[0];
      extras.set_aside_b_microbatches = counts[1];
      extras.set_aside_a_sum = read_matrix(base + ".A_prev_sum", layer.d_in);
      extras.set_aside_b_sum = read_matrix(base + ".B_prev_sum", layer.d_out);
    }
    for (const bool a : {true, false}) {
      const std::string name = base + (a ? ".A_chain" : ".B_chain");
      if (file.tensors.count(name) == 0) continue;
      const std::int64_t two[] = {2};
      const auto progress = ckpt::read_i64(file, name, two);
      if (progress[0] <= 0 || progress[0] >= kfac::kPieceUnits || progress[1] < 0 ||
          progress[1] > std::numeric_limits<std::uint32_t>::max()) {
        throw std::runtime_error("K-FAC progress '" + name + "' is not a chain in progress");
      }
      auto factor = read_matrix(name + "_factor", a ? layer.d_in : layer.d_out);
      if (factor.size() == 0 || !factor.allFinite()) {
        throw std::runtime_error("K-FAC progress '" + name + "_factor' is " +
                                 (factor.size() == 0 ? "missing" : "not finite"));
      }
      (a ? extras.chain_a_factor : extras.chain_b_factor) = std::move(factor);
      (a ? extras.chain_a_damping : extras.chain_b_damping) =
          std::bit_cast<float>(static_cast<std::uint32_t>(progress[1]));
      (a ? extras.chain_a_next_unit : extras.chain_b_next_unit) = static_cast<int>(progress[0]);
    }
    try {
      device::check_extras(extras, layer.d_in, layer.d_out, base);
    } catch (const std::invalid_argument& error) {
      throw std::runtime_error(error.what());
    }
    if (slot.offloaded) restored_offload[key] = read_offload_records(file, base, key, slot);
    if (runtime) {
      restored_extras[key] = std::move(extras);
      continue;
    }
    for (const bool a : {true, false}) {
      auto& chain = a ? slot.chain_a : slot.chain_b;
      chain.reset();
      const int next_unit = a ? extras.chain_a_next_unit : extras.chain_b_next_unit;
      if (next_unit == 0) continue;
      try {
        chain = std::make_shared<kfac::InverseChain>(
            a ? extras.chain_a_factor : extras.chain_b_factor,
            a ? extras.chain_a_damping : extras.chain_b_damping);
        chain->run(0, next_unit);
      } catch (const std::exception& error) {
        throw std::runtime_error(std::string("K-FAC progress '") + base +
                                 (a ? ".A_chain" : ".B_chain") + "': " + error.what());
      }
    }
    slot.previous_a_inverse = std::move(extras.previous_a_inverse);
    slot.previous_b_inverse = std::move(extras.previous_b_inverse);
    slot.previous_a_sum = std::move(extras.set_aside_a_sum);
    slot.previous_b_sum = std::move(extras.set_aside_b_sum);
    slot.previous_a_microbatches = extras.set_aside_a_microbatches;
    slot.previous_b_microbatches = extras.set_aside_b_microbatches;
  }
  std::map<CaptureKey, Captured> restored_a, restored_b;
  for (const bool is_b : {false, true}) {
    for (const auto& key : is_b ? wanted_b : wanted_a) {
      const auto name = capture_name(prefix, is_b, key);
      auto it = file.tensors.find(name);
      if (it == file.tensors.end()) continue;
      const auto& shape = it->second.shape;
      if (shape.size() != 2 || shape[0] < 1) {
        throw std::runtime_error("K-FAC progress '" + name + "' is not a [rows, columns] matrix");
      }
      const auto& layer = kfac_states.at(key.pipeline).at({key.layer, key.linear});
      const std::int64_t width = is_b ? layer.d_out : layer.d_in;
      if (shape[1] != width) {
        throw std::runtime_error("K-FAC progress '" + name + "' has " + std::to_string(shape[1]) +
                                 " columns, the layer's " +
                                 (is_b ? "output gradients have " : "inputs have ") +
                                 std::to_string(width));
      }
      Captured captured;
      captured.rows = shape[0];
      auto values = ckpt::read_f32(file, name, shape);
      if (runtime) {
        captured.device = upload_capture(values, shape[0], shape[1]);
      } else {
        captured.data = std::make_shared<std::vector<float>>(std::move(values));
      }
      const std::int64_t one[] = {1};
      captured.sequences = ckpt::read_i64(file, name + ".sequences", one).at(0);
      (is_b ? restored_b : restored_a)[key] = std::move(captured);
    }
  }
  for (auto& [key, extras] : restored_extras) device_kfac.at(key)->load_extras(extras);
  for (const auto& [key, progress] : restored_offload) apply_offload_progress(key, progress);
  kfac_slots = std::move(restored_slots);
  captures = std::move(restored_a);
  captures_b = std::move(restored_b);
  recount_captures();
}

#define PF_INSTANTIATE(T)                                                                          \
  template std::string Worker<T>::Impl::slot_name(std::string_view, const FactorKey&);             \
  template std::string Worker<T>::Impl::capture_name(std::string_view, bool, const CaptureKey&);   \
  template void Worker<T>::Impl::add_matrix(std::vector<ckpt::TensorRecord>&, std::string,         \
                                            const Eigen::MatrixXf&);                               \
  template std::vector<float> Worker<T>::Impl::download_capture(const tensor::Tensor&) const;      \
  template tensor::Tensor Worker<T>::Impl::upload_capture(const std::vector<float>&, std::int64_t, \
                                                          std::int64_t);                           \
  template device::KfacLayerExtras Worker<T>::Impl::host_extras(const KfacSlot&);                  \
  template std::vector<ckpt::TensorRecord> Worker<T>::Impl::kfac_progress_records(                 \
      std::string_view) const;                                                                     \
  template void Worker<T>::Impl::load_kfac_progress(const ckpt::SafetensorsFile&, std::string_view);
PF_INSTANTIATE(float)
PF_INSTANTIATE(double)
#undef PF_INSTANTIATE

}  // namespace pf::exec
