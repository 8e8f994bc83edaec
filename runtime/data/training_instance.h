// One BERT pretraining example: [CLS] A [SEP] B [SEP] with masked-LM targets and an NSP label.
#pragma once

#include <cstdint>
#include <vector>

#include "runtime/data/vocabulary.h"

namespace pf::data {

struct TrainingInstance {
  std::vector<TokenId> tokens;                  // after masking; [CLS] A [SEP] B [SEP]
  std::uint32_t segment_a_length = 0;           // tokens of type 0: len(A) + 2
  bool is_random_next = false;                  // NSP label 1 (Google's convention: 1 = random)
  std::vector<std::uint32_t> masked_positions;  // ascending
  std::vector<TokenId> masked_labels;           // original token at each masked position

  bool operator==(const TrainingInstance&) const = default;
};

}  // namespace pf::data
