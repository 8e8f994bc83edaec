#include "runtime/device/host_device_runtime.h"

#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>

#include "kfac/inverse_chain.h"
#include "kfac/layer_state.h"
#include "kfac/pieces.h"
#include "kfac/precondition.h"
#include "runtime/device/stream_timeline.h"

namespace pf::device {

namespace {

// kfac/layer_state.h's functions on one KfacLayerState, keeping the inverses an inversion
// replaced (what the CPU path's KfacSlot keeps as previous_*_inverse).
class HostKfacLayer final : public DeviceKfacLayer {
 public:
  HostKfacLayer(tensor::Backend& backend, std::int64_t d_in, std::int64_t d_out, std::string name)
      : backend_(&backend), layer_(d_in, d_out), name_(std::move(name)) {}

  void accumulate(bool a, kernels::ConstMatrixView<float> x, float scale, int unit_begin,
                  int unit_end) override {
    if (!x.contiguous()) {
      throw std::invalid_argument("K-FAC " + name_ + ": curvature from a strided view (ld " +
                                  std::to_string(x.ld) + ", " + std::to_string(x.cols) +
                                  " columns); the host layer takes contiguous rows");
    }
    if (a) {
      kfac::accumulate_a(layer_, x.data, x.rows, unit_begin, unit_end);
    } else {
      kfac::accumulate_b(layer_, x.data, x.rows, scale, unit_begin, unit_end);
    }
  }
  std::int64_t pending_microbatches(bool a) const override {
    return (a ? layer_.a : layer_.b).microbatches;
  }
  void finalize(bool a, float running_average) override {
    const auto& factor = a ? layer_.a : layer_.b;
    if (running_average != 0.0F && factor.refreshes > 0 && factor.value.size() == 0) {
      missing(a, "value", "finalize with a running average");
    }
    if (a) {
      kfac::finalize_a(layer_, running_average);
    } else {
      kfac::finalize_b(layer_, running_average);
    }
  }
  kfac::FactorDamping damping(float lambda, bool pi_adjusted) override {
    for (const bool a : {true, false}) {
      const auto& factor = a ? layer_.a : layer_.b;
      if (factor.refreshes > 0 && factor.value.size() == 0) missing(a, "value", "damping");
    }
    return kfac::layer_damping(layer_, lambda, pi_adjusted);
  }
  void invert(bool a, float damping, kfac::InverseMethod method) override {
    const auto& factor = a ? layer_.a : layer_.b;
    if (factor.refreshes > 0 && factor.value.size() == 0) missing(a, "value", "inversion");
    (a ? previous_a_ : previous_b_) = (a ? layer_.a : layer_.b).inverse;
    if (a) {
      kfac::invert_a(layer_, damping, method);
    } else {
      kfac::invert_b(layer_, damping, method);
    }
  }
  void begin_inverse_chain(bool a, float damping) override {
    const auto& factor = a ? layer_.a : layer_.b;
    if (factor.refreshes == 0) {
      throw std::logic_error("K-FAC " + name_ + ": inversion of factor " + (a ? "A" : "B") +
                             ", which was never finalized");
    }
    if (factor.value.size() == 0) missing(a, "value", "inversion");
    (a ? chain_a_ : chain_b_) = std::make_unique<kfac::InverseChain>(factor.value, damping);
  }
  void run_inverse_chain(bool a, int unit_begin, int unit_end) override {
    auto& chain = a ? chain_a_ : chain_b_;
    if (!chain) {
      throw std::logic_error("K-FAC " + name_ + ": inversion piece [" + std::to_string(unit_begin) +
                             ", " + std::to_string(unit_end) + ") of factor " + (a ? "A" : "B") +
                             " without the chain's first piece");
    }
    try {
      chain->run(unit_begin, unit_end);
    } catch (const std::logic_error& error) {
      throw std::logic_error("K-FAC " + name_ + " (" + (a ? "A" : "B") + "): " + error.what());
    }
    if (!chain->finished()) return;
    auto& factor = a ? layer_.a : layer_.b;
    (a ? previous_a_ : previous_b_) = factor.inverse;
    const float damping = chain->damping();
    kfac::set_inverse(factor, chain->take(), damping);
    chain.reset();
  }
  bool has_inverse(bool a, bool previous) const override {
    const auto& inverse =
        previous ? (a ? previous_a_ : previous_b_) : (a ? layer_.a : layer_.b).inverse;
    return inverse.size() > 0;
  }
  void precondition(bool previous_a, bool previous_b, float* grad_w, float* grad_b) override {
    const auto [a_inv, b_inv] = inverses(previous_a, previous_b);
    kfac::precondition(*a_inv, *b_inv, grad_w, grad_b, layer_.d_out, layer_.d_in, grad_w, grad_b);
  }
  void precondition_rows(bool previous_a, bool previous_b, const float* grad_w, const float* grad_b,
                         int unit_begin, int unit_end, float* out_w, float* out_b) override {
    const auto [a_inv, b_inv] = inverses(previous_a, previous_b);
    kfac::precondition_rows(*a_inv, *b_inv, grad_w, grad_b, layer_.d_out, layer_.d_in, unit_begin,
                            unit_end, out_w, out_b);
  }
  kfac::KfacLayerState to_host() const override { return layer_; }
  void load(const kfac::KfacLayerState& state) override {
    if (state.d_in != layer_.d_in || state.d_out != layer_.d_out) {
      throw std::invalid_argument("K-FAC " + name_ + ": the state is " +
                                  std::to_string(state.d_out) + " x " + std::to_string(state.d_in) +
                                  ", the layer " + std::to_string(layer_.d_out) + " x " +
                                  std::to_string(layer_.d_in));
    }
    layer_ = state;
  }
  // The executor's CPU path's arithmetic on the same matrices (its begin_round and wrapped
  // inversions), so that a pipelined refresh gives its bits.
  void set_aside(bool a) override {
    auto& factor = a ? layer_.a : layer_.b;
    auto& count = a ? set_aside_a_microbatches_ : set_aside_b_microbatches_;
    if (count != 0) {
      throw std::logic_error("K-FAC " + name_ + ": the factor sums of two earlier refreshes are " +
                             "both unfinalized (" + (a ? "A" : "B") + ")");
    }
    (a ? set_aside_a_sum_ : set_aside_b_sum_) = std::move(factor.sum);
    factor.sum = Eigen::MatrixXf();
    count = factor.microbatches;
    factor.microbatches = 0;
  }
  std::int64_t set_aside_microbatches(bool a) const override {
    return a ? set_aside_a_microbatches_ : set_aside_b_microbatches_;
  }
  void finalize_set_aside(bool a, float running_average) override {
    auto& factor = a ? layer_.a : layer_.b;
    auto& sum = a ? set_aside_a_sum_ : set_aside_b_sum_;
    auto& count = a ? set_aside_a_microbatches_ : set_aside_b_microbatches_;
    if (count == 0) {
      throw std::logic_error("K-FAC " + name_ + ": no set-aside " + (a ? "A" : "B") +
                             " sums to finalize");
    }
    std::swap(factor.sum, sum);
    std::swap(factor.microbatches, count);
    finalize(a, running_average);
    std::swap(factor.sum, sum);  // the window's accumulation back; the set-aside is released
    std::swap(factor.microbatches, count);
  }
  std::span<float> sync_piece(bool a, bool set_aside, int unit_begin, int unit_end) override {
    if (!set_aside) return kfac::sync_piece(a ? layer_.a : layer_.b, unit_begin, unit_end);
    Eigen::MatrixXf& sum = a ? set_aside_a_sum_ : set_aside_b_sum_;
    if (sum.size() == 0) {
      throw std::logic_error("K-FAC " + name_ + ": no set-aside " + (a ? "A" : "B") +
                             " sums to sync");
    }
    const std::int64_t d = sum.rows();
    const kfac::ItemRange columns = kfac::piece_items(d, unit_begin, unit_end);
    return {sum.data() + columns.begin * d, static_cast<std::size_t>(columns.size() * d)};
  }
  void set_microbatches(bool a, bool set_aside, std::int64_t count) override {
    if (set_aside) {
      (a ? set_aside_a_microbatches_ : set_aside_b_microbatches_) = count;
    } else {
      (a ? layer_.a : layer_.b).microbatches = count;
    }
  }
  KfacLayerExtras extras_to_host() const override {
    KfacLayerExtras extras;
    extras.previous_a_inverse = previous_a_;
    extras.previous_b_inverse = previous_b_;
    extras.set_aside_a_sum = set_aside_a_sum_;
    extras.set_aside_b_sum = set_aside_b_sum_;
    extras.set_aside_a_microbatches = set_aside_a_microbatches_;
    extras.set_aside_b_microbatches = set_aside_b_microbatches_;
    if (chain_a_) {
      extras.chain_a_factor = chain_a_->factor();
      extras.chain_a_damping = chain_a_->damping();
      extras.chain_a_next_unit = chain_a_->next_unit();
    }
    if (chain_b_) {
      extras.chain_b_factor = chain_b_->factor();
      extras.chain_b_damping = chain_b_->damping();
      extras.chain_b_next_unit = chain_b_->next_unit();
    }
    return extras;
  }
  void load_extras(const KfacLayerExtras& extras) override {
    check_extras(extras, layer_.d_in, layer_.d_out, name_);
    previous_a_ = extras.previous_a_inverse;
    previous_b_ = extras.previous_b_inverse;
    set_aside_a_sum_ = extras.set_aside_a_sum;
    set_aside_b_sum_ = extras.set_aside_b_sum;
    set_aside_a_microbatches_ = extras.set_aside_a_microbatches;
    set_aside_b_microbatches_ = extras.set_aside_b_microbatches;
    chain_a_ =
        resume_chain(extras.chain_a_factor, extras.chain_a_damping, extras.chain_a_next_unit);
    chain_b_ =
        resume_chain(extras.chain_b_factor, extras.chain_b_damping, extras.chain_b_next_unit);
  }
  // The matrices are Eigen's (the CPU's K-FAC functions run on them): a detached one is copied
  // into a tensor of the backend, an attached one out of it (the CPU backend's copies have run
  // when they return, so the tensor holds its contents by then).
  tensor::Tensor detach(bool a, Matrix which) override {
    Eigen::MatrixXf& matrix = matrix_of(a, which);
    if (matrix.size() == 0) return {};
    auto buffer = allocate_ ? allocate_(matrix.rows())
                            : tensor::Tensor::empty(*backend_, {matrix.rows(), matrix.cols()},
                                                    tensor::DType::kF32);
    std::memcpy(buffer.raw_data(), matrix.data(), buffer.nbytes());
    matrix = Eigen::MatrixXf();
    return buffer;
  }
  tensor::Tensor attach(bool a, Matrix which, tensor::Tensor matrix) override {
    const std::int64_t d = a ? layer_.d_in : layer_.d_out;
    if (matrix.numel() != d * d || matrix.dtype() != tensor::DType::kF32) {
      throw std::invalid_argument("K-FAC " + name_ + ": a " + std::to_string(matrix.numel()) +
                                  "-element matrix attached as " + (a ? "A" : "B") + "'s (" +
                                  std::to_string(d) + " x " + std::to_string(d) + " floats)");
    }
    auto replaced = detach(a, which);
    Eigen::MatrixXf& into = matrix_of(a, which);
    into.resize(d, d);
    std::memcpy(into.data(), matrix.raw_data(), matrix.nbytes());
    return replaced;
  }
  tensor::Tensor drop_sums(bool a, bool set_aside) override {
    if (set_aside) {
      (a ? set_aside_a_sum_ : set_aside_b_sum_) = Eigen::MatrixXf();
      (a ? set_aside_a_microbatches_ : set_aside_b_microbatches_) = 0;
    } else {
      auto& factor = a ? layer_.a : layer_.b;
      factor.sum = Eigen::MatrixXf();
      factor.microbatches = 0;
    }
    return {};
  }
  // kfac::finalize frees the sums, so none are ever idle here; an idle set-aside sum is freed
  // by finalize_set_aside too.
  tensor::Tensor release_idle_sums(bool /*a*/) override { return {}; }
  void allocate_with(Allocate allocate) override { allocate_ = std::move(allocate); }
  std::int64_t device_bytes() const override {
    std::int64_t floats =
        previous_a_.size() + previous_b_.size() + set_aside_a_sum_.size() + set_aside_b_sum_.size();
    for (const auto* factor : {&layer_.a, &layer_.b}) {
      floats += factor->sum.size() + factor->value.size() + factor->inverse.size();
    }
    std::int64_t bytes = floats * static_cast<std::int64_t>(sizeof(float));
    for (const auto* chain : {chain_a_.get(), chain_b_.get()}) {
      if (chain != nullptr) bytes += chain->bytes();
    }
    return bytes;
  }

