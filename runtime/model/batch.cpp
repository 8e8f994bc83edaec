#include "runtime/model/batch.h"

#include <algorithm>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>

namespace pf::model {
namespace {

void check_size(std::size_t actual, std::int64_t expected, const char* field) {
  if (static_cast<std::int64_t>(actual) != expected) {
    throw std::invalid_argument("batch: " + std::string(field) + " has " + std::to_string(actual) +
                                " entries, expected " + std::to_string(expected));
  }
}

void check_range(const std::vector<std::int64_t>& values, std::int64_t limit, std::int64_t cols,
                 const char* field) {
  for (std::size_t i = 0; i < values.size(); ++i) {
    if (values[i] < 0 || values[i] >= limit) {
      throw std::invalid_argument("batch: " + std::string(field) + "[" +
                                  std::to_string(static_cast<std::int64_t>(i) / cols) + "][" +
                                  std::to_string(static_cast<std::int64_t>(i) % cols) +
                                  "] = " + std::to_string(values[i]) + " is outside [0, " +
                                  std::to_string(limit) + ")");
    }
  }
}

}  // namespace

void Batch::validate(const BertConfig& config) const {
  if (batch_size <= 0 || seq_len <= 0 || max_predictions < 0) {
    throw std::invalid_argument("batch: batch_size and seq_len must be positive");
  }
  if (seq_len > config.max_position_embeddings) {
    throw std::invalid_argument("batch: seq_len " + std::to_string(seq_len) +
                                " exceeds max_position_embeddings " +
                                std::to_string(config.max_position_embeddings));
  }
  check_size(input_ids.size(), tokens(), "input_ids");
  check_size(token_type_ids.size(), tokens(), "token_type_ids");
  check_size(attention_mask.size(), tokens(), "attention_mask");
  check_size(masked_lm_positions.size(), predictions(), "masked_lm_positions");
  check_size(masked_lm_ids.size(), predictions(), "masked_lm_ids");
  check_size(masked_lm_weights.size(), predictions(), "masked_lm_weights");
  check_size(next_sentence_labels.size(), batch_size, "next_sentence_labels");
  check_range(input_ids, config.vocab_size, seq_len, "input_ids");
  check_range(token_type_ids, config.type_vocab_size, seq_len, "token_type_ids");
  check_range(attention_mask, 2, seq_len, "attention_mask");
  check_range(masked_lm_positions, seq_len, std::max<std::int64_t>(max_predictions, 1),
              "masked_lm_positions");
  check_range(masked_lm_ids, config.vocab_size, std::max<std::int64_t>(max_predictions, 1),
              "masked_lm_ids");
  check_range(next_sentence_labels, 2, 1, "next_sentence_labels");
  for (std::size_t i = 0; i < masked_lm_weights.size(); ++i) {
    if (!(masked_lm_weights[i] >= 0.0F) || !std::isfinite(masked_lm_weights[i])) {
      throw std::invalid_argument("batch: masked_lm_weights entry " + std::to_string(i) +
                                  " must be finite and non-negative");
    }
  }
}

Batch make_random_batch(const BertConfig& config, std::int64_t batch_size, std::int64_t seq_len,
                        std::int64_t max_predictions, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  Batch batch;
  batch.batch_size = batch_size;
  batch.seq_len = seq_len;
  batch.max_predictions = max_predictions;
  const auto tokens = static_cast<std::size_t>(batch_size * seq_len);
  batch.input_ids.resize(tokens);
  batch.token_type_ids.resize(tokens);
  batch.attention_mask.resize(tokens);
  batch.masked_lm_positions.assign(static_cast<std::size_t>(batch_size * max_predictions), 0);
  batch.masked_lm_ids.assign(batch.masked_lm_positions.size(), 0);
  batch.masked_lm_weights.assign(batch.masked_lm_positions.size(), 0.0F);
  batch.next_sentence_labels.resize(static_cast<std::size_t>(batch_size));
  std::uniform_int_distribution<std::int64_t> token(1, config.vocab_size - 1);
  for (std::int64_t b = 0; b < batch_size; ++b) {
    // Every other sequence is padded over its last quarter.
    const std::int64_t length = (b % 2 == 1) ? std::max<std::int64_t>(2, seq_len * 3 / 4) : seq_len;
    const std::int64_t second_segment = length / 2;
    for (std::int64_t s = 0; s < seq_len; ++s) {
      const auto i = static_cast<std::size_t>(b * seq_len + s);
      const bool real = s < length;
      batch.input_ids[i] = real ? token(rng) : 0;
      batch.token_type_ids[i] = (real && s >= second_segment && config.type_vocab_size > 1) ? 1 : 0;
      batch.attention_mask[i] = real ? 1 : 0;
    }
    // Mask ~15% of the real positions after the first, up to max_predictions.
    std::vector<std::int64_t> candidates(
        static_cast<std::size_t>(std::max<std::int64_t>(length - 1, 0)));
    std::iota(candidates.begin(), candidates.end(), 1);
    std::shuffle(candidates.begin(), candidates.end(), rng);
    const auto count = std::min<std::int64_t>(max_predictions,
                                              std::max<std::int64_t>(1, (length * 15 + 99) / 100));
    std::sort(candidates.begin(),
              candidates.begin() +
                  std::min<std::int64_t>(count, static_cast<std::int64_t>(candidates.size())));
    for (std::int64_t p = 0; p < count && p < static_cast<std::int64_t>(candidates.size()); ++p) {
      const auto slot = static_cast<std::size_t>(b * max_predictions + p);
      const auto position = candidates[static_cast<std::size_t>(p)];
      batch.masked_lm_positions[slot] = position;
      batch.masked_lm_ids[slot] = batch.input_ids[static_cast<std::size_t>(b * seq_len + position)];
      batch.masked_lm_weights[slot] = 1.0F;
      batch.input_ids[static_cast<std::size_t>(b * seq_len + position)] = token(rng);  // "[MASK]"
    }
    batch.next_sentence_labels[static_cast<std::size_t>(b)] = static_cast<std::int64_t>(rng() % 2);
  }
  return batch;
}

}  // namespace pf::model
