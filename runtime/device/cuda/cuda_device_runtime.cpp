#include "runtime/device/cuda/cuda_device_runtime.h"

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

#include "kernels/cuda/cuda_check.h"
#include "kfac/cuda/layer_state_cuda.h"
#include "kfac/pieces.h"
#include "runtime/optim/cuda/fused_optimizers.h"

namespace pf::device::cuda {

namespace {

using kernels::cuda::CudaBackend;

// A CUDA event with timing (CudaEvent disables it: it only orders streams).
class CudaTimingMark final : public TimingMark {
 public:
  CudaTimingMark() { CUDA_CHECK(cudaEventCreate(&event_)); }
  ~CudaTimingMark() override {
    if (event_ != nullptr) cudaEventDestroy(event_);
  }
  CudaTimingMark(const CudaTimingMark&) = delete;
  CudaTimingMark& operator=(const CudaTimingMark&) = delete;
  void record(tensor::Stream& stream) override {
    CUDA_CHECK(cudaEventRecord(event_, kernels::cuda::stream_of(&stream)));
  }
  double seconds_since(const TimingMark& earlier) const override {
    float milliseconds = 0.0F;
    CUDA_CHECK(cudaEventElapsedTime(&milliseconds,
                                    dynamic_cast<const CudaTimingMark&>(earlier).event_, event_));
    return static_cast<double>(milliseconds) * 1e-3;
  }

 private:
  cudaEvent_t event_ = nullptr;
};

class CudaKfacLayer final : public DeviceKfacLayer {
 public:
  CudaKfacLayer(std::shared_ptr<kfac::cuda::KfacCuda> kfac, tensor::Stream* stream,
                std::int64_t d_in, std::int64_t d_out, const std::string& name)
      : owner_(std::move(kfac)),
        kfac_(*owner_),
        stream_(stream),
        layer_(kfac_, d_in, d_out, name),
        name_(name) {}

