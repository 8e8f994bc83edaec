#include "runtime/device/kfac_layer_extras.h"

#include <stdexcept>

#include "kfac/pieces.h"

namespace pf::device {

namespace {

void check_matrix(const Eigen::MatrixXf& matrix, std::int64_t dim, const std::string& layer,
                  const char* what) {
  if (matrix.size() == 0 || (matrix.rows() == dim && matrix.cols() == dim)) return;
  throw std::invalid_argument("K-FAC " + layer + ": " + what + " is " +
                              std::to_string(matrix.rows()) + " x " +
                              std::to_string(matrix.cols()) + ", the factor is " +
                              std::to_string(dim) + " x " + std::to_string(dim));
}

void check_set_aside(const Eigen::MatrixXf& sum, std::int64_t microbatches,
                     const std::string& layer, const char* what) {
  if (microbatches < 0) {
    throw std::invalid_argument("K-FAC " + layer + ": " + what + " counts " +
                                std::to_string(microbatches) + " micro-batches");
  }
  if ((microbatches > 0) != (sum.size() > 0)) {
    throw std::invalid_argument("K-FAC " + layer + ": " + what + " counts " +
                                std::to_string(microbatches) + " micro-batches but " +
                                (sum.size() > 0 ? "holds a sum" : "has no sum"));
  }
}

void check_chain(const Eigen::MatrixXf& factor, float damping, int next_unit,
                 const std::string& layer, const char* what) {
  if (next_unit == 0 && factor.size() == 0) return;
  if (next_unit <= 0 || next_unit >= kfac::kPieceUnits) {
    throw std::invalid_argument("K-FAC " + layer + ": " + what + " is at unit " +
                                std::to_string(next_unit) + ", not inside (0, " +
                                std::to_string(kfac::kPieceUnits) + ")");
  }
  if (factor.size() == 0) {
    throw std::invalid_argument("K-FAC " + layer + ": " + what + " has no factor");
  }
  if (!(damping >= 0.0F)) {
    throw std::invalid_argument("K-FAC " + layer + ": " + what + " has damping " +
                                std::to_string(damping));
  }
}

}  // namespace

void check_extras(const KfacLayerExtras& extras, std::int64_t d_in, std::int64_t d_out,
                  const std::string& layer) {
  check_matrix(extras.previous_a_inverse, d_in, layer, "the previous A inverse");
  check_matrix(extras.previous_b_inverse, d_out, layer, "the previous B inverse");
  check_matrix(extras.set_aside_a_sum, d_in, layer, "the set-aside A sum");
  check_matrix(extras.set_aside_b_sum, d_out, layer, "the set-aside B sum");
  check_set_aside(extras.set_aside_a_sum, extras.set_aside_a_microbatches, layer,
                  "the set-aside A sum");
  check_set_aside(extras.set_aside_b_sum, extras.set_aside_b_microbatches, layer,
                  "the set-aside B sum");
  check_matrix(extras.chain_a_factor, d_in, layer, "the A inversion chain's factor");
  check_matrix(extras.chain_b_factor, d_out, layer, "the B inversion chain's factor");
  check_chain(extras.chain_a_factor, extras.chain_a_damping, extras.chain_a_next_unit, layer,
              "the A inversion chain");
  check_chain(extras.chain_b_factor, extras.chain_b_damping, extras.chain_b_next_unit, layer,
              "the B inversion chain");
}

}  // namespace pf::device
