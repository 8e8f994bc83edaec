#include "runtime/device/kfac_layer_extras.h"

#include <stdexcept>

namespace pf::device {

void check_extra_matrix(const Eigen::MatrixXf& matrix, std::int64_t dim, const std::string& layer,
                        const char* what) {
  if (matrix.size() == 0 || (matrix.rows() == dim && matrix.cols() == dim)) return;
  throw std::invalid_argument("K-FAC " + layer + ": " + what + " is " +
                              std::to_string(matrix.rows()) + " x " +
                              std::to_string(matrix.cols()) + ", the factor is " +
                              std::to_string(dim) + " x " + std::to_string(dim));
}

}  // namespace pf::device
