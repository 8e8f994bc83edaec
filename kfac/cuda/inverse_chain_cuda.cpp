#include "kfac/cuda/inverse_chain_cuda.h"

#include <cublas_v2.h>

#include <algorithm>
#include <stdexcept>
#include <utility>

#include "kernels/cuda/cuda_check.h"
#include "kfac/cuda/cusolver_check.h"
#include "kfac/cuda/kfac_kernels.h"

namespace pf::kfac::cuda {

namespace {

std::size_t cholesky_columns(const std::vector<InverseChainStep>& steps) {
  return static_cast<std::size_t>(
      std::count_if(steps.begin(), steps.end(), [](const InverseChainStep& step) {
        return step.kind == InverseChainStep::Kind::kCholeskyColumn;
      }));
}

}  // namespace

InverseChainCuda::InverseChainCuda(KfacCuda& kfac, const float* factor, std::int64_t d,
                                   float damping, std::string name, std::int64_t block)
    : kfac_(&kfac), name_(std::move(name)), dim_(d), damping_(damping) {
  if (d <= 0 || block <= 0) {
    throw std::invalid_argument("InverseChainCuda: " + name_ + ": size " + std::to_string(d) +
                                " and block " + std::to_string(block) + " must be positive");
  }
  if (!(damping >= 0.0F)) {
    throw std::invalid_argument("InverseChainCuda: " + name_ + ": damping must be >= 0, got " +
                                std::to_string(damping));
  }
  if (!kfac.ops().all_finite(factor, d * d)) {
    throw std::runtime_error("InverseChainCuda: " + name_ +
                             ": the factor has non-finite entries (NaN or inf)");
  }
  steps_ = inverse_chain_steps(d, block);
  const cudaStream_t stream = kfac.ops().stream();
  const auto bytes = static_cast<std::size_t>(d * d) * sizeof(float);
  factor_ = kfac.take_floats(d * d).reshape({d, d});
  cholesky_ = kfac.take_floats(d * d).reshape({d, d});
  inverse_ = kfac.take_floats(d * d).reshape({d, d});
  CUDA_CHECK(cudaMemcpyAsync(factor_.raw_data(), factor, bytes, cudaMemcpyDeviceToDevice, stream));
  CUDA_CHECK(
      cudaMemcpyAsync(cholesky_.raw_data(), factor, bytes, cudaMemcpyDeviceToDevice, stream));
  add_to_diagonal(cholesky_.data<float>(), d, damping, stream);
  // The widest diagonal block sets potrf's workspace; after it, one int per block column.
  const int widest = static_cast<int>(std::min(block, d));
  CUSOLVER_CHECK(cusolverDnSpotrf_bufferSize(kfac.cusolver(), CUBLAS_FILL_MODE_LOWER, widest,
                                             cholesky_.data<float>(), static_cast<int>(d),
                                             &workspace_floats_));
  const auto infos = static_cast<std::int64_t>(cholesky_columns(steps_));
  workspace_ = kfac.take_floats(workspace_floats_ + infos);
  CUDA_CHECK(cudaMemsetAsync(workspace_.data<float>() + workspace_floats_, 0,
                             static_cast<std::size_t>(infos) * sizeof(int), stream));
}

InverseChainCuda::~InverseChainCuda() {
  for (auto* held : {&factor_, &cholesky_, &inverse_, &workspace_}) {
    kfac_->give_back(std::exchange(*held, tensor::Tensor()));
  }
}

void InverseChainCuda::run(int unit_begin, int unit_end) {
  check_piece_units(unit_begin, unit_end, "InverseChainCuda::run");
  if (unit_begin != next_unit_ || cholesky_.numel() == 0) {
    throw std::logic_error("InverseChainCuda: " + name_ + ": piece [" + std::to_string(unit_begin) +
                           ", " + std::to_string(unit_end) +
                           ") out of order: the chain is at unit " + std::to_string(next_unit_));
  }
  const auto range = inverse_chain_piece(steps_, unit_begin, unit_end);
  for (std::size_t s = range.first; s < range.last; ++s) run_step(s);
  next_unit_ = unit_end;
  if (!finished()) return;
  // Every block column's potrf has run: one wait for their infos.
  const std::size_t blocks = cholesky_columns(steps_);
  std::vector<int> infos(blocks);
  CUDA_CHECK(cudaMemcpyAsync(infos.data(), workspace_.data<float>() + workspace_floats_,
                             blocks * sizeof(int), cudaMemcpyDeviceToHost, kfac_->ops().stream()));
  kfac_->ops().synchronize();
  for (std::size_t b = 0; b < blocks; ++b) {
    if (infos[b] < 0) {
      throw std::runtime_error("InverseChainCuda: " + name_ + ": potrf rejected argument " +
                               std::to_string(-infos[b]));
    }
    if (infos[b] > 0) {
      // Not positive definite in fp32: the eigen path, as damped_inverse falls back to (the
      // blocks after the failing one computed nothing meaningful).
      kfac_->damped_inverse(factor_.data<float>(), dim_, damping_, InverseMethod::kEigen,
                            inverse_.data<float>(), name_);
      status_ = {true, static_cast<int>(steps_[b].first) + infos[b]};
      return;
    }
  }
}

void InverseChainCuda::run_step(std::size_t index) {
  const InverseChainStep& step = steps_[index];
  const int n = static_cast<int>(dim_);
  const int first = static_cast<int>(step.first);
  const int width = static_cast<int>(step.width);
  const int rest = n - first - width;
  const cudaStream_t stream = kfac_->ops().stream();
  const cublasHandle_t cublas = kfac_->ops().cublas().get();
  float* l = cholesky_.data<float>();
  const float one = 1.0F;
  const float minus_one = -1.0F;
  if (step.kind == InverseChainStep::Kind::kCholeskyColumn) {
    // Column-major: element (i, j) at i + j * n. Block columns come first in steps_, so the
    // step's index is its block's.
    float* diagonal = l + first + static_cast<std::int64_t>(first) * n;
    int* info = reinterpret_cast<int*>(workspace_.data<float>() + workspace_floats_) + index;
    CUSOLVER_CHECK(cusolverDnSpotrf(kfac_->cusolver(), CUBLAS_FILL_MODE_LOWER, width, diagonal, n,
                                    workspace_.data<float>(), workspace_floats_, info));
    if (rest == 0) return;
    // L21 = A21 L11^-T, then A22 -= L21 L21^T (lower triangle).
    float* panel = diagonal + width;
    CUBLAS_CHECK(cublasStrsm(cublas, CUBLAS_SIDE_RIGHT, CUBLAS_FILL_MODE_LOWER, CUBLAS_OP_T,
                             CUBLAS_DIAG_NON_UNIT, rest, width, &one, diagonal, n, panel, n));
    float* trailing = l + static_cast<std::int64_t>(first + width) * (n + 1);
    CUBLAS_CHECK(cublasSsyrk(cublas, CUBLAS_FILL_MODE_LOWER, CUBLAS_OP_N, rest, width, &minus_one,
                             panel, n, &one, trailing, n));
    return;
  }
  // X[first:, first:first+width] = L22^-T (L22^-1 E2), L22 = L[first:, first:]: the identity's
  // columns are zero above `first`, so L^-1 E is too, and both solves need only L's trailing
  // block and rows [first, n) (kfac/cholesky_inverse_columns.h, the CPU chain's step). The rows
  // above `first` are the upper triangle, mirrored from the lower one at the last step: n^3
  // FLOPs with the factorization, where solving every row took 5/3 n^3.
  float* columns = inverse_.data<float>() + static_cast<std::int64_t>(first) * n;
  set_unit_columns(columns, n, first, width, stream);
  const int below = n - first;
  const float* lower_right = l + static_cast<std::int64_t>(first) * (n + 1);
  CUBLAS_CHECK(cublasStrsm(cublas, CUBLAS_SIDE_LEFT, CUBLAS_FILL_MODE_LOWER, CUBLAS_OP_N,
                           CUBLAS_DIAG_NON_UNIT, below, width, &one, lower_right, n,
                           columns + first, n));
  CUBLAS_CHECK(cublasStrsm(cublas, CUBLAS_SIDE_LEFT, CUBLAS_FILL_MODE_LOWER, CUBLAS_OP_T,
                           CUBLAS_DIAG_NON_UNIT, below, width, &one, lower_right, n,
                           columns + first, n));
  if (first + width == n) fill_upper_from_lower(inverse_.data<float>(), dim_, stream);
}

InverseChainCuda::Result InverseChainCuda::take() {
  if (!finished() || inverse_.numel() == 0) {
    throw std::logic_error("InverseChainCuda: " + name_ + ": the chain is at unit " +
                           std::to_string(next_unit_) + " of " + std::to_string(kPieceUnits));
  }
  Result result{std::exchange(inverse_, tensor::Tensor()), status_};
  for (auto* held : {&factor_, &cholesky_, &workspace_}) {
    kfac_->give_back(std::exchange(*held, tensor::Tensor()));
  }
  return result;
}

std::int64_t InverseChainCuda::device_bytes() const {
  std::int64_t bytes = 0;
  for (const auto* held : {&factor_, &cholesky_, &inverse_, &workspace_}) {
    bytes += static_cast<std::int64_t>(held->nbytes());
  }
  return bytes;
}

}  // namespace pf::kfac::cuda
