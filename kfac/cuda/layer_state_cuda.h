#pragma once
// K-FAC state of one preconditioned Linear layer on a GPU: kfac/layer_state.h's life cycle
// (curvature per micro-batch or piece of one, finalize into the factor with the same running
// average, damping, inversion, preconditioning) with its factors, accumulators and inverses in
// device memory, computed by a KfacCuda on its stream. Counters and errors are the CPU's; to_host
// and load give the CPU's KfacLayerState, so KfacState's checkpoint records serve both devices.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "kernels/matrix_view.h"
#include "kfac/cuda/inverse_chain_cuda.h"
#include "kfac/cuda/kfac_cuda.h"
#include "kfac/layer_state.h"
#include "kfac/pieces.h"
#include "runtime/tensor/tensor.h"

namespace pf::kfac::cuda {

// One Kronecker factor (dim x dim, column-major like Eigen's) and its counters. The matrices are
// allocated when first written and kept (a finalize without a running average swaps the sum's
// and the value's buffers); K-FAC offload detaches and attaches value and inverse, so either
// may be absent (numel 0) while its flag says it was computed.
struct DeviceFactor {
  explicit DeviceFactor(std::int64_t dim);
  std::int64_t dim = 0;
  tensor::Tensor sum, value, inverse;  // valid as the flags below say, when allocated
  bool accumulating = false;           // sum holds the refresh in progress (lower triangle)
  std::int64_t microbatches = 0;
  std::int64_t refreshes = 0;  // value is valid when > 0
  bool inverted = false;       // inverse is valid
  float damping = 0.0F;
  std::int64_t inverted_refresh = 0;
  std::int64_t cholesky_fallbacks = 0;
};

class KfacLayerCuda {
 public:
  // `name` labels errors (e.g. "layer 3 query"). Throws std::invalid_argument unless both
  // dimensions are positive. `kfac` (and its backend) must outlive this.
  KfacLayerCuda(KfacCuda& kfac, std::int64_t d_in, std::int64_t d_out, std::string name);

  std::int64_t d_in() const { return a_.dim; }
  std::int64_t d_out() const { return b_.dim; }
  const DeviceFactor& a() const { return a_; }
  const DeviceFactor& b() const { return b_; }

  // a: [tokens, d_in] (any leading dimension) adds a^T a / tokens; g: [tokens, d_out] adds
  // output_grad_scale * g^T g. A piece [unit_begin, unit_end) adds its token rows only
  // (pieces.h); the piece ending at kPieceUnits counts the micro-batch.
  void accumulate_a(kernels::ConstMatrixView<float> a, int unit_begin = 0,
                    int unit_end = kPieceUnits);
  void accumulate_b(kernels::ConstMatrixView<float> g, float output_grad_scale, int unit_begin = 0,
                    int unit_end = kPieceUnits);
  void finalize_a(float running_average = 0.0F);
  void finalize_b(float running_average = 0.0F);
  FactorDamping damping(float lambda, bool pi_adjusted = true);
  DeviceInverseResult invert_a(float damping, InverseMethod method = InverseMethod::kCholesky);
  DeviceInverseResult invert_b(float damping, InverseMethod method = InverseMethod::kCholesky);
  // A Cholesky inversion in pieces (InverseChainCuda; kfac::InverseChain on the CPU): begin
  // copies the factor's value and fixes the damping (throws as invert_a/b for a factor never
  // finalized or not on the device); each run_inverse_chain runs a piece, and the piece ending
  // at kPieceUnits installs the inverse as invert_a/b does and returns what it did. Throws
  // std::logic_error for a piece without its chain or out of order.
  void begin_inverse_chain(bool a, float damping);
  std::optional<DeviceInverseResult> run_inverse_chain(bool a, int unit_begin, int unit_end);
  // The factor's chain in progress (null: none).
  const InverseChainCuda* inverse_chain(bool a) const { return (a ? chain_a_ : chain_b_).get(); }
  // A chain rebuilt from a checkpoint (its factor, damping and next unit; next unit 0: none),
  // bit for bit the one saved. Throws std::invalid_argument for a factor of another size.
  void resume_inverse_chain(bool a, const Eigen::MatrixXf& factor, float damping, int next_unit);