  void accumulate(bool a, kernels::ConstMatrixView<float> x, float scale, int unit_begin,
                  int unit_end) override {
    if (a) {
      layer_.accumulate_a(x, unit_begin, unit_end);
    } else {
      layer_.accumulate_b(x, scale, unit_begin, unit_end);
    }
  }
  std::int64_t pending_microbatches(bool a) const override {
    return (a ? layer_.a() : layer_.b()).microbatches;
  }
  void finalize(bool a, float running_average) override {
    if (a) {
      layer_.finalize_a(running_average);
    } else {
      layer_.finalize_b(running_average);
    }
  }
  kfac::FactorDamping damping(float lambda, bool pi_adjusted) override {
    return layer_.damping(lambda, pi_adjusted);
  }
  void invert(bool a, float damping, kfac::InverseMethod method) override {
    keep_previous_inverse(a);
    if (a) {
      layer_.invert_a(damping, method);
    } else {
      layer_.invert_b(damping, method);
    }
  }
  void begin_inverse_chain(bool a, float damping) override {
    layer_.begin_inverse_chain(a, damping);
  }
  void run_inverse_chain(bool a, int unit_begin, int unit_end) override {
    // The last piece installs the new inverse: the one it replaces is kept first.
    const auto* chain = layer_.inverse_chain(a);
    if (chain != nullptr && chain->next_unit() == unit_begin && unit_end == kfac::kPieceUnits) {
      keep_previous_inverse(a);
    }
    layer_.run_inverse_chain(a, unit_begin, unit_end);
  }
  bool has_inverse(bool a, bool previous) const override {
    if (previous) return a ? has_previous_a_ : has_previous_b_;
    const auto& factor = a ? layer_.a() : layer_.b();
    return factor.inverted && factor.inverse.numel() > 0;
  }
  void precondition(bool previous_a, bool previous_b, float* grad_w, float* grad_b) override {
    const float* a_inv = previous_a ? previous_a_.data<float>() : layer_.a().inverse.data<float>();
    const float* b_inv = previous_b ? previous_b_.data<float>() : layer_.b().inverse.data<float>();
    kfac_.precondition(a_inv, b_inv, grad_w, grad_b, layer_.d_out(), layer_.d_in(), grad_w, grad_b);
  }
  void precondition_rows(bool previous_a, bool previous_b, const float* grad_w, const float* grad_b,
                         int unit_begin, int unit_end, float* out_w, float* out_b) override {
    const float* a_inv = previous_a ? previous_a_.data<float>() : layer_.a().inverse.data<float>();
    const float* b_inv = previous_b ? previous_b_.data<float>() : layer_.b().inverse.data<float>();
    kfac_.precondition_rows(a_inv, b_inv, grad_w, grad_b, layer_.d_out(), layer_.d_in(), unit_begin,
                            unit_end, out_w, out_b);
  }
  kfac::KfacLayerState to_host() const override { return layer_.to_host(); }
  void load(const kfac::KfacLayerState& state) override { layer_.load(state); }
  void set_aside(bool a) override {
    auto& held = a ? set_aside_a_ : set_aside_b_;
    if (held.microbatches != 0 || held.accumulating) {
      throw std::logic_error("K-FAC " + name_ + ": the factor sums of two earlier refreshes are " +
                             "both unfinalized (" + (a ? "A" : "B") + ")");
    }
    layer_.exchange_accumulator(a, held);  // the layer gets the idle one
  }
  std::int64_t set_aside_microbatches(bool a) const override {
    return (a ? set_aside_a_ : set_aside_b_).microbatches;
  }
  void finalize_set_aside(bool a, float running_average) override {
    auto& held = a ? set_aside_a_ : set_aside_b_;
    if (held.microbatches == 0) {
      throw std::logic_error("K-FAC " + name_ + ": no set-aside " + (a ? "A" : "B") +
                             " sums to finalize");
    }
    layer_.exchange_accumulator(a, held);
    finalize(a, running_average);
    layer_.exchange_accumulator(a, held);  // the window's accumulation back; `held` idle again
  }
  std::span<float> sync_piece(bool a, bool set_aside, int unit_begin, int unit_end) override {
    if (!set_aside) return layer_.sync_piece(a, unit_begin, unit_end);
    auto& held = a ? set_aside_a_ : set_aside_b_;
    if (!held.accumulating) {
      throw std::logic_error("K-FAC " + name_ + ": no set-aside " + (a ? "A" : "B") +
                             " sums to sync");
    }
    kfac::check_piece_units(unit_begin, unit_end, "sync_piece");  // no throw while swapped
    // The set-aside buffer in the layer for the call; its device memory stays where it is.
    layer_.exchange_accumulator(a, held);
    const auto range = layer_.sync_piece(a, unit_begin, unit_end);
    layer_.exchange_accumulator(a, held);
    return range;
  }
  void set_microbatches(bool a, bool set_aside, std::int64_t count) override {
    if (set_aside) {
      (a ? set_aside_a_ : set_aside_b_).microbatches = count;
    } else {
      layer_.set_microbatches(a, count);
    }
  }
  tensor::Tensor detach(bool a, Matrix which) override {
    if (which != Matrix::kPreviousInverse) return layer_.detach(a, which == Matrix::kInverse);
    (a ? has_previous_a_ : has_previous_b_) = false;
    return std::exchange(a ? previous_a_ : previous_b_, tensor::Tensor());
  }
  tensor::Tensor attach(bool a, Matrix which, tensor::Tensor matrix) override {
    if (which != Matrix::kPreviousInverse) {
      return layer_.attach(a, which == Matrix::kInverse, std::move(matrix));
    }
    const std::int64_t d = a ? layer_.d_in() : layer_.d_out();
    if (matrix.numel() != d * d || matrix.dtype() != tensor::DType::kF32) {
      throw std::invalid_argument("K-FAC " + name_ + ": a " + std::to_string(matrix.numel()) +
                                  "-element matrix attached as " + (a ? "A" : "B") +
                                  "'s previous inverse (" + std::to_string(d) + " x " +
                                  std::to_string(d) + " floats)");
    }
    (a ? has_previous_a_ : has_previous_b_) = true;
    return std::exchange(a ? previous_a_ : previous_b_, std::move(matrix));
  }
  tensor::Tensor drop_sums(bool a, bool set_aside) override {
    if (!set_aside) return layer_.drop_sum(a);
    auto& held = a ? set_aside_a_ : set_aside_b_;
    held.accumulating = false;
    held.microbatches = 0;
    return std::exchange(held.sum, tensor::Tensor());
  }
  tensor::Tensor release_idle_sums(bool a) override {
    // The set-aside accumulator is idle between a finalize_set_aside and the next set_aside;
    // the layer's own is idle once finalized (finalize left it the value's old buffer).
    auto& held = a ? set_aside_a_ : set_aside_b_;
    if (!held.accumulating && held.microbatches == 0 && held.sum.numel() > 0) {
      // One buffer per call: the caller releases each; the next call gives the other.
      return std::exchange(held.sum, tensor::Tensor());
    }
    return layer_.release_idle_sum(a);
  }
  void allocate_with(Allocate allocate) override {
    allocate_ = allocate;
    layer_.allocate_with(std::move(allocate));
  }
  std::int64_t device_bytes() const override {
    std::int64_t bytes = layer_.device_bytes();
    for (const auto* matrix : {&previous_a_, &previous_b_, &set_aside_a_.sum, &set_aside_b_.sum}) {
      bytes += static_cast<std::int64_t>(matrix->nbytes());
    }
    return bytes;
  }
  KfacLayerExtras extras_to_host() const override {
    KfacLayerExtras extras;
    if (has_previous_a_) extras.previous_a_inverse = download(previous_a_, layer_.d_in());
    if (has_previous_b_) extras.previous_b_inverse = download(previous_b_, layer_.d_out());
    if (set_aside_a_.microbatches > 0) {
      extras.set_aside_a_sum = download(set_aside_a_.sum, layer_.d_in());
      extras.set_aside_a_microbatches = set_aside_a_.microbatches;
    }
    if (set_aside_b_.microbatches > 0) {
      extras.set_aside_b_sum = download(set_aside_b_.sum, layer_.d_out());
      extras.set_aside_b_microbatches = set_aside_b_.microbatches;
    }
    for (const bool a : {true, false}) {
      const auto* chain = layer_.inverse_chain(a);
      if (chain == nullptr) continue;
      (a ? extras.chain_a_factor : extras.chain_b_factor) = download(chain->factor(), chain->dim());
      (a ? extras.chain_a_damping : extras.chain_b_damping) = chain->damping();
      (a ? extras.chain_a_next_unit : extras.chain_b_next_unit) = chain->next_unit();
    }
    return extras;
  }
  void load_extras(const KfacLayerExtras& extras) override {
    check_extras(extras, layer_.d_in(), layer_.d_out(), name_);
    has_previous_a_ = upload(previous_a_, extras.previous_a_inverse);
    has_previous_b_ = upload(previous_b_, extras.previous_b_inverse);
    for (const bool a : {true, false}) {
      auto& held = a ? set_aside_a_ : set_aside_b_;
      held.accumulating = upload(held.sum, a ? extras.set_aside_a_sum : extras.set_aside_b_sum);
      held.microbatches = a ? extras.set_aside_a_microbatches : extras.set_aside_b_microbatches;
    }
    layer_.resume_inverse_chain(true, extras.chain_a_factor, extras.chain_a_damping,
                                extras.chain_a_next_unit);
    layer_.resume_inverse_chain(false, extras.chain_b_factor, extras.chain_b_damping,
                                extras.chain_b_next_unit);
  }

