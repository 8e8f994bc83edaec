// Google's create_pretraining_data.py in C++: documents of tokenized sentences become sequence
// pairs with next-sentence labels and masked-LM targets, drawn from a Python-compatible RNG.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/data/bert_tokenizer.h"
#include "runtime/data/python_random.h"
#include "runtime/data/training_instance.h"

namespace pf::data {

// Tokenized documents: document d holds sentences [document_starts[d], document_starts[d+1]),
// sentence s holds tokens [sentence_starts[s], sentence_starts[s+1]).
struct TokenizedCorpus {
  std::vector<TokenId> tokens;
  std::vector<std::size_t> sentence_starts{0};
  std::vector<std::size_t> document_starts{0};

  std::size_t num_documents() const { return document_starts.size() - 1; }
  std::size_t num_sentences() const { return sentence_starts.size() - 1; }
  std::size_t document_size(std::size_t d) const {
    return document_starts[d + 1] - document_starts[d];
  }
  std::size_t sentence_size(std::size_t s) const {
    return sentence_starts[s + 1] - sentence_starts[s];
  }
};

struct CorpusReadStats {
  std::size_t files = 0;
  std::size_t lines = 0;
  std::size_t empty_sentences = 0;     // non-blank lines with no tokens (e.g. only controls)
  std::size_t invalid_utf8_lines = 0;  // lines that had ill-formed bytes (dropped when allowed)
  std::size_t invalid_utf8_bytes = 0;
};

// Reads BERT's input format: one sentence per line, blank lines between documents; each file
// also starts a new document. Empty documents are dropped.
class CorpusReader {
 public:
  CorpusReader(const BertTokenizer& tokenizer, bool skip_invalid_utf8);
  // Throws std::invalid_argument naming origin:line on invalid UTF-8 unless skipping.
  void add_text(std::string_view text, const std::string& origin);
  void add_file(const std::string& path);
  TokenizedCorpus finish();
  const CorpusReadStats& stats() const { return stats_; }

 private:
  void end_document();

  const BertTokenizer& tokenizer_;
  bool skip_invalid_utf8_;
  TokenizedCorpus corpus_;
  CorpusReadStats stats_;
  BasicTokens scratch_;
  std::string clean_;
};

struct InstanceOptions {
  std::size_t max_seq_length = 128;
  std::size_t max_predictions_per_seq = 20;
  double masked_lm_prob = 0.15;
  double short_seq_prob = 0.1;
  std::size_t dupe_factor = 10;
  std::uint64_t seed = 12345;
  bool whole_word_mask = false;

  void validate() const;  // throws std::invalid_argument naming the bad field
};

struct InstanceStats {
  std::size_t instances = 0;
  std::size_t random_next = 0;
  std::size_t single_segment_chunks = 0;  // these always take a random B (Google's rule)
  std::size_t tokens = 0;                 // including [CLS]/[SEP]
  std::size_t masked = 0;
  std::size_t masked_as_mask = 0;
  std::size_t masked_as_random = 0;  // replaced by a random token (may equal the original)
  std::size_t masked_unchanged = 0;  // kept by the 10% "unchanged" branch
  std::size_t max_length = 0;
};

// All instances, in the order Google's script writes them (documents shuffled, dupe_factor
// passes, then all instances shuffled).
std::vector<TrainingInstance> create_instances(const TokenizedCorpus& corpus,
                                               const Vocabulary& vocab,
                                               const InstanceOptions& options,
                                               InstanceStats* stats = nullptr);

}  // namespace pf::data
