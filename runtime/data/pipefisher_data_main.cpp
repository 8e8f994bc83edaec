// pipefisher_data: BERT pretraining data from the command line.
//   tokenize  stdin lines -> WordPiece tokens or ids
//   vocab     text files -> vocab.txt (WordPiece training)
//   corpus    reStructuredText or plain paragraphs -> one sentence per line
//   shards    sentence files -> binary shards of masked-LM/NSP instances
//   inspect   shard header and decoded instances
// Errors print one line on stderr; exit status 2 for bad input or usage, 1 for an internal
// failure (common/exit_codes.h).
#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/exit_codes.h"
#include "runtime/data/bert_tokenizer.h"
#include "runtime/data/pretraining_instances.h"
#include "runtime/data/rst_corpus.h"
#include "runtime/data/sentence_splitter.h"
#include "runtime/data/shard_format.h"
#include "runtime/data/text_file.h"
#include "runtime/data/unicode_text.h"
#include "runtime/data/vocab_trainer.h"

namespace {

using namespace pf::data;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Files given directly, and the regular files inside given directories (sorted).
std::vector<std::string> expand_inputs(const std::vector<std::string>& inputs) {
  std::vector<std::string> files;
  for (const std::string& input : inputs) {
    if (std::filesystem::is_directory(input)) {
      std::vector<std::string> inside;
      for (const auto& entry : std::filesystem::recursive_directory_iterator(input)) {
        if (entry.is_regular_file()) inside.push_back(entry.path().string());
      }
      std::sort(inside.begin(), inside.end());
      files.insert(files.end(), inside.begin(), inside.end());
    } else {
      files.push_back(input);
    }
  }
  return files;
}

int run_tokenize(const std::string& vocab_path, bool ids, bool cased, std::size_t max_word_chars,
                 bool skip_invalid) {
  const Vocabulary vocab = Vocabulary::load(vocab_path);
  const BertTokenizer tokenizer(vocab, {.lower_case = !cased, .max_word_chars = max_word_chars});
  std::ios::sync_with_stdio(false);
  std::string line;
  std::string clean;
  std::string out;
  std::vector<TokenId> tokens;
  BasicTokens scratch;
  std::size_t line_number = 0;
  std::size_t dropped = 0;
  while (std::getline(std::cin, line)) {
    ++line_number;
    std::string_view text = line;
    const std::size_t bad = find_invalid_utf8(text);
    if (bad != std::string_view::npos) {
      if (!skip_invalid) {
        std::cerr << "pipefisher_data tokenize: stdin line " << line_number
                  << ": invalid UTF-8 at byte " << bad + 1
                  << " of the line (use --skip-invalid-utf8 to drop such bytes)\n";
        return pf::kExitBadInput;
      }
      clean.clear();
      dropped += drop_invalid_utf8(text, clean);
      text = clean;
    }
    tokens.clear();
    tokenizer.encode(text, tokens, scratch);
    out.clear();
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      if (i > 0) out += ' ';
      out += ids ? std::to_string(tokens[i]) : vocab.token(tokens[i]);
    }
    out += '\n';
    std::cout << out;
  }
  if (dropped > 0)
    std::cerr << "pipefisher_data tokenize: dropped " << dropped << " invalid UTF-8 bytes\n";
  return 0;
}

