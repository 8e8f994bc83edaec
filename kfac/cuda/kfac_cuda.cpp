#include "kfac/cuda/kfac_cuda.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kfac/cuda/cusolver_check.h"
#include "kfac/cuda/kfac_kernels.h"
#include "kfac/pieces.h"

namespace pf::kfac::cuda {
namespace {

void check_dim(std::int64_t d, const char* op) {
  if (d <= 0) throw std::invalid_argument(std::string(op) + ": factor dimension must be > 0");
}

}  // namespace

CusolverHandle::CusolverHandle() {
  CUSOLVER_CHECK(cusolverDnCreate(&handle_));
}
CusolverHandle::~CusolverHandle() {
  if (handle_ != nullptr) cusolverDnDestroy(handle_);
}

KfacCuda::KfacCuda(kernels::cuda::CudaBackend& backend, tensor::Stream* stream)
    : backend_(&backend),
      ops_(backend, stream, kernels::GemmPrecision::kFp32),
      work_(backend, ops_.stream()),
      matrix_(backend, ops_.stream()),
      vectors_(backend, ops_.stream()) {
  CUSOLVER_CHECK(cusolverDnSetStream(cusolver_.get(), ops_.stream()));
}

tensor::Tensor KfacCuda::take_floats(std::int64_t count) {
  const auto it = spare_.find(count);
  if (it == spare_.end()) return tensor::Tensor::empty(*backend_, {count}, tensor::DType::kF32);
  tensor::Tensor buffer = std::move(it->second);
  spare_.erase(it);
  return buffer;
}

void KfacCuda::give_back(tensor::Tensor buffer) {
  // A buffer someone else still holds is only dropped here.
  if (buffer.numel() == 0 || buffer.dtype() != tensor::DType::kF32 || !buffer.sole_owner()) return;
  const std::int64_t count = buffer.numel();
  spare_.emplace(count, std::move(buffer));
}

std::int64_t KfacCuda::spare_bytes() const {
  std::int64_t bytes = 0;
  for (const auto& [count, buffer] : spare_) bytes += static_cast<std::int64_t>(buffer.nbytes());
  return bytes;
}

float* KfacCuda::scratch_floats(kernels::cuda::DeviceScratch& scratch, std::int64_t count) {
  return static_cast<float*>(scratch.ensure(static_cast<std::size_t>(count) * sizeof(float)));
}

void KfacCuda::add_gram_lower(float* sum, std::int64_t d, const float* x, std::int64_t rows,
                              float scale) {
  add_gram_lower(sum, kernels::ConstMatrixView<float>(x, rows, d), scale);
}

void KfacCuda::add_gram_lower(float* sum, kernels::ConstMatrixView<float> x, float scale) {
  const std::int64_t d = x.cols;
  const std::int64_t rows = x.rows;
  if (rows < 0 || d < 0) throw std::invalid_argument("add_gram_lower: negative size");
  if (x.ld < d) {
    throw std::invalid_argument("add_gram_lower: leading dimension " + std::to_string(x.ld) +
                                " is below the " + std::to_string(d) + " columns");
  }
  if (rows == 0 || d == 0) return;
  if (x.data == nullptr || sum == nullptr) {
    throw std::invalid_argument("add_gram_lower: null input");
  }
  // The row-major [rows, d] input with rows ld apart is the column-major d x rows matrix X = x^T
  // with leading dimension ld: x^T x = X X^T.
  const float one = 1.0F;
  CUBLAS_CHECK(cublasSsyrk(ops_.cublas().get(), CUBLAS_FILL_MODE_LOWER, CUBLAS_OP_N,
                           static_cast<int>(d), static_cast<int>(rows), &scale, x.data,
                           static_cast<int>(x.ld), &one, sum, static_cast<int>(d)));
}

void KfacCuda::fill_upper_from_lower(float* matrix, std::int64_t d) {
  cuda::fill_upper_from_lower(matrix, d, ops_.stream());
}

void KfacCuda::symmetrize(float* matrix, std::int64_t d) {
  cuda::symmetrize(matrix, d, ops_.stream());
}

void KfacCuda::blend(float* matrix, const float* other, std::int64_t d, float alpha, float beta) {
  cuda::blend(matrix, other, d * d, alpha, beta, ops_.stream());
}

double KfacCuda::pi_adjustment(const float* a, std::int64_t d_in, const float* b,
                               std::int64_t d_out) {
  check_dim(d_in, "pi_adjustment");
  check_dim(d_out, "pi_adjustment");
  auto* traces = static_cast<double*>(work_.ensure(2 * sizeof(double)));
  trace(a, d_in, traces, ops_.stream());
  trace(b, d_out, traces + 1, ops_.stream());
  double host[2] = {0.0, 0.0};
  CUDA_CHECK(cudaMemcpyAsync(host, traces, sizeof(host), cudaMemcpyDeviceToHost, ops_.stream()));
  ops_.synchronize();
  const double normalized_a = std::max(host[0] / static_cast<double>(d_in), kTraceFloor);
  const double normalized_b = std::max(host[1] / static_cast<double>(d_out), kTraceFloor);
  return std::sqrt(normalized_a / normalized_b);
}

FactorDamping KfacCuda::factored_damping(const float* a, std::int64_t d_in, const float* b,
                                         std::int64_t d_out, float lambda, bool pi_adjusted) {
  if (!(lambda >= 0.0F)) {
    throw std::invalid_argument("factored_damping: lambda must be >= 0, got " +
                                std::to_string(lambda));
  }
  FactorDamping damping;
  damping.pi = pi_adjusted ? pi_adjustment(a, d_in, b, d_out) : 1.0;
  const double root = std::sqrt(double{lambda});
  damping.a = static_cast<float>(root * damping.pi);
  damping.b = static_cast<float>(root / damping.pi);
  return damping;
}

DeviceInverseResult KfacCuda::damped_inverse(const float* factor, std::int64_t d, float damping,
                                             InverseMethod method, float* inverse,
                                             std::string_view layer) {
  const std::string name(layer);
  check_dim(d, "damped_inverse");
  if (!(damping >= 0.0F)) {
    throw std::invalid_argument("damped_inverse: " + name + ": damping must be >= 0, got " +
                                std::to_string(damping));
  }
  if (!ops_.all_finite(factor, d * d)) {
    throw std::runtime_error("damped_inverse: " + name +
                             ": the factor has non-finite entries (NaN or inf)");
  }
  if (method == InverseMethod::kEigen) {
    eigen_inverse(factor, d, damping, inverse, layer);
    return {false, 0};
  }
  const cudaStream_t stream = ops_.stream();
  const int n = static_cast<int>(d);
  CUDA_CHECK(cudaMemcpyAsync(inverse, factor, static_cast<std::size_t>(d * d) * sizeof(float),
                             cudaMemcpyDeviceToDevice, stream));
  add_to_diagonal(inverse, d, damping, stream);
  int potrf_size = 0;
  int potri_size = 0;
  CUSOLVER_CHECK(cusolverDnSpotrf_bufferSize(cusolver_.get(), CUBLAS_FILL_MODE_LOWER, n, inverse, n,
                                             &potrf_size));
  CUSOLVER_CHECK(cusolverDnSpotri_bufferSize(cusolver_.get(), CUBLAS_FILL_MODE_LOWER, n, inverse, n,
                                             &potri_size));
  const int lwork = std::max(potrf_size, potri_size);
  // Layout of work_: [info (int, padded to 16 bytes)][workspace floats].
  auto* base = static_cast<unsigned char*>(
      work_.ensure(16 + static_cast<std::size_t>(lwork) * sizeof(float)));
  int* info = reinterpret_cast<int*>(base);
  float* workspace = reinterpret_cast<float*>(base + 16);
  CUSOLVER_CHECK(cusolverDnSpotrf(cusolver_.get(), CUBLAS_FILL_MODE_LOWER, n, inverse, n, workspace,
                                  lwork, info));
  int host_info = 0;
  CUDA_CHECK(cudaMemcpyAsync(&host_info, info, sizeof(int), cudaMemcpyDeviceToHost, stream));
  ops_.synchronize();
  if (host_info < 0) {
    throw std::runtime_error("damped_inverse: " + name + ": potrf rejected argument " +
                             std::to_string(-host_info));
  }
  if (host_info > 0) {
    // Not positive definite in fp32 (the damping is too small for the factor's conditioning):
    // the same fallback as the CPU path.
    eigen_inverse(factor, d, damping, inverse, layer);
    return {true, host_info};
  }
  CUSOLVER_CHECK(cusolverDnSpotri(cusolver_.get(), CUBLAS_FILL_MODE_LOWER, n, inverse, n, workspace,
                                  lwork, info));
  CUDA_CHECK(cudaMemcpyAsync(&host_info, info, sizeof(int), cudaMemcpyDeviceToHost, stream));
  ops_.synchronize();
  if (host_info != 0) {
    throw std::runtime_error("damped_inverse: " + name + ": potri failed with info " +
                             std::to_string(host_info));
  }
  cuda::fill_upper_from_lower(inverse, d, stream);
  return {false, 0};
}

void KfacCuda::eigen_inverse(const float* factor, std::int64_t d, float damping, float* inverse,
                             std::string_view layer) {
  const std::string name(layer);
  const cudaStream_t stream = ops_.stream();
  const int n = static_cast<int>(d);
  float* vectors = scratch_floats(vectors_, d * d + d);
  float* values = vectors + d * d;
  CUDA_CHECK(cudaMemcpyAsync(vectors, factor, static_cast<std::size_t>(d * d) * sizeof(float),
                             cudaMemcpyDeviceToDevice, stream));
  int lwork = 0;
  CUSOLVER_CHECK(cusolverDnSsyevd_bufferSize(cusolver_.get(), CUSOLVER_EIG_MODE_VECTOR,
                                             CUBLAS_FILL_MODE_LOWER, n, vectors, n, values,
                                             &lwork));
  auto* base = static_cast<unsigned char*>(
      work_.ensure(16 + static_cast<std::size_t>(lwork) * sizeof(float)));
  int* info = reinterpret_cast<int*>(base);
  CUSOLVER_CHECK(cusolverDnSsyevd(cusolver_.get(), CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_LOWER,
                                  n, vectors, n, values, reinterpret_cast<float*>(base + 16), lwork,
                                  info));
  int host_info = 0;
  float smallest = 0.0F;
  CUDA_CHECK(cudaMemcpyAsync(&host_info, info, sizeof(int), cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaMemcpyAsync(&smallest, values, sizeof(float), cudaMemcpyDeviceToHost, stream));
  ops_.synchronize();
  if (host_info != 0) {
    throw std::runtime_error("damped_inverse: " + name + ": the eigen solver (syevd) failed on a " +
                             std::to_string(d) + " x " + std::to_string(d) + " factor, info " +
                             std::to_string(host_info));
  }
  if (std::max(smallest, 0.0F) + damping <= 0.0F) {
    throw std::runtime_error("damped_inverse: " + name +
                             ": the factor is singular and damping is 0");
  }
  // inverse = Q diag(1 / (max(e, 0) + damping)) Q^T
  float* scaled = scratch_floats(matrix_, d * d);
  scale_columns(vectors, values, d, damping, scaled, stream);
  // Column-major: inverse = scaled * vectors^T.
  const float one = 1.0F;
  const float zero = 0.0F;
  CUBLAS_CHECK(cublasSgemm(ops_.cublas().get(), CUBLAS_OP_N, CUBLAS_OP_T, n, n, n, &one, scaled, n,
                           vectors, n, &zero, inverse, n));
  cuda::symmetrize(inverse, d, stream);
}

void KfacCuda::precondition(const float* a_inv, const float* b_inv, const float* grad_w,
                            const float* grad_b, std::int64_t d_out, std::int64_t d_in,
                            float* out_w, float* out_b) {
  check_dim(d_in, "precondition");
  check_dim(d_out, "precondition");
  if ((grad_b == nullptr) != (out_b == nullptr)) {
    throw std::invalid_argument("precondition: grad_b and out_b must both be given or both null");
  }
  using kernels::Transpose;
  float* right = scratch_floats(matrix_, d_out * d_in + d_out);
  // G A_inv first (A_inv symmetric: its column-major storage is also its row-major one), into a
  // temporary so that out_w may alias grad_w.
  ops_.gemm({grad_w, d_out, d_in}, Transpose::kNo, {a_inv, d_in, d_in}, Transpose::kNo,
            {right, d_out, d_in}, 1.0F, 0.0F);
  ops_.gemm({b_inv, d_out, d_out}, Transpose::kNo, {right, d_out, d_in}, Transpose::kNo,
            {out_w, d_out, d_in}, 1.0F, 0.0F);
  if (grad_b != nullptr) {
    float* bias = right + d_out * d_in;
    ops_.gemm({b_inv, d_out, d_out}, Transpose::kNo, {grad_b, d_out, 1}, Transpose::kNo,
              {bias, d_out, 1}, 1.0F, 0.0F);
    CUDA_CHECK(cudaMemcpyAsync(out_b, bias, static_cast<std::size_t>(d_out) * sizeof(float),
                               cudaMemcpyDeviceToDevice, ops_.stream()));
  }
}

void KfacCuda::precondition_rows(const float* a_inv, const float* b_inv, const float* grad_w,
                                 const float* grad_b, std::int64_t d_out, std::int64_t d_in,
                                 int unit_begin, int unit_end, float* out_w, float* out_b) {
  check_dim(d_in, "precondition_rows");
  check_dim(d_out, "precondition_rows");
  check_piece_units(unit_begin, unit_end, "precondition_rows");
  if ((grad_b == nullptr) != (out_b == nullptr)) {
    throw std::invalid_argument(
        "precondition_rows: grad_b and out_b must both be given or both null");
  }
  if (out_w == grad_w || (grad_b != nullptr && out_b == grad_b)) {
    throw std::invalid_argument(
        "precondition_rows: the output aliases the gradient (each piece reads all of it)");
  }
  const ItemRange rows = piece_items(d_out, unit_begin, unit_end);
  if (rows.size() == 0) return;
  using kernels::Transpose;
  // b_inv is symmetric: its column-major storage is also its row-major one, and its rows
  // [r0, r1) are contiguous there.
  const float* b_rows = b_inv + rows.begin * d_out;
  float* left = scratch_floats(matrix_, rows.size() * d_in);
  ops_.gemm({b_rows, rows.size(), d_out}, Transpose::kNo, {grad_w, d_out, d_in}, Transpose::kNo,
            {left, rows.size(), d_in}, 1.0F, 0.0F);
  ops_.gemm({left, rows.size(), d_in}, Transpose::kNo, {a_inv, d_in, d_in}, Transpose::kNo,
            {out_w + rows.begin * d_in, rows.size(), d_in}, 1.0F, 0.0F);
  if (grad_b != nullptr) {
    ops_.gemm({b_rows, rows.size(), d_out}, Transpose::kNo, {grad_b, d_out, 1}, Transpose::kNo,
              {out_b + rows.begin, rows.size(), 1}, 1.0F, 0.0F);
  }
}

}  // namespace pf::kfac::cuda
