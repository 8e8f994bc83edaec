#include "runtime/executor/batch_source.h"

#include "kernels/rng.h"

namespace pf::exec {

SyntheticBatches::SyntheticBatches(model::BertConfig config, std::int64_t micro_batch_size,
                                   std::int64_t seq_len, std::int64_t max_predictions,
                                   std::uint64_t seed)
    : config_(std::move(config)),
      micro_batch_size_(micro_batch_size),
      seq_len_(seq_len),
      max_predictions_(max_predictions),
      seed_(seed) {}

std::shared_ptr<const model::Batch> SyntheticBatches::batch(std::int64_t step, int index) {
  std::lock_guard lock(mutex_);
  auto& slot = cache_[{step, index}];
  if (!slot) {
    const std::uint64_t seed =
        kernels::derive_seed(kernels::derive_seed(seed_, static_cast<std::uint64_t>(step)),
                             static_cast<std::uint64_t>(index));
    slot = std::make_shared<const model::Batch>(
        model::make_random_batch(config_, micro_batch_size_, seq_len_, max_predictions_, seed));
  }
  return slot;
}

void SyntheticBatches::release_before(std::int64_t step) {
  std::lock_guard lock(mutex_);
  cache_.erase(cache_.begin(), cache_.lower_bound({step, -1}));
}

}  // namespace pf::exec