 private:
  Eigen::MatrixXf& matrix_of(bool a, Matrix which) {
    auto& factor = a ? layer_.a : layer_.b;
    switch (which) {
      case Matrix::kValue:
        return factor.value;
      case Matrix::kInverse:
        return factor.inverse;
      case Matrix::kPreviousInverse:
        break;
    }
    return a ? previous_a_ : previous_b_;
  }
  // The inverses a preconditioning reads (the newest or the ones they replaced).
  std::pair<const Eigen::MatrixXf*, const Eigen::MatrixXf*> inverses(bool previous_a,
                                                                     bool previous_b) const {
    const Eigen::MatrixXf& a_inv = previous_a ? previous_a_ : layer_.a.inverse;
    const Eigen::MatrixXf& b_inv = previous_b ? previous_b_ : layer_.b.inverse;
    if (a_inv.size() == 0)
      missing(true, previous_a ? "previous inverse" : "inverse", "precondition");
    if (b_inv.size() == 0)
      missing(false, previous_b ? "previous inverse" : "inverse", "precondition");
    return {&a_inv, &b_inv};
  }
  // A chain rebuilt from a checkpoint's extras (checked already): none for next unit 0.
  static std::unique_ptr<kfac::InverseChain> resume_chain(const Eigen::MatrixXf& factor,
                                                          float damping, int next_unit) {
    if (next_unit == 0) return nullptr;
    auto chain = std::make_unique<kfac::InverseChain>(factor, damping);
    chain->run(0, next_unit);
    return chain;
  }
  [[noreturn]] void missing(bool a, const char* matrix, const char* what) const {
    throw std::logic_error("K-FAC " + name_ + ": " + what + " without factor " + (a ? "A" : "B") +
                           "'s " + matrix + " on the device (offloaded and not prefetched)");
  }