 private:
  // The factor's inverse becomes the previous one before an inversion replaces it. An inverse
  // detached by K-FAC offload is replaced by none (the executor brings the one a refresh's
  // earlier steps need from host memory).
  void keep_previous_inverse(bool a) {
    const auto& factor = a ? layer_.a() : layer_.b();
    auto& previous = a ? previous_a_ : previous_b_;
    bool& has_previous = a ? has_previous_a_ : has_previous_b_;
    has_previous = factor.inverted && factor.inverse.numel() > 0;
    if (!has_previous) return;
    if (!previous.defined() || previous.numel() == 0) {
      previous = allocate_ ? allocate_(factor.dim)
                           : tensor::Tensor::empty(kfac_.backend(), {factor.dim, factor.dim},
                                                   tensor::DType::kF32);
    }
    kfac_.backend().copy(previous.raw_data(), factor.inverse.raw_data(), previous.nbytes(),
                         tensor::CopyKind::kDeviceToDevice, stream_);
  }
  // The host waits for the work issued on the layer's stream.
  void wait() const {
    if (stream_ != nullptr) {
      stream_->synchronize();
    } else {
      kfac_.backend().synchronize();
    }
  }
  // A dim x dim device matrix (column-major, as Eigen's) to the host, after the stream's work.
  Eigen::MatrixXf download(const tensor::Tensor& matrix, std::int64_t dim) const {
    Eigen::MatrixXf host(dim, dim);
    kfac_.backend().copy(host.data(), matrix.raw_data(),
                         static_cast<std::size_t>(host.size()) * sizeof(float),
                         tensor::CopyKind::kDeviceToHost, stream_);
    wait();
    return host;
  }
  // Into `matrix` (allocated on first use); false for an empty host matrix (nothing held).
  bool upload(tensor::Tensor& matrix, const Eigen::MatrixXf& host) {
    if (host.size() == 0) return false;
    if (matrix.numel() != host.size()) {
      matrix =
          tensor::Tensor::empty(kfac_.backend(), {host.rows(), host.cols()}, tensor::DType::kF32);
    }
    kfac_.backend().copy(matrix.raw_data(), host.data(), matrix.nbytes(),
                         tensor::CopyKind::kHostToDevice, stream_);
    wait();  // `host` may go
    return true;
  }

