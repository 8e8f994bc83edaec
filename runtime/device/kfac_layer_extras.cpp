#include "runtime/device/kfac_layer_extras.h"

#include <stdexcept>

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
}

}  // namespace pf::device
