#pragma once
// What the executor needs from a device beyond the ops interface, behind one abstract class so
// that runtime code never names CUDA (no #ifdef outside device_runtime.cpp, the one file that
// maps a device to its implementation, as kernels/make_ops.cpp does for the ops):
//   - the backend (memory, copies, streams, events) all workers of this process share;
//   - timing marks recorded in stream order (CUDA events with timing), for the measured trace;
//   - the device's optimizers (fused multi-tensor kernels) and K-FAC layers (cuBLAS/cuSOLVER);
//   - an in-process exchange for device-to-device messages between workers sharing the device.
// The CPU keeps its own path (each worker owns a CpuBackend; host clocks; Eigen K-FAC): a run
// on the CPU has no DeviceRuntime at all, so it executes exactly as before.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

#include "kernels/backend_ops.h"
#include "kernels/matrix_view.h"
#include "kfac/damping.h"
#include "kfac/inverse.h"
#include "kfac/layer_state.h"
#include "runtime/device/kfac_layer_extras.h"
#include "runtime/device/message_exchange.h"
#include "runtime/optim/adamw.h"
#include "runtime/optim/lamb.h"
#include "runtime/optim/optimizer.h"
#include "runtime/optim/sgd.h"
#include "runtime/tensor/backend.h"
#include "runtime/tensor/tensor.h"

namespace pf::device {

// The device cannot be used: this build has no CUDA, or no CUDA device is present. A bad
// command-line choice (exit status 2), so it derives from std::invalid_argument.
class DeviceUnavailableError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// A point in a stream's work: record() marks it; once the stream has passed both marks (the
// caller synchronized it), seconds_since gives the time between them.
class TimingMark {
 public:
  virtual ~TimingMark() = default;
  TimingMark() = default;
  TimingMark(const TimingMark&) = delete;
  TimingMark& operator=(const TimingMark&) = delete;
  virtual void record(tensor::Stream& stream) = 0;
  virtual double seconds_since(const TimingMark& earlier) const = 0;
};

// Page-locked ("pinned") host memory from DeviceRuntime::allocate_pinned_host: copies between it
// and device memory run asynchronously on a stream at the host link's full rate (cudaHostAlloc
// on a GPU; ordinary host memory on the CPU backend, whose copies are memcpy's). Freed with its
// owner; move-only. An empty buffer holds nothing.
class PinnedHostBuffer {
 public:
  using Free = void (*)(void*);
  PinnedHostBuffer() = default;
  PinnedHostBuffer(void* data, std::size_t bytes, Free free) noexcept
      : data_(data), bytes_(bytes), free_(free) {}
  ~PinnedHostBuffer() { reset(); }
  PinnedHostBuffer(PinnedHostBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)),
        bytes_(std::exchange(other.bytes_, 0)),
        free_(std::exchange(other.free_, nullptr)) {}
  PinnedHostBuffer& operator=(PinnedHostBuffer&& other) noexcept {
    if (this != &other) {
      reset();
      data_ = std::exchange(other.data_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
      free_ = std::exchange(other.free_, nullptr);
    }
    return *this;
  }
  PinnedHostBuffer(const PinnedHostBuffer&) = delete;
  PinnedHostBuffer& operator=(const PinnedHostBuffer&) = delete;

  void* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }
  bool empty() const { return data_ == nullptr; }
  void reset() noexcept {
    if (data_ != nullptr && free_ != nullptr) free_(data_);
    data_ = nullptr;
    bytes_ = 0;
    free_ = nullptr;
  }
  friend void swap(PinnedHostBuffer& x, PinnedHostBuffer& y) noexcept {
    std::swap(x.data_, y.data_);
    std::swap(x.bytes_, y.bytes_);
    std::swap(x.free_, y.free_);
  }

 private:
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
  Free free_ = nullptr;
};

// One preconditioned Linear's K-FAC state on the device (kfac/layer_state.h's life cycle), plus
// the inverses an inversion replaced: a refresh's earlier steps precondition with those while
// the new ones are computed in the bubbles (as the executor's CPU path keeps previous_*_inverse).
class DeviceKfacLayer {
 public:
  virtual ~DeviceKfacLayer() = default;
  DeviceKfacLayer() = default;
  DeviceKfacLayer(const DeviceKfacLayer&) = delete;
  DeviceKfacLayer& operator=(const DeviceKfacLayer&) = delete;

