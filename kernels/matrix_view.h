#pragma once
// A non-owning row-major matrix: rows x cols elements, row i starting at data + i * ld.
// The ops take these instead of tensors so that they work on fp32 and on the double-precision
// reference path of the tests, and on strided sub-blocks (one head's columns of the fused QKV).
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace pf::kernels {

template <typename T>
struct MatrixView {
  T* data = nullptr;
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::int64_t ld = 0;  // leading dimension: elements between consecutive rows

  MatrixView() = default;
  MatrixView(T* data_, std::int64_t rows_, std::int64_t cols_, std::int64_t ld_ = -1)
      : data(data_), rows(rows_), cols(cols_), ld(ld_ < 0 ? cols_ : ld_) {}
  // A view of mutable memory converts to a read-only view.
  template <typename U,
            typename = std::enable_if_t<std::is_same_v<const U, T> && !std::is_same_v<U, T>>>
  MatrixView(const MatrixView<U>& other)  // NOLINT(google-explicit-constructor)
      : data(other.data), rows(other.rows), cols(other.cols), ld(other.ld) {}

  T* row(std::int64_t i) const { return data + i * ld; }
  bool contiguous() const { return ld == cols; }
  std::int64_t size() const { return rows * cols; }
  // Columns [first, first + count) of every row.
  MatrixView block_cols(std::int64_t first, std::int64_t count) const {
    return MatrixView(data + first, rows, count, ld);
  }
  MatrixView block_rows(std::int64_t first, std::int64_t count) const {
    return MatrixView(data + first * ld, count, cols, ld);
  }
};

template <typename T>
using ConstMatrixView = MatrixView<const T>;

inline void require(bool condition, const char* op, const std::string& what) {
  if (!condition) throw std::invalid_argument(std::string(op) + ": " + what);
}

}  // namespace pf::kernels
