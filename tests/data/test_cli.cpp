// pipefisher_data end to end: tokenize, corpus, vocab, shards, inspect; exit codes and errors.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>

#include "runtime/data/loader.h"
#include "runtime/data/text_file.h"
#include "runtime/data/vocabulary.h"
#include "tests/data/data_test_util.h"

namespace pf::data {
namespace {

using testing::random_corpus;
using testing::small_vocab;
using testing::TempDir;

// Runs the command through the shell; returns its exit status.
int run(const std::string& arguments) {
  const std::string command = std::string(PF_DATA_CLI) + " " + arguments;
  const int status = std::system(command.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

TEST(DataCli, TokenizePrintsOneLinePerInputLine) {
  TempDir dir("pf_data_cli_tokenize");
  small_vocab().save(dir.file("vocab.txt"));
  write_file(dir.file("in.txt"), "The CAT sat.\n\nthe dogs ran, far away!\n");
  ASSERT_EQ(run("tokenize --vocab " + dir.file("vocab.txt") + " < " + dir.file("in.txt") + " > " +
                dir.file("out.txt")),
            0);
  EXPECT_EQ(read_text_file(dir.file("out.txt")),
            "the cat sat .\n\nthe dog ##s ran , far away [UNK]\n");
  ASSERT_EQ(run("tokenize --ids --vocab " + dir.file("vocab.txt") + " < " + dir.file("in.txt") +
                " > " + dir.file("ids.txt")),
            0);
  EXPECT_EQ(read_text_file(dir.file("ids.txt")).substr(0, 9), "7 8 9 5\n\n");
  write_file(dir.file("bad.txt"), "fine\nbad \xc3\x28 byte\n");
  EXPECT_EQ(run("tokenize --vocab " + dir.file("vocab.txt") + " < " + dir.file("bad.txt") +
                " > /dev/null 2> " + dir.file("err.txt")),
            2);  // bad input (README "Exit status")
  EXPECT_NE(read_text_file(dir.file("err.txt")).find("stdin line 2: invalid UTF-8 at byte 5"),
            std::string::npos);
}

TEST(DataCli, ParagraphsToShardsAndLoader) {
  TempDir dir("pf_data_cli_shards");
  small_vocab().save(dir.file("vocab.txt"));
  std::string paragraphs;
  for (int i = 0; i < 30; ++i) {
    paragraphs += "The cat sat on the mat. The dog ran far away from home. They played all day.\n";
    paragraphs += "The big red ball is here. They ran and played.\n\n\n";
  }
  write_file(dir.file("paragraphs.txt"), paragraphs);
  ASSERT_EQ(run("shards " + dir.file("paragraphs.txt") + " --format paragraphs --vocab " +
                dir.file("vocab.txt") + " --out-dir " + dir.file("shards") +
                " --max-seq-length 32 --max-predictions-per-seq 5 --dupe-factor 2 "
                "--instances-per-shard 50 > " +
                dir.file("report.json")),
            0);
  const auto report = nlohmann::json::parse(read_text_file(dir.file("report.json")));
  EXPECT_EQ(report.at("documents").get<int>(), 30);
  EXPECT_EQ(report.at("sentences").get<int>(), 30 * 5);
  const std::size_t instances = report.at("instances").get<std::size_t>();
  ASSERT_GE(instances, 60U);
  LoaderOptions options;
  for (const auto& shard : report.at("shards")) options.shards.push_back(shard.at("path"));
  EXPECT_EQ(options.shards.size(), (instances + 49) / 50);
  options.vocab_hash = small_vocab().hash();
  options.micro_batch_size = 4;
  options.max_epochs = 1;
  ShardLoader loader(options);
  std::size_t batches = 0;
  while (loader.next()) ++batches;
  EXPECT_EQ(batches, instances / 4);
  EXPECT_EQ(run("inspect " + options.shards[0] + " --vocab " + dir.file("vocab.txt") +
                " --show 1 > /dev/null"),
            0);
}

TEST(DataCli, CorpusAndVocab) {
  TempDir dir("pf_data_cli_vocab");
  write_file(dir.file("doc.rst"),
             "Title\n=====\n\nSome :func:`prose` here. More prose follows::\n\n   code()\n");
  ASSERT_EQ(run("corpus --from-rst " + dir.file("") + " --out " + dir.file("corpus.txt") +
                " > /dev/null"),
            0);
  EXPECT_EQ(read_text_file(dir.file("corpus.txt")), "Some prose here.\nMore prose follows:\n\n");
  write_file(dir.file("text.txt"), random_corpus(20, 2));
  ASSERT_EQ(run("vocab " + dir.file("text.txt") + " --size 200 --out " + dir.file("vocab.txt") +
                " > /dev/null"),
            0);
  const Vocabulary vocab = Vocabulary::load(dir.file("vocab.txt"));
  EXPECT_EQ(vocab.size(), 200U);
  EXPECT_TRUE(vocab.find("the").has_value());
}

// The convention of every program (README "Exit status"): 2 for bad input or usage.
TEST(DataCli, BadInputAndUsageExitWithStatusTwo) {
  TempDir dir("pf_data_cli_errors");
  write_file(dir.file("no_specials.txt"), "the\ncat\n");
  write_file(dir.file("text.txt"), "the cat sat .\n");
  EXPECT_EQ(run("shards " + dir.file("text.txt") + " --vocab " + dir.file("no_specials.txt") +
                " --out-dir " + dir.file("out") + " 2> " + dir.file("err.txt")),
            2);
  EXPECT_NE(read_text_file(dir.file("err.txt")).find("lacks the special token(s) [PAD] [UNK]"),
            std::string::npos);
  write_file(dir.file("not_a_shard"), "hello");
  EXPECT_EQ(run("inspect " + dir.file("not_a_shard") + " 2> /dev/null"), 2);
  EXPECT_EQ(run("frobnicate 2> /dev/null"), 2);
  EXPECT_EQ(run("shards --max-seq-length lots 2> /dev/null"), 2);
  // A directory as --vocab used to end in a bare std::bad_alloc.
  EXPECT_EQ(run("inspect " + dir.file("not_a_shard") + " --vocab " + dir.path() + " 2> " +
                dir.file("err.txt")),
            2);
  EXPECT_NE(read_text_file(dir.file("err.txt")).find("it is a directory, not a file"),
            std::string::npos)
      << read_text_file(dir.file("err.txt"));
  write_file(dir.file("bad_utf8.txt"), "ok\n\xff\n");
  small_vocab().save(dir.file("vocab.txt"));
  EXPECT_EQ(run("tokenize --vocab " + dir.file("vocab.txt") + " < " + dir.file("bad_utf8.txt") +
                " > /dev/null 2>&1"),
            2);
}

}  // namespace
}  // namespace pf::data
