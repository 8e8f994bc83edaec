#include "runtime/executor/host_kfac_state.h"

#include <cstring>
#include <stdexcept>
#include <string>

namespace pf::exec {
namespace {

// Device matrix -> host buffer (memcpy of its contiguous storage); empty stays empty.
void copy_out(const Eigen::MatrixXf& from, std::vector<float>& to) {
  to.resize(static_cast<std::size_t>(from.size()));
  if (!to.empty()) std::memcpy(to.data(), from.data(), to.size() * sizeof(float));
}

// Host buffer -> device matrix d x d; an empty buffer gives an empty matrix.
void copy_in(const std::vector<float>& from, std::int64_t d, Eigen::MatrixXf& to) {
  if (from.empty()) {
    to = Eigen::MatrixXf();
    return;
  }
  if (static_cast<std::int64_t>(from.size()) != d * d) {
    throw std::logic_error("K-FAC offload: host copy of " + std::to_string(from.size()) +
                           " floats for a " + std::to_string(d) + " x " + std::to_string(d) +
                           " factor");
  }
  to.resize(d, d);
  std::memcpy(to.data(), from.data(), from.size() * sizeof(float));
}

}  // namespace

void HostKfacState::write_back(kfac::KfacLayerState& layer, bool new_a, bool new_b,
                               bool this_round) {
  for (const bool is_a : {true, false}) {
    kfac::FactorState& factor = is_a ? layer.a : layer.b;
    Factor& host = is_a ? a_ : b_;
    copy_out(factor.value, host.value);
    factor.value = Eigen::MatrixXf();
    if (!(is_a ? new_a : new_b)) continue;
    host.previous_inverse.swap(host.inverse);
    copy_out(factor.inverse, host.inverse);
    factor.inverse = Eigen::MatrixXf();
    (is_a ? written_a_ : written_b_) = this_round;
  }
}

void HostKfacState::prefetch_factors(kfac::KfacLayerState& layer) const {
  copy_in(a_.value, layer.d_in, layer.a.value);
  copy_in(b_.value, layer.d_out, layer.b.value);
}

void HostKfacState::prefetch_inverse(bool a, bool previous, std::int64_t d,
                                     Eigen::MatrixXf& into) const {
  const Factor& host = a ? a_ : b_;
  copy_in(previous ? host.previous_inverse : host.inverse, d, into);
}

OffloadedFactor HostKfacState::to_host(bool a, std::int64_t d) const {
  const Factor& host = a ? a_ : b_;
  OffloadedFactor factor;
  copy_in(host.value, d, factor.value);
  copy_in(host.inverse, d, factor.inverse);
  copy_in(host.previous_inverse, d, factor.previous_inverse);
  return factor;
}

void HostKfacState::load(bool a, std::int64_t d, const OffloadedFactor& factor, bool written) {
  for (const Eigen::MatrixXf* matrix : {&factor.value, &factor.inverse, &factor.previous_inverse}) {
    if (matrix->size() != 0 && (matrix->rows() != d || matrix->cols() != d)) {
      throw std::invalid_argument("K-FAC offload: a " + std::to_string(matrix->rows()) + " x " +
                                  std::to_string(matrix->cols()) + " host matrix for a " +
                                  std::to_string(d) + " x " + std::to_string(d) + " factor");
    }
  }
  Factor& host = a ? a_ : b_;
  copy_out(factor.value, host.value);
  copy_out(factor.inverse, host.inverse);
  copy_out(factor.previous_inverse, host.previous_inverse);
  (a ? written_a_ : written_b_) = written;
}

std::int64_t HostKfacState::bytes() const {
  std::int64_t floats = 0;
  for (const Factor* f : {&a_, &b_}) {
    floats +=
        static_cast<std::int64_t>(f->value.size() + f->inverse.size() + f->previous_inverse.size());
  }
  return floats * static_cast<std::int64_t>(sizeof(float));
}

}  // namespace pf::exec
