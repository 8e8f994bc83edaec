#include "runtime/executor/shard_batches.h"

#include <stdexcept>
#include <string>

namespace pf::exec {

model::Batch to_model_batch(const data::MicroBatch& micro) {
  model::Batch batch;
  batch.batch_size = static_cast<std::int64_t>(micro.batch_size);
  batch.seq_len = static_cast<std::int64_t>(micro.seq_length);
  batch.max_predictions = static_cast<std::int64_t>(micro.max_predictions);
  auto widen = [](const std::vector<std::int32_t>& source) {
    return std::vector<std::int64_t>(source.begin(), source.end());
  };
  batch.input_ids = widen(micro.input_ids);
  batch.token_type_ids = widen(micro.token_type_ids);
  batch.attention_mask = widen(micro.attention_mask);
  batch.masked_lm_positions = widen(micro.masked_positions);
  batch.masked_lm_ids = widen(micro.masked_label_ids);
  batch.masked_lm_weights = micro.masked_weights;
  batch.next_sentence_labels = widen(micro.next_sentence_labels);
  return batch;
}

ShardBatches::ShardBatches(data::LoaderOptions options, int replicas, int microbatches_per_replica,
                           std::vector<data::LoaderPosition> starts, std::int64_t first_step)
    : microbatches_(microbatches_per_replica) {
  if (replicas < 1 || microbatches_per_replica < 1) {
    throw std::invalid_argument("shard batches: replicas and micro-batches must be >= 1");
  }
  if (!starts.empty() && starts.size() != static_cast<std::size_t>(replicas)) {
    throw std::invalid_argument("shard batches: " + std::to_string(starts.size()) +
                                " loader positions for " + std::to_string(replicas) +
                                " data-parallel replicas");
  }
  replicas_.resize(static_cast<std::size_t>(replicas));
  for (int r = 0; r < replicas; ++r) {
    auto replica_options = options;
    replica_options.replica_rank = static_cast<std::size_t>(r);
    replica_options.replica_count = static_cast<std::size_t>(replicas);
    std::optional<data::LoaderPosition> start;
    if (!starts.empty()) start = starts[static_cast<std::size_t>(r)];
    auto& replica = replicas_[static_cast<std::size_t>(r)];
    replica.loader = std::make_unique<data::ShardLoader>(replica_options, start);
    replica.next_step = first_step;
  }
}

ShardBatches::~ShardBatches() = default;

void ShardBatches::read_through(Replica& replica, std::int64_t step) {
  while (replica.next_step <= step) {
    std::vector<std::shared_ptr<const model::Batch>> batches;
    data::LoaderPosition position;
    for (int i = 0; i < microbatches_; ++i) {
      auto micro = replica.loader->next();
      if (!micro) {
        throw std::runtime_error("the training data ran out at step " +
                                 std::to_string(replica.next_step) +
                                 " (the loader's epoch limit was reached)");
      }
      position = micro->position_after;
      batches.push_back(std::make_shared<const model::Batch>(to_model_batch(*micro)));
    }
    replica.steps[replica.next_step] = std::move(batches);
    replica.positions[replica.next_step] = position;
    ++replica.next_step;
  }
}

std::shared_ptr<const model::Batch> ShardBatches::batch(std::int64_t step, int index) {
  const int r = index / microbatches_;
  if (index < 0 || r >= static_cast<int>(replicas_.size())) {
    throw std::out_of_range("shard batches: micro-batch index " + std::to_string(index) +
                            " is outside the global batch");
  }
  std::lock_guard lock(mutex_);
  auto& replica = replicas_[static_cast<std::size_t>(r)];
  read_through(replica, step);
  auto it = replica.steps.find(step);
  if (it == replica.steps.end()) {
    throw std::logic_error("shard batches: step " + std::to_string(step) + " was already released");
  }
  return it->second[static_cast<std::size_t>(index % microbatches_)];
}

void ShardBatches::release_before(std::int64_t step) {
  std::lock_guard lock(mutex_);
  for (auto& replica : replicas_) {
    replica.steps.erase(replica.steps.begin(), replica.steps.lower_bound(step));
    // Positions stay until a later step's exist (checkpoints ask after the step ends).
    if (replica.positions.size() > 1) {
      replica.positions.erase(replica.positions.begin(), replica.positions.lower_bound(step - 1));
    }
  }
}

std::vector<data::LoaderPosition> ShardBatches::positions_after(std::int64_t step) {
  std::vector<data::LoaderPosition> positions;
  for (std::size_t r = 0; r < replicas_.size(); ++r) {
    positions.push_back(position_after(step, static_cast<int>(r)));
  }
  return positions;
}

data::LoaderPosition ShardBatches::position_after(std::int64_t step, int replica_index) {
  std::lock_guard lock(mutex_);
  auto& replica = replicas_.at(static_cast<std::size_t>(replica_index));
  read_through(replica, step);
  auto it = replica.positions.find(step);
  if (it == replica.positions.end()) {
    throw std::logic_error("shard batches: no position recorded after step " +
                           std::to_string(step));
  }
  return it->second;
}

const data::ShardLoader& ShardBatches::loader(int replica) const {
  return *replicas_.at(static_cast<std::size_t>(replica)).loader;
}

}  // namespace pf::exec
