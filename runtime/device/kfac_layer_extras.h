#pragma once
// What a device K-FAC layer (device_runtime.h's DeviceKfacLayer) keeps beside its
// kfac::KfacLayerState, as the executor's CPU path keeps it in its per-Linear bookkeeping: the
// inverses the latest inversions replaced (a refresh's earlier steps precondition with them).
// Checkpoints taken inside a refresh window save and restore it (Worker::kfac_progress_records).
#include <cstdint>
#include <string>

#include "kfac/eigen_core.h"

namespace pf::device {

struct KfacLayerExtras {
  Eigen::MatrixXf previous_a_inverse, previous_b_inverse;  // empty: none
};

// Throws std::invalid_argument naming `layer` and `what` unless `matrix` is empty or
// dim x dim (what a layer of that factor dimension can hold).
void check_extra_matrix(const Eigen::MatrixXf& matrix, std::int64_t dim, const std::string& layer,
                        const char* what);

}  // namespace pf::device
