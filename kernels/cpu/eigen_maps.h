#pragma once
// Eigen maps of MatrixView (row-major, strided rows).
#include <Eigen/Core>

#include "kernels/matrix_view.h"

namespace pf::kernels::cpu {

template <typename T>
using RowMatrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <typename T>
using MatrixMap = Eigen::Map<RowMatrix<T>, Eigen::Unaligned, Eigen::OuterStride<>>;
template <typename T>
using ConstMatrixMap = Eigen::Map<const RowMatrix<T>, Eigen::Unaligned, Eigen::OuterStride<>>;

template <typename T>
MatrixMap<T> map(MatrixView<T> view) {
  return MatrixMap<T>(view.data, view.rows, view.cols, Eigen::OuterStride<>(view.ld));
}
template <typename T>
ConstMatrixMap<T> map(MatrixView<const T> view) {
  return ConstMatrixMap<T>(view.data, view.rows, view.cols, Eigen::OuterStride<>(view.ld));
}
template <typename T>
Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>> array(T* data, std::int64_t count) {
  return Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>>(data, count);
}
template <typename T>
Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>> array(const T* data, std::int64_t count) {
  return Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>>(data, count);
}

// Rows are processed in parallel in chunks big enough to amortise the OpenMP fork.
inline bool worth_parallel(std::int64_t elements) {
  return elements >= (1 << 15);
}

}  // namespace pf::kernels::cpu
