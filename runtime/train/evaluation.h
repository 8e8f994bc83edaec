#pragma once
// Held-out evaluation for pipefisher_train: MLM loss and accuracy, NSP loss and accuracy of the
// model being trained, on a fixed set of micro-batches it never trains on. The executor's
// workers hold the model in pipeline chunks; between steps (every worker idle) the evaluator
// copies their parameters into one whole-model BertChunk of its own and runs the forward pass
// (no dropout) over every evaluation batch. Nothing of the training run is touched, so an
// evaluated run trains exactly as an unevaluated one. On a device (the executor's
// RunSetup::device) that whole-model copy lives on the device too, with a stream of its own:
// the parameters are copied device to device, the forward runs there with the run's precision,
// and only the logits come back to the host.
//
// Averages are over the whole evaluation set: the MLM loss and accuracy over every real masked
// position (weight 1), the NSP loss and accuracy over every sequence. (Training's per-step loss
// is instead the mean of per-micro-batch means; with padded predictions the two differ slightly.)
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels/matrix_view.h"
#include "runtime/device/device_runtime.h"
#include "runtime/executor/executor.h"
#include "runtime/model/batch.h"
#include "runtime/model/bert_chunk.h"
#include "runtime/tensor/cpu_backend.h"

namespace pf::train {

struct EvalMetrics {
  double mlm_loss_sum = 0.0;  // natural-log cross-entropy summed over predictions
  double mlm_correct = 0.0;   // argmax == label
  double mlm_predictions = 0.0;
  double nsp_loss_sum = 0.0;
  double nsp_correct = 0.0;
  double sequences = 0.0;

  double mlm_loss() const { return mlm_predictions > 0 ? mlm_loss_sum / mlm_predictions : 0.0; }
  double mlm_accuracy() const { return mlm_predictions > 0 ? mlm_correct / mlm_predictions : 0.0; }
  double nsp_loss() const { return sequences > 0 ? nsp_loss_sum / sequences : 0.0; }
  double nsp_accuracy() const { return sequences > 0 ? nsp_correct / sequences : 0.0; }
  double loss() const { return mlm_loss() + nsp_loss(); }
};

// Adds one micro-batch's predictions: mlm_logits [B*P, V] (row b*P + p is masked slot p of
// sequence b; rows of weight 0 are padding and skipped), nsp_logits [B, 2]. Ties in the argmax
// go to the lowest index. Throws std::invalid_argument when the shapes do not match the batch.
template <typename T>
void accumulate_predictions(kernels::ConstMatrixView<T> mlm_logits,
                            kernels::ConstMatrixView<T> nsp_logits, const model::Batch& batch,
                            EvalMetrics& metrics);

// Runs `chunks` (the whole model, in order: embeddings first, head last) forward without
// dropout over every batch and returns the metrics of all of them. The logits are read through
// the head chunk's backend (downloaded from a device).
template <typename T>
EvalMetrics evaluate_chunks(const std::vector<model::BertChunk<T>*>& chunks,
                            const std::vector<std::shared_ptr<const model::Batch>>& batches);

// The evaluation set in memory and a whole-model copy to run it on.
template <typename T>
class Evaluator {
 public:
  // Throws std::invalid_argument when there are no batches or one does not fit the model, or
  // for a device with a double model. runtime: the training run's device (null: the CPU).
  Evaluator(const model::BertConfig& config,
            std::vector<std::shared_ptr<const model::Batch>> batches,
            std::shared_ptr<device::DeviceRuntime> runtime = nullptr);

  // Copies the parameters of replica 0's workers (every chunk of the model; the tied decoder
  // copy is the word-embedding matrix here) and evaluates. Call only while the executor is not
  // running. Throws std::runtime_error when a parameter of the model is held by no worker, or
  // when a chunk is on another device than the evaluator.
  EvalMetrics evaluate(exec::ThreadedExecutor<T>& executor);
  // The same on a model given as chunks (tests, single-process use).
  EvalMetrics evaluate(const std::vector<model::BertChunk<T>*>& source_chunks);

  std::size_t num_batches() const { return batches_.size(); }

 private:
  std::vector<std::shared_ptr<const model::Batch>> batches_;
  tensor::CpuBackend backend_;                      // the model's memory on the CPU
  std::shared_ptr<device::DeviceRuntime> runtime_;  // ... or the device's
  std::unique_ptr<tensor::Stream> stream_;          // on the device: the evaluation's own
  std::unique_ptr<model::BertChunk<T>> model_;
};

// The first `count` micro-batches of `micro_batch_size` sequences of the shards, in shard order
// without shuffling (the same set for every run and seed). count 0: one pass over all of them.
// Throws std::invalid_argument for an unusable directory or sequences of another length.
std::vector<std::shared_ptr<const model::Batch>> load_eval_batches(const std::string& directory,
                                                                   std::int64_t micro_batch_size,
                                                                   std::int64_t count,
                                                                   std::int64_t seq_len);

extern template class Evaluator<float>;
extern template class Evaluator<double>;

}  // namespace pf::train