  // x: device memory [tokens, d] (any leading dimension); pieces as kfac/pieces.h.
  virtual void accumulate(bool a, kernels::ConstMatrixView<float> x, float scale, int unit_begin,
                          int unit_end) = 0;
  // Micro-batches accumulated since the factor's last finalize.
  virtual std::int64_t pending_microbatches(bool a) const = 0;
  virtual void finalize(bool a, float running_average) = 0;
  virtual kfac::FactorDamping damping(float lambda, bool pi_adjusted) = 0;
  // Replaces the factor's inverse; the one it replaces becomes the previous inverse.
  virtual void invert(bool a, float damping, kfac::InverseMethod method) = 0;
  // A Cholesky inversion divided into pieces (kfac/inverse_chain.h's steps, so that each piece
  // fits its bubble): begin copies the factor's value (the chain keeps it: offload may detach
  // the value between pieces) and fixes the damping; pieces then run in order, the first at
  // unit 0, and the one ending at kPieceUnits installs the inverse as invert does (the inverse
  // it replaces becomes the previous inverse). Same factor, damping and pieces => the same bits
  // on a backend (the CPU's are kfac::InverseChain's). Throws std::logic_error naming the layer
  // for a piece out of order or without its chain.
  virtual void begin_inverse_chain(bool a, float damping) = 0;
  virtual void run_inverse_chain(bool a, int unit_begin, int unit_end) = 0;
  virtual bool has_inverse(bool a, bool previous) const = 0;
  // A pipelined refresh (Schedule::kfac_pipelined_refresh): at a window's start the factor's
  // unfinalized sums (the previous refresh's, whose inversion runs in this window) are set
  // aside and the window accumulates into fresh ones; finalize_set_aside finalizes the set-aside
  // sums into the factor's value (as finalize does) and leaves the window's accumulation as it
  // is. set_aside throws std::logic_error when sums are set aside already, finalize_set_aside
  // when none are.
  virtual void set_aside(bool a) = 0;
  virtual std::int64_t set_aside_microbatches(bool a) const = 0;
  virtual void finalize_set_aside(bool a, float running_average) = 0;
  // A curvature sync between replicas (or Chimera's pipelines): the part of the factor's sums
  // (the window's, or with `set_aside` the ones set aside) that the sync piece [unit_begin,
  // unit_end) all-reduces, in device memory: kfac::sync_piece's columns of the d x d
  // column-major sum, so that pieces cover it once and their element-wise sums give the whole
  // sum's bits. Valid until the sums are finalized or set aside; written by the caller in
  // stream order. Throws std::logic_error when the factor holds no sums.
  virtual std::span<float> sync_piece(bool a, bool set_aside, int unit_begin, int unit_end) = 0;
  // The synced micro-batch count of those sums (what finalize divides by).
  virtual void set_microbatches(bool a, bool set_aside, std::int64_t count) = 0;
  // grad_w (d_out x d_in, row-major) and grad_b (may be null), device memory, in place.
  virtual void precondition(bool previous_a, bool previous_b, float* grad_w, float* grad_b) = 0;
  // One piece of a preconditioning divided by gradient rows (kfac::precondition_rows): the
  // rows of out_w and out_b in the piece's share [unit_begin, unit_end) of the d_out rows, from
  // the whole gradient grad_w / grad_b (device memory; every piece reads all of it, so the
  // outputs must not alias it: the caller keeps the gradient as it was before the first piece).
  // Same pieces => the same bits on a backend (the CPU's are kfac::precondition_rows').
  virtual void precondition_rows(bool previous_a, bool previous_b, const float* grad_w,
                                 const float* grad_b, int unit_begin, int unit_end, float* out_w,
                                 float* out_b) = 0;
  // The state as the CPU keeps it (waits for the device), for statistics and checkpoints.
  virtual kfac::KfacLayerState to_host() const = 0;
  // Restores what to_host gave (a checkpoint). Throws std::invalid_argument when the
  // dimensions differ.
  virtual void load(const kfac::KfacLayerState& state) = 0;
  // The extras (waits for the device), and back (an inversion chain in progress is rebuilt and
  // run up to its next unit); load_extras throws std::invalid_argument as check_extras does.
  virtual KfacLayerExtras extras_to_host() const = 0;
  virtual void load_extras(const KfacLayerExtras& extras) = 0;

