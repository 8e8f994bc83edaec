#include "runtime/data/loader.h"

#include <algorithm>
#include <stdexcept>

#include "runtime/data/python_random.h"

namespace pf::data {
namespace {

std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

std::uint64_t field(const nlohmann::json& json, const char* name) {
  if (!json.is_object() || !json.contains(name)) {
    throw std::invalid_argument(std::string("loader position: missing field '") + name + "'");
  }
  const auto& value = json.at(name);
  if (!value.is_number_unsigned() &&
      !(value.is_number_integer() && value.get<std::int64_t>() >= 0)) {
    throw std::invalid_argument(std::string("loader position: field '") + name +
                                "' must be a non-negative integer, got " + value.dump());
  }
  return value.get<std::uint64_t>();
}

}  // namespace

nlohmann::json LoaderPosition::to_json() const {
  return {{"epoch", epoch},
          {"batches_in_epoch", batches_in_epoch},
          {"seed", seed},
          {"replica_rank", replica_rank},
          {"replica_count", replica_count},
          {"micro_batch_size", micro_batch_size},
          {"num_instances", num_instances}};
}

LoaderPosition LoaderPosition::from_json(const nlohmann::json& json) {
  LoaderPosition p;
  p.epoch = field(json, "epoch");
  p.batches_in_epoch = field(json, "batches_in_epoch");
  p.seed = field(json, "seed");
  p.replica_rank = field(json, "replica_rank");
  p.replica_count = field(json, "replica_count");
  p.micro_batch_size = field(json, "micro_batch_size");
  p.num_instances = field(json, "num_instances");
  return p;
}

void LoaderOptions::validate() const {
  if (shards.empty()) throw std::invalid_argument("loader: no shard files given");
  if (micro_batch_size < 1) throw std::invalid_argument("loader: micro_batch_size must be >= 1");
  if (replica_count < 1 || replica_rank >= replica_count) {
    throw std::invalid_argument("loader: replica rank " + std::to_string(replica_rank) +
                                " is not in [0, " + std::to_string(replica_count) + ")");
  }
  if (shuffle_buffer < 1) throw std::invalid_argument("loader: shuffle_buffer must be >= 1");
  if (prefetch_batches < 1) throw std::invalid_argument("loader: prefetch_batches must be >= 1");
}

ShardLoader::ShardLoader(LoaderOptions options, std::optional<LoaderPosition> start)
    : options_(std::move(options)) {
  options_.validate();
  std::optional<std::uint64_t> vocab_hash = options_.vocab_hash;
  for (const std::string& path : options_.shards) {
    readers_.emplace_back(path, vocab_hash, options_.verify_checksums);
    const ShardInfo& info = readers_.back().info();
    if (!vocab_hash) vocab_hash = info.vocab_hash;
    if (readers_.size() == 1) {
      seq_length_ = info.max_seq_length;
      max_predictions_ = info.max_predictions;
    } else if (info.max_seq_length != seq_length_ || info.max_predictions != max_predictions_) {
      throw std::invalid_argument(
          "shard '" + path + "' has max_seq_length " + std::to_string(info.max_seq_length) +
          "/max_predictions " + std::to_string(info.max_predictions) + ", the first shard " +
          std::to_string(seq_length_) + "/" + std::to_string(max_predictions_));
    }
    shard_offsets_.push_back(total_instances_);
    total_instances_ += readers_.back().size();
  }
  if (total_instances_ < options_.replica_count) {
    throw std::invalid_argument("loader: " + std::to_string(total_instances_) +
                                " instances cannot feed " + std::to_string(options_.replica_count) +
                                " replicas");
  }
  position_.seed = options_.seed;
  position_.replica_rank = options_.replica_rank;
  position_.replica_count = options_.replica_count;
  position_.micro_batch_size = options_.micro_batch_size;
  position_.num_instances = total_instances_;
  if (start) {
    LoaderPosition expected = position_;
    expected.epoch = start->epoch;
    expected.batches_in_epoch = start->batches_in_epoch;
    if (!(expected == *start)) {
      throw std::invalid_argument("loader: saved position " + start->to_json().dump() +
                                  " belongs to another stream than " + expected.to_json().dump());
    }
    if (start->batches_in_epoch > batches_per_epoch()) {
      throw std::invalid_argument("loader: saved position is past the end of its epoch");
    }
    position_ = *start;
  }
  if (batches_per_epoch() == 0) {
    throw std::invalid_argument("loader: " + std::to_string(total_instances_) + " instances over " +
                                std::to_string(options_.replica_count) +
                                " replicas do not fill one micro-batch of " +
                                std::to_string(options_.micro_batch_size));
  }
  start_ = position_;
  worker_ = std::thread([this] { produce(); });
}

ShardLoader::~ShardLoader() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  changed_.notify_all();
  if (worker_.joinable()) worker_.join();
}

std::size_t ShardLoader::batches_per_epoch() const {
  const std::size_t world = options_.replica_count;
  const std::size_t batch = options_.micro_batch_size;
  if (options_.drop_remainder) return (total_instances_ / world) / batch;
  const std::size_t mine =
      total_instances_ / world + (options_.replica_rank < total_instances_ % world ? 1 : 0);
  return (mine + batch - 1) / batch;
}

