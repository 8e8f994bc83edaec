#include "runtime/optim/cuda/fused_optimizers.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <stdexcept>

#include "kernels/cuda/cuda_check.h"
#include "runtime/optim/cuda/fused_kernels.h"

namespace pf::optim::cuda {

MultiTensorTable::MultiTensorTable(kernels::cuda::CudaBackend& backend, cudaStream_t stream,
                                   int state_buffers)
    : backend_(&backend), stream_(stream), state_buffers_(state_buffers) {}

MultiTensorTable::~MultiTensorTable() {
  if (tensors_ == nullptr) return;
  cudaStreamSynchronize(stream_);
  backend_->deallocate(tensors_, tensors_bytes_);
  backend_->deallocate(chunks_, chunks_bytes_);
  for (float* buffer : state_) {
    backend_->deallocate(buffer, static_cast<std::size_t>(total_) * sizeof(float));
  }
}

void MultiTensorTable::bind(std::span<const ParamView> params, const char* optimizer) {
  if (tensors_ != nullptr) {
    bool same = params.size() == names_.size();
    for (std::size_t i = 0; same && i < params.size(); ++i) {
      if (params[i].name != names_[i] || params[i].size != sizes_[i] ||
          params[i].value != values_[i]) {
        throw std::invalid_argument(std::string(optimizer) + ": parameter '" + params[i].name +
                                    "' (position " + std::to_string(i) +
                                    ") differs from the list of the first step");
      }
    }
    if (!same) {
      throw std::invalid_argument(std::string(optimizer) + ": " + std::to_string(params.size()) +
                                  " parameters, the first step had " +
                                  std::to_string(names_.size()));
    }
    return;
  }
  validate_params(params);
  for (const auto& p : params) {
    names_.push_back(p.name);
    sizes_.push_back(p.size);
    offsets_.push_back(static_cast<std::size_t>(total_));
    shapes_.push_back(p.shape);
    values_.push_back(p.value);
    total_ += static_cast<std::int64_t>(p.size);
  }
  for (int b = 0; b < state_buffers_; ++b) {
    auto* buffer =
        static_cast<float*>(backend_->allocate(static_cast<std::size_t>(total_) * sizeof(float)));
    backend_->fill_zero(buffer, static_cast<std::size_t>(total_) * sizeof(float));
    state_.push_back(buffer);
  }
  std::vector<TensorEntry> entries;
  std::vector<Chunk> chunks;
  std::int64_t offset = 0;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const auto size = static_cast<std::int64_t>(params[i].size);
    entries.push_back({params[i].value, params[i].grad,
                       state_buffers_ > 0 ? state_[0] + offset : nullptr,
                       state_buffers_ > 1 ? state_[1] + offset : nullptr, size,
                       params[i].no_weight_decay ? 1 : 0});
    for (std::int64_t begin = 0; begin < size; begin += kChunkElements) {
      chunks.push_back({static_cast<int>(i), begin, std::min(size, begin + kChunkElements)});
    }
    offset += size;
  }
  tensors_bytes_ = std::max<std::size_t>(1, entries.size() * sizeof(TensorEntry));
  chunks_bytes_ = std::max<std::size_t>(1, chunks.size() * sizeof(Chunk));
  tensors_ = backend_->allocate(tensors_bytes_);
  chunks_ = backend_->allocate(chunks_bytes_);
  CUDA_CHECK(cudaMemcpyAsync(tensors_, entries.data(), entries.size() * sizeof(TensorEntry),
                             cudaMemcpyHostToDevice, stream_));
  CUDA_CHECK(cudaMemcpyAsync(chunks_, chunks.data(), chunks.size() * sizeof(Chunk),
                             cudaMemcpyHostToDevice, stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));  // the host vectors go out of scope
  chunk_count_ = static_cast<std::int64_t>(chunks.size());
}

std::int64_t MultiTensorTable::state_bytes(std::string_view param) const {
  for (std::size_t i = 0; i < names_.size(); ++i) {
    if (names_[i] == param) {
      return static_cast<std::int64_t>(state_.size() * sizes_[i] * sizeof(float));
    }
  }
  return 0;
}

