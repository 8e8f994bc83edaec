// Streams pretraining instances from shards as padded micro-batches: epoch-wise shuffling (shard
// order + a shuffle buffer), a disjoint split across data-parallel replicas, resumable from a
// saved position, and read-ahead on a background thread.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "runtime/data/shard_format.h"

namespace pf::data {

// Where a replica's stream stands: the next micro-batch is batch `batches_in_epoch` of `epoch`.
// Checkpoints store it; the other fields let a resume check that the stream is the same one.
struct LoaderPosition {
  std::uint64_t epoch = 0;
  std::uint64_t batches_in_epoch = 0;
  std::uint64_t seed = 0;
  std::uint64_t replica_rank = 0;
  std::uint64_t replica_count = 1;
  std::uint64_t micro_batch_size = 0;
  std::uint64_t num_instances = 0;

  nlohmann::json to_json() const;
  // Throws std::invalid_argument naming a missing or mistyped field.
  static LoaderPosition from_json(const nlohmann::json& json);
  bool operator==(const LoaderPosition&) const = default;
};

struct LoaderOptions {
  std::vector<std::string> shards;
  std::size_t micro_batch_size = 32;
  std::size_t replica_rank = 0;
  std::size_t replica_count = 1;
  std::size_t shuffle_buffer = 10000;  // 1 = no shuffling within the shard stream
  bool shuffle_shards = true;
  std::uint64_t seed = 0;
  std::size_t prefetch_batches = 4;
  // When set, every shard must carry this vocabulary hash; otherwise they must all agree.
  std::optional<std::uint64_t> vocab_hash;
  bool verify_checksums = true;
  // true: every replica yields the same number of full micro-batches per epoch (the few
  // instances left over vary from epoch to epoch); false: every instance once per epoch, the last
  // micro-batch of a replica may be short.
  bool drop_remainder = true;
  std::uint64_t max_epochs = 0;  // 0 = endless

  void validate() const;
};

// Row-major [batch, seq_length] and [batch, max_predictions] arrays, Google's feature layout:
// padding has input id 0 ([PAD] is id 0 in BERT vocabularies), type 0, mask 0; unused masked
// slots have position 0, label 0, weight 0.
struct MicroBatch {
  std::size_t batch_size = 0;
  std::size_t seq_length = 0;
  std::size_t max_predictions = 0;
  std::vector<std::int32_t> input_ids;
  std::vector<std::int32_t> token_type_ids;
  std::vector<std::int32_t> attention_mask;
  std::vector<std::int32_t> masked_positions;
  std::vector<std::int32_t> masked_label_ids;
  std::vector<float> masked_weights;
  std::vector<std::int32_t> next_sentence_labels;  // 1 = B is a random segment
  std::vector<std::uint64_t> instance_ids;         // global ids (shard order as given)
  std::uint64_t epoch = 0;
  LoaderPosition position_after;  // save this with a checkpoint taken after using the batch
};

class ShardLoader {
 public:
  // Opens and checks every shard (throws std::runtime_error / std::invalid_argument), then
  // starts reading ahead from `start` (its stream fields must match the options when set).
  explicit ShardLoader(LoaderOptions options, std::optional<LoaderPosition> start = std::nullopt);
  ~ShardLoader();
  ShardLoader(const ShardLoader&) = delete;
  ShardLoader& operator=(const ShardLoader&) = delete;

  // The next micro-batch; std::nullopt after max_epochs. Rethrows a reading error.
  std::optional<MicroBatch> next();
  // Position after the last batch returned by next() (the start position before any).
  LoaderPosition position() const { return position_; }

  std::size_t num_instances() const { return total_instances_; }
  std::size_t batches_per_epoch() const;
  std::size_t seq_length() const { return seq_length_; }
  std::size_t max_predictions() const { return max_predictions_; }
  // From the shard headers: the embedding table size the model needs, and the vocabulary's hash.
  std::size_t vocab_size() const { return readers_.front().info().vocab_size; }
  std::uint64_t vocab_hash() const { return readers_.front().info().vocab_hash; }

  // This replica's global instance ids for `epoch`, in stream order (deterministic).
  std::vector<std::uint64_t> replica_order(std::uint64_t epoch) const;

 private:
  void produce();
  MicroBatch assemble(const std::vector<std::uint64_t>& order, std::uint64_t epoch,
                      std::uint64_t batch);

  LoaderOptions options_;
  std::vector<ShardReader> readers_;
  std::vector<std::uint64_t> shard_offsets_;  // global id of each shard's first record
  std::size_t total_instances_ = 0;
  std::size_t seq_length_ = 0;
  std::size_t max_predictions_ = 0;
  LoaderPosition position_;
  LoaderPosition start_;

  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<MicroBatch> ready_;
  bool stop_ = false;
  bool finished_ = false;
  std::exception_ptr error_;
  std::thread worker_;  // last: started after everything above exists
};

}  // namespace pf::data
