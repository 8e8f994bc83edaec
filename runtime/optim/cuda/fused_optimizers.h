#pragma once
// AdamW, LAMB and momentum SGD on a GPU as fused multi-tensor kernels (one launch updates every
// tensor of the list, as apex's multi_tensor_apply): the same arithmetic as runtime/optim's CPU
// optimizers, on ParamViews whose value and grad point to device memory. They are
// optim::Optimizers, so the trainer and the executor hold them as they hold the CPU ones, and
// their checkpoint records are the CPU optimizers' (same names, shapes and dtype: a run may
// resume on the other device). The first step (or load_state) fixes the parameter list (names,
// sizes, order) and allocates the state on the device; later steps must pass the same list.
// All work runs on one stream; LAMB waits for it once per step (the global gradient norm
// decides the clipping, and a non-finite norm must stop the step); state_records waits too.
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/cuda/cuda_ops.h"
#include "runtime/optim/adamw.h"
#include "runtime/optim/lamb.h"
#include "runtime/optim/optimizer.h"
#include "runtime/optim/param_view.h"
#include "runtime/optim/sgd.h"
#include "runtime/optim/state_io.h"

namespace pf::optim::cuda {

// The device-side table of a parameter list: per-tensor pointers and state, and the chunks the
// kernels' blocks take.
class MultiTensorTable {
 public:
  MultiTensorTable(kernels::cuda::CudaBackend& backend, cudaStream_t stream, int state_buffers);
  ~MultiTensorTable();
  MultiTensorTable(const MultiTensorTable&) = delete;
  MultiTensorTable& operator=(const MultiTensorTable&) = delete;

  // Builds the table on the first call; afterwards checks that `params` is the same list
  // (throws std::invalid_argument naming the first parameter that differs).
  void bind(std::span<const ParamView> params, const char* optimizer);
  bool bound() const { return tensors_ != nullptr; }
  // State buffer `buffer` of tensor `index` (of the bound list): downloaded (waits for the
  // stream), or uploaded from `values` (which must hold the tensor's size).
  std::vector<float> read_state(int buffer, std::size_t index) const;
  void write_state(int buffer, std::size_t index, std::span<const float> values);
  const std::string& name(std::size_t index) const { return names_[index]; }
  const std::vector<std::int64_t>& shape(std::size_t index) const { return shapes_[index]; }
  const void* tensors() const { return tensors_; }
  const void* chunks() const { return chunks_; }
  std::int64_t chunk_count() const { return chunk_count_; }
  std::int64_t tensor_count() const { return static_cast<std::int64_t>(names_.size()); }
  float* state(int buffer) const { return state_[static_cast<std::size_t>(buffer)]; }
  std::int64_t total_size() const { return total_; }
  // Bytes the state buffers hold for the tensor named `param` (every buffer allocated, whether
  // or not the algorithm reads it); 0 before the first step binds the list or for another name.
  std::int64_t state_bytes(std::string_view param) const;

 private:
  kernels::cuda::CudaBackend* backend_;
  cudaStream_t stream_;
  int state_buffers_;
  std::vector<std::string> names_;
  std::vector<std::size_t> sizes_;
  std::vector<std::size_t> offsets_;
  std::vector<std::vector<std::int64_t>> shapes_;
  std::vector<const float*> values_;
  void* tensors_ = nullptr;
  std::size_t tensors_bytes_ = 0;
  void* chunks_ = nullptr;
  std::size_t chunks_bytes_ = 0;
  std::int64_t chunk_count_ = 0;
  std::vector<float*> state_;
  std::int64_t total_ = 0;
};

class CudaAdamW final : public Optimizer {
 public:
  CudaAdamW(kernels::cuda::CudaBackend& backend, tensor::Stream* stream, AdamWOptions options = {});
  std::int64_t steps_taken() const override { return steps_; }
  std::vector<ckpt::TensorRecord> state_records(std::string_view prefix) const override;
  void load_state(const ckpt::SafetensorsFile& file, std::span<const View> params,
                  std::string_view prefix) override;
  std::int64_t state_bytes(std::string_view param) const override {
    return table_.state_bytes(param);
  }
  std::string_view name() const override { return "adamw"; }

 private:
  void apply_step(std::span<const View> params, float learning_rate,
                  std::optional<double> global_norm) override;

  AdamWOptions options_;
  cudaStream_t stream_;
  MultiTensorTable table_;
  std::int64_t steps_ = 0;
};

class CudaSgd final : public Optimizer {
 public:
  CudaSgd(kernels::cuda::CudaBackend& backend, tensor::Stream* stream, SgdOptions options = {});
  std::int64_t steps_taken() const override { return steps_; }
  // Like the CPU's: a momentum_buffer per parameter, none when momentum is 0.
  std::vector<ckpt::TensorRecord> state_records(std::string_view prefix) const override;
  void load_state(const ckpt::SafetensorsFile& file, std::span<const View> params,
                  std::string_view prefix) override;
  std::int64_t state_bytes(std::string_view param) const override {
    return table_.state_bytes(param);
  }
  std::string_view name() const override { return "sgd"; }

 private:
  void apply_step(std::span<const View> params, float learning_rate,
                  std::optional<double> global_norm) override;

  SgdOptions options_;
  cudaStream_t stream_;
  MultiTensorTable table_;
  std::int64_t steps_ = 0;
};

// step's global_norm: as BasicOptimizer::step (absent: computed on the device from `params`);
// throws std::runtime_error before changing anything when the norm is not finite.
class CudaLamb final : public Optimizer {
 public:
  CudaLamb(kernels::cuda::CudaBackend& backend, tensor::Stream* stream, LambOptions options = {});
  std::int64_t steps_taken() const override { return steps_; }
  std::vector<ckpt::TensorRecord> state_records(std::string_view prefix) const override;
  void load_state(const ckpt::SafetensorsFile& file, std::span<const View> params,
                  std::string_view prefix) override;
  std::int64_t state_bytes(std::string_view param) const override {
    return table_.state_bytes(param);
  }
  std::string_view name() const override { return "lamb"; }
  double last_grad_norm() const { return last_grad_norm_; }
  // Each tensor's trust ratio in the last step (downloads the per-tensor norms); all 1 before
  // this object's first step.
  std::vector<double> last_trust_ratios() const;

 private:
  void apply_step(std::span<const View> params, float learning_rate,
                  std::optional<double> global_norm) override;

  LambOptions options_;
  cudaStream_t stream_;
  MultiTensorTable table_;
  kernels::cuda::DeviceScratch sums_;  // per tensor: ||p||^2, ||u||^2 (double); then the norm
  std::vector<bool> no_weight_decay_;
  std::int64_t steps_ = 0;
  double last_grad_norm_ = 0.0;
  bool sums_valid_ = false;  // sums_ holds the norms of a step of this object (not a load)
};

}  // namespace pf::optim::cuda
