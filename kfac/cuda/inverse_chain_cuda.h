#pragma once
// kfac/inverse_chain.h's divided Cholesky inversion on a GPU, so that an inversion too long for
// any bubble runs in pieces that fit: the same steps (per block column, cuSOLVER potrf on the
// diagonal block, cuBLAS trsm on the panel below it and syrk on the trailing matrix; then per
// block of the inverse's columns, two cuBLAS triangular solves), issued piece by piece on the
// KfacCuda's stream, and the same rule for which steps a piece runs. The chain copies the
// factor (K-FAC offload may detach the layer's value between pieces). A diagonal block that is
// not positive definite in fp32 is found when the last piece reads every block's potrf info (one
// host wait per chain, not per step); the chain then computes the eigen inverse of its factor,
// as damped_inverse falls back. Against damped_inverse (potrf + potri) the result differs by
// fp32 rounding; the same factor, damping and pieces give the same bits on the same GPU.
#include <cstdint>
#include <string>
#include <vector>

#include "kfac/cuda/kfac_cuda.h"
#include "kfac/inverse_chain.h"
#include "runtime/tensor/tensor.h"

namespace pf::kfac::cuda {

class InverseChainCuda {
 public:
  // factor: d x d device memory (column-major, symmetric), copied on the stream. `name` labels
  // errors. Throws as damped_inverse does for a non-finite factor (one host wait) or a negative
  // damping. `kfac` must outlive the chain.
  InverseChainCuda(KfacCuda& kfac, const float* factor, std::int64_t d, float damping,
                   std::string name, std::int64_t block = kInverseChainBlock);
  // Gives its buffers back to the KfacCuda (KfacCuda::take_floats).
  ~InverseChainCuda();
  InverseChainCuda(const InverseChainCuda&) = delete;
  InverseChainCuda& operator=(const InverseChainCuda&) = delete;

  // Runs the piece [unit_begin, unit_end); pieces come in order, the first at 0. Throws
  // std::logic_error otherwise. The piece ending at kPieceUnits waits for the stream once (the
  // potrf infos) and falls back to the eigen inverse if a block was not positive definite.
  void run(int unit_begin, int unit_end);
  bool finished() const { return next_unit_ == kPieceUnits; }
  int next_unit() const { return next_unit_; }
  float damping() const { return damping_; }
  std::int64_t dim() const { return dim_; }
  // The factor the chain inverts (device memory, d x d): a checkpoint between two pieces saves
  // it with next_unit() and damping().
  const tensor::Tensor& factor() const { return factor_; }

  struct Result {
    tensor::Tensor inverse;  // d x d device memory, written in stream order
    DeviceInverseResult status;
  };
  // The inverse, once finished (std::logic_error before). Leaves the chain empty, its other
  // buffers given back to the KfacCuda.
  Result take();
  // Device memory held (the factor copy, L, the inverse and the solver's workspace), all taken
  // from the KfacCuda's spare buffers (KfacCuda::take_floats).
  std::int64_t device_bytes() const;

 private:
  void run_step(std::size_t index);

  KfacCuda* kfac_;
  std::string name_;
  std::int64_t dim_ = 0;
  float damping_ = 0.0F;
  std::vector<InverseChainStep> steps_;
  tensor::Tensor factor_;    // kept for the eigen fallback and checkpoints
  tensor::Tensor cholesky_;  // the damped factor; its lower triangle becomes L
  tensor::Tensor inverse_;
  tensor::Tensor workspace_;  // potrf's workspace, then one info per block column (int32)
  int workspace_floats_ = 0;
  int next_unit_ = 0;
  DeviceInverseResult status_;
};

}  // namespace pf::kfac::cuda
