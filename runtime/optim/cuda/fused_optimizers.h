#pragma once
// AdamW, LAMB and momentum SGD on a GPU as fused multi-tensor kernels (one launch updates every
// tensor of the list, as apex's multi_tensor_apply): the same arithmetic as runtime/optim's CPU
// optimizers, on ParamViews whose value and grad point to device memory. The first step fixes
// the parameter list (names, sizes, order) and allocates the state on the device; later steps
// must pass the same list. All work runs on one stream; LAMB waits for it once per step (the
// global gradient norm decides the clipping, and a non-finite norm must stop the step).
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_ops.h"
#include "runtime/optim/adamw.h"
#include "runtime/optim/lamb.h"
#include "runtime/optim/param_view.h"
#include "runtime/optim/sgd.h"

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
  const void* tensors() const { return tensors_; }
  const void* chunks() const { return chunks_; }
  std::int64_t chunk_count() const { return chunk_count_; }
  std::int64_t tensor_count() const { return static_cast<std::int64_t>(names_.size()); }
  float* state(int buffer) const { return state_[static_cast<std::size_t>(buffer)]; }
  std::int64_t total_size() const { return total_; }

 private:
  kernels::cuda::CudaBackend* backend_;
  cudaStream_t stream_;
  int state_buffers_;
  std::vector<std::string> names_;
  std::vector<std::size_t> sizes_;
  std::vector<const float*> values_;
  void* tensors_ = nullptr;
  std::size_t tensors_bytes_ = 0;
  void* chunks_ = nullptr;
  std::size_t chunks_bytes_ = 0;
  std::int64_t chunk_count_ = 0;
  std::vector<float*> state_;
  std::int64_t total_ = 0;
};

class CudaAdamW {
 public:
  CudaAdamW(kernels::cuda::CudaBackend& backend, tensor::Stream* stream, AdamWOptions options = {});
  void step(std::span<const ParamView> params, float learning_rate);
  std::int64_t steps_taken() const { return steps_; }

 private:
  AdamWOptions options_;
  cudaStream_t stream_;
  MultiTensorTable table_;
  std::int64_t steps_ = 0;
};

class CudaSgd {
 public:
  CudaSgd(kernels::cuda::CudaBackend& backend, tensor::Stream* stream, SgdOptions options = {});
  void step(std::span<const ParamView> params, float learning_rate);
  std::int64_t steps_taken() const { return steps_; }

 private:
  SgdOptions options_;
  cudaStream_t stream_;
  MultiTensorTable table_;
  std::int64_t steps_ = 0;
};

class CudaLamb {
 public:
  CudaLamb(kernels::cuda::CudaBackend& backend, tensor::Stream* stream, LambOptions options = {});
  // global_grad_norm: as BasicOptimizer::step (absent: computed on the device from `params`).
  // Throws std::runtime_error before changing anything when the norm is not finite.
  void step(std::span<const ParamView> params, float learning_rate,
            std::optional<double> global_grad_norm = std::nullopt);
  std::int64_t steps_taken() const { return steps_; }
  double last_grad_norm() const { return last_grad_norm_; }
  // Each tensor's trust ratio in the last step (downloads the per-tensor norms).
  std::vector<double> last_trust_ratios() const;

 private:
  LambOptions options_;
  cudaStream_t stream_;
  MultiTensorTable table_;
  kernels::cuda::DeviceScratch sums_;  // per tensor: ||p||^2, ||u||^2 (double); then the norm
  std::vector<bool> no_weight_decay_;
  std::int64_t steps_ = 0;
  double last_grad_norm_ = 0.0;
};

}  // namespace pf::optim::cuda