int run_vocab(const std::vector<std::string>& inputs, const std::string& out_path,
              const VocabTrainerOptions& options, bool cased, bool skip_invalid) {
  const auto start = Clock::now();
  const BasicTokenizer basic(!cased);
  WordCounts counts;
  BasicTokens scratch;
  std::string clean;
  std::size_t dropped = 0;
  std::uint64_t bytes = 0;
  for (const std::string& path : expand_inputs(inputs)) {
    const std::string text = read_text_file(path);
    bytes += text.size();
    std::size_t line_number = 0;
    for_each_line(text, [&](std::string_view line) {
      ++line_number;
      const std::size_t bad = find_invalid_utf8(line);
      if (bad != std::string_view::npos) {
        if (!skip_invalid) {
          throw std::invalid_argument(path + ":" + std::to_string(line_number) +
                                      ": invalid UTF-8 at byte " + std::to_string(bad + 1) +
                                      " of the line (use --skip-invalid-utf8 to drop such bytes)");
        }
        clean.clear();
        dropped += drop_invalid_utf8(line, clean);
        line = clean;
      }
      count_words(basic, line, counts, scratch);
    });
  }
  if (counts.empty()) throw std::invalid_argument("the inputs contain no words to train on");
  VocabTrainerStats stats;
  const std::vector<std::string> tokens = train_wordpiece_vocab(counts, options, &stats);
  const Vocabulary vocab = Vocabulary::from_tokens(tokens, out_path);
  vocab.save(out_path);
  const nlohmann::json report = {{"vocab", out_path},
                                 {"size", vocab.size()},
                                 {"hash", vocab.hash()},
                                 {"input_bytes", bytes},
                                 {"words", stats.words},
                                 {"distinct_words", stats.distinct_words},
                                 {"alphabet", stats.alphabet},
                                 {"merges", stats.merges},
                                 {"unused_padding", stats.padding},
                                 {"invalid_utf8_bytes_dropped", dropped},
                                 {"seconds", seconds_since(start)}};
  std::cout << report.dump(2) << '\n';
  return 0;
}

int run_corpus(const std::vector<std::string>& inputs, const std::string& out_path,
               const std::string& format) {
  const auto start = Clock::now();
  std::string out;
  RstStats stats;
  std::vector<std::string> files;
  for (const std::string& input : inputs) {
    if (std::filesystem::is_directory(input)) {
      const auto inside = format == "rst" ? find_rst_files(input) : expand_inputs({input});
      files.insert(files.end(), inside.begin(), inside.end());
    } else {
      files.push_back(input);
    }
  }
  if (files.empty()) throw std::invalid_argument("no input files found");
  for (const std::string& path : files) {
    const std::string text = read_text_file(path);
    const std::size_t bad = find_invalid_utf8(text);
    if (bad != std::string_view::npos) {
      throw std::invalid_argument(path + ": invalid UTF-8 at byte offset " + std::to_string(bad));
    }
    if (format == "rst") {
      rst_to_corpus(text, out, stats);
    } else {
      ++stats.files;
      stats.input_bytes += text.size();
      out += paragraphs_to_sentences(text);
    }
  }
  write_text_file(out_path, out);
  const nlohmann::json report = {{"out", out_path},
                                 {"files", stats.files},
                                 {"input_bytes", stats.input_bytes},
                                 {"output_bytes", out.size()},
                                 {"documents", stats.documents},
                                 {"sentences", stats.sentences},
                                 {"seconds", seconds_since(start)}};
  std::cout << report.dump(2) << '\n';
  return 0;
}

struct ShardCommand {
  std::vector<std::string> inputs;
  std::string vocab_path;
  std::string out_dir;
  std::string prefix = "shard";
  std::string format = "sentences";
  std::size_t instances_per_shard = 65536;
  bool cased = false;
  bool skip_invalid = false;
  std::size_t max_word_chars = 100;
  InstanceOptions instance;
};

