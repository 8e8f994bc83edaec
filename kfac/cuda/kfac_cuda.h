#pragma once
// K-FAC of one Linear layer on a GPU, the same math as kfac/ (factors.h, damping.h, inverse.h,
// precondition.h) on device memory: curvature with cuBLAS SYRK, damping from traces, inversion
// with cuSOLVER (Cholesky potrf + potri; eigendecomposition syevd as the alternative and the
// fallback), preconditioning with GEMMs. Factors and inverses are fp32, d x d, column-major
// (Eigen's layout, so they copy to and from Eigen::MatrixXf as they are); layer inputs and
// gradients are row-major [tokens, d] as the model writes them. All work runs on one stream.
#include <cusolverDn.h>

#include <cstdint>
#include <map>
#include <string>
#include <string_view>

#include "kernels/cuda/cuda_ops.h"
#include "kfac/damping.h"
#include "kfac/inverse.h"
#include "runtime/tensor/tensor.h"

namespace pf::kfac::cuda {

class CusolverHandle {
 public:
  CusolverHandle();
  ~CusolverHandle();
  CusolverHandle(const CusolverHandle&) = delete;
  CusolverHandle& operator=(const CusolverHandle&) = delete;
  cusolverDnHandle_t get() const { return handle_; }

 private:
  cusolverDnHandle_t handle_ = nullptr;
};

// What an inversion did: like InverseResult without the matrix (it is written to the caller's
// device memory), plus cuSOLVER's info of the Cholesky (0: success; i > 0: the leading minor of
// order i is not positive definite).
struct DeviceInverseResult {
  bool fell_back_to_eigen = false;
  int cholesky_info = 0;
};

class KfacCuda {
 public:
  // Issues on `stream` (null: the default stream); the backend must outlive this.
  explicit KfacCuda(kernels::cuda::CudaBackend& backend, tensor::Stream* stream = nullptr);

  kernels::cuda::CudaOps& ops() { return ops_; }
  // Float buffers for inversion chains and the inverses they install, reused in this stream's
  // order: a chain's buffers come back when it ends (and an installed inverse's predecessor),
  // so refreshes after the first allocate nothing; a cudaFree would wait for the whole device,
  // which the workers sharing a GPU all feel. take_floats returns a buffer of exactly `count`
  // floats; give_back takes one whose work is issued on this stream (an empty one, or one still
  // shared with another holder, is only dropped).
  tensor::Tensor take_floats(std::int64_t count);
  void give_back(tensor::Tensor buffer);
  std::int64_t spare_bytes() const;
  kernels::cuda::CudaBackend& backend() const { return *backend_; }
  cusolverDnHandle_t cusolver() const { return cusolver_.get(); }

  // sum (d x d, lower triangle) += scale * x^T x, x row-major [rows, d] (factors.h).
  void add_gram_lower(float* sum, std::int64_t d, const float* x, std::int64_t rows, float scale);
  // The same from a strided view (d = x.cols): e.g. one of the query/key/value column blocks of
  // the fused QKV output gradient, as BertChunk hands them to a KfacCapture, read in place.
  void add_gram_lower(float* sum, kernels::ConstMatrixView<float> x, float scale);
  void fill_upper_from_lower(float* matrix, std::int64_t d);
  // (C + C^T) / 2 in place.
  void symmetrize(float* matrix, std::int64_t d);
  // matrix = alpha * matrix + beta * other (both d x d), e.g. the running average of factors.
  void blend(float* matrix, const float* other, std::int64_t d, float alpha, float beta);

  // pi and the factored damping of damping.h from the factors' traces (waits for the stream).
  double pi_adjustment(const float* a, std::int64_t d_in, const float* b, std::int64_t d_out);
  FactorDamping factored_damping(const float* a, std::int64_t d_in, const float* b,
                                 std::int64_t d_out, float lambda, bool pi_adjusted = true);

  // inverse = (factor + damping I)^-1 (inverse.h): Cholesky, falling back to the eigen path when
  // the damped factor is not positive definite in fp32, or the eigen path directly. `layer`
  // names the factor in errors: a non-finite factor, a negative damping, an eigen solver that
  // does not converge (with cuSOLVER's info) or a singular factor with damping 0 throw.
  DeviceInverseResult damped_inverse(const float* factor, std::int64_t d, float damping,
                                     InverseMethod method, float* inverse,
                                     std::string_view layer = "factor");

  // out_w (d_out x d_in, row-major) = b_inv grad_w a_inv, out_b = b_inv grad_b (precondition.h);
  // the outputs may alias the inputs; grad_b/out_b may be null.
  void precondition(const float* a_inv, const float* b_inv, const float* grad_w,
                    const float* grad_b, std::int64_t d_out, std::int64_t d_in, float* out_w,
                    float* out_b);
  // One piece of it by gradient rows, as kfac::precondition_rows: out_w[r0:r1] =
  // (b_inv[r0:r1, :] grad_w) a_inv, out_b[r0:r1] = b_inv[r0:r1, :] grad_b for the rows of the
  // piece's share [unit_begin, unit_end) of d_out. The outputs must not alias the inputs (every
  // piece reads the whole gradient); throws std::invalid_argument if they do.
  void precondition_rows(const float* a_inv, const float* b_inv, const float* grad_w,
                         const float* grad_b, std::int64_t d_out, std::int64_t d_in, int unit_begin,
                         int unit_end, float* out_w, float* out_b);

 private:
  void eigen_inverse(const float* factor, std::int64_t d, float damping, float* inverse,
                     std::string_view layer);
  float* scratch_floats(kernels::cuda::DeviceScratch& scratch, std::int64_t count);

  kernels::cuda::CudaBackend* backend_;
  kernels::cuda::CudaOps ops_;  // cuBLAS (fp32 products) and reductions on the stream
  CusolverHandle cusolver_;
  kernels::cuda::DeviceScratch work_;                  // cuSOLVER workspace + info
  kernels::cuda::DeviceScratch matrix_;                // a d x d temporary
  kernels::cuda::DeviceScratch vectors_;               // eigenvectors
  std::multimap<std::int64_t, tensor::Tensor> spare_;  // take_floats' free buffers by size
};

}  // namespace pf::kfac::cuda
