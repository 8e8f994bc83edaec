// Instance creation (Google's create_pretraining_data algorithm): structure and statistics over
// a corpus made in the test, and byte-identical shards from the same seed.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iterator>

#include "runtime/data/pretraining_instances.h"
#include "runtime/data/shard_format.h"
#include "runtime/data/text_file.h"
#include "tests/data/data_test_util.h"

namespace pf::data {
namespace {

using testing::random_corpus;
using testing::small_vocab;
using testing::TempDir;

TokenizedCorpus tokenize_corpus(const BertTokenizer& tokenizer, const std::string& text) {
  CorpusReader reader(tokenizer, false);
  reader.add_text(text, "test corpus");
  return reader.finish();
}

std::vector<TokenId> restore_original(const TrainingInstance& instance) {
  std::vector<TokenId> tokens = instance.tokens;
  for (std::size_t m = 0; m < instance.masked_positions.size(); ++m) {
    tokens[instance.masked_positions[m]] = instance.masked_labels[m];
  }
  return tokens;
}

bool contains_run(const std::vector<TokenId>& haystack, std::vector<TokenId>::const_iterator first,
                  std::vector<TokenId>::const_iterator last) {
  return std::search(haystack.begin(), haystack.end(), first, last) != haystack.end();
}

TEST(DataCorpusReader, DocumentsSentencesAndBlankLines) {
  const Vocabulary vocab = small_vocab();
  const BertTokenizer tokenizer(vocab);
  // Blank lines (also several, or with spaces) separate documents; a line without tokens
  // (only control characters) is skipped and counted.
  const TokenizedCorpus corpus =
      tokenize_corpus(tokenizer, "the cat sat .\nthe dog ran .\n\n \n\nbig red ball .\n\x01\x02\n");
  EXPECT_EQ(corpus.num_documents(), 2U);
  EXPECT_EQ(corpus.num_sentences(), 3U);
  EXPECT_EQ(corpus.document_size(0), 2U);
  EXPECT_EQ(corpus.sentence_size(2), 4U);
}

TEST(DataInstances, StructureAndLimits) {
  const Vocabulary vocab = small_vocab();
  const BertTokenizer tokenizer(vocab);
  const TokenizedCorpus corpus = tokenize_corpus(tokenizer, random_corpus(40, 7));
  InstanceOptions options;
  options.max_seq_length = 32;
  options.max_predictions_per_seq = 5;
  options.dupe_factor = 2;
  const auto instances = create_instances(corpus, vocab, options);
  ASSERT_FALSE(instances.empty());
  const auto& special = vocab.special();
  for (const TrainingInstance& instance : instances) {
    ASSERT_LE(instance.tokens.size(), options.max_seq_length);
    EXPECT_EQ(instance.tokens.front(), special.cls);
    EXPECT_EQ(instance.tokens.back(), special.sep);
    ASSERT_GE(instance.segment_a_length, 3U);  // [CLS] at least one token [SEP]
    EXPECT_EQ(instance.tokens[instance.segment_a_length - 1], special.sep);
    EXPECT_LT(instance.segment_a_length + 1, instance.tokens.size());  // B non-empty
    ASSERT_EQ(instance.masked_positions.size(), instance.masked_labels.size());
    EXPECT_LE(instance.masked_positions.size(), options.max_predictions_per_seq);
    EXPECT_GE(instance.masked_positions.size(), 1U);
    EXPECT_TRUE(std::is_sorted(instance.masked_positions.begin(), instance.masked_positions.end()));
    const auto original = restore_original(instance);
    for (std::size_t m = 0; m < instance.masked_positions.size(); ++m) {
      const auto position = instance.masked_positions[m];
      // [CLS] and [SEP] are never masked; labels are real tokens.
      EXPECT_NE(original[position], special.cls);
      EXPECT_NE(original[position], special.sep);
      EXPECT_NE(instance.masked_labels[m], special.mask);
    }
    // Each segment is a contiguous run of corpus text (truncation only trims the ends).
    const auto a_begin = original.begin() + 1;
    const auto a_end = original.begin() + instance.segment_a_length - 1;
    EXPECT_TRUE(contains_run(corpus.tokens, a_begin, a_end));
    EXPECT_TRUE(contains_run(corpus.tokens, a_end + 1, original.end() - 1));
  }
}

TEST(DataInstances, MaskingAndNspStatistics) {
  const Vocabulary vocab = small_vocab();
  const BertTokenizer tokenizer(vocab);
  const TokenizedCorpus corpus = tokenize_corpus(tokenizer, random_corpus(300, 11));
  InstanceOptions options;  // BERT phase 1: 128 tokens, 20 predictions, 15 %, 80/10/10
  options.dupe_factor = 3;
  InstanceStats stats;
  const auto instances = create_instances(corpus, vocab, options, &stats);
  ASSERT_EQ(stats.instances, instances.size());
  ASSERT_GT(stats.masked, 5000U);
  std::size_t tokens = 0;
  std::size_t masked = 0;
  std::size_t random_next = 0;
  std::size_t as_mask = 0;
  for (const TrainingInstance& instance : instances) {
    EXPECT_LE(instance.tokens.size(), options.max_seq_length);
    tokens += instance.tokens.size();
    masked += instance.masked_positions.size();
    random_next += instance.is_random_next ? 1 : 0;
    for (const auto position : instance.masked_positions) {
      as_mask += instance.tokens[position] == vocab.special().mask ? 1 : 0;
    }
    // round(len * 0.15), at least 1, at most 20 (all candidates are single tokens here).
    const auto expected = std::min<std::size_t>(
        20, std::max<std::size_t>(1, static_cast<std::size_t>(std::nearbyint(
                                         static_cast<double>(instance.tokens.size()) * 0.15))));
    EXPECT_EQ(instance.masked_positions.size(), expected);
  }
  EXPECT_EQ(stats.tokens, tokens);
  EXPECT_EQ(stats.masked, masked);
  EXPECT_EQ(stats.random_next, random_next);
  const double masked_fraction = static_cast<double>(masked) / static_cast<double>(tokens);
  EXPECT_NEAR(masked_fraction, 0.15, 0.01);
  const double n = static_cast<double>(stats.masked);
  EXPECT_NEAR(static_cast<double>(stats.masked_as_mask) / n, 0.8, 0.02);
  EXPECT_NEAR(static_cast<double>(stats.masked_as_random) / n, 0.1, 0.02);
  EXPECT_NEAR(static_cast<double>(stats.masked_unchanged) / n, 0.1, 0.02);
  // The random branch may itself draw [MASK] from the vocabulary.
  EXPECT_GE(as_mask, stats.masked_as_mask);
  EXPECT_LE(as_mask, stats.masked_as_mask + stats.masked_as_random);
  // NSP: the coin gives a random B half the time; chunks of a single segment always take a
  // random B (Google's rule), which tilts the overall ratio above one half.
  const double forced = static_cast<double>(stats.single_segment_chunks);
  const double coin_flips = static_cast<double>(instances.size()) - forced;
  ASSERT_GT(coin_flips, 1000.0);
  // Within 4 standard deviations of a fair coin.
  EXPECT_NEAR((static_cast<double>(random_next) - forced) / coin_flips, 0.5,
              4 * 0.5 / std::sqrt(coin_flips))
      << random_next << " random of " << instances.size() << ", " << forced << " forced";
  EXPECT_NEAR(static_cast<double>(random_next) / static_cast<double>(instances.size()), 0.5, 0.1);
}

TEST(DataInstances, ShortSequencesAndDupeFactor) {
  const Vocabulary vocab = small_vocab();
  const BertTokenizer tokenizer(vocab);
  const TokenizedCorpus corpus = tokenize_corpus(tokenizer, random_corpus(60, 3));
  InstanceOptions options;
  options.max_seq_length = 64;
  options.dupe_factor = 1;
  const auto once = create_instances(corpus, vocab, options);
  options.dupe_factor = 4;
  const auto four = create_instances(corpus, vocab, options);
  // Each pass re-chunks every document, so the count scales roughly with the dupe factor.
  EXPECT_GT(four.size(), 3 * once.size());
  options.short_seq_prob = 1.0;  // every document picks a random target length in [2, 61]
  const auto short_ones = create_instances(corpus, vocab, options);
  double mean_long = 0;
  double mean_short = 0;
  for (const auto& i : four)
    mean_long += static_cast<double>(i.tokens.size()) / static_cast<double>(four.size());
  for (const auto& i : short_ones)
    mean_short += static_cast<double>(i.tokens.size()) / static_cast<double>(short_ones.size());
  EXPECT_LT(mean_short, mean_long);
}

TEST(DataInstances, WholeWordMaskingMasksAllPieces) {
  const Vocabulary vocab = small_vocab();
  const BertTokenizer tokenizer(vocab);
  const TokenizedCorpus corpus = tokenize_corpus(
      tokenizer,
      "cats played sat . dogs ran all day .\nthe cats sat .\n\nballs played .\nreds ran .\n");
  InstanceOptions options;
  options.whole_word_mask = true;
  options.dupe_factor = 20;
  options.masked_lm_prob = 0.3;
  const auto instances = create_instances(corpus, vocab, options);
  for (const auto& instance : instances) {
    const auto original = restore_original(instance);
    for (std::size_t m = 0; m < instance.masked_positions.size(); ++m) {
      const auto p = instance.masked_positions[m];
      // A masked continuation piece implies its word's previous piece is masked too.
      if (vocab.is_continuation(original[p])) {
        EXPECT_TRUE(m > 0 && instance.masked_positions[m - 1] == p - 1);
      }
    }
  }
}

TEST(DataShards, SameSeedGivesByteIdenticalShards) {
  const Vocabulary vocab = small_vocab();
  const BertTokenizer tokenizer(vocab);
  const TokenizedCorpus corpus = tokenize_corpus(tokenizer, random_corpus(50, 5));
  TempDir dir("pf_data_instances");
  ShardInfo info;
  info.vocab_hash = vocab.hash();
  info.vocab_size = static_cast<std::uint32_t>(vocab.size());
  info.max_seq_length = 128;
  info.max_predictions = 20;
  InstanceOptions options;
  options.dupe_factor = 2;
  write_shard(dir.file("a"), info, create_instances(corpus, vocab, options));
  write_shard(dir.file("b"), info, create_instances(corpus, vocab, options));
  options.seed = 54321;
  write_shard(dir.file("c"), info, create_instances(corpus, vocab, options));
  const std::string a = read_text_file(dir.file("a"));
  EXPECT_EQ(a, read_text_file(dir.file("b")));
  EXPECT_NE(a, read_text_file(dir.file("c")));

  // The shard reads back to the same instances.
  options.seed = 12345;
  const auto instances = create_instances(corpus, vocab, options);
  ShardReader reader(dir.file("a"), vocab.hash());
  ASSERT_EQ(reader.size(), instances.size());
  TrainingInstance read;
  for (std::size_t i = 0; i < instances.size(); ++i) {
    reader.read(i, read);
    ASSERT_EQ(read, instances[i]) << "instance " << i;
  }
}

}  // namespace
}  // namespace pf::data
