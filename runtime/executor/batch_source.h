#pragma once
// Where the executor's micro-batches come from: batch(step, index) is micro-batch `index` of
// the global batch of training step `step` (index = replica * micro-batches + micro-batch within
// the replica's step; Chimera's pipeline 1 numbers after pipeline 0). Every worker that needs a
// micro-batch (the embedding chunk for the tokens, the head for the labels, every chunk for the
// attention mask) asks for it, so implementations are thread-safe and deterministic.
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

#include "runtime/model/batch.h"
#include "runtime/model/bert_config.h"

namespace pf::exec {

class BatchSource {
 public:
  virtual ~BatchSource() = default;
  BatchSource() = default;
  BatchSource(const BatchSource&) = delete;
  BatchSource& operator=(const BatchSource&) = delete;
  virtual std::shared_ptr<const model::Batch> batch(std::int64_t step, int index) = 0;
  // The executor has finished every step before `step`: their batches may be dropped.
  virtual void release_before(std::int64_t step) { (void)step; }
};

// Reproducible random batches (model::make_random_batch seeded by (seed, step, index)), for
// tests and benchmarks.
class SyntheticBatches final : public BatchSource {
 public:
  SyntheticBatches(model::BertConfig config, std::int64_t micro_batch_size, std::int64_t seq_len,
                   std::int64_t max_predictions, std::uint64_t seed);
  std::shared_ptr<const model::Batch> batch(std::int64_t step, int index) override;
  void release_before(std::int64_t step) override;

 private:
  model::BertConfig config_;
  std::int64_t micro_batch_size_, seq_len_, max_predictions_;
  std::uint64_t seed_;
  std::mutex mutex_;
  std::map<std::pair<std::int64_t, int>, std::shared_ptr<const model::Batch>> cache_;
};

}  // namespace pf::exec
