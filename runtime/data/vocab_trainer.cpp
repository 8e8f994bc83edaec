#include "runtime/data/vocab_trainer.h"

#include <algorithm>
#include <map>
#include <queue>
#include <stdexcept>

#include "runtime/data/unicode_text.h"

namespace pf::data {
namespace {

using Symbol = std::uint32_t;
using PairKey = std::uint64_t;

PairKey pair_key(Symbol a, Symbol b) {
  return (PairKey{a} << 32) | b;
}

struct HeapEntry {
  std::int64_t count;
  PairKey key;
  // Highest count first; ties broken by the smaller key (deterministic).
  bool operator<(const HeapEntry& other) const {
    return count != other.count ? count < other.count : key > other.key;
  }
};

struct Word {
  std::vector<Symbol> symbols;
  std::int64_t count;
};

}  // namespace

void count_words(const BasicTokenizer& tokenizer, std::string_view text, WordCounts& counts,
                 BasicTokens& scratch) {
  scratch.clear();
  tokenizer.split(text, scratch);
  for (std::size_t i = 0; i < scratch.size(); ++i) {
    const std::string_view word = scratch[i];
    const auto it = counts.find(word);
    if (it != counts.end()) {
      ++it->second;
    } else {
      counts.emplace(std::string(word), 1);
    }
  }
}

std::vector<std::string> train_wordpiece_vocab(const WordCounts& counts,
                                               const VocabTrainerOptions& options,
                                               VocabTrainerStats* stats) {
  const std::vector<std::string> specials = {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"};
  if (options.vocab_size < specials.size() + 1) {
    throw std::invalid_argument("vocab_size must exceed the 5 special tokens, got " +
                                std::to_string(options.vocab_size));
  }
  VocabTrainerStats local;
  local.distinct_words = counts.size();

  // Alphabet: the most frequent characters (ties by code point).
  std::map<char32_t, std::uint64_t> char_counts;
  std::vector<std::pair<std::string, std::uint64_t>> sorted_words(counts.begin(), counts.end());
  std::sort(sorted_words.begin(), sorted_words.end());
  std::vector<std::vector<char32_t>> word_chars(sorted_words.size());
  for (std::size_t w = 0; w < sorted_words.size(); ++w) {
    const std::string& word = sorted_words[w].first;
    local.words += sorted_words[w].second;
    for (std::size_t pos = 0; pos < word.size();) {
      char32_t cp = 0;
      const int length = decode_utf8(word, pos, cp);
      if (length == 0) throw std::invalid_argument("word count table holds invalid UTF-8");
      pos += static_cast<std::size_t>(length);
      word_chars[w].push_back(cp);
      char_counts[cp] += sorted_words[w].second;
    }
  }
  std::vector<std::pair<std::uint64_t, char32_t>> by_frequency;
  for (const auto& [cp, count] : char_counts) by_frequency.emplace_back(count, cp);
  std::sort(by_frequency.begin(), by_frequency.end(), [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  });
  const std::size_t room = (options.vocab_size - specials.size()) / 2;
  by_frequency.resize(std::min({by_frequency.size(), options.alphabet_limit, room}));
  std::vector<char32_t> alphabet;
  for (const auto& entry : by_frequency) alphabet.push_back(entry.second);
  std::sort(alphabet.begin(), alphabet.end());
  local.alphabet = alphabet.size();

  std::vector<std::string> symbols;  // text of each symbol ("##" marks a continuation)
  std::unordered_map<std::string, Symbol> symbol_ids;
  std::map<char32_t, std::pair<Symbol, Symbol>> char_symbols;
  auto add_symbol = [&](std::string text) {
    const auto [it, inserted] = symbol_ids.emplace(text, static_cast<Symbol>(symbols.size()));
    if (inserted) symbols.push_back(std::move(text));
    return it->second;
  };
  for (const char32_t cp : alphabet) {
    std::string text;
    append_utf8(text, cp);
    const Symbol initial = add_symbol(text);
    char_symbols[cp] = {initial, add_symbol("##" + text)};
  }

  std::vector<Word> words;
  for (std::size_t w = 0; w < sorted_words.size(); ++w) {
    Word word{{}, static_cast<std::int64_t>(sorted_words[w].second)};
    bool known = true;
    for (std::size_t k = 0; k < word_chars[w].size() && known; ++k) {
      const auto it = char_symbols.find(word_chars[w][k]);
      known = it != char_symbols.end();
      if (known) word.symbols.push_back(k == 0 ? it->second.first : it->second.second);
    }
    if (known && word.symbols.size() >= 1) words.push_back(std::move(word));
  }

  std::unordered_map<PairKey, std::int64_t> pair_counts;
  std::unordered_map<PairKey, std::vector<std::uint32_t>> pair_words;
  for (std::uint32_t w = 0; w < words.size(); ++w) {
    const auto& s = words[w].symbols;
    for (std::size_t i = 0; i + 1 < s.size(); ++i) {
      const PairKey key = pair_key(s[i], s[i + 1]);
      pair_counts[key] += words[w].count;
      pair_words[key].push_back(w);
    }
  }
  std::priority_queue<HeapEntry> heap;
  for (const auto& [key, count] : pair_counts) heap.push({count, key});

  std::vector<std::string> merged;  // new pieces in merge order
  const std::size_t target = options.vocab_size - specials.size();
  std::vector<std::size_t> last_visit(words.size(), static_cast<std::size_t>(-1));
  std::vector<PairKey> increased;
  while (symbols.size() < target && !heap.empty()) {
    const HeapEntry top = heap.top();
    heap.pop();
    const auto current = pair_counts.find(top.key);
    const std::int64_t count = current == pair_counts.end() ? 0 : current->second;
    if (count != top.count) {  // stale entry: requeue with the current count
      if (count > 0) heap.push({count, top.key});
      continue;
    }
    if (count < static_cast<std::int64_t>(options.min_frequency) || count <= 0) break;
    const auto a = static_cast<Symbol>(top.key >> 32);
    const auto b = static_cast<Symbol>(top.key & 0xffffffffU);
    std::string text = symbols[a] + symbols[b].substr(2);
    const std::size_t before = symbols.size();
    const Symbol c = add_symbol(std::move(text));
    if (symbols.size() > before) merged.push_back(symbols[c]);
    ++local.merges;

    const std::vector<std::uint32_t> affected = std::move(pair_words[top.key]);
    pair_words.erase(top.key);
    increased.clear();
    for (const std::uint32_t w : affected) {
      if (last_visit[w] == local.merges) continue;
      last_visit[w] = local.merges;
      Word& word = words[w];
      auto& s = word.symbols;
      bool contains = false;
      for (std::size_t i = 0; i + 1 < s.size() && !contains; ++i)
        contains = s[i] == a && s[i + 1] == b;
      if (!contains) continue;
      for (std::size_t i = 0; i + 1 < s.size(); ++i)
        pair_counts[pair_key(s[i], s[i + 1])] -= word.count;
      std::vector<Symbol> next;
      next.reserve(s.size());
      for (std::size_t i = 0; i < s.size(); ++i) {
        if (i + 1 < s.size() && s[i] == a && s[i + 1] == b) {
          next.push_back(c);
          ++i;
        } else {
          next.push_back(s[i]);
        }
      }
      s = std::move(next);
      for (std::size_t i = 0; i + 1 < s.size(); ++i) {
        const PairKey key = pair_key(s[i], s[i + 1]);
        pair_counts[key] += word.count;
        if (s[i] == c || s[i + 1] == c) {
          pair_words[key].push_back(w);
          increased.push_back(key);
        }
      }
    }
    pair_counts.erase(top.key);
    std::sort(increased.begin(), increased.end());
    increased.erase(std::unique(increased.begin(), increased.end()), increased.end());
    for (const PairKey key : increased) heap.push({pair_counts[key], key});
  }

  std::vector<std::string> vocab = specials;
  for (std::size_t i = 0; i < alphabet.size() * 2; ++i) vocab.push_back(symbols[i]);
  for (std::string& piece : merged) vocab.push_back(std::move(piece));
  if (options.pad_to_size) {
    for (std::size_t k = 0; vocab.size() < options.vocab_size; ++k) {
      vocab.push_back("[unused" + std::to_string(k) + "]");
      ++local.padding;
    }
  }
  if (stats != nullptr) *stats = local;
  return vocab;
}

}  // namespace pf::data
