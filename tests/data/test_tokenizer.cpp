// BERT tokenization on tricky strings. Each expectation is derived by hand from the reference
// algorithm (google-research/bert tokenization.py: clean -> CJK spacing -> whitespace split ->
// lower() + NFD + drop Mn -> punctuation split -> WordPiece), with the reasoning next to it.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "runtime/data/bert_tokenizer.h"
#include "runtime/data/python_random.h"
#include "runtime/data/unicode_text.h"

namespace pf::data {
namespace {

using Tokens = std::vector<std::string>;

Vocabulary test_vocab() {
  return Vocabulary::from_tokens(
      {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "world",  ",",     "!",        "?",
       ".",     "-",     "$",     "^",     "`",      "«",     "»",      "—",     "a",        "##a",
       "b",     "##b",   "c",     "##c",   "un",     "##aff", "##able", "una",   "##ffable", "ab",
       "##bc",  "ca",    "va",    "tres",  "bien",   "ecole", "naive",  "cafe",  "istanbul", "οδος",
       "σοφος", "中",    "文",    "字",    "abc",    "5",     "##€",    "Héllo", "é",        "##é"},
      "test vocabulary");
}

Tokens basic(std::string_view text, bool lower = true) {
  return BasicTokenizer(lower).split(text);
}

TEST(DataBasicTokenizer, SplitsPunctuationAndLowercases) {
  // Every non-alphanumeric printable ASCII character is punctuation, even $ ^ ` (Sc/Sk in
  // Unicode): each becomes its own word.
  EXPECT_EQ(basic("Hello, World!"), (Tokens{"hello", ",", "world", "!"}));
  EXPECT_EQ(basic("a.b-c $5^2`"), (Tokens{"a", ".", "b", "-", "c", "$", "5", "^", "2", "`"}));
  // Unicode punctuation (categories P*) splits too; currency signs (Sc) outside ASCII do not.
  EXPECT_EQ(basic("«hi»—yes 5€"), (Tokens{"«", "hi", "»", "—", "yes", "5€"}));
}

TEST(DataBasicTokenizer, StripsAccentsOnlyWhenLowercasing) {
  // lower() then NFD splits é into e + U+0301 (Mn), which is dropped.
  EXPECT_EQ(basic("Héllo Naïve CAFÉ"), (Tokens{"hello", "naive", "cafe"}));
  EXPECT_EQ(basic("Ça va? Très bien!"), (Tokens{"ca", "va", "?", "tres", "bien", "!"}));
  // Cased mode keeps case and accents untouched (no normalisation at all).
  EXPECT_EQ(basic("Héllo CAFÉ", false), (Tokens{"Héllo", "CAFÉ"}));
  // Python's full lower-casing maps U+0130 to "i" + U+0307; the dot (Mn) is then stripped.
  EXPECT_EQ(basic("İstanbul"), (Tokens{"istanbul"}));
  // Final_Sigma: a capital sigma at the end of a word lowers to ς, inside a word to σ.
  EXPECT_EQ(basic("ΟΔΟΣ ΣΟΦΟΣ"), (Tokens{"οδος", "σοφος"}));
  // Hangul syllables decompose canonically into conjoining jamo (category Lo, kept).
  EXPECT_EQ(basic("한"), (Tokens{"\u1112\u1161\u11ab"}));
}

TEST(DataBasicTokenizer, SplitsCjkIdeographs) {
  // Each CJK ideograph becomes a word of its own, even inside a run of Latin letters.
  EXPECT_EQ(basic("中文abc字"), (Tokens{"中", "文", "abc", "字"}));
  // Hiragana is not in the CJK ideograph blocks: it stays one word. Uncased, NFD splits が into
  // か + U+3099 (a combining voiced mark, Mn), which accent stripping drops.
  EXPECT_EQ(basic("ひらがな"), (Tokens{"ひらかな"}));
  EXPECT_EQ(basic("ひらがな", false), (Tokens{"ひらがな"}));
}

TEST(DataBasicTokenizer, CleansControlAndWhitespaceCharacters) {
  // NUL, U+FFFD and Cc/Cf characters are deleted without splitting: zero-width space (Cf),
  // soft hyphen (Cf), BEL (Cc).
  EXPECT_EQ(basic(std::string("a\0b", 3)), (Tokens{"ab"}));
  EXPECT_EQ(basic("a\u200bb a\u00adb a\ab a\ufffdb"), (Tokens{"ab", "ab", "ab", "ab"}));
  // \t \r \n and Zs (no-break space, ideographic space) are whitespace; U+2028 (Zl) survives
  // cleaning but Python's str.split() splits on it.
  EXPECT_EQ(basic("a\tb\r\nc\u00a0d\u3000e\u2028f"), (Tokens{"a", "b", "c", "d", "e", "f"}));
  EXPECT_TRUE(basic("").empty());
  EXPECT_TRUE(basic(" \t \r\n").empty());
  EXPECT_TRUE(basic("\u200b\u200b").empty());
}

TEST(DataBasicTokenizer, RejectsInvalidUtf8WithPosition) {
  try {
    basic("ok \xff no");
    FAIL() << "no exception";
  } catch (const std::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find("byte 3"), std::string::npos) << error.what();
  }
  EXPECT_THROW(basic("\xed\xa0\x80"), std::invalid_argument);  // an encoded surrogate
  EXPECT_THROW(basic("\xc0\xaf"), std::invalid_argument);      // an overlong '/'
  EXPECT_THROW(basic("abc\xe4\xb8"), std::invalid_argument);   // truncated sequence
}

TEST(DataWordPiece, GreedyLongestMatchFirst) {
  const Vocabulary vocab = test_vocab();
  const BertTokenizer tokenizer(vocab);
  // "unaffable": longest prefix in the vocabulary is "una", then "##ffable".
  EXPECT_EQ(tokenizer.tokenize("unaffable"), (Tokens{"una", "##ffable"}));
  // "abc": greedy takes "ab", then needs "##c" (present).
  EXPECT_EQ(tokenizer.tokenize("abc"), (Tokens{"abc"}));
  EXPECT_EQ(tokenizer.tokenize("abbc"), (Tokens{"ab", "##bc"}));
  // No backtracking: "cab" -> "ca" then "##b" is found.
  EXPECT_EQ(tokenizer.tokenize("cab"), (Tokens{"ca", "##b"}));
  // A word with one unmatchable piece becomes a single [UNK] (not partial pieces).
  EXPECT_EQ(tokenizer.tokenize("abx hello"), (Tokens{"[UNK]", "hello"}));
  // "5€" is one basic word: "5" then "##€".
  EXPECT_EQ(tokenizer.tokenize("5€"), (Tokens{"5", "##€"}));
  EXPECT_EQ(tokenizer.tokenize("Hello, World!"), (Tokens{"hello", ",", "world", "!"}));
  EXPECT_EQ(tokenizer.tokenize("中文字"), (Tokens{"中", "文", "字"}));
}

TEST(DataWordPiece, LongWordsBecomeUnknownByCodePoints) {
  const Vocabulary vocab = test_vocab();
  const BertTokenizer tokenizer(vocab);
  // 100 characters are still split into pieces; 101 exceed max_input_chars_per_word.
  EXPECT_EQ(tokenizer.tokenize(std::string(100, 'a')).size(), 100U);
  EXPECT_EQ(tokenizer.tokenize(std::string(101, 'a')), (Tokens{"[UNK]"}));
  // The limit counts characters, not bytes: 60 x "é" is 120 bytes but 60 characters.
  const BertTokenizer cased(vocab, {.lower_case = false});
  std::string accents;
  for (int i = 0; i < 60; ++i) accents += "é";
  EXPECT_EQ(cased.tokenize(accents).size(), 60U);
  EXPECT_EQ(cased.tokenize("Héllo"), (Tokens{"Héllo"}));
  // Google's tokenization.py uses 200: the option reproduces it.
  const BertTokenizer google(vocab, {.lower_case = true, .max_word_chars = 200});
  EXPECT_EQ(google.tokenize(std::string(150, 'a')).size(), 150U);
}

TEST(DataWordPiece, IdsMatchTokens) {
  const Vocabulary vocab = test_vocab();
  const BertTokenizer tokenizer(vocab);
  const auto ids = tokenizer.encode("Hello unaffable!");
  ASSERT_EQ(ids.size(), 4U);
  EXPECT_EQ(vocab.token(ids[0]), "hello");
  EXPECT_EQ(vocab.token(ids[1]), "una");
  EXPECT_EQ(vocab.token(ids[2]), "##ffable");
  EXPECT_EQ(vocab.token(ids[3]), "!");
  EXPECT_TRUE(vocab.is_continuation(ids[2]));
  EXPECT_FALSE(vocab.is_continuation(ids[1]));
}

TEST(DataPythonRandom, MatchesCPython) {
  // Values printed by CPython 3.11: r = random.Random(12345); r.getrandbits(32) twice;
  // r.random(); r.randint(0, 30521); r.randint(2, 125); r.shuffle(list(range(10)));
  // r.getrandbits(40). Then Random(2**40 + 7).getrandbits(32) and Random(0).getrandbits(32).
  PythonRandom rng(12345);
  EXPECT_EQ(rng.getrandbits(32), 1789368711U);
  EXPECT_EQ(rng.getrandbits(32), 3146859322U);
  EXPECT_DOUBLE_EQ(rng.random(), 0.010169169457068361);
  EXPECT_EQ(rng.randint(0, 30521), 27040);
  EXPECT_EQ(rng.randint(2, 125), 104);
  std::vector<int> items = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9};
  rng.shuffle(items);
  EXPECT_EQ(items, (std::vector<int>{6, 0, 8, 1, 7, 9, 2, 3, 5, 4}));
  EXPECT_EQ(rng.getrandbits(40), 476200952753ULL);
  EXPECT_EQ(PythonRandom((1ULL << 40) + 7).getrandbits(32), 2635837658U);
  EXPECT_EQ(PythonRandom(0).getrandbits(32), 3626764237U);
}

}  // namespace
}  // namespace pf::data