  // K-FAC offload (docs/offload.md) moves a factor's value, its inverse and the inverse the last
  // inversion replaced between device and host memory; the executor makes the copies (on its
  // copy stream) and the layer lends or takes the device buffers.
  enum class Matrix : std::uint8_t { kValue, kInverse, kPreviousInverse };
  // Detaches the matrix's device buffer (d x d floats, column-major, of the runtime's backend)
  // and returns it; an empty tensor when the layer holds none. Work issued so far on the
  // layer's stream may still read it: the caller orders its reuse after that work. The
  // factor's counters stay (refreshes, damping), so what reads the matrix later (finalize with
  // a running average, damping, inversion, preconditioning) needs it attached again first, and
  // throws std::logic_error naming the layer otherwise; an inversion with its inverse detached
  // replaces no previous inverse (none is kept).
  virtual tensor::Tensor detach(bool a, Matrix which) = 0;
  // Gives the layer `matrix` (d x d floats on the runtime's backend, written by the caller in
  // stream order before the layer's stream reads it) as that matrix, and returns the buffer it
  // replaces (empty if none), which work issued so far may still read. An inverse attached
  // counts as computed (kInverse: the last inversion's; kPreviousInverse: the one it replaced).
  // Throws std::invalid_argument for a matrix of another size.
  virtual tensor::Tensor attach(bool a, Matrix which, tensor::Tensor matrix) = 0;
  // Bytes of device memory the layer holds: sums (set-aside ones too), values, inverses, the
  // inverses they replaced and inversion chains in progress.
  virtual std::int64_t device_bytes() const = 0;
  // K-FAC state sharded across data-parallel replicas (kfac/state_placement.h): a replica that
  // does not hold the factors drops its sums (`set_aside`: the ones set aside) once the curvature
  // sync has read them; the holders finalize theirs. Returns the device buffer, if the layer
  // gives one back (work issued so far may still read it).
  virtual tensor::Tensor drop_sums(bool a, bool set_aside) = 0;
  // K-FAC offload: the factor's accumulator buffers that hold no refresh in progress (its sums
  // once finalized, and idle set-aside ones), for the executor to give back at a write-back.
  // A layer may keep them for its next accumulation (the CUDA layer's finalize swaps the sums'
  // buffer and the value's), which for an offloaded Linear would leave half its state on the
  // device between refreshes; empty where it holds none (the CPU's finalize frees the sums).
  virtual tensor::Tensor release_idle_sums(bool a) = 0;
  // K-FAC offload: where the device buffers the layer creates come from (d x d floats, usable
  // on its stream once returned): the worker's staging pool, which the copies take from and the
  // detached buffers go back to. With the backend's own allocations instead, every inversion
  // (a new inverse) and every detach of the CPU backend's layer added a buffer that the pool
  // kept to the step's end: by then the device held every buffer of the step's copies, the
  // whole offloaded state at once. Unset: the backend allocates.
  using Allocate = std::function<tensor::Tensor(std::int64_t dim)>;
  virtual void allocate_with(Allocate allocate) = 0;
};

// The optimizer a run asked for ("lamb", "adamw", "sgd") with its options.
struct OptimizerChoice {
  std::string name = "lamb";
  optim::AdamWOptions adamw;
  optim::LambOptions lamb;
  optim::SgdOptions sgd;
};

class DeviceRuntime {
 public:
  virtual ~DeviceRuntime() = default;
  DeviceRuntime() = default;
  DeviceRuntime(const DeviceRuntime&) = delete;
  DeviceRuntime& operator=(const DeviceRuntime&) = delete;

  virtual tensor::Device device() const = 0;
  virtual kernels::GemmPrecision precision() const = 0;
  // How the model's attention core runs on this device (the CPU backend: batched only).
  virtual kernels::AttentionAlgorithm attention() const {
    return kernels::AttentionAlgorithm::kBatchedGemm;
  }
  // Shared by every worker of the process (thread-safe).
  virtual tensor::Backend& backend() = 0;
  // Makes the calling thread use this device (each worker thread calls it before its work).
  virtual void bind_thread() = 0;
  virtual std::unique_ptr<TimingMark> create_timing_mark() = 0;
  // Issue on `stream` (the worker's compute stream).
  virtual std::unique_ptr<optim::Optimizer> make_optimizer(const OptimizerChoice& choice,
                                                           tensor::Stream* stream) = 0;
  // `name` labels errors ("layer 3 query").
  virtual std::unique_ptr<DeviceKfacLayer> make_kfac_layer(tensor::Stream* stream,
                                                           std::int64_t d_in, std::int64_t d_out,
                                                           const std::string& name) = 0;
  // Messages between the workers of this process.
  virtual MessageExchange& exchange() = 0;
  // `bytes` of pinned host memory (K-FAC offload's host copies). Throws std::runtime_error
  // naming the size when it cannot be had.
  virtual PinnedHostBuffer allocate_pinned_host(std::size_t bytes) = 0;
};

// nullptr for the CPU (the executor's own path). For cuda:N, the CUDA runtime on device N.
// Throws DeviceUnavailableError with one line: "--device cuda: this build has no CUDA (...)"
// or "--device cuda:N: no CUDA device (...)".
std::shared_ptr<DeviceRuntime> open_device_runtime(
    tensor::Device device, kernels::GemmPrecision precision = kernels::GemmPrecision::kFp32,
    kernels::AttentionAlgorithm attention = kernels::AttentionAlgorithm::kBatchedGemm);

// True when this build can open a CUDA device runtime.
bool cuda_runtime_compiled();

}  // namespace pf::device