std::vector<float> MultiTensorTable::read_state(int buffer, std::size_t index) const {
  std::vector<float> values(sizes_.at(index));
  CUDA_CHECK(cudaMemcpyAsync(values.data(),
                             state_.at(static_cast<std::size_t>(buffer)) + offsets_[index],
                             values.size() * sizeof(float), cudaMemcpyDeviceToHost, stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  return values;
}

void MultiTensorTable::write_state(int buffer, std::size_t index, std::span<const float> values) {
  if (values.size() != sizes_.at(index)) {
    throw std::invalid_argument("optimizer state of '" + names_[index] +
                                "': " + std::to_string(values.size()) + " values for a tensor of " +
                                std::to_string(sizes_[index]));
  }
  CUDA_CHECK(cudaMemcpyAsync(state_.at(static_cast<std::size_t>(buffer)) + offsets_[index],
                             values.data(), values.size() * sizeof(float), cudaMemcpyHostToDevice,
                             stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
}

namespace {

// AdamW's and LAMB's moments (state buffers 0 and 1) as the CPU optimizers' records.
std::vector<ckpt::TensorRecord> adam_records(const MultiTensorTable& table, std::string_view prefix,
                                             std::int64_t steps) {
  AdamMomentsMap<float> moments;
  if (steps > 0 && table.bound()) {
    for (std::size_t i = 0; i < static_cast<std::size_t>(table.tensor_count()); ++i) {
      moments[table.name(i)] =
          AdamMoments<float>{table.read_state(0, i), table.read_state(1, i), table.shape(i)};
    }
  }
  return adam_moment_records(prefix, steps, moments);
}

// Reads and checks every record first (nothing changes when one is missing or mis-shaped), then
// binds the list and uploads the moments (zeros when the checkpoint has taken no step).
std::int64_t load_adam(MultiTensorTable& table, const ckpt::SafetensorsFile& file,
                       std::span<const ParamView> params, std::string_view prefix,
                       const char* optimizer) {
  validate_params(params);
  std::int64_t steps = 0;
  const auto moments = read_adam_moments<float>(file, params, prefix, steps);
  table.bind(params, optimizer);
  for (std::size_t i = 0; i < params.size(); ++i) {
    const auto found = moments.find(params[i].name);
    if (found != moments.end()) {
      table.write_state(0, i, found->second.exp_avg);
      table.write_state(1, i, found->second.exp_avg_sq);
    } else {
      const std::vector<float> zeros(params[i].size, 0.0F);
      table.write_state(0, i, zeros);
      table.write_state(1, i, zeros);
    }
  }
  return steps;
}

const TensorEntry* entries(const MultiTensorTable& table) {
  return static_cast<const TensorEntry*>(table.tensors());
}
const Chunk* chunk_list(const MultiTensorTable& table) {
  return static_cast<const Chunk*>(table.chunks());
}

}  // namespace

CudaAdamW::CudaAdamW(kernels::cuda::CudaBackend& backend, tensor::Stream* stream,
                     AdamWOptions options)
    : options_(options), stream_(kernels::cuda::stream_of(stream)), table_(backend, stream_, 2) {
  if (!(options.beta1 >= 0 && options.beta1 < 1) || !(options.beta2 >= 0 && options.beta2 < 1) ||
      !(options.eps > 0) || !(options.weight_decay >= 0)) {
    throw std::invalid_argument("AdamW: betas must lie in [0, 1), eps > 0, weight_decay >= 0");
  }
}

std::vector<ckpt::TensorRecord> CudaAdamW::state_records(std::string_view prefix) const {
  return adam_records(table_, prefix, steps_);
}

void CudaAdamW::load_state(const ckpt::SafetensorsFile& file, std::span<const View> params,
                           std::string_view prefix) {
  steps_ = load_adam(table_, file, params, prefix, "AdamW");
}

void CudaAdamW::apply_step(std::span<const View> params, float learning_rate,
                           std::optional<double> /*global_norm: AdamW does not clip*/) {
  table_.bind(params, "AdamW");
  ++steps_;
  const double t = static_cast<double>(steps_);
  const auto beta1 = static_cast<float>(options_.beta1);
  const auto beta2 = static_cast<float>(options_.beta2);
  // The CPU's scalars, rounded to float the same way.
  const AdamWScalars scalars{
      beta1,
      beta2,
      static_cast<float>(options_.eps),
      static_cast<float>(static_cast<double>(learning_rate) /
                         (1.0 - std::pow(static_cast<double>(beta1), t))),
      static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(static_cast<double>(beta2), t))),
      1.0F - learning_rate * static_cast<float>(options_.weight_decay)};
  adamw_step(entries(table_), chunk_list(table_), table_.chunk_count(), scalars, stream_);
}

CudaSgd::CudaSgd(kernels::cuda::CudaBackend& backend, tensor::Stream* stream, SgdOptions options)
    : options_(options), stream_(kernels::cuda::stream_of(stream)), table_(backend, stream_, 1) {
  if (!(options.momentum >= 0) || !(options.weight_decay >= 0) ||
      (options.nesterov && (options.momentum <= 0 || options.dampening != 0))) {
    throw std::invalid_argument(
        "SGD: momentum and weight_decay must be >= 0; Nesterov needs momentum > 0 and no "
        "dampening");
  }
}

std::vector<ckpt::TensorRecord> CudaSgd::state_records(std::string_view prefix) const {
  std::vector<ckpt::TensorRecord> records{step_record(prefix, steps_)};
  if (steps_ == 0 || options_.momentum == 0 || !table_.bound()) return records;
  std::map<std::string, std::size_t, std::less<>> by_name;  // the CPU's order
  for (std::size_t i = 0; i < static_cast<std::size_t>(table_.tensor_count()); ++i) {
    by_name.emplace(table_.name(i), i);
  }
  for (const auto& [name, i] : by_name) {
    const auto values = table_.read_state(0, i);
    records.push_back(state_buffer_record<float>(prefix, name, "momentum_buffer", table_.shape(i),
                                                 std::span<const float>(values)));
  }
  return records;
}

void CudaSgd::load_state(const ckpt::SafetensorsFile& file, std::span<const View> params,
                         std::string_view prefix) {
  validate_params(params);
  const auto steps = read_step(file, prefix);
  std::vector<std::vector<float>> buffers;
  if (steps > 0 && options_.momentum != 0) {
    for (const auto& param : params) {
      buffers.push_back(read_state_buffer(file, prefix, param, "momentum_buffer"));
    }
  }
  table_.bind(params, "SGD");
  for (std::size_t i = 0; i < params.size(); ++i) {
    table_.write_state(0, i,
                       buffers.empty() ? std::vector<float>(params[i].size, 0.0F) : buffers[i]);
  }
  steps_ = steps;
}

void CudaSgd::apply_step(std::span<const View> params, float learning_rate,
                         std::optional<double> /*global_norm: SGD does not clip*/) {
  table_.bind(params, "SGD");
  const bool first = steps_ == 0;
  ++steps_;
  const auto momentum = static_cast<float>(options_.momentum);
  // torch starts the buffer at the first gradient itself (no dampening on that step).
  const SgdScalars scalars{learning_rate,
                           momentum,
                           first ? 0.0F : momentum,
                           first ? 1.0F : 1.0F - static_cast<float>(options_.dampening),
                           static_cast<float>(options_.weight_decay),
                           options_.nesterov};
  sgd_step(entries(table_), chunk_list(table_), table_.chunk_count(), scalars, stream_);
}

CudaLamb::CudaLamb(kernels::cuda::CudaBackend& backend, tensor::Stream* stream, LambOptions options)
    : options_(options),
      stream_(kernels::cuda::stream_of(stream)),
      table_(backend, stream_, 2),
      sums_(backend, stream_) {
  if (!(options.beta1 >= 0 && options.beta1 < 1) || !(options.beta2 >= 0 && options.beta2 < 1) ||
      !(options.eps > 0) || !(options.weight_decay >= 0)) {
    throw std::invalid_argument("LAMB: betas must lie in [0, 1), eps > 0, weight_decay >= 0");
  }
}

std::vector<ckpt::TensorRecord> CudaLamb::state_records(std::string_view prefix) const {
  return adam_records(table_, prefix, steps_);
}

void CudaLamb::load_state(const ckpt::SafetensorsFile& file, std::span<const View> params,
                          std::string_view prefix) {
  steps_ = load_adam(table_, file, params, prefix, "LAMB");
  if (no_weight_decay_.empty()) {
    for (const auto& p : params) no_weight_decay_.push_back(p.no_weight_decay);
  }
}

void CudaLamb::apply_step(std::span<const View> params, float learning_rate,
                          std::optional<double> global_grad_norm) {
  // BasicOptimizer::step has validated the list and refused a negative norm.
  table_.bind(params, "LAMB");
  if (no_weight_decay_.empty()) {
    for (const auto& p : params) no_weight_decay_.push_back(p.no_weight_decay);
  }
  const auto tensors = table_.tensor_count();
  // [0, 2 tensors): per-tensor sums; [2 tensors]: the gradient square sum; then the chunks'
  // partial sums (2 per chunk), added in order by the kernels.
  const auto chunks = table_.chunk_count();
  auto* sums = static_cast<double*>(
      sums_.ensure(static_cast<std::size_t>(2 * tensors + 1 + 2 * chunks) * sizeof(double)));
  double* chunk_partials = sums + 2 * tensors + 1;
  CUDA_CHECK(cudaMemsetAsync(sums, 0, static_cast<std::size_t>(2 * tensors + 1) * sizeof(double),
                             stream_));
  double grad_norm = 0.0;
  if (global_grad_norm.has_value()) {
    grad_norm = *global_grad_norm;
  } else {
    cuda::grad_square_sum(entries(table_), chunk_list(table_), chunks, sums + 2 * tensors,
                          chunk_partials, stream_);
    double square_sum = 0.0;
    CUDA_CHECK(cudaMemcpyAsync(&square_sum, sums + 2 * tensors, sizeof(double),
                               cudaMemcpyDeviceToHost, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    grad_norm = std::sqrt(square_sum);
  }
  last_grad_norm_ = grad_norm;
  if (!std::isfinite(grad_norm)) {
    throw std::runtime_error("LAMB: the global gradient norm is not finite (" +
                             std::to_string(grad_norm) + "); refusing to update");
  }
  const double max_norm = static_cast<double>(static_cast<float>(options_.max_grad_norm));
  const double clip = max_norm > 0 && grad_norm > max_norm ? grad_norm / max_norm : 1.0;
  ++steps_;
  const double t = static_cast<double>(steps_);
  const auto beta1 = static_cast<float>(options_.beta1);
  const auto beta2 = static_cast<float>(options_.beta2);
  const LambScalars scalars{beta1,
                            beta2,
                            static_cast<float>(options_.eps),
                            static_cast<float>(1.0 / (1.0 - std::pow(double{beta1}, t))),
                            static_cast<float>(1.0 / (1.0 - std::pow(double{beta2}, t))),
                            static_cast<float>(1.0 / clip),
                            static_cast<float>(options_.weight_decay),
                            static_cast<double>(learning_rate),
                            options_.trust_ratio_without_decay};
  lamb_moments(entries(table_), chunk_list(table_), chunks, scalars, sums, chunk_partials, stream_);
  sums_valid_ = true;
  lamb_apply(entries(table_), chunk_list(table_), table_.chunk_count(), scalars, sums, stream_);
}

std::vector<double> CudaLamb::last_trust_ratios() const {
  const auto tensors = table_.tensor_count();
  std::vector<double> sums(static_cast<std::size_t>(2 * tensors));
  if (tensors == 0 || !sums_valid_)
    return std::vector<double>(static_cast<std::size_t>(tensors), 1);
  auto& scratch = const_cast<kernels::cuda::DeviceScratch&>(sums_);
  CUDA_CHECK(cudaMemcpyAsync(sums.data(), scratch.ensure(sums.size() * sizeof(double)),
                             sums.size() * sizeof(double), cudaMemcpyDeviceToHost, stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  std::vector<double> ratios;
  for (std::int64_t i = 0; i < tensors; ++i) {
    const double p = sums[static_cast<std::size_t>(2 * i)];
    const double u = sums[static_cast<std::size_t>(2 * i + 1)];
    const bool decays =
        !no_weight_decay_[static_cast<std::size_t>(i)] && options_.weight_decay != 0.0;
    const bool applies = decays || options_.trust_ratio_without_decay;
    ratios.push_back(applies && p > 0 && u > 0 ? std::sqrt(p) / std::sqrt(u) : 1.0);
  }
  return ratios;
}

}  // namespace pf::optim::cuda
