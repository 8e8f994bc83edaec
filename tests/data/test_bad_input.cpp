// Bad input gets a clear error (or a documented, counted skip), never a crash or a hang.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "common/input_error.h"
#include "runtime/data/loader.h"
#include "runtime/data/pretraining_instances.h"
#include "runtime/data/shard_format.h"
#include "runtime/data/text_file.h"
#include "tests/data/data_test_util.h"

namespace pf::data {
namespace {

using testing::random_corpus;
using testing::small_vocab;
using testing::TempDir;

// Runs `fn`, expects an exception of type E whose message contains `needle`.
template <class E, class Fn>
void expect_error(Fn&& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "no exception; expected one mentioning '" << needle << "'";
  } catch (const E& error) {
    EXPECT_NE(std::string(error.what()).find(needle), std::string::npos) << error.what();
  }
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

TEST(DataBadInput, InvalidUtf8IsAnErrorWithFileAndLineOrACountedSkip) {
  const Vocabulary vocab = small_vocab();
  const BertTokenizer tokenizer(vocab);
  const std::string text = "the cat sat .\nthe \xff\xfe dog ran .\n";
  CorpusReader strict(tokenizer, false);
  expect_error<std::invalid_argument>([&] { strict.add_text(text, "corpus.txt"); },
                                      "corpus.txt:2: invalid UTF-8 at byte 5");
  CorpusReader lenient(tokenizer, true);
  lenient.add_text(text, "corpus.txt");
  EXPECT_EQ(lenient.stats().invalid_utf8_lines, 1U);
  EXPECT_EQ(lenient.stats().invalid_utf8_bytes, 2U);
  const TokenizedCorpus corpus = lenient.finish();
  EXPECT_EQ(corpus.num_sentences(), 2U);
  EXPECT_EQ(corpus.sentence_size(1), 4U);  // the dog ran .
}

TEST(DataBadInput, EmptyInputsSayThereIsNothingToMake) {
  const Vocabulary vocab = small_vocab();
  const BertTokenizer tokenizer(vocab);
  CorpusReader reader(tokenizer, false);
  reader.add_text("", "empty.txt");
  reader.add_text("\n\n   \n", "blank.txt");
  const TokenizedCorpus corpus = reader.finish();
  EXPECT_EQ(corpus.num_documents(), 0U);
  expect_error<std::invalid_argument>([&] { create_instances(corpus, vocab, {}); }, "no documents");
  TempDir dir("pf_data_bad_empty");
  write_file(dir.file("empty.txt"), "");
  expect_error<std::invalid_argument>([&] { Vocabulary::load(dir.file("empty.txt")); }, "empty");
  expect_error<std::runtime_error>([&] { read_text_file(dir.file("missing.txt")); }, "missing.txt");
}

TEST(DataBadInput, SingleSentenceDocumentsAndASingleDocument) {
  const Vocabulary vocab = small_vocab();
  const BertTokenizer tokenizer(vocab);
  for (const std::string text :
       {"the cat sat .\n\nthe dog ran .\n", "the cat sat on the mat .\n"}) {
    CorpusReader reader(tokenizer, false);
    reader.add_text(text, "tiny.txt");
    const TokenizedCorpus corpus = reader.finish();
    InstanceOptions options;
    options.dupe_factor = 3;
    const auto instances = create_instances(corpus, vocab, options);
    ASSERT_EQ(instances.size(), 3U * corpus.num_documents());
    for (const auto& instance : instances) {
      // One segment per chunk: B is always a random segment (NSP label 1).
      EXPECT_TRUE(instance.is_random_next);
      EXPECT_GT(instance.tokens.size(), instance.segment_a_length);
    }
  }
}

TEST(DataBadInput, TenMegabyteLineIsTruncatedInLinearTime) {
  const Vocabulary vocab = small_vocab();
  const BertTokenizer tokenizer(vocab);
  std::string line;
  line.reserve(10'000'100);
  while (line.size() < 10'000'000) line += "the big red ball ";
  std::string text = "the cat sat .\n" + line + "\nthe dog ran .\n\nhome far away .\n";
  const auto start = std::chrono::steady_clock::now();
  CorpusReader reader(tokenizer, false);
  reader.add_text(text, "long.txt");
  const TokenizedCorpus corpus = reader.finish();
  InstanceOptions options;
  options.dupe_factor = 1;
  const auto instances = create_instances(corpus, vocab, options);
  for (const auto& instance : instances) EXPECT_LE(instance.tokens.size(), 128U);
  // Also a single 10 MB "word": one [UNK], no quadratic WordPiece search.
  EXPECT_EQ(tokenizer.encode(std::string(10'000'000, 'x')),
            std::vector<TokenId>{vocab.special().unk});
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 120.0) << "pathologically slow";
}

TEST(DataBadInput, VocabularyWithoutSpecialTokensOrWithDuplicates) {
  TempDir dir("pf_data_bad_vocab");
  write_file(dir.file("no_specials.txt"), "[PAD]\nthe\ncat\n[CLS]\n");
  expect_error<std::invalid_argument>([&] { Vocabulary::load(dir.file("no_specials.txt")); },
                                      "lacks the special token(s) [UNK] [SEP] [MASK]");
  write_file(dir.file("duplicates.txt"), "[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nthe\ncat\nthe\n");
  expect_error<std::invalid_argument>([&] { Vocabulary::load(dir.file("duplicates.txt")); },
                                      "duplicates.txt:8: duplicate token 'the' (first on line 6)");
  write_file(dir.file("bad_utf8.txt"), "[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nca\xfft\n");
  expect_error<std::invalid_argument>([&] { Vocabulary::load(dir.file("bad_utf8.txt")); },
                                      "bad_utf8.txt:6: invalid UTF-8");
  // Google's files end lines with \n; \r\n and trailing spaces are stripped like load_vocab.
  write_file(dir.file("crlf.txt"), "[PAD]\r\n[UNK] \r\n[CLS]\r\n[SEP]\r\n[MASK]\r\nthe");
  const Vocabulary vocab = Vocabulary::load(dir.file("crlf.txt"));
  EXPECT_EQ(vocab.size(), 6U);
  EXPECT_EQ(vocab.special().unk, 1);
  EXPECT_EQ(vocab.token(5), "the");
}

class DataBadShards : public ::testing::Test {
 protected:
  void SetUp() override {
    const Vocabulary vocab = small_vocab();
    const BertTokenizer tokenizer(vocab);
    CorpusReader reader(tokenizer, false);
    reader.add_text(random_corpus(20, 1), "corpus");
    InstanceOptions options;
    options.dupe_factor = 1;
    info_.vocab_hash = vocab.hash();
    info_.vocab_size = static_cast<std::uint32_t>(vocab.size());
    info_.max_seq_length = 128;
    info_.max_predictions = 20;
    write_shard(path_, info_, create_instances(reader.finish(), vocab, options));
    bytes_ = read_text_file(path_);
  }