  tensor::Backend* backend_;
  Allocate allocate_;  // detach's buffers (unset: the backend's)
  kfac::KfacLayerState layer_;
  Eigen::MatrixXf previous_a_, previous_b_;
  Eigen::MatrixXf set_aside_a_sum_, set_aside_b_sum_;
  std::int64_t set_aside_a_microbatches_ = 0, set_aside_b_microbatches_ = 0;
  std::unique_ptr<kfac::InverseChain> chain_a_, chain_b_;  // divided inversions in progress
  std::string name_;
};

}  // namespace

std::unique_ptr<optim::Optimizer> make_host_optimizer(const OptimizerChoice& choice) {
  if (choice.name == "adamw") return std::make_unique<optim::BasicAdamW<float>>(choice.adamw);
  if (choice.name == "sgd") return std::make_unique<optim::BasicSgd<float>>(choice.sgd);
  if (choice.name == "lamb") return std::make_unique<optim::BasicLamb<float>>(choice.lamb);
  throw std::invalid_argument("optimizer '" + choice.name + "': expected lamb, adamw or sgd");
}

std::unique_ptr<TimingMark> HostDeviceRuntime::create_timing_mark() {
  return std::make_unique<HostTimingMark>();
}

std::unique_ptr<optim::Optimizer> HostDeviceRuntime::make_optimizer(const OptimizerChoice& choice,
                                                                    tensor::Stream* /*stream*/) {
  return make_host_optimizer(choice);
}

std::unique_ptr<DeviceKfacLayer> HostDeviceRuntime::make_kfac_layer(tensor::Stream* /*stream*/,
                                                                    std::int64_t d_in,
                                                                    std::int64_t d_out,
                                                                    const std::string& name) {
  return std::make_unique<HostKfacLayer>(backend_, d_in, d_out, name);
}

PinnedHostBuffer HostDeviceRuntime::allocate_pinned_host(std::size_t bytes) {
  if (bytes == 0) return {};
  // 64-byte aligned, as the backend's allocations (aligned_alloc wants a multiple of it).
  void* data = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  if (data == nullptr) {
    throw std::runtime_error("pinned host memory: cannot allocate " + std::to_string(bytes) +
                             " bytes");
  }
  return PinnedHostBuffer(data, bytes, [](void* pointer) { std::free(pointer); });
}

}  // namespace pf::device
