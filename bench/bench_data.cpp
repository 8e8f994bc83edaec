// Data-path benchmarks: tokenization MB/s on one core (the demo corpus when python3.11-doc is
// installed, generated text otherwise), instance creation, and loader throughput.
#include <benchmark/benchmark.h>

#include <filesystem>
#include <memory>
#include <string>

#include "runtime/data/bert_tokenizer.h"
#include "runtime/data/loader.h"
#include "runtime/data/pretraining_instances.h"
#include "runtime/data/python_random.h"
#include "runtime/data/rst_corpus.h"
#include "runtime/data/shard_format.h"
#include "runtime/data/text_file.h"
#include "runtime/data/vocab_trainer.h"

namespace {

using namespace pf::data;

constexpr const char* kDocs = "/usr/share/doc/python3.11-doc/html/_sources";

// The corpus, its vocabulary (trained on it, 30522 pieces) and the derived data, built once.
struct Fixture {
  std::string corpus;
  std::string accented;  // the same text with many non-ASCII letters
  std::unique_ptr<Vocabulary> vocab;
  std::string source;

  Fixture() {
    if (std::filesystem::is_directory(kDocs)) {
      RstStats stats;
      for (const auto& path : find_rst_files(kDocs))
        rst_to_corpus(read_text_file(path), corpus, stats);
      source = "python3.11-doc demo corpus";
    } else {
      PythonRandom rng(1);
      const char* words[] = {"the",      "tokenizer", "splits",      "words", "into",
                             "pieces",   "and",       "punctuation", "(like", "this),",
                             "quickly.", "Results",   "vary:"};
      while (corpus.size() < 4'000'000) {
        for (int w = 0; w < 12; ++w) {
          corpus += words[rng.below(13)];
          corpus += ' ';
        }
        corpus += '\n';
      }
      source = "generated text";
    }
    const std::size_t limit = std::min<std::size_t>(corpus.size(), 2'000'000);
    for (std::size_t i = 0; i < limit; ++i) {
      const char c = corpus[i];
      if (c == 'e') {
        accented += "é";
      } else if (c == 'a') {
        accented += "à";
      } else {
        accented += c;
      }
    }
    const BasicTokenizer basic(true);
    WordCounts counts;
    BasicTokens scratch;
    for_each_line(corpus,
                  [&](std::string_view line) { count_words(basic, line, counts, scratch); });
    vocab =
        std::make_unique<Vocabulary>(Vocabulary::from_tokens(train_wordpiece_vocab(counts, {})));
  }
};

const Fixture& fixture() {
  static const Fixture instance;
  return instance;
}

void tokenize_text(benchmark::State& state, const std::string& text, bool lower_case) {
  const BertTokenizer tokenizer(*fixture().vocab, {.lower_case = lower_case});
  std::vector<TokenId> ids;
  BasicTokens scratch;
  std::size_t tokens = 0;
  for (auto _ : state) {
    tokens = 0;
    for_each_line(text, [&](std::string_view line) {
      ids.clear();
      tokenizer.encode(line, ids, scratch);
      tokens += ids.size();
    });
    benchmark::DoNotOptimize(tokens);
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * text.size()));
  state.counters["tokens"] = static_cast<double>(tokens);
  state.SetLabel(fixture().source);
}

void BM_TokenizeUncased(benchmark::State& state) {
  tokenize_text(state, fixture().corpus, true);
}
void BM_TokenizeCased(benchmark::State& state) {
  tokenize_text(state, fixture().corpus, false);
}
void BM_TokenizeAccentedUncased(benchmark::State& state) {
  tokenize_text(state, fixture().accented, true);
}
BENCHMARK(BM_TokenizeUncased)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_TokenizeCased)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_TokenizeAccentedUncased)->Unit(benchmark::kMillisecond);

void BM_CreateInstancesDupe1(benchmark::State& state) {
  const Vocabulary& vocab = *fixture().vocab;
  const BertTokenizer tokenizer(vocab);
  CorpusReader reader(tokenizer, false);
  reader.add_text(fixture().corpus, "corpus");
  const TokenizedCorpus corpus = reader.finish();
  InstanceOptions options;
  options.dupe_factor = 1;
  std::size_t instances = 0;
  for (auto _ : state) {
    instances = create_instances(corpus, vocab, options).size();
    benchmark::DoNotOptimize(instances);
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * instances));
  state.counters["instances"] = static_cast<double>(instances);
}
BENCHMARK(BM_CreateInstancesDupe1)->Unit(benchmark::kMillisecond);

void BM_LoaderMicroBatches(benchmark::State& state) {
  const Vocabulary& vocab = *fixture().vocab;
  const BertTokenizer tokenizer(vocab);
  CorpusReader reader(tokenizer, false);
  reader.add_text(fixture().corpus.substr(0, 1'000'000), "corpus");
  InstanceOptions options;
  options.dupe_factor = 1;
  const auto instances = create_instances(reader.finish(), vocab, options);
  const std::string path =
      (std::filesystem::temp_directory_path() / "pf_bench_data.pfshard").string();
  ShardInfo info;
  info.vocab_hash = vocab.hash();
  info.vocab_size = static_cast<std::uint32_t>(vocab.size());
  info.max_seq_length = 128;
  info.max_predictions = 20;
  write_shard(path, info, instances);
  LoaderOptions loader_options;
  loader_options.shards = {path};
  loader_options.micro_batch_size = static_cast<std::size_t>(state.range(0));
  ShardLoader loader(loader_options);
  std::size_t sequences = 0;
  for (auto _ : state) {
    const auto batch = loader.next();
    sequences += batch->batch_size;
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(sequences));
  std::filesystem::remove(path);
}
BENCHMARK(BM_LoaderMicroBatches)->Arg(32)->Arg(256)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