  TempDir dir_{"pf_data_bad_shards"};
  std::string path_ = dir_.file("good.pfshard");
  ShardInfo info_;
  std::string bytes_;
};

TEST_F(DataBadShards, GoodShardOpens) {
  ShardReader reader(path_, info_.vocab_hash);
  EXPECT_GT(reader.size(), 0U);
}

TEST_F(DataBadShards, TruncatedShard) {
  write_file(dir_.file("cut"), bytes_.substr(0, bytes_.size() - 100));
  expect_error<std::runtime_error>([&] { ShardReader reader(dir_.file("cut")); }, "truncated");
  write_file(dir_.file("stub"), bytes_.substr(0, 20));
  expect_error<std::runtime_error>([&] { ShardReader reader(dir_.file("stub")); },
                                   "shorter than its 64-byte header");
  write_file(dir_.file("empty"), "");
  expect_error<std::runtime_error>([&] { ShardReader reader(dir_.file("empty")); }, "shorter than");
}

TEST_F(DataBadShards, CorruptedRecordsAndHeader) {
  std::string corrupted = bytes_;
  corrupted[bytes_.size() / 2] ^= 0x10;
  write_file(dir_.file("flip"), corrupted);
  expect_error<std::runtime_error>([&] { ShardReader reader(dir_.file("flip")); },
                                   "checksum mismatch");
  // Without the checksum pass the damaged record is still caught when read... or reads as a
  // plausible record; either way no crash. A length field beyond the limit is always caught.
  std::string bad_length = bytes_;
  bad_length[ShardInfo::kHeaderBytes] = '\xff';
  bad_length[ShardInfo::kHeaderBytes + 1] = '\xff';
  write_file(dir_.file("length"), bad_length);
  ShardReader unchecked(dir_.file("length"), std::nullopt, false);
  TrainingInstance instance;
  expect_error<std::runtime_error>([&] { unchecked.read(0, instance); },
                                   "record 0: bad length 65535");
  std::string header = bytes_;
  header[20] ^= 0x01;  // inside the vocabulary hash
  write_file(dir_.file("header"), header);
  expect_error<std::runtime_error>([&] { ShardReader reader(dir_.file("header")); },
                                   "header checksum");
  write_file(dir_.file("text"), std::string(200, 'x'));
  expect_error<std::runtime_error>([&] { ShardReader reader(dir_.file("text")); },
                                   "not a pipefisher shard");
}

// The good shard's header with another instance count (and a matching header checksum, and the
// checksum of an empty payload), followed by no records at all.
std::string header_claiming(const std::string& shard, std::uint64_t instances) {
  std::string header = shard.substr(0, ShardInfo::kHeaderBytes);
  const std::uint64_t empty_payload = fnv1a64("");
  std::memcpy(header.data() + 40, &instances, 8);
  std::memcpy(header.data() + 48, &empty_payload, 8);
  const std::uint64_t checksum = fnv1a64(std::string_view(header.data(), 56));
  std::memcpy(header.data() + 56, &checksum, 8);
  return header;
}

// Issue #16 defect 5: 64 + num_instances * record_bytes wrapped around to the file size, so a
// 64-byte file claiming 2^58 instances passed the size check ("checksum ok").
TEST_F(DataBadShards, InstanceCountCannotWrapTheSizeCheck) {
  ASSERT_EQ(info_.max_seq_length, 128U);  // 640-byte records: 2^58 * 640 = 0 (mod 2^64)
  write_file(dir_.file("wrap"), header_claiming(bytes_, std::uint64_t{1} << 58));
  expect_error<InputError>([&] { ShardReader reader(dir_.file("wrap")); },
                           "header field 'num_instances' = 288230376151711744 but the file's 64 "
                           "bytes hold at most 0 records of 640 bytes");
  write_file(dir_.file("one_short"), header_claiming(bytes_, 1));
  expect_error<InputError>([&] { ShardReader reader(dir_.file("one_short")); },
                           "'num_instances' = 1 but the file's 64 bytes hold at most 0 records");
  write_file(dir_.file("none"), header_claiming(bytes_, 0));
  EXPECT_EQ(ShardReader(dir_.file("none")).size(), 0U);
}

TEST_F(DataBadShards, ADirectoryIsNotAFile) {
  expect_error<InputError>([&] { read_text_file(dir_.path()); }, "it is a directory, not a file");
  expect_error<InputError>([&] { Vocabulary::load(dir_.path()); }, "is a directory");
}

TEST_F(DataBadShards, OtherFormatVersion) {
  std::string future = bytes_;
  future[8] = 2;
  write_file(dir_.file("v2"), future);
  expect_error<std::runtime_error>([&] { ShardReader reader(dir_.file("v2")); },
                                   "format version 2, this build reads version 1");
}

TEST_F(DataBadShards, ShardFromAnotherVocabulary) {
  expect_error<std::runtime_error>([&] { ShardReader reader(path_, info_.vocab_hash + 1); },
                                   "made with another vocabulary");
  LoaderOptions options;
  options.shards = {path_};
  options.vocab_hash = info_.vocab_hash ^ 0xff;
  expect_error<std::runtime_error>([&] { ShardLoader loader(options); }, "another vocabulary");
}

TEST_F(DataBadShards, LoaderRejectsBadOptions) {
  LoaderOptions options;
  expect_error<std::invalid_argument>([&] { ShardLoader loader(options); }, "no shard files");
  options.shards = {path_};
  options.replica_count = 2;
  options.replica_rank = 2;
  expect_error<std::invalid_argument>([&] { ShardLoader loader(options); }, "replica rank 2");
  options.replica_rank = 0;
  options.micro_batch_size = 100000;
  expect_error<std::invalid_argument>([&] { ShardLoader loader(options); },
                                      "do not fill one micro-batch");
}

}  // namespace
}  // namespace pf::data