int run_shards(const ShardCommand& command) {
  const auto start = Clock::now();
  const Vocabulary vocab = Vocabulary::load(command.vocab_path);
  const BertTokenizer tokenizer(
      vocab, {.lower_case = !command.cased, .max_word_chars = command.max_word_chars});
  command.instance.validate();
  CorpusReader reader(tokenizer, command.skip_invalid);
  std::uint64_t bytes = 0;
  const auto files = expand_inputs(command.inputs);
  if (files.empty()) throw std::invalid_argument("no input files given");
  for (const std::string& path : files) {
    std::string text = read_text_file(path);
    bytes += text.size();
    if (command.format == "paragraphs") text = paragraphs_to_sentences(text);
    reader.add_text(text, path);
  }
  const TokenizedCorpus corpus = reader.finish();
  const double read_seconds = seconds_since(start);
  InstanceStats stats;
  const std::vector<TrainingInstance> instances =
      create_instances(corpus, vocab, command.instance, &stats);
  const double create_seconds = seconds_since(start) - read_seconds;
  std::filesystem::create_directories(command.out_dir);
  ShardInfo info;
  info.vocab_hash = vocab.hash();
  info.vocab_size = static_cast<std::uint32_t>(vocab.size());
  info.max_seq_length = static_cast<std::uint32_t>(command.instance.max_seq_length);
  info.max_predictions = static_cast<std::uint32_t>(command.instance.max_predictions_per_seq);
  nlohmann::json shard_list = nlohmann::json::array();
  const std::size_t per_shard = std::max<std::size_t>(1, command.instances_per_shard);
  for (std::size_t first = 0, index = 0; first < instances.size(); first += per_shard, ++index) {
    const std::size_t last = std::min(instances.size(), first + per_shard);
    const std::vector<TrainingInstance> part(instances.begin() + static_cast<std::ptrdiff_t>(first),
                                             instances.begin() + static_cast<std::ptrdiff_t>(last));
    char name[32];
    std::snprintf(name, sizeof(name), "-%05zu.pfshard", index);
    const std::string path =
        (std::filesystem::path(command.out_dir) / (command.prefix + name)).string();
    write_shard(path, info, part);
    shard_list.push_back({{"path", path}, {"instances", part.size()}});
  }
  const auto& read = reader.stats();
  const double masked = static_cast<double>(std::max<std::size_t>(1, stats.masked));
  const nlohmann::json report = {
      {"shards", shard_list},
      {"vocab_hash", vocab.hash()},
      {"input_files", read.files},
      {"input_bytes", bytes},
      {"lines", read.lines},
      {"documents", corpus.num_documents()},
      {"sentences", corpus.num_sentences()},
      {"tokens", corpus.tokens.size()},
      {"lines_without_tokens", read.empty_sentences},
      {"invalid_utf8_lines", read.invalid_utf8_lines},
      {"invalid_utf8_bytes_dropped", read.invalid_utf8_bytes},
      {"instances", stats.instances},
      {"random_next_fraction", static_cast<double>(stats.random_next) /
                                   static_cast<double>(std::max<std::size_t>(1, stats.instances))},
      {"single_segment_chunks", stats.single_segment_chunks},
      {"masked_fraction", static_cast<double>(stats.masked) /
                              static_cast<double>(std::max<std::size_t>(1, stats.tokens))},
      {"mask_token_fraction", static_cast<double>(stats.masked_as_mask) / masked},
      {"random_token_fraction", static_cast<double>(stats.masked_as_random) / masked},
      {"unchanged_fraction", static_cast<double>(stats.masked_unchanged) / masked},
      {"max_length", stats.max_length},
      {"mean_length", static_cast<double>(stats.tokens) /
                          static_cast<double>(std::max<std::size_t>(1, stats.instances))},
      {"seconds_tokenize", read_seconds},
      {"seconds_instances", create_seconds},
      {"seconds_total", seconds_since(start)}};
  std::cout << report.dump(2) << '\n';
  return 0;
}

int run_inspect(const std::vector<std::string>& shards, const std::string& vocab_path,
                std::size_t show) {
  std::optional<Vocabulary> vocab;
  if (!vocab_path.empty()) vocab = Vocabulary::load(vocab_path);
  for (const std::string& path : shards) {
    ShardReader reader(path, vocab ? std::optional<std::uint64_t>(vocab->hash()) : std::nullopt);
    const ShardInfo& info = reader.info();
    std::cout << path << ": version " << info.version << ", " << info.num_instances
              << " instances, max_seq_length " << info.max_seq_length << ", max_predictions "
              << info.max_predictions << ", vocabulary " << info.vocab_size << " tokens (hash "
              << info.vocab_hash << "), checksum ok\n";
    TrainingInstance instance;
    for (std::size_t i = 0; i < std::min(show, reader.size()); ++i) {
      reader.read(i, instance);
      std::cout << "instance " << i << " (NSP label " << (instance.is_random_next ? 1 : 0)
                << (instance.is_random_next ? ", random next" : ", actual next") << "):\n  ";
      std::size_t m = 0;
      for (std::size_t t = 0; t < instance.tokens.size(); ++t) {
        const std::string token =
            vocab ? vocab->token(instance.tokens[t]) : std::to_string(instance.tokens[t]);
        const bool is_masked =
            m < instance.masked_positions.size() && instance.masked_positions[m] == t;
        if (is_masked) {
          const std::string label = vocab ? vocab->token(instance.masked_labels[m])
                                          : std::to_string(instance.masked_labels[m]);
          std::cout << token << "{" << label << "} ";
          ++m;
        } else {
          std::cout << token << ' ';
        }
        if (t + 1 == instance.segment_a_length) std::cout << "| ";
      }
      std::cout << '\n';
    }
  }
  return 0;
}

