#include "runtime/data/pretraining_instances.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "runtime/data/text_file.h"
#include "runtime/data/unicode_text.h"

namespace pf::data {
namespace {

bool is_ascii_space(char c) {
  return c == ' ' || c == '\t' || c == '\r' || c == '\n' || c == '\v' || c == '\f';
}

// A segment under construction; truncation removes from either end in O(1).
struct Segment {
  std::vector<TokenId> tokens;
  std::size_t begin = 0;
  std::size_t end = 0;
  std::size_t size() const { return end - begin; }
};

void append_sentence(const TokenizedCorpus& corpus, std::size_t sentence, Segment& segment) {
  segment.tokens.insert(
      segment.tokens.end(),
      corpus.tokens.begin() + static_cast<std::ptrdiff_t>(corpus.sentence_starts[sentence]),
      corpus.tokens.begin() + static_cast<std::ptrdiff_t>(corpus.sentence_starts[sentence + 1]));
  segment.end = segment.tokens.size();
}

void truncate_pair(Segment& a, Segment& b, std::size_t max_tokens, PythonRandom& rng) {
  while (a.size() + b.size() > max_tokens) {
    Segment& longer = a.size() > b.size() ? a : b;
    if (rng.random() < 0.5) {
      ++longer.begin;
    } else {
      --longer.end;
    }
  }
}

class InstanceMaker {
 public:
  InstanceMaker(const TokenizedCorpus& corpus, const std::vector<std::size_t>& documents,
                const Vocabulary& vocab, const InstanceOptions& options, PythonRandom& rng,
                InstanceStats& stats)
      : corpus_(corpus),
        documents_(documents),
        vocab_(vocab),
        options_(options),
        rng_(rng),
        stats_(stats) {}

  void from_document(std::size_t document_index, std::vector<TrainingInstance>& out) {
    const std::size_t document = documents_[document_index];
    const std::size_t first = corpus_.document_starts[document];
    const std::size_t count = corpus_.document_size(document);
    const std::size_t max_tokens = options_.max_seq_length - 3;
    std::size_t target_length = max_tokens;
    if (rng_.random() < options_.short_seq_prob) {
      target_length =
          static_cast<std::size_t>(rng_.randint(2, static_cast<std::int64_t>(max_tokens)));
    }
    std::vector<std::size_t> chunk;  // sentence ids
    std::size_t chunk_length = 0;
    // `i` may step back (unused segments are reused), hence the signed index as in the original.
    for (std::int64_t i = 0; i < static_cast<std::int64_t>(count); ++i) {
      const std::size_t sentence = first + static_cast<std::size_t>(i);
      chunk.push_back(sentence);
      chunk_length += corpus_.sentence_size(sentence);
      if (i + 1 != static_cast<std::int64_t>(count) && chunk_length < target_length) continue;
      std::size_t a_end = 1;
      if (chunk.size() >= 2) {
        a_end =
            static_cast<std::size_t>(rng_.randint(1, static_cast<std::int64_t>(chunk.size()) - 1));
      }
      Segment a;
      for (std::size_t j = 0; j < a_end; ++j) append_sentence(corpus_, chunk[j], a);
      Segment b;
      bool is_random_next = false;
      stats_.single_segment_chunks += chunk.size() == 1 ? 1 : 0;
      if (chunk.size() == 1 || rng_.random() < 0.5) {
        is_random_next = true;
        const auto target_b =
            static_cast<std::int64_t>(target_length) - static_cast<std::int64_t>(a.size());
        std::size_t random_document = 0;
        for (int attempt = 0; attempt < 10; ++attempt) {
          random_document = static_cast<std::size_t>(
              rng_.randint(0, static_cast<std::int64_t>(documents_.size()) - 1));
          if (random_document != document_index) break;
        }
        const std::size_t other = documents_[random_document];
        const std::size_t other_size = corpus_.document_size(other);
        const auto start =
            static_cast<std::size_t>(rng_.randint(0, static_cast<std::int64_t>(other_size) - 1));
        for (std::size_t j = start; j < other_size; ++j) {
          append_sentence(corpus_, corpus_.document_starts[other] + j, b);
          if (static_cast<std::int64_t>(b.size()) >= target_b) break;
        }
        i -= static_cast<std::int64_t>(chunk.size() - a_end);
      } else {
        for (std::size_t j = a_end; j < chunk.size(); ++j) append_sentence(corpus_, chunk[j], b);
      }
      truncate_pair(a, b, max_tokens, rng_);
      out.push_back(make_instance(a, b, is_random_next));
      chunk.clear();
      chunk_length = 0;
    }
  }