  std::shared_ptr<kfac::cuda::KfacCuda> owner_;  // declared first: outlives layer_
  kfac::cuda::KfacCuda& kfac_;
  tensor::Stream* stream_;
  kfac::cuda::KfacLayerCuda layer_;
  tensor::Tensor previous_a_, previous_b_;
  bool has_previous_a_ = false, has_previous_b_ = false;
  // A pipelined refresh's set-aside sums (idle: not accumulating, no micro-batches).
  kfac::cuda::KfacLayerCuda::Accumulator set_aside_a_, set_aside_b_;
  Allocate allocate_;  // unset: the backend's
  std::string name_;
};

}  // namespace

CudaDeviceRuntime::CudaDeviceRuntime(int index, kernels::GemmPrecision precision,
                                     kernels::AttentionAlgorithm attention)
    : index_(index), precision_(precision), attention_(attention) {
  const int count = kernels::cuda::device_count();
  if (count == 0) {
    throw DeviceUnavailableError("--device cuda:" + std::to_string(index) +
                                 ": no CUDA device (the driver reports none)");
  }
  if (index < 0 || index >= count) {
    throw DeviceUnavailableError("--device cuda:" + std::to_string(index) +
                                 ": no such CUDA device (" + std::to_string(count) +
                                 " present: cuda:0.." + std::to_string(count - 1) + ")");
  }
  backend_ = std::make_unique<CudaBackend>(index);
}

PinnedHostBuffer CudaDeviceRuntime::allocate_pinned_host(std::size_t bytes) {
  if (bytes == 0) return {};
  void* data = nullptr;
  try {
    CUDA_CHECK(cudaHostAlloc(&data, bytes, cudaHostAllocDefault));
  } catch (const std::runtime_error& error) {
    throw std::runtime_error("pinned host memory of " + std::to_string(bytes) +
                             " bytes (K-FAC offload): " + error.what());
  }
  // cudaFreeHost's error cannot be reported from a destructor; it fails only for a bad pointer.
  return PinnedHostBuffer(data, bytes, [](void* pointer) { (void)cudaFreeHost(pointer); });
}

void CudaDeviceRuntime::bind_thread() {
  CUDA_CHECK(cudaSetDevice(index_));
}

std::unique_ptr<TimingMark> CudaDeviceRuntime::create_timing_mark() {
  return std::make_unique<CudaTimingMark>();
}

std::unique_ptr<optim::Optimizer> CudaDeviceRuntime::make_optimizer(const OptimizerChoice& choice,
                                                                    tensor::Stream* stream) {
  if (choice.name == "adamw") {
    return std::make_unique<optim::cuda::CudaAdamW>(*backend_, stream, choice.adamw);
  }
  if (choice.name == "sgd") {
    return std::make_unique<optim::cuda::CudaSgd>(*backend_, stream, choice.sgd);
  }
  if (choice.name == "lamb") {
    return std::make_unique<optim::cuda::CudaLamb>(*backend_, stream, choice.lamb);
  }
  throw std::invalid_argument("optimizer '" + choice.name + "': expected lamb, adamw or sgd");
}

std::unique_ptr<DeviceKfacLayer> CudaDeviceRuntime::make_kfac_layer(tensor::Stream* stream,
                                                                    std::int64_t d_in,
                                                                    std::int64_t d_out,
                                                                    const std::string& name) {
  std::shared_ptr<kfac::cuda::KfacCuda> kfac;
  {
    const std::lock_guard lock(mutex_);
    auto& slot = kfac_by_stream_[stream];
    kfac = slot.lock();
    if (!kfac) {
      kfac = std::make_shared<kfac::cuda::KfacCuda>(*backend_, stream);
      slot = kfac;
    }
  }
  return std::make_unique<CudaKfacLayer>(std::move(kfac), stream, d_in, d_out, name);
}

}  // namespace pf::device::cuda
