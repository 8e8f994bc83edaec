#pragma once
// The hook K-FAC needs: per micro-batch, each encoder Linear's input activations a (T x d_in,
// T = tokens of the micro-batch) from the forward and its output gradients g (T x d_out) from
// the backward. g is d(loss_scale * loss)/d(output), where loss is the micro-batch's MLM + NSP
// loss (each a mean over its examples). Rows are tokens in (sequence, position) order.
#include <cstdint>
#include <map>
#include <tuple>

#include <Eigen/Core>

#include "kernels/matrix_view.h"
#include "scheduler/instruction.h"

namespace pf::model {

using sched::LinearKind;

// The views are only valid during the call: a sink that keeps them must copy.
template <typename T>
class KfacCapture {
 public:
  virtual ~KfacCapture() = default;
  virtual void on_input(int layer, LinearKind linear, int microbatch,
                        kernels::ConstMatrixView<T> activations) = 0;
  virtual void on_output_grad(int layer, LinearKind linear, int microbatch,
                              kernels::ConstMatrixView<T> gradients) = 0;
};

// A sink that copies everything into Eigen matrices (row-major, T x d).
template <typename T>
class KfacCaptureStore final : public KfacCapture<T> {
 public:
  using Matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using Key = std::tuple<int, LinearKind, int>;  // layer, linear, micro-batch

  void on_input(int layer, LinearKind linear, int microbatch,
                kernels::ConstMatrixView<T> activations) override {
    copy(inputs_[{layer, linear, microbatch}], activations);
  }
  void on_output_grad(int layer, LinearKind linear, int microbatch,
                      kernels::ConstMatrixView<T> gradients) override {
    copy(output_grads_[{layer, linear, microbatch}], gradients);
  }
  const std::map<Key, Matrix>& inputs() const { return inputs_; }
  const std::map<Key, Matrix>& output_grads() const { return output_grads_; }
  void clear() {
    inputs_.clear();
    output_grads_.clear();
  }

 private:
  static void copy(Matrix& target, kernels::ConstMatrixView<T> source) {
    target.resize(source.rows, source.cols);
    for (std::int64_t i = 0; i < source.rows; ++i) {
      for (std::int64_t j = 0; j < source.cols; ++j) target(i, j) = source.row(i)[j];
    }
  }
  std::map<Key, Matrix> inputs_;
  std::map<Key, Matrix> output_grads_;
};

}  // namespace pf::model
