// Embedding gather/scatter, row gather/scatter and the softmax cross-entropy.
#include <cmath>
#include <vector>

#include "kernels/cpu/eigen_maps.h"
#include "kernels/ops.h"

namespace pf::kernels {
namespace {

void check_index(std::int64_t value, std::int64_t limit, std::int64_t row, const char* op,
                 const char* what) {
  if (value < 0 || value >= limit) {
    throw std::invalid_argument(std::string(op) + ": " + what + " value " + std::to_string(value) +
                                " at row " + std::to_string(row) + " is outside [0, " +
                                std::to_string(limit) + ")");
  }
}

}  // namespace

template <typename T>
void embedding_forward(ConstMatrixView<T> table, const std::int64_t* ids, MatrixView<T> out,
                       const char* what, bool accumulate_output) {
  require(table.cols == out.cols, "embedding_forward", "table width differs from output width");
  for (std::int64_t r = 0; r < out.rows; ++r) {
    check_index(ids[r], table.rows, r, "embedding_forward", what);
  }
#pragma omp parallel for schedule(static) if (cpu::worth_parallel(out.size()))
  for (std::int64_t r = 0; r < out.rows; ++r) {
    auto source = cpu::array(table.row(ids[r]), table.cols);
    auto target = cpu::array(out.row(r), out.cols);
    if (accumulate_output) {
      target += source;
    } else {
      target = source;
    }
  }
}

template <typename T>
void embedding_backward(ConstMatrixView<T> dout, const std::int64_t* ids, MatrixView<T> dtable,
                        std::int64_t skip_id) {
  require(dtable.cols == dout.cols, "embedding_backward", "table width differs from grad width");
  // Serial over rows: two rows with the same id add into the same table row.
  for (std::int64_t r = 0; r < dout.rows; ++r) {
    check_index(ids[r], dtable.rows, r, "embedding_backward", "id");
    if (ids[r] == skip_id) continue;
    cpu::array(dtable.row(ids[r]), dtable.cols) += cpu::array(dout.row(r), dout.cols);
  }
}

template <typename T>
void gather_rows(ConstMatrixView<T> in, const std::int64_t* index, MatrixView<T> out) {
  embedding_forward(in, index, out, "row index");
}

template <typename T>
void scatter_add_rows(ConstMatrixView<T> dout, const std::int64_t* index, MatrixView<T> din) {
  embedding_backward(dout, index, din);
}

template <typename T>
T cross_entropy_forward(MatrixView<T> logits, const std::int64_t* labels, const T* weights,
                        const char* what) {
  T total_weight = T(0);
  for (std::int64_t r = 0; r < logits.rows; ++r) {
    const T w = weights == nullptr ? T(1) : weights[r];
    if (w != T(0)) check_index(labels[r], logits.cols, r, "cross_entropy", what);
    total_weight += w;
  }
  // Each row's loss, then their sum in row order: the same total for any thread count (an
  // OpenMP reduction would add per-thread partial sums).
  std::vector<T> row_loss(static_cast<std::size_t>(logits.rows), T(0));
#pragma omp parallel for schedule(static) if (cpu::worth_parallel(logits.size()))
  for (std::int64_t r = 0; r < logits.rows; ++r) {
    auto row = cpu::array(logits.row(r), logits.cols);
    const T max = row.maxCoeff();
    row = (row - max).exp();
    const T normaliser = row.sum();
    const T w = weights == nullptr ? T(1) : weights[r];
    if (w != T(0)) {
      row_loss[static_cast<std::size_t>(r)] = w * (std::log(normaliser) - std::log(row[labels[r]]));
    }
    row *= T(1) / normaliser;
  }
  T total = T(0);
  for (const T loss : row_loss) total += loss;
  return total_weight == T(0) ? T(0) : total / total_weight;
}

template <typename T>
void cross_entropy_backward(MatrixView<T> probs, const std::int64_t* labels, const T* weights,
                            T scale) {
  T total_weight = T(0);
  for (std::int64_t r = 0; r < probs.rows; ++r)
    total_weight += weights == nullptr ? T(1) : weights[r];
#pragma omp parallel for schedule(static) if (cpu::worth_parallel(probs.size()))
  for (std::int64_t r = 0; r < probs.rows; ++r) {
    auto row = cpu::array(probs.row(r), probs.cols);
    const T w = weights == nullptr ? T(1) : weights[r];
    if (w == T(0) || total_weight == T(0)) {
      row.setZero();
      continue;
    }
    row[labels[r]] -= T(1);
    row *= scale * w / total_weight;
  }
}

#define PF_INSTANTIATE(T)                                                                         \
  template void embedding_forward<T>(ConstMatrixView<T>, const std::int64_t*, MatrixView<T>,      \
                                     const char*, bool);                                          \
  template void embedding_backward<T>(ConstMatrixView<T>, const std::int64_t*, MatrixView<T>,     \
                                      std::int64_t);                                              \
  template void gather_rows<T>(ConstMatrixView<T>, const std::int64_t*, MatrixView<T>);           \
  template void scatter_add_rows<T>(ConstMatrixView<T>, const std::int64_t*, MatrixView<T>);      \
  template T cross_entropy_forward<T>(MatrixView<T>, const std::int64_t*, const T*, const char*); \
  template void cross_entropy_backward<T>(MatrixView<T>, const std::int64_t*, const T*, T);
PF_INSTANTIATE(float)
PF_INSTANTIATE(double)
#undef PF_INSTANTIATE

}  // namespace pf::kernels