// corpus + vocab + shards in one go, for the README's demo pretraining run.
int run_demo(const std::string& docs, const std::string& out_dir, std::size_t vocab_size,
             ShardCommand command) {
  std::filesystem::create_directories(out_dir);
  const auto dir = std::filesystem::path(out_dir);
  const std::string corpus_path = (dir / "corpus.txt").string();
  const std::string vocab_path = (dir / "vocab.txt").string();
  std::cout << "== corpus\n";
  run_corpus({docs}, corpus_path, "rst");
  std::cout << "== vocab\n";
  VocabTrainerOptions options;
  options.vocab_size = vocab_size;
  run_vocab({corpus_path}, vocab_path, options, command.cased, false);
  std::cout << "== shards\n";
  command.inputs = {corpus_path};
  command.vocab_path = vocab_path;
  command.out_dir = (dir / "shards").string();
  return run_shards(command);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"BERT pretraining data: tokenizer, vocabulary, corpus, shards"};
  app.require_subcommand(1);

  std::string vocab_path;
  bool ids = false;
  bool cased = false;
  bool skip_invalid = false;
  std::size_t max_word_chars = 100;
  auto* tokenize = app.add_subcommand("tokenize", "Tokenize standard input line by line");
  tokenize->add_option("--vocab", vocab_path, "vocab.txt")->required()->check(CLI::ExistingFile);
  tokenize->add_flag("--ids", ids, "print ids instead of tokens");
  tokenize->add_flag("--cased", cased, "keep case and accents");
  tokenize->add_option("--max-word-chars", max_word_chars, "longer words become [UNK]")
      ->capture_default_str();
  tokenize->add_flag("--skip-invalid-utf8", skip_invalid,
                     "drop ill-formed bytes instead of failing");

  std::vector<std::string> inputs;
  std::string out_path;
  VocabTrainerOptions vocab_options;
  bool no_pad = false;
  auto* vocab = app.add_subcommand("vocab", "Train a WordPiece vocabulary (vocab.txt)");
  vocab->add_option("inputs", inputs, "text files or directories")->required();
  vocab->add_option("--out", out_path, "vocab.txt to write")->required();
  vocab->add_option("--size", vocab_options.vocab_size, "vocabulary size")->capture_default_str();
  vocab
      ->add_option("--min-frequency", vocab_options.min_frequency,
                   "stop when the best pair is rarer")
      ->capture_default_str();
  vocab->add_option("--alphabet", vocab_options.alphabet_limit, "most frequent characters kept")
      ->capture_default_str();
  vocab->add_flag("--no-pad", no_pad, "do not fill up with [unusedN] when merging stops early");
  vocab->add_flag("--cased", cased, "keep case and accents");
  vocab->add_flag("--skip-invalid-utf8", skip_invalid, "drop ill-formed bytes instead of failing");

  std::string corpus_format = "rst";
  std::string from_rst;
  auto* corpus = app.add_subcommand("corpus", "Make BERT input text (one sentence per line)");
  corpus->add_option("inputs", inputs, "input files or directories");
  corpus->add_option("--from-rst", from_rst,
                     "directory of reStructuredText sources (same as --format rst DIR)");
  corpus->add_option("--format", corpus_format, "rst | paragraphs")
      ->check(CLI::IsMember({"rst", "paragraphs"}))
      ->capture_default_str();
  corpus->add_option("--out", out_path, "output text file")->required();

  ShardCommand shard_command;
  auto* shards = app.add_subcommand("shards", "Create masked-LM/NSP instances as binary shards");
  shards
      ->add_option(
          "inputs", shard_command.inputs,
          "text files (one sentence per line, blank line between documents) or directories")
      ->required();
  shards->add_option("--vocab", shard_command.vocab_path, "vocab.txt")
      ->required()
      ->check(CLI::ExistingFile);
  shards->add_option("--out-dir", shard_command.out_dir, "output directory")->required();
  shards->add_option("--prefix", shard_command.prefix, "shard file name prefix")
      ->capture_default_str();
  shards->add_option("--format", shard_command.format, "sentences | paragraphs")
      ->check(CLI::IsMember({"sentences", "paragraphs"}))
      ->capture_default_str();
  shards->add_option("--instances-per-shard", shard_command.instances_per_shard)
      ->capture_default_str();
  shards->add_option("--max-seq-length", shard_command.instance.max_seq_length)
      ->capture_default_str();
  shards->add_option("--max-predictions-per-seq", shard_command.instance.max_predictions_per_seq)
      ->capture_default_str();
  shards->add_option("--masked-lm-prob", shard_command.instance.masked_lm_prob)
      ->capture_default_str();
  shards->add_option("--short-seq-prob", shard_command.instance.short_seq_prob)
      ->capture_default_str();
  shards->add_option("--dupe-factor", shard_command.instance.dupe_factor)->capture_default_str();
  shards->add_option("--seed", shard_command.instance.seed)->capture_default_str();
  shards->add_flag("--whole-word-mask", shard_command.instance.whole_word_mask,
                   "mask all pieces of a word together");
  shards->add_flag("--cased", shard_command.cased, "keep case and accents");
  shards->add_option("--max-word-chars", shard_command.max_word_chars)->capture_default_str();
  shards->add_flag("--skip-invalid-utf8", shard_command.skip_invalid,
                   "drop ill-formed bytes (counted) instead of failing");

  std::vector<std::string> shard_paths;
  std::size_t show = 3;
  auto* inspect = app.add_subcommand("inspect", "Check shards and print decoded instances");
  inspect->add_option("shards", shard_paths, "shard files")->required();
  inspect->add_option("--vocab", vocab_path, "vocab.txt (checks the hash, prints tokens)");
  inspect->add_option("--show", show, "instances to print per shard")->capture_default_str();

  std::string docs = "/usr/share/doc/python3.11-doc/html/_sources";
  std::string demo_dir;
  std::size_t demo_vocab_size = 30522;
  ShardCommand demo_command;
  auto* demo = app.add_subcommand(
      "demo", "corpus + vocab + shards from python3.11-doc (DIR/corpus.txt, vocab.txt, shards/)");
  demo->add_option("--out-dir", demo_dir, "output directory")->required();
  demo->add_option("--docs", docs, "reStructuredText sources")->capture_default_str();
  demo->add_option("--vocab-size", demo_vocab_size)->capture_default_str();
  demo->add_option("--max-seq-length", demo_command.instance.max_seq_length)->capture_default_str();
  demo->add_option("--max-predictions-per-seq", demo_command.instance.max_predictions_per_seq)
      ->capture_default_str();
  demo->add_option("--dupe-factor", demo_command.instance.dupe_factor)->capture_default_str();
  demo->add_option("--seed", demo_command.instance.seed)->capture_default_str();

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    if (error.get_exit_code() == 0) return app.exit(error);  // --help
    std::cerr << "pipefisher_data: error: " << error.what() << " (see --help)\n";
    return pf::kExitBadInput;
  }
  try {
    if (*tokenize) return run_tokenize(vocab_path, ids, cased, max_word_chars, skip_invalid);
    if (*vocab) {
      vocab_options.pad_to_size = !no_pad;
      return run_vocab(inputs, out_path, vocab_options, cased, skip_invalid);
    }
    if (*corpus) {
      if (!from_rst.empty()) {
        inputs.push_back(from_rst);
        corpus_format = "rst";
      }
      if (inputs.empty()) throw std::invalid_argument("corpus: give input files or --from-rst DIR");
      return run_corpus(inputs, out_path, corpus_format);
    }
    if (*shards) return run_shards(shard_command);
    if (*inspect) return run_inspect(shard_paths, vocab_path, show);
    if (*demo) return run_demo(docs, demo_dir, demo_vocab_size, demo_command);
  } catch (const std::exception& error) {
    std::cerr << "pipefisher_data " << app.get_subcommands().front()->get_name()
              << ": error: " << error.what() << '\n';
    return pf::exit_code_for(error);
  }
  return 0;
}
