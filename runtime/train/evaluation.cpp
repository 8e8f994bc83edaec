#include "runtime/train/evaluation.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <set>
#include <stdexcept>

#include "runtime/data/loader.h"
#include "runtime/executor/shard_batches.h"

namespace pf::train {

namespace {

// log(sum exp(row)) and the index of the row's maximum, in double.
template <typename T>
std::pair<double, std::int64_t> log_sum_exp_and_argmax(const T* row, std::int64_t columns) {
  std::int64_t best = 0;
  for (std::int64_t c = 1; c < columns; ++c) {
    if (row[c] > row[best]) best = c;
  }
  const double top = static_cast<double>(row[best]);
  double sum = 0.0;
  for (std::int64_t c = 0; c < columns; ++c) sum += std::exp(static_cast<double>(row[c]) - top);
  return {top + std::log(sum), best};
}

// A view's rows on the host, read through the chunk's backend (downloaded from a device, after
// the work issued on the chunk's stream).
template <typename T>
std::vector<T> host_rows(const model::BertChunk<T>& chunk, kernels::ConstMatrixView<T> view) {
  std::vector<T> host(static_cast<std::size_t>(view.rows * view.cols));
  const auto row_bytes = static_cast<std::size_t>(view.cols) * sizeof(T);
  if (view.contiguous()) {
    chunk.backend().copy(host.data(), view.data, host.size() * sizeof(T),
                         tensor::CopyKind::kDeviceToHost, chunk.stream());
  } else {
    for (std::int64_t r = 0; r < view.rows; ++r) {
      chunk.backend().copy(host.data() + r * view.cols, view.row(r), row_bytes,
                           tensor::CopyKind::kDeviceToHost, chunk.stream());
    }
  }
  chunk.ops().synchronize();
  return host;
}

}  // namespace

template <typename T>
void accumulate_predictions(kernels::ConstMatrixView<T> mlm_logits,
                            kernels::ConstMatrixView<T> nsp_logits, const model::Batch& batch,
                            EvalMetrics& metrics) {
  const std::int64_t rows = batch.predictions();
  if (nsp_logits.rows != batch.batch_size || nsp_logits.cols != 2) {
    throw std::invalid_argument("evaluation: NSP logits are " + std::to_string(nsp_logits.rows) +
                                " x " + std::to_string(nsp_logits.cols) + ", the batch needs " +
                                std::to_string(batch.batch_size) + " x 2");
  }
  if (rows > 0 && mlm_logits.rows != rows) {
    throw std::invalid_argument("evaluation: " + std::to_string(mlm_logits.rows) +
                                " rows of MLM logits for " + std::to_string(rows) +
                                " masked slots");
  }
  for (std::int64_t r = 0; r < rows; ++r) {
    const auto index = static_cast<std::size_t>(r);
    if (batch.masked_lm_weights[index] == 0.0F) continue;  // padding slot
    const std::int64_t label = batch.masked_lm_ids[index];
    if (label < 0 || label >= mlm_logits.cols) {
      throw std::invalid_argument(
          "evaluation: masked_lm_ids[" + std::to_string(r) + "] = " + std::to_string(label) +
          " is outside the vocabulary of " + std::to_string(mlm_logits.cols));
    }
    const T* row = mlm_logits.data + r * mlm_logits.ld;
    const auto [lse, best] = log_sum_exp_and_argmax(row, mlm_logits.cols);
    const double weight = static_cast<double>(batch.masked_lm_weights[index]);
    metrics.mlm_loss_sum += weight * (lse - static_cast<double>(row[label]));
    metrics.mlm_correct += best == label ? weight : 0.0;
    metrics.mlm_predictions += weight;
  }
  for (std::int64_t b = 0; b < batch.batch_size; ++b) {
    const std::int64_t label = batch.next_sentence_labels[static_cast<std::size_t>(b)];
    const T* row = nsp_logits.data + b * nsp_logits.ld;
    const auto [lse, best] = log_sum_exp_and_argmax(row, 2);
    metrics.nsp_loss_sum += lse - static_cast<double>(row[label]);
    metrics.nsp_correct += best == label ? 1.0 : 0.0;
    metrics.sequences += 1.0;
  }
}

template <typename T>
EvalMetrics evaluate_chunks(const std::vector<model::BertChunk<T>*>& chunks,
                            const std::vector<std::shared_ptr<const model::Batch>>& batches) {
  if (chunks.empty()) throw std::invalid_argument("evaluation: no model chunks");
  EvalMetrics metrics;
  model::ForwardOptions options;
  options.training = false;
  options.keep_logits = true;
  constexpr int kMicrobatch = 0;
  for (const auto& batch : batches) {
    kernels::ConstMatrixView<T> activation;
    for (auto* chunk : chunks) {
      auto result = chunk->forward(kMicrobatch, *batch, activation, options);
      activation = result.output;
      if (chunk == chunks.back()) {
        const auto mlm = host_rows(*chunk, result.mlm_logits);
        const auto nsp = host_rows(*chunk, result.nsp_logits);
        accumulate_predictions<T>({mlm.data(), result.mlm_logits.rows, result.mlm_logits.cols},
                                  {nsp.data(), result.nsp_logits.rows, result.nsp_logits.cols},
                                  *batch, metrics);
      }
    }
    for (auto* chunk : chunks) chunk->discard(kMicrobatch);
  }
  return metrics;
}

template <typename T>
Evaluator<T>::Evaluator(const model::BertConfig& config,
                        std::vector<std::shared_ptr<const model::Batch>> batches,
                        std::shared_ptr<device::DeviceRuntime> runtime)
    : batches_(std::move(batches)), runtime_(std::move(runtime)) {
  if (batches_.empty()) throw std::invalid_argument("evaluation: no evaluation batches");
  for (const auto& batch : batches_) batch->validate(config);
  if (!runtime_) {
    model_ = std::make_unique<model::BertChunk<T>>(config, model::whole_model(config), backend_);
    return;
  }
  if constexpr (!std::is_same_v<T, float>) {
    throw std::invalid_argument("evaluation on device " + tensor::to_string(runtime_->device()) +
                                " runs float models (this one is double)");
  } else {
    stream_ = runtime_->backend().create_stream();
    model_ = std::make_unique<model::BertChunk<T>>(config, model::whole_model(config),
                                                   runtime_->backend(), stream_.get(),
                                                   runtime_->precision(), runtime_->attention());
  }
}

template <typename T>
EvalMetrics Evaluator<T>::evaluate(const std::vector<model::BertChunk<T>*>& source_chunks) {
  std::set<std::string> copied;
  for (auto* source : source_chunks) {
    if (source->device() != model_->device()) {
      throw std::runtime_error("evaluation: a model chunk is on " +
                               tensor::to_string(source->device()) + ", the evaluator on " +
                               tensor::to_string(model_->device()));
    }
    for (const auto& from : source->parameters()) {
      auto to = model_->parameter(from.name);
      if (!to) continue;  // the head's copy of the tied word embeddings
      if (to->size != from.size) {
        throw std::runtime_error("evaluation: parameter " + from.name + " has " +
                                 std::to_string(from.size) + " values in the training model, " +
                                 std::to_string(to->size) + " in the evaluation model");
      }
      // On one device (the source's stream finished its work: the executor is idle); in stream
      // order before the evaluation's forward.
      model_->backend().copy(to->value, from.value, static_cast<std::size_t>(from.size) * sizeof(T),
                             tensor::CopyKind::kDeviceToDevice, model_->stream());
      copied.insert(from.name);
    }
  }
  for (const auto& parameter : model_->parameters()) {
    if (copied.count(parameter.name) == 0) {
      throw std::runtime_error("evaluation: no model chunk holds parameter " + parameter.name);
    }
  }
  return evaluate_chunks<T>({model_.get()}, batches_);
}

template <typename T>
EvalMetrics Evaluator<T>::evaluate(exec::ThreadedExecutor<T>& executor) {
  // Replica 0's ranks are 0 .. workers-1; Chimera's two pipelines hold equal weights.
  const int workers = executor.setup().schedule.num_workers();
  std::vector<model::BertChunk<T>*> chunks;
  for (int rank = 0; rank < workers; ++rank) {
    for (auto* chunk : executor.worker(rank).chunks()) chunks.push_back(chunk);
  }
  return evaluate(chunks);
}

std::vector<std::shared_ptr<const model::Batch>> load_eval_batches(const std::string& directory,
                                                                   std::int64_t micro_batch_size,
                                                                   std::int64_t count,
                                                                   std::int64_t seq_len) {
  namespace fs = std::filesystem;
  if (!fs::is_directory(directory)) {
    throw std::invalid_argument("--eval-data " + directory +
                                ": not a directory of shards (pipefisher_data)");
  }
  std::vector<std::string> files;
  for (const auto& entry : fs::directory_iterator(directory)) {
    if (entry.is_regular_file() && entry.path().extension() == ".pfshard") {
      files.push_back(entry.path().string());
    }
  }
  std::sort(files.begin(), files.end());
  if (files.empty()) {
    throw std::invalid_argument("--eval-data " + directory + ": no *.pfshard files in it");
  }
  data::LoaderOptions options;
  options.shards = files;
  options.micro_batch_size = static_cast<std::size_t>(micro_batch_size);
  options.shuffle_buffer = 1;
  options.shuffle_shards = false;
  options.drop_remainder = true;
  options.max_epochs = 1;
  data::ShardLoader loader(options);
  if (static_cast<std::int64_t>(loader.seq_length()) != seq_len) {
    throw std::invalid_argument("--eval-data " + directory + ": sequences of " +
                                std::to_string(loader.seq_length()) +
                                " tokens, the training data's are " + std::to_string(seq_len));
  }
  std::vector<std::shared_ptr<const model::Batch>> batches;
  const std::int64_t limit = count > 0 ? count : std::numeric_limits<std::int64_t>::max();
  while (static_cast<std::int64_t>(batches.size()) < limit) {
    auto micro = loader.next();
    if (!micro) break;
    batches.push_back(std::make_shared<const model::Batch>(exec::to_model_batch(*micro)));
  }
  if (batches.empty()) {
    throw std::invalid_argument("--eval-data " + directory + ": fewer than " +
                                std::to_string(micro_batch_size) +
                                " sequences, not one full micro-batch");
  }
  return batches;
}

template void accumulate_predictions<float>(kernels::ConstMatrixView<float>,
                                            kernels::ConstMatrixView<float>, const model::Batch&,
                                            EvalMetrics&);
template void accumulate_predictions<double>(kernels::ConstMatrixView<double>,
                                             kernels::ConstMatrixView<double>, const model::Batch&,
                                             EvalMetrics&);
template EvalMetrics evaluate_chunks<float>(
    const std::vector<model::BertChunk<float>*>&,
    const std::vector<std::shared_ptr<const model::Batch>>&);
template EvalMetrics evaluate_chunks<double>(
    const std::vector<model::BertChunk<double>*>&,
    const std::vector<std::shared_ptr<const model::Batch>>&);
template class Evaluator<float>;
template class Evaluator<double>;

}  // namespace pf::train
