#include "runtime/executor/pinned_kfac_state.h"

#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

namespace pf::exec {
namespace {

using Matrix = device::DeviceKfacLayer::Matrix;

// A pinned buffer is replaced only once the copy stream has run the copies that may read or
// write it.
void replace_host(const OffloadStreams& on, device::PinnedHostBuffer& host, std::size_t bytes) {
  if (!host.empty()) on.copy->synchronize();
  host = on.runtime->allocate_pinned_host(bytes);
}

// Device buffer -> pinned host buffer on the copy stream (the host buffer allocated once); the
// device buffer goes back to staging after the copy. An empty one leaves the host holding none.
template <typename Held>
void copy_out(const OffloadStreams& on, tensor::Tensor device, Held& host) {
  if (device.numel() == 0) {
    host.held = false;
    return;
  }
  const std::size_t bytes = device.nbytes();
  if (host.buffer.bytes() != bytes) replace_host(on, host.buffer, bytes);
  on.runtime->backend().copy(host.buffer.data(), device.raw_data(), bytes,
                             tensor::CopyKind::kDeviceToHost, on.copy);
  host.held = true;
  release_staging(on, std::move(device), *on.copy);
}

// Pinned host buffer -> a staging buffer on the copy stream, attached to the layer as `which`
// (the buffer it replaces goes back after the compute stream's work so far); none on the host
// drops the layer's matrix.
template <typename Held>
void copy_in(const OffloadStreams& on, device::DeviceKfacLayer& layer, bool a, Matrix which,
             const Held& host, std::int64_t d) {
  if (!host.held) {
    release_staging(on, layer.detach(a, which), *on.compute);
    return;
  }
  const std::size_t bytes = static_cast<std::size_t>(d * d) * sizeof(float);
  if (host.buffer.bytes() != bytes) {
    throw std::logic_error("K-FAC offload: host copy of " + std::to_string(host.buffer.bytes()) +
                           " bytes for a " + std::to_string(d) + " x " + std::to_string(d) +
                           " factor");
  }
  auto buffer = on.staging->acquire({d, d}, tensor::DType::kF32, *on.copy);
  on.runtime->backend().copy(buffer.raw_data(), host.buffer.data(), bytes,
                             tensor::CopyKind::kHostToDevice, on.copy);
  release_staging(on, layer.attach(a, which, std::move(buffer)), *on.compute);
}

}  // namespace

void release_staging(const OffloadStreams& on, tensor::Tensor buffer, tensor::Stream& last_use) {
  if (buffer.numel() == 0) return;
  on.staging->release(std::move(buffer), last_use);
}

void PinnedKfacState::reserve(const OffloadStreams& on, std::int64_t d_in, std::int64_t d_out,
                              bool values, bool inverses) {
  for (const bool is_a : {true, false}) {
    Factor& host = is_a ? a_ : b_;
    const std::int64_t d = is_a ? d_in : d_out;
    const std::size_t bytes = static_cast<std::size_t>(d * d) * sizeof(float);
    for (Held* held : {&host.value, &host.inverse, &host.previous_inverse}) {
      if (!(held == &host.value ? values : inverses)) continue;
      if (held->buffer.bytes() != bytes) replace_host(on, held->buffer, bytes);
    }
  }
}

void PinnedKfacState::write_back(const OffloadStreams& on, device::DeviceKfacLayer& layer,
                                 bool new_a, bool new_b, bool this_round) {
  // The copies read what the compute stream's work so far (the inversion) wrote.
  const auto computed = on.runtime->backend().create_event();
  computed->record(*on.compute);
  on.copy->wait(*computed);
  for (const bool is_a : {true, false}) {
    Factor& host = is_a ? a_ : b_;
    copy_out(on, layer.detach(is_a, Matrix::kValue), host.value);
    if (!(is_a ? new_a : new_b)) continue;
    std::swap(host.previous_inverse, host.inverse);
    copy_out(on, layer.detach(is_a, Matrix::kInverse), host.inverse);
    (is_a ? written_a_ : written_b_) = this_round;
  }
}

void PinnedKfacState::prefetch_factors(const OffloadStreams& on, device::DeviceKfacLayer& layer,
                                       std::int64_t d_in, std::int64_t d_out) const {
  copy_in(on, layer, true, Matrix::kValue, a_.value, d_in);
  copy_in(on, layer, false, Matrix::kValue, b_.value, d_out);
}

void PinnedKfacState::prefetch_inverse(const OffloadStreams& on, device::DeviceKfacLayer& layer,
                                       bool a, bool previous, std::int64_t d, Matrix into) const {
  const Factor& host = a ? a_ : b_;
  copy_in(on, layer, a, into, previous ? host.previous_inverse : host.inverse, d);
}

OffloadedFactor PinnedKfacState::to_host(const OffloadStreams& on, bool a, std::int64_t d) const {
  on.copy->synchronize();
  const Factor& host = a ? a_ : b_;
  const auto matrix = [d](const Held& from) {
    if (!from.held) return Eigen::MatrixXf();
    if (from.buffer.bytes() != static_cast<std::size_t>(d * d) * sizeof(float)) {
      throw std::logic_error("K-FAC offload: pinned copy of " +
                             std::to_string(from.buffer.bytes()) + " bytes for a " +
                             std::to_string(d) + " x " + std::to_string(d) + " factor");
    }
    Eigen::MatrixXf to(d, d);
    std::memcpy(to.data(), from.buffer.data(), from.buffer.bytes());
    return to;
  };
  return {matrix(host.value), matrix(host.inverse), matrix(host.previous_inverse)};
}

void PinnedKfacState::load(const OffloadStreams& on, bool a, std::int64_t d,
                           const OffloadedFactor& factor, bool written) {
  for (const Eigen::MatrixXf* matrix : {&factor.value, &factor.inverse, &factor.previous_inverse}) {
    if (matrix->size() != 0 && (matrix->rows() != d || matrix->cols() != d)) {
      throw std::invalid_argument("K-FAC offload: a " + std::to_string(matrix->rows()) + " x " +
                                  std::to_string(matrix->cols()) + " host matrix for a " +
                                  std::to_string(d) + " x " + std::to_string(d) + " factor");
    }
  }
  on.copy->synchronize();  // no copy reads or writes the buffers replaced here
  Factor& host = a ? a_ : b_;
  const auto fill = [&](const Eigen::MatrixXf& from, Held& to) {
    to.held = from.size() != 0;
    if (!to.held) return;
    const std::size_t bytes = static_cast<std::size_t>(from.size()) * sizeof(float);
    if (to.buffer.bytes() != bytes) to.buffer = on.runtime->allocate_pinned_host(bytes);
    std::memcpy(to.buffer.data(), from.data(), bytes);
  };
  fill(factor.value, host.value);
  fill(factor.inverse, host.inverse);
  fill(factor.previous_inverse, host.previous_inverse);
  (a ? written_a_ : written_b_) = written;
}

std::int64_t PinnedKfacState::bytes() const {
  std::int64_t bytes = 0;
  for (const Factor* f : {&a_, &b_}) {
    for (const auto* held : {&f->value, &f->inverse, &f->previous_inverse}) {
      bytes += static_cast<std::int64_t>(held->buffer.bytes());
    }
  }
  return bytes;
}

}  // namespace pf::exec