 private:
  TrainingInstance make_instance(const Segment& a, const Segment& b, bool is_random_next) {
    const SpecialTokenIds& special = vocab_.special();
    TrainingInstance instance;
    instance.tokens.reserve(a.size() + b.size() + 3);
    instance.tokens.push_back(special.cls);
    instance.tokens.insert(instance.tokens.end(),
                           a.tokens.begin() + static_cast<std::ptrdiff_t>(a.begin),
                           a.tokens.begin() + static_cast<std::ptrdiff_t>(a.end));
    instance.tokens.push_back(special.sep);
    instance.segment_a_length = static_cast<std::uint32_t>(instance.tokens.size());
    instance.tokens.insert(instance.tokens.end(),
                           b.tokens.begin() + static_cast<std::ptrdiff_t>(b.begin),
                           b.tokens.begin() + static_cast<std::ptrdiff_t>(b.end));
    instance.tokens.push_back(special.sep);
    instance.is_random_next = is_random_next;
    mask(instance);
    ++stats_.instances;
    stats_.random_next += is_random_next ? 1 : 0;
    stats_.tokens += instance.tokens.size();
    stats_.max_length = std::max(stats_.max_length, instance.tokens.size());
    return instance;
  }

  void mask(TrainingInstance& instance) {
    const SpecialTokenIds& special = vocab_.special();
    std::vector<TokenId>& tokens = instance.tokens;
    // Candidate groups (a word's pieces under whole-word masking, else single tokens), stored
    // flat: group g is members_[groups_[g].first, + groups_[g].second).
    members_.clear();
    groups_.clear();
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      if (tokens[i] == special.cls || tokens[i] == special.sep) continue;
      if (options_.whole_word_mask && !groups_.empty() && vocab_.is_continuation(tokens[i])) {
        ++groups_.back().second;
      } else {
        groups_.emplace_back(members_.size(), 1);
      }
      members_.push_back(static_cast<std::uint32_t>(i));
    }
    rng_.shuffle(groups_);
    const auto rounded = static_cast<std::size_t>(
        std::nearbyint(static_cast<double>(tokens.size()) * options_.masked_lm_prob));
    const std::size_t to_predict =
        std::min(options_.max_predictions_per_seq, std::max<std::size_t>(1, rounded));
    const std::vector<TokenId> original = tokens;
    std::vector<std::pair<std::uint32_t, TokenId>> masked;
    for (const auto& [offset, size] : groups_) {
      if (masked.size() >= to_predict) break;
      if (masked.size() + size > to_predict) continue;
      for (std::size_t k = offset; k < offset + size; ++k) {
        const std::uint32_t index = members_[k];
        TokenId replacement = special.mask;
        if (rng_.random() < 0.8) {
          ++stats_.masked_as_mask;
        } else if (rng_.random() < 0.5) {
          replacement = original[index];
          ++stats_.masked_unchanged;
        } else {
          replacement =
              static_cast<TokenId>(rng_.randint(0, static_cast<std::int64_t>(vocab_.size()) - 1));
          ++stats_.masked_as_random;
        }
        tokens[index] = replacement;
        masked.emplace_back(index, original[index]);
      }
    }
    std::sort(masked.begin(), masked.end());
    stats_.masked += masked.size();
    for (const auto& [index, label] : masked) {
      instance.masked_positions.push_back(index);
      instance.masked_labels.push_back(label);
    }
  }

  const TokenizedCorpus& corpus_;
  const std::vector<std::size_t>& documents_;
  const Vocabulary& vocab_;
  const InstanceOptions& options_;
  PythonRandom& rng_;
  InstanceStats& stats_;
  std::vector<std::uint32_t> members_;
  std::vector<std::pair<std::size_t, std::size_t>> groups_;
};

}  // namespace