  // dW = B_inv G A_inv, db = B_inv g_b on device memory (in place allowed; biases may be null).
  void precondition(const float* grad_w, const float* grad_b, float* out_w, float* out_b);

  // A factor's accumulator: its sum (lower triangle), whether that holds a refresh in progress,
  // and the micro-batches in it. A pipelined refresh keeps a second one per factor: the previous
  // refresh's sums, set aside at a window's start while the window accumulates anew.
  struct Accumulator {
    tensor::Tensor sum;
    bool accumulating = false;
    std::int64_t microbatches = 0;
  };
  // Swaps the factor's accumulator (A or B) with `other`, whose sum is first given a dim x dim
  // buffer if it has none (device memory moves, nothing is copied).
  void exchange_accumulator(bool a, Accumulator& other);

  // The columns of the factor's sum (A or B) that a curvature-sync piece [unit_begin, unit_end)
  // all-reduces (kfac::sync_piece's range, here in device memory). Throws std::logic_error
  // when the factor is not accumulating.
  std::span<float> sync_piece(bool a, int unit_begin, int unit_end);
  // The factor's synced micro-batch count.
  void set_microbatches(bool a, std::int64_t count);

  // K-FAC offload: a factor's value or inverse buffer out of the layer (empty when it holds
  // none; work issued so far may still read it) and into it (dim x dim floats of this backend,
  // written in stream order; returns the buffer it replaces). An attached inverse counts as
  // computed. attach throws std::invalid_argument for another size.
  tensor::Tensor detach(bool a, bool inverse);
  tensor::Tensor attach(bool a, bool inverse, tensor::Tensor matrix);
  // Sharded K-FAC state: the factor's sums leave the layer (it no longer accumulates); returns
  // their buffer (work issued so far may still read it).
  tensor::Tensor drop_sum(bool a);
  // K-FAC offload: the factor's sum buffer when it holds no refresh in progress (finalized
  // since its last accumulation; the next one allocates anew), else an empty tensor.
  tensor::Tensor release_idle_sum(bool a);
  // Bytes of device memory held (sums, values, inverses, inversion chains in progress).
  std::int64_t device_bytes() const;
  // Where the layer's new sums and inverses come from (a dim x dim float buffer, usable on the
  // layer's stream): K-FAC offload hands it the staging pool the copies take from and give back
  // to, so that the buffers the layer gives up at a write-back return as its next ones instead
  // of the pool growing by a new allocation per inversion. Unset: the backend allocates.
  void allocate_with(std::function<tensor::Tensor(std::int64_t dim)> allocate) {
    allocate_ = std::move(allocate);
  }

  // The state as the CPU keeps it (downloads; waits for the stream), and back. A detached
  // matrix is absent from it, as from the CPU path's state of an offloaded Linear.
  KfacLayerState to_host() const;
  // Throws std::invalid_argument when the dimensions differ.
  void load(const KfacLayerState& host);

 private:
  void accumulate(DeviceFactor& factor, kernels::ConstMatrixView<float> x, float scale,
                  int unit_begin, int unit_end, const char* which);
  void finalize(DeviceFactor& factor, float running_average, const char* which);
  DeviceInverseResult invert(DeviceFactor& factor, float damping, InverseMethod method,
                             const char* which);
  // Throws std::logic_error naming the layer unless the factor was finalized and its value is
  // on the device.
  void require_value(const DeviceFactor& factor, const char* which) const;
  // The factor's inverse is the one just computed, with `damping`.
  static void mark_inverted(DeviceFactor& factor, float damping, const DeviceInverseResult& result);

  // A dim x dim buffer for `matrix` unless it has one (allocate_'s, else the backend's).
  void ensure_buffer(tensor::Tensor& matrix, std::int64_t dim);

  KfacCuda* kfac_;
  kernels::cuda::CudaBackend* backend_;
  std::function<tensor::Tensor(std::int64_t dim)> allocate_;
  std::string name_;
  DeviceFactor a_;
  DeviceFactor b_;
  std::unique_ptr<InverseChainCuda> chain_a_, chain_b_;
};

}  // namespace pf::kfac::cuda
