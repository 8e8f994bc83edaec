#pragma once
// One (micro-)batch of BERT pretraining data, BERT-style: sequences padded to seq_len, at most
// max_predictions masked positions per sequence (padding predictions have weight 0).
#include <cstdint>
#include <vector>

#include "runtime/model/bert_config.h"

namespace pf::model {

struct Batch {
  std::int64_t batch_size = 0;
  std::int64_t seq_len = 0;
  std::int64_t max_predictions = 0;
  std::vector<std::int64_t> input_ids;             // [B, S]
  std::vector<std::int64_t> token_type_ids;        // [B, S]
  std::vector<std::int64_t> attention_mask;        // [B, S], 1 real token / 0 padding
  std::vector<std::int64_t> masked_lm_positions;   // [B, P], positions within the sequence
  std::vector<std::int64_t> masked_lm_ids;         // [B, P], the original tokens
  std::vector<float> masked_lm_weights;            // [B, P], 1 real prediction / 0 padding
  std::vector<std::int64_t> next_sentence_labels;  // [B], 0 is-next / 1 random

  std::int64_t tokens() const { return batch_size * seq_len; }
  std::int64_t predictions() const { return batch_size * max_predictions; }
  // Throws std::invalid_argument naming the field, row and value that is wrong (sizes, ids out
  // of the vocabulary, positions past the sequence, labels not 0/1, sequence longer than the
  // position table).
  void validate(const BertConfig& config) const;
};

// A reproducible synthetic batch (random tokens, ~15% masked, some padding), for tests and
// benchmarks.
Batch make_random_batch(const BertConfig& config, std::int64_t batch_size, std::int64_t seq_len,
                        std::int64_t max_predictions, std::uint64_t seed);

}  // namespace pf::model