std::vector<std::uint64_t> ShardLoader::replica_order(std::uint64_t epoch) const {
  PythonRandom rng(splitmix64(options_.seed ^ splitmix64(epoch + 1)));
  std::vector<std::size_t> shard_order(readers_.size());
  for (std::size_t s = 0; s < shard_order.size(); ++s) shard_order[s] = s;
  if (options_.shuffle_shards) rng.shuffle(shard_order);
  // The global stream every replica computes identically; replica r takes every world-th item.
  const std::size_t world = options_.replica_count;
  const std::size_t limit =
      options_.drop_remainder ? (total_instances_ / world) * world : total_instances_;
  std::vector<std::uint64_t> mine;
  mine.reserve(limit / world + 1);
  std::size_t emitted = 0;
  auto emit = [&](std::uint64_t id) {
    if (emitted < limit && emitted % world == options_.replica_rank) mine.push_back(id);
    ++emitted;
  };
  std::vector<std::uint64_t> buffer;
  buffer.reserve(std::min(options_.shuffle_buffer, total_instances_));
  for (const std::size_t s : shard_order) {
    for (std::size_t r = 0; r < readers_[s].size(); ++r) {
      buffer.push_back(shard_offsets_[s] + r);
      if (buffer.size() == options_.shuffle_buffer) {
        const auto j = static_cast<std::size_t>(rng.below(buffer.size()));
        emit(buffer[j]);
        buffer[j] = buffer.back();
        buffer.pop_back();
      }
    }
  }
  rng.shuffle(buffer);
  for (const std::uint64_t id : buffer) emit(id);
  return mine;
}

MicroBatch ShardLoader::assemble(const std::vector<std::uint64_t>& order, std::uint64_t epoch,
                                 std::uint64_t batch) {
  const std::size_t first = static_cast<std::size_t>(batch) * options_.micro_batch_size;
  const std::size_t count = std::min(options_.micro_batch_size, order.size() - first);
  MicroBatch out;
  out.batch_size = count;
  out.seq_length = seq_length_;
  out.max_predictions = max_predictions_;
  out.input_ids.assign(count * seq_length_, 0);
  out.token_type_ids.assign(count * seq_length_, 0);
  out.attention_mask.assign(count * seq_length_, 0);
  out.masked_positions.assign(count * max_predictions_, 0);
  out.masked_label_ids.assign(count * max_predictions_, 0);
  out.masked_weights.assign(count * max_predictions_, 0.0F);
  out.next_sentence_labels.assign(count, 0);
  out.epoch = epoch;
  TrainingInstance instance;
  for (std::size_t row = 0; row < count; ++row) {
    const std::uint64_t id = order[first + row];
    const auto shard = static_cast<std::size_t>(
        std::upper_bound(shard_offsets_.begin(), shard_offsets_.end(), id) -
        shard_offsets_.begin() - 1);
    readers_[shard].read(static_cast<std::size_t>(id - shard_offsets_[shard]), instance);
    out.instance_ids.push_back(id);
    const std::size_t base = row * seq_length_;
    for (std::size_t t = 0; t < instance.tokens.size(); ++t) {
      out.input_ids[base + t] = instance.tokens[t];
      out.token_type_ids[base + t] = t < instance.segment_a_length ? 0 : 1;
      out.attention_mask[base + t] = 1;
    }
    const std::size_t mbase = row * max_predictions_;
    for (std::size_t m = 0; m < instance.masked_positions.size(); ++m) {
      out.masked_positions[mbase + m] = static_cast<std::int32_t>(instance.masked_positions[m]);
      out.masked_label_ids[mbase + m] = instance.masked_labels[m];
      out.masked_weights[mbase + m] = 1.0F;
    }
    out.next_sentence_labels[row] = instance.is_random_next ? 1 : 0;
  }
  out.position_after = start_;
  out.position_after.epoch = epoch;
  out.position_after.batches_in_epoch = batch + 1;
  if (batch + 1 >= batches_per_epoch()) {
    out.position_after.epoch = epoch + 1;
    out.position_after.batches_in_epoch = 0;
  }
  return out;
}

void ShardLoader::produce() {
  try {
    std::uint64_t epoch = start_.epoch;
    std::uint64_t batch = start_.batches_in_epoch;
    const std::size_t per_epoch = batches_per_epoch();
    while (per_epoch > 0 && (options_.max_epochs == 0 || epoch < options_.max_epochs)) {
      const std::vector<std::uint64_t> order = replica_order(epoch);
      for (; batch < per_epoch; ++batch) {
        MicroBatch ready = assemble(order, epoch, batch);
        std::unique_lock lock(mutex_);
        changed_.wait(lock, [&] { return stop_ || ready_.size() < options_.prefetch_batches; });
        if (stop_) return;
        ready_.push_back(std::move(ready));
        changed_.notify_all();
      }
      batch = 0;
      ++epoch;
    }
  } catch (...) {
    std::lock_guard lock(mutex_);
    error_ = std::current_exception();
  }
  std::lock_guard lock(mutex_);
  finished_ = true;
  changed_.notify_all();
}

std::optional<MicroBatch> ShardLoader::next() {
  std::unique_lock lock(mutex_);
  changed_.wait(lock, [&] { return !ready_.empty() || finished_; });
  if (ready_.empty()) {
    if (error_) std::rethrow_exception(error_);
    return std::nullopt;
  }
  MicroBatch batch = std::move(ready_.front());
  ready_.pop_front();
  position_ = batch.position_after;
  changed_.notify_all();
  return batch;
}

}  // namespace pf::data
