#include "runtime/data/bert_tokenizer.h"

#include <algorithm>

namespace pf::data {
namespace {

bool is_char_boundary(std::string_view text, std::size_t pos) {
  return pos >= text.size() || (static_cast<unsigned char>(text[pos]) & 0xC0U) != 0x80U;
}

std::size_t count_chars(std::string_view text) {
  std::size_t count = 0;
  for (const char c : text) count += (static_cast<unsigned char>(c) & 0xC0U) != 0x80U ? 1 : 0;
  return count;
}

}  // namespace

BertTokenizer::BertTokenizer(const Vocabulary& vocab, TokenizerOptions options)
    : vocab_(vocab), options_(options), basic_(options.lower_case) {}

void BertTokenizer::encode(std::string_view text, std::vector<TokenId>& ids,
                           BasicTokens& scratch) const {
  scratch.clear();
  basic_.split(text, scratch);
  for (std::size_t i = 0; i < scratch.size(); ++i) wordpiece(scratch[i], ids);
}

std::vector<TokenId> BertTokenizer::encode(std::string_view text) const {
  std::vector<TokenId> ids;
  BasicTokens scratch;
  encode(text, ids, scratch);
  return ids;
}

std::vector<std::string> BertTokenizer::tokenize(std::string_view text) const {
  std::vector<std::string> tokens;
  for (const TokenId id : encode(text)) tokens.push_back(vocab_.token(id));
  return tokens;
}

void BertTokenizer::wordpiece(std::string_view word, std::vector<TokenId>& ids) const {
  if (word.empty()) return;
  if (word.size() > options_.max_word_chars && count_chars(word) > options_.max_word_chars) {
    ids.push_back(vocab_.special().unk);
    return;
  }
  const std::size_t first_piece = ids.size();
  std::size_t start = 0;
  while (start < word.size()) {
    // Longest match first; substrings longer than the longest vocabulary entry cannot match.
    const std::size_t longest =
        start == 0 ? vocab_.max_token_bytes() : vocab_.max_continuation_bytes();
    std::size_t end = std::min(word.size(), start + longest);
    while (end > start && !is_char_boundary(word, end)) --end;
    bool matched = false;
    while (end > start) {
      const std::string_view piece = word.substr(start, end - start);
      const auto id = start == 0 ? vocab_.find(piece) : vocab_.find_continuation(piece);
      if (id) {
        ids.push_back(*id);
        matched = true;
        break;
      }
      do {
        --end;
      } while (end > start && !is_char_boundary(word, end));
    }
    if (!matched) {
      ids.resize(first_piece);
      ids.push_back(vocab_.special().unk);
      return;
    }
    start = end;
  }
}

}  // namespace pf::data
