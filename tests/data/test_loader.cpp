// The shard loader: every instance exactly once per epoch across replicas, batch contents,
// resuming from a saved position, and clean shutdown/error propagation of the read-ahead thread.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <set>

#include "runtime/data/loader.h"
#include "tests/data/data_test_util.h"

namespace pf::data {
namespace {

using testing::TempDir;

constexpr std::uint32_t kVocabSize = 1000;

// Instance `id` is recognisable: its first A token is 10 + id % 900, its length varies.
TrainingInstance synthetic_instance(std::size_t id) {
  TrainingInstance instance;
  const std::size_t a = 1 + id % 5;
  const std::size_t b = 1 + id % 7;
  instance.tokens.push_back(2);
  for (std::size_t i = 0; i < a; ++i)
    instance.tokens.push_back(static_cast<TokenId>(10 + (id + i) % 900));
  instance.tokens.push_back(3);
  instance.segment_a_length = static_cast<std::uint32_t>(instance.tokens.size());
  for (std::size_t i = 0; i < b; ++i)
    instance.tokens.push_back(static_cast<TokenId>(10 + (id * 3 + i) % 900));
  instance.tokens.push_back(3);
  instance.is_random_next = id % 2 == 1;
  instance.masked_positions = {1};
  instance.masked_labels = {static_cast<TokenId>(10 + id % 900)};
  return instance;
}

std::vector<std::string> make_shards(const TempDir& dir, const std::vector<std::size_t>& sizes) {
  std::vector<std::string> paths;
  ShardInfo info;
  info.vocab_hash = 42;
  info.vocab_size = kVocabSize;
  info.max_seq_length = 16;
  info.max_predictions = 3;
  std::size_t next = 0;
  for (std::size_t s = 0; s < sizes.size(); ++s) {
    std::vector<TrainingInstance> instances;
    for (std::size_t i = 0; i < sizes[s]; ++i) instances.push_back(synthetic_instance(next++));
    paths.push_back(dir.file("shard" + std::to_string(s)));
    write_shard(paths.back(), info, instances);
  }
  return paths;
}

LoaderOptions options_for(const std::vector<std::string>& shards) {
  LoaderOptions options;
  options.shards = shards;
  options.micro_batch_size = 4;
  options.shuffle_buffer = 16;
  options.seed = 99;
  options.vocab_hash = 42;
  return options;
}

std::vector<std::uint64_t> drain_epoch(ShardLoader& loader, std::uint64_t epoch) {
  std::vector<std::uint64_t> ids;
  for (std::size_t b = 0; b < loader.batches_per_epoch(); ++b) {
    const auto batch = loader.next();
    EXPECT_TRUE(batch.has_value());
    if (!batch) break;
    EXPECT_EQ(batch->epoch, epoch);
    ids.insert(ids.end(), batch->instance_ids.begin(), batch->instance_ids.end());
  }
  return ids;
}

TEST(DataLoader, EveryInstanceOncePerEpochAcrossReplicas) {
  TempDir dir("pf_data_loader");
  const auto shards = make_shards(dir, {37, 50, 13});  // 100 instances
  for (const std::size_t world : {1U, 3U, 4U}) {
    for (std::uint64_t epoch = 0; epoch < 2; ++epoch) {
      std::multiset<std::uint64_t> seen;
      for (std::size_t rank = 0; rank < world; ++rank) {
        LoaderOptions options = options_for(shards);
        options.replica_count = world;
        options.replica_rank = rank;
        options.drop_remainder = false;
        options.max_epochs = epoch + 1;
        LoaderPosition start;
        start.epoch = epoch;
        start.seed = 99;
        start.replica_rank = rank;
        start.replica_count = world;
        start.micro_batch_size = 4;
        start.num_instances = 100;
        ShardLoader loader(options, start);
        for (const auto id : drain_epoch(loader, epoch)) seen.insert(id);
        EXPECT_FALSE(loader.next().has_value()) << "max_epochs ends the stream";
      }
      ASSERT_EQ(seen.size(), 100U) << "world " << world;
      for (std::uint64_t id = 0; id < 100; ++id) EXPECT_EQ(seen.count(id), 1U) << "id " << id;
    }
  }
}

TEST(DataLoader, DropRemainderGivesEqualDisjointReplicas) {
  TempDir dir("pf_data_loader_drop");
  const auto shards = make_shards(dir, {37, 50, 13});
  std::set<std::uint64_t> seen;
  for (std::size_t rank = 0; rank < 3; ++rank) {
    LoaderOptions options = options_for(shards);
    options.replica_count = 3;
    options.replica_rank = rank;
    ShardLoader loader(options);
    EXPECT_EQ(loader.batches_per_epoch(), 8U);  // 33 instances each -> 8 full batches of 4
    for (const auto id : drain_epoch(loader, 0)) EXPECT_TRUE(seen.insert(id).second) << id;
  }
  EXPECT_EQ(seen.size(), 96U);
}

TEST(DataLoader, BatchContentsMatchTheShards) {
  TempDir dir("pf_data_loader_content");
  const auto shards = make_shards(dir, {10, 10});
  LoaderOptions options = options_for(shards);
  options.micro_batch_size = 5;
  ShardLoader loader(options);
  const auto batch = loader.next();
  ASSERT_TRUE(batch.has_value());
  EXPECT_EQ(loader.vocab_size(), kVocabSize);
  EXPECT_EQ(loader.vocab_hash(), 42U);
  EXPECT_EQ(loader.seq_length(), 16U);
  EXPECT_EQ(loader.max_predictions(), 3U);
  ASSERT_EQ(batch->batch_size, 5U);
  ASSERT_EQ(batch->seq_length, 16U);
  ASSERT_EQ(batch->input_ids.size(), 5U * 16U);
  for (std::size_t row = 0; row < 5; ++row) {
    const TrainingInstance expected = synthetic_instance(batch->instance_ids[row]);
    for (std::size_t t = 0; t < 16; ++t) {
      const bool real = t < expected.tokens.size();
      EXPECT_EQ(batch->input_ids[row * 16 + t], real ? expected.tokens[t] : 0);
      EXPECT_EQ(batch->attention_mask[row * 16 + t], real ? 1 : 0);
      EXPECT_EQ(batch->token_type_ids[row * 16 + t],
                (real && t >= expected.segment_a_length) ? 1 : 0);
    }
    EXPECT_EQ(batch->masked_positions[row * 3], 1);
    EXPECT_EQ(batch->masked_label_ids[row * 3], expected.masked_labels[0]);
    EXPECT_FLOAT_EQ(batch->masked_weights[row * 3], 1.0F);
    EXPECT_FLOAT_EQ(batch->masked_weights[row * 3 + 1], 0.0F);
    EXPECT_EQ(batch->next_sentence_labels[row], expected.is_random_next ? 1 : 0);
  }
}

TEST(DataLoader, ShufflesDeterministicallyPerEpoch) {
  TempDir dir("pf_data_loader_shuffle");
  const auto shards = make_shards(dir, {40, 40});
  ShardLoader a(options_for(shards));
  ShardLoader b(options_for(shards));
  EXPECT_EQ(a.replica_order(0), b.replica_order(0));
  EXPECT_NE(a.replica_order(0), a.replica_order(1));
  LoaderOptions other = options_for(shards);
  other.seed = 100;
  EXPECT_NE(ShardLoader(other).replica_order(0), a.replica_order(0));
  std::vector<std::uint64_t> sorted = a.replica_order(0);
  std::sort(sorted.begin(), sorted.end());
  EXPECT_NE(sorted, a.replica_order(0));
}

TEST(DataLoader, ResumeContinuesWhereItStopped) {
  TempDir dir("pf_data_loader_resume");
  const auto shards = make_shards(dir, {30, 25});  // 55 -> 13 batches of 4 per epoch
  LoaderOptions options = options_for(shards);
  options.replica_count = 2;
  options.replica_rank = 1;
  options.max_epochs = 3;
  std::vector<std::vector<std::uint64_t>> uninterrupted;
  {
    ShardLoader loader(options);
    while (auto batch = loader.next()) uninterrupted.push_back(batch->instance_ids);
  }
  ASSERT_EQ(uninterrupted.size(), 3U * 6U);  // 27 per replica -> 6 batches, 3 epochs
  for (const std::size_t stop_after : {1U, 5U, 6U, 11U}) {
    nlohmann::json saved;
    {
      ShardLoader loader(options);
      for (std::size_t b = 0; b < stop_after; ++b) ASSERT_TRUE(loader.next().has_value());
      saved = loader.position().to_json();  // what a checkpoint stores
    }
    ShardLoader resumed(options, LoaderPosition::from_json(nlohmann::json::parse(saved.dump())));
    std::size_t index = stop_after;
    while (auto batch = resumed.next()) {
      ASSERT_LT(index, uninterrupted.size());
      EXPECT_EQ(batch->instance_ids, uninterrupted[index]) << "batch " << index;
      ++index;
    }
    EXPECT_EQ(index, uninterrupted.size());
  }
}

TEST(DataLoader, PositionFromAnotherStreamIsRejected) {
  TempDir dir("pf_data_loader_position");
  const auto shards = make_shards(dir, {20});
  LoaderOptions options = options_for(shards);
  LoaderPosition position;
  position.seed = 1;  // options say 99
  position.micro_batch_size = 4;
  position.num_instances = 20;
  EXPECT_THROW(ShardLoader(options, position), std::invalid_argument);
  EXPECT_THROW(LoaderPosition::from_json(nlohmann::json{{"epoch", 1}}), std::invalid_argument);
  EXPECT_THROW(LoaderPosition::from_json(nlohmann::json::parse(
                   R"({"epoch":-1,"batches_in_epoch":0,"seed":0,"replica_rank":0,)"
                   R"("replica_count":1,"micro_batch_size":4,"num_instances":20})")),
               std::invalid_argument);
}

TEST(DataLoader, DestructionWhileReadingAheadDoesNotHang) {
  TempDir dir("pf_data_loader_stop");
  const auto shards = make_shards(dir, {200});
  LoaderOptions options = options_for(shards);
  options.prefetch_batches = 2;
  for (int i = 0; i < 20; ++i) {
    ShardLoader loader(options);  // endless epochs; the worker blocks on a full queue
    if (i % 2 == 0) {
      ASSERT_TRUE(loader.next().has_value());
    }
  }
}

TEST(DataLoader, ReadErrorReachesTheTrainer) {
  TempDir dir("pf_data_loader_error");
  const auto shards = make_shards(dir, {400});
  LoaderOptions options = options_for(shards);
  options.prefetch_batches = 1;
  options.shuffle_buffer = 1;
  options.shuffle_shards = false;
  ShardLoader loader(options);
  ASSERT_TRUE(loader.next().has_value());
  // The file loses its second half after the loader checked it.
  std::filesystem::resize_file(shards[0], ShardInfo::kHeaderBytes + 100 * (8 + 4 * 16 + 6 * 3));
  bool threw = false;
  try {
    for (int i = 0; i < 200; ++i) loader.next();
  } catch (const std::runtime_error& error) {
    threw = true;
    EXPECT_NE(std::string(error.what()).find("cannot read record"), std::string::npos)
        << error.what();
  }
  EXPECT_TRUE(threw);
}

}  // namespace
}  // namespace pf::data
