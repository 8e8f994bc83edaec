#include "kfac/cuda/layer_state_cuda.h"

#include <stdexcept>
#include <utility>

#include "kernels/cuda/cuda_check.h"

namespace pf::kfac::cuda {
namespace {

std::size_t matrix_bytes(std::int64_t dim) {
  return static_cast<std::size_t>(dim * dim) * sizeof(float);
}

Eigen::MatrixXf download(kernels::cuda::CudaBackend& backend, const tensor::Tensor& matrix,
                         std::int64_t dim) {
  Eigen::MatrixXf host(dim, dim);
  backend.synchronize();
  backend.copy(host.data(), matrix.raw_data(), matrix_bytes(dim), tensor::CopyKind::kDeviceToHost);
  backend.synchronize();
  return host;
}

void upload(kernels::cuda::CudaBackend& backend, tensor::Tensor& matrix,
            const Eigen::MatrixXf& host, std::int64_t dim, const char* what) {
  if (host.rows() != dim || host.cols() != dim) {
    throw std::invalid_argument(std::string("KfacLayerCuda::load: ") + what + " is " +
                                std::to_string(host.rows()) + " x " + std::to_string(host.cols()) +
                                ", expected " + std::to_string(dim) + " x " + std::to_string(dim));
  }
  backend.copy(matrix.raw_data(), host.data(), matrix_bytes(dim), tensor::CopyKind::kHostToDevice);
  backend.synchronize();
}

}  // namespace

DeviceFactor::DeviceFactor(std::int64_t dim_) : dim(dim_) {}

namespace {
// A dim x dim buffer for `matrix` unless it has one (contents undefined).
void ensure(kernels::cuda::CudaBackend& backend, tensor::Tensor& matrix, std::int64_t dim) {
  if (matrix.numel() != dim * dim) {
    matrix = tensor::Tensor::empty(backend, {dim, dim}, tensor::DType::kF32);
  }
}
bool present(const tensor::Tensor& matrix) {
  return matrix.numel() > 0;
}
}  // namespace

namespace {
std::int64_t positive(std::int64_t dim, std::int64_t d_in, std::int64_t d_out) {
  if (d_in <= 0 || d_out <= 0) {
    throw std::invalid_argument("KfacLayerCuda: dimensions must be positive, got d_in " +
                                std::to_string(d_in) + ", d_out " + std::to_string(d_out));
  }
  return dim;
}
}  // namespace

KfacLayerCuda::KfacLayerCuda(KfacCuda& kfac, std::int64_t d_in, std::int64_t d_out,
                             std::string name)
    : kfac_(&kfac),
      backend_(&kfac.backend()),
      name_(std::move(name)),
      a_(positive(d_in, d_in, d_out)),
      b_(positive(d_out, d_in, d_out)) {}

void KfacLayerCuda::accumulate(DeviceFactor& factor, kernels::ConstMatrixView<float> x, float scale,
                               int unit_begin, int unit_end, const char* which) {
  const std::int64_t tokens = x.rows;
  if (tokens <= 0) {
    throw std::invalid_argument(std::string("accumulate_") + which + ": " + name_ +
                                ": a micro-batch needs at least one token, got " +
                                std::to_string(tokens));
  }
  if (x.cols != factor.dim) {
    throw std::invalid_argument(std::string("accumulate_") + which + ": " + name_ + ": " +
                                std::to_string(x.cols) + " columns, the factor is " +
                                std::to_string(factor.dim) + " x " + std::to_string(factor.dim));
  }
  const ItemRange rows = piece_items(tokens, unit_begin, unit_end);
  if (!factor.accumulating) {
    ensure_buffer(factor.sum, factor.dim);
    CUDA_CHECK(
        cudaMemsetAsync(factor.sum.raw_data(), 0, matrix_bytes(factor.dim), kfac_->ops().stream()));
    factor.accumulating = true;
  }
  if (rows.size() > 0) {
    kfac_->add_gram_lower(factor.sum.data<float>(), x.block_rows(rows.begin, rows.size()), scale);
  }
  if (unit_end == kPieceUnits) ++factor.microbatches;
}

void KfacLayerCuda::accumulate_a(kernels::ConstMatrixView<float> a, int unit_begin, int unit_end) {
  accumulate(a_, a, a.rows > 0 ? 1.0F / static_cast<float>(a.rows) : 0.0F, unit_begin, unit_end,
             "a");
}

void KfacLayerCuda::accumulate_b(kernels::ConstMatrixView<float> g, float output_grad_scale,
                                 int unit_begin, int unit_end) {
  if (!(output_grad_scale > 0.0F)) {
    throw std::invalid_argument("accumulate_b: " + name_ + ": output_grad_scale must be > 0, got " +
                                std::to_string(output_grad_scale));
  }
  accumulate(b_, g, output_grad_scale, unit_begin, unit_end, "b");
}

void KfacLayerCuda::finalize(DeviceFactor& factor, float running_average, const char* which) {
  if (factor.microbatches == 0) {
    throw std::logic_error(std::string("finalize_") + which + ": " + name_ +
                           ": no micro-batch was accumulated since the last refresh");
  }
  if (!(running_average >= 0.0F && running_average < 1.0F)) {
    throw std::invalid_argument(std::string("finalize_") + which + ": " + name_ +
                                ": running_average must lie in [0, 1), got " +
                                std::to_string(running_average));
  }
  const bool blends = running_average != 0.0F && factor.refreshes > 0;
  if (blends && !present(factor.value)) {
    throw std::logic_error(std::string("finalize_") + which + ": " + name_ +
                           ": a running average without the factor's value on the device "
                           "(offloaded and not prefetched)");
  }
  float* mean = factor.sum.data<float>();
  kfac_->blend(mean, mean, factor.dim, 1.0F / static_cast<float>(factor.microbatches), 0.0F);
  kfac_->fill_upper_from_lower(mean, factor.dim);
  if (!blends) {
    // The old value's memory (if any) becomes the next accumulator.
    std::swap(factor.value, factor.sum);
  } else {
    kfac_->blend(factor.value.data<float>(), mean, factor.dim, running_average,
                 1.0F - running_average);
  }
  factor.accumulating = false;
  factor.microbatches = 0;
  ++factor.refreshes;
}

void KfacLayerCuda::finalize_a(float running_average) {
  finalize(a_, running_average, "a");
}
void KfacLayerCuda::finalize_b(float running_average) {
  finalize(b_, running_average, "b");
}

FactorDamping KfacLayerCuda::damping(float lambda, bool pi_adjusted) {
  if (a_.refreshes == 0 || b_.refreshes == 0) {
    throw std::logic_error("layer_damping: " + name_ + ": both factors must be finalized first");
  }
  if (!present(a_.value) || !present(b_.value)) {
    throw std::logic_error("layer_damping: " + name_ +
                           ": a factor's value is not on the device (offloaded and not "
                           "prefetched)");
  }
  return kfac_->factored_damping(a_.value.data<float>(), a_.dim, b_.value.data<float>(), b_.dim,
                                 lambda, pi_adjusted);
}

void KfacLayerCuda::require_value(const DeviceFactor& factor, const char* which) const {
  if (factor.refreshes == 0) {
    throw std::logic_error(std::string("invert_") + which + ": " + name_ +
                           ": the factor was never finalized");
  }
  if (!present(factor.value)) {
    throw std::logic_error(std::string("invert_") + which + ": " + name_ +
                           ": the factor's value is not on the device (offloaded and not "
                           "prefetched)");
  }
}

void KfacLayerCuda::mark_inverted(DeviceFactor& factor, float damping,
                                  const DeviceInverseResult& result) {
  factor.inverted = true;
  factor.damping = damping;
  factor.inverted_refresh = factor.refreshes;
  if (result.fell_back_to_eigen) ++factor.cholesky_fallbacks;
}

DeviceInverseResult KfacLayerCuda::invert(DeviceFactor& factor, float damping, InverseMethod method,
                                          const char* which) {
  require_value(factor, which);
  ensure_buffer(factor.inverse, factor.dim);
  const auto result = kfac_->damped_inverse(factor.value.data<float>(), factor.dim, damping, method,
                                            factor.inverse.data<float>(), name_ + " " + which);
  mark_inverted(factor, damping, result);
  return result;
}

DeviceInverseResult KfacLayerCuda::invert_a(float damping, InverseMethod method) {
  return invert(a_, damping, method, "A");
}
DeviceInverseResult KfacLayerCuda::invert_b(float damping, InverseMethod method) {
  return invert(b_, damping, method, "B");
}

void KfacLayerCuda::precondition(const float* grad_w, const float* grad_b, float* out_w,
                                 float* out_b) {
  if (!a_.inverted || !b_.inverted || !present(a_.inverse) || !present(b_.inverse)) {
    throw std::logic_error("precondition_layer: " + name_ +
                           ": both inverses must be computed (and on the device) first");
  }
  kfac_->precondition(a_.inverse.data<float>(), b_.inverse.data<float>(), grad_w, grad_b, b_.dim,
                      a_.dim, out_w, out_b);
}

void KfacLayerCuda::exchange_accumulator(bool a, Accumulator& other) {
  DeviceFactor& factor = a ? a_ : b_;
  if (other.sum.numel() != factor.dim * factor.dim) {
    // Uninitialized: an accumulator that is not accumulating is cleared on the stream by its
    // first curvature task.
    other.sum = tensor::Tensor();
    ensure_buffer(other.sum, factor.dim);
  }
  std::swap(factor.sum, other.sum);
  std::swap(factor.accumulating, other.accumulating);
  std::swap(factor.microbatches, other.microbatches);
}

std::span<float> KfacLayerCuda::sync_piece(bool a, int unit_begin, int unit_end) {
  check_piece_units(unit_begin, unit_end, "sync_piece");
  DeviceFactor& factor = a ? a_ : b_;
  if (!factor.accumulating) {
    throw std::logic_error(std::string("sync_piece: ") + name_ + ": factor " + (a ? "A" : "B") +
                           " has no accumulated curvature to sync");
  }
  const ItemRange columns = piece_items(factor.dim, unit_begin, unit_end);
  return {factor.sum.data<float>() + columns.begin * factor.dim,
          static_cast<std::size_t>(columns.size() * factor.dim)};
}

void KfacLayerCuda::set_microbatches(bool a, std::int64_t count) {
  (a ? a_ : b_).microbatches = count;
}

tensor::Tensor KfacLayerCuda::detach(bool a, bool inverse) {
  DeviceFactor& factor = a ? a_ : b_;
  return std::exchange(inverse ? factor.inverse : factor.value, tensor::Tensor());
}

tensor::Tensor KfacLayerCuda::attach(bool a, bool inverse, tensor::Tensor matrix) {
  DeviceFactor& factor = a ? a_ : b_;
  if (matrix.numel() != factor.dim * factor.dim || matrix.dtype() != tensor::DType::kF32) {
    throw std::invalid_argument("KfacLayerCuda::attach: " + name_ + ": a " +
                                std::to_string(matrix.numel()) + "-element matrix as " +
                                (a ? "A" : "B") + "'s (" + std::to_string(factor.dim) + " x " +
                                std::to_string(factor.dim) + " floats)");
  }
  if (inverse) factor.inverted = true;
  return std::exchange(inverse ? factor.inverse : factor.value, std::move(matrix));
}

tensor::Tensor KfacLayerCuda::drop_sum(bool a) {
  DeviceFactor& factor = a ? a_ : b_;
  factor.accumulating = false;
  factor.microbatches = 0;
  return std::exchange(factor.sum, tensor::Tensor());
}

void KfacLayerCuda::ensure_buffer(tensor::Tensor& matrix, std::int64_t dim) {
  if (matrix.numel() == dim * dim) return;
  matrix = allocate_ ? allocate_(dim)
                     : tensor::Tensor::empty(*backend_, {dim, dim}, tensor::DType::kF32);
}

tensor::Tensor KfacLayerCuda::release_idle_sum(bool a) {
  DeviceFactor& factor = a ? a_ : b_;
  if (factor.accumulating) return {};
  return std::exchange(factor.sum, tensor::Tensor());
}

void KfacLayerCuda::begin_inverse_chain(bool a, float damping) {
  DeviceFactor& factor = a ? a_ : b_;
  const char* which = a ? "A" : "B";
  require_value(factor, which);
  (a ? chain_a_ : chain_b_) = std::make_unique<InverseChainCuda>(
      *kfac_, factor.value.data<float>(), factor.dim, damping, name_ + " " + which);
}

std::optional<DeviceInverseResult> KfacLayerCuda::run_inverse_chain(bool a, int unit_begin,
                                                                    int unit_end) {
  auto& chain = a ? chain_a_ : chain_b_;
  if (!chain) {
    throw std::logic_error("inversion piece [" + std::to_string(unit_begin) + ", " +
                           std::to_string(unit_end) + ") of " + name_ + " " + (a ? "A" : "B") +
                           " without the chain's first piece");
  }
  chain->run(unit_begin, unit_end);
  if (!chain->finished()) return std::nullopt;
  DeviceFactor& factor = a ? a_ : b_;
  const float damping = chain->damping();
  auto result = chain->take();
  chain.reset();
  // The replaced inverse's buffer serves the next chain (work issued so far on this stream,
  // the previous inverse's copy included, reads it first).
  kfac_->give_back(std::exchange(factor.inverse, std::move(result.inverse)));
  mark_inverted(factor, damping, result.status);
  return result.status;
}

void KfacLayerCuda::resume_inverse_chain(bool a, const Eigen::MatrixXf& factor, float damping,
                                         int next_unit) {
  auto& chain = a ? chain_a_ : chain_b_;
  chain.reset();
  if (next_unit == 0) return;
  const std::int64_t dim = (a ? a_ : b_).dim;
  tensor::Tensor staged = tensor::Tensor::empty(*backend_, {dim, dim}, tensor::DType::kF32);
  upload(*backend_, staged, factor, dim, "the inversion chain's factor");
  auto resumed = std::make_unique<InverseChainCuda>(*kfac_, staged.data<float>(), dim, damping,
                                                    name_ + " " + (a ? "A" : "B"));
  resumed->run(0, next_unit);
  chain = std::move(resumed);
}

std::int64_t KfacLayerCuda::device_bytes() const {
  std::int64_t bytes = 0;
  for (const auto* chain : {chain_a_.get(), chain_b_.get()}) {
    if (chain != nullptr) bytes += chain->device_bytes();
  }
  for (const auto* factor : {&a_, &b_}) {
    for (const auto* matrix : {&factor->sum, &factor->value, &factor->inverse}) {
      bytes += static_cast<std::int64_t>(matrix->nbytes());
    }
  }
  return bytes;
}

KfacLayerState KfacLayerCuda::to_host() const {
  KfacLayerState host(a_.dim, b_.dim);
  const auto copy = [&](const DeviceFactor& from, FactorState& to) {
    if (from.accumulating) to.sum = download(*backend_, from.sum, from.dim);
    to.microbatches = from.microbatches;
    if (from.refreshes > 0 && present(from.value)) {
      to.value = download(*backend_, from.value, from.dim);
    }
    to.refreshes = from.refreshes;
    if (from.inverted && present(from.inverse))
      to.inverse = download(*backend_, from.inverse, from.dim);
    to.damping = from.damping;
    to.inverted_refresh = from.inverted_refresh;
    to.cholesky_fallbacks = from.cholesky_fallbacks;
  };
  copy(a_, host.a);
  copy(b_, host.b);
  return host;
}

void KfacLayerCuda::load(const KfacLayerState& host) {
  if (host.d_in != a_.dim || host.d_out != b_.dim) {
    throw std::invalid_argument("KfacLayerCuda::load: " + name_ + ": the state is " +
                                std::to_string(host.d_out) + " x " + std::to_string(host.d_in) +
                                ", the layer " + std::to_string(b_.dim) + " x " +
                                std::to_string(a_.dim));
  }
  const auto copy = [&](const FactorState& from, DeviceFactor& to) {
    to.accumulating = from.sum.size() > 0;
    if (to.accumulating) {
      ensure(*backend_, to.sum, to.dim);
      upload(*backend_, to.sum, from.sum, to.dim, "sum");
    }
    to.microbatches = from.microbatches;
    if (from.value.size() > 0) {
      ensure(*backend_, to.value, to.dim);
      upload(*backend_, to.value, from.value, to.dim, "value");
    } else {
      to.value = tensor::Tensor();
    }
    to.refreshes = from.value.size() > 0 ? from.refreshes : 0;
    to.inverted = from.inverse.size() > 0;
    if (to.inverted) {
      ensure(*backend_, to.inverse, to.dim);
      upload(*backend_, to.inverse, from.inverse, to.dim, "inverse");
    } else {
      to.inverse = tensor::Tensor();
    }
    to.damping = from.damping;
    to.inverted_refresh = from.inverted_refresh;
    to.cholesky_fallbacks = from.cholesky_fallbacks;
  };
  copy(host.a, a_);
  copy(host.b, b_);
}

}  // namespace pf::kfac::cuda