CorpusReader::CorpusReader(const BertTokenizer& tokenizer, bool skip_invalid_utf8)
    : tokenizer_(tokenizer), skip_invalid_utf8_(skip_invalid_utf8) {}

void CorpusReader::end_document() {
  if (corpus_.document_starts.back() != corpus_.num_sentences()) {
    corpus_.document_starts.push_back(corpus_.num_sentences());
  }
}

void CorpusReader::add_text(std::string_view text, const std::string& origin) {
  ++stats_.files;
  end_document();
  std::size_t line_number = 0;
  for_each_line(text, [&](std::string_view line) {
    ++line_number;
    ++stats_.lines;
    while (!line.empty() && is_ascii_space(line.front())) line.remove_prefix(1);
    while (!line.empty() && is_ascii_space(line.back())) line.remove_suffix(1);
    if (line.empty()) {
      end_document();
      return;
    }
    const std::size_t bad = find_invalid_utf8(line);
    if (bad != std::string_view::npos) {
      if (!skip_invalid_utf8_) {
        throw std::invalid_argument(origin + ":" + std::to_string(line_number) +
                                    ": invalid UTF-8 at byte " + std::to_string(bad + 1) +
                                    " of the line (use --skip-invalid-utf8 to drop such bytes)");
      }
      clean_.clear();
      stats_.invalid_utf8_bytes += drop_invalid_utf8(line, clean_);
      ++stats_.invalid_utf8_lines;
      line = clean_;
    }
    const std::size_t before = corpus_.tokens.size();
    tokenizer_.encode(line, corpus_.tokens, scratch_);
    if (corpus_.tokens.size() == before) {
      ++stats_.empty_sentences;
      return;
    }
    corpus_.sentence_starts.push_back(corpus_.tokens.size());
  });
  end_document();
}

void CorpusReader::add_file(const std::string& path) {
  add_text(read_text_file(path), path);
}

TokenizedCorpus CorpusReader::finish() {
  end_document();
  TokenizedCorpus result = std::move(corpus_);
  corpus_ = TokenizedCorpus{};
  return result;
}

void InstanceOptions::validate() const {
  if (max_seq_length < 5 || max_seq_length > 65535) {
    throw std::invalid_argument("max_seq_length must be in [5, 65535], got " +
                                std::to_string(max_seq_length));
  }
  if (max_predictions_per_seq < 1 || max_predictions_per_seq > max_seq_length) {
    throw std::invalid_argument("max_predictions_per_seq must be in [1, max_seq_length], got " +
                                std::to_string(max_predictions_per_seq));
  }
  if (!(masked_lm_prob > 0.0 && masked_lm_prob < 1.0)) {
    throw std::invalid_argument("masked_lm_prob must be in (0, 1), got " +
                                std::to_string(masked_lm_prob));
  }
  if (!(short_seq_prob >= 0.0 && short_seq_prob <= 1.0)) {
    throw std::invalid_argument("short_seq_prob must be in [0, 1], got " +
                                std::to_string(short_seq_prob));
  }
  if (dupe_factor < 1) throw std::invalid_argument("dupe_factor must be at least 1");
}

std::vector<TrainingInstance> create_instances(const TokenizedCorpus& corpus,
                                               const Vocabulary& vocab,
                                               const InstanceOptions& options,
                                               InstanceStats* stats) {
  options.validate();
  if (corpus.num_documents() == 0) {
    throw std::invalid_argument("the corpus has no documents with tokens: nothing to make");
  }
  PythonRandom rng(options.seed);
  std::vector<std::size_t> documents(corpus.num_documents());
  for (std::size_t d = 0; d < documents.size(); ++d) documents[d] = d;
  rng.shuffle(documents);
  InstanceStats local;
  InstanceMaker maker(corpus, documents, vocab, options, rng, local);
  std::vector<TrainingInstance> instances;
  for (std::size_t pass = 0; pass < options.dupe_factor; ++pass) {
    for (std::size_t d = 0; d < documents.size(); ++d) maker.from_document(d, instances);
  }
  rng.shuffle(instances);
  if (stats != nullptr) *stats = local;
  return instances;
}

}  // namespace pf::data
