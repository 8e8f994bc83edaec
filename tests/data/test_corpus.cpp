// Corpus preparation: the sentence splitter, reStructuredText stripping, vocabulary training.
#include <gtest/gtest.h>

#include <algorithm>

#include "runtime/data/bert_tokenizer.h"
#include "runtime/data/rst_corpus.h"
#include "runtime/data/sentence_splitter.h"
#include "runtime/data/vocab_trainer.h"

namespace pf::data {
namespace {

using Lines = std::vector<std::string>;

TEST(DataSentenceSplitter, SplitsOnTerminatorsBeforeCapitals) {
  EXPECT_EQ(split_sentences("One sentence. Another one! A third? Yes."),
            (Lines{"One sentence.", "Another one!", "A third?", "Yes."}));
  // Lower-case after the period, abbreviations, initials, dotted words and decimals: no split.
  EXPECT_EQ(split_sentences(
                "See e.g. the docs. Mr. Smith met J. R. Doe in the U.S. Army. Pi is 3.14 here."),
            (Lines{"See e.g. the docs.", "Mr. Smith met J. R. Doe in the U.S. Army.",
                   "Pi is 3.14 here."}));
  EXPECT_EQ(split_sentences("It ends here.\" Then more (really.) Next one."),
            (Lines{"It ends here.\"", "Then more (really.)", "Next one."}));
  EXPECT_EQ(split_sentences("call f.close() now. Done"), (Lines{"call f.close() now.", "Done"}));
  EXPECT_EQ(split_sentences("  spaced \n  out   text  "), (Lines{"spaced out text"}));
  EXPECT_TRUE(split_sentences("   ").empty());
}

TEST(DataSentenceSplitter, ParagraphsBecomeDocuments) {
  const std::string text =
      "First line of a paragraph\ncontinues here. Second sentence.\n\nNew paragraph.\n\n\n"
      "Next document.\n";
  EXPECT_EQ(paragraphs_to_sentences(text),
            "First line of a paragraph continues here.\nSecond sentence.\nNew paragraph.\n\n"
            "Next document.\n\n");
}

TEST(DataRst, InlineMarkup) {
  EXPECT_EQ(strip_inline_rst("Use :func:`len` and :meth:`~dict.items` or :class:`!Foo`."),
            "Use len and items or Foo.");
  EXPECT_EQ(
      strip_inline_rst("See :ref:`the tutorial <tut-intro>` and `Python <https://python.org>`_."),
      "See the tutorial and Python.");
  EXPECT_EQ(strip_inline_rst("A ``literal *x*`` and *emphasis* and **strong** text [#]_."),
            "A literal *x* and emphasis and strong text.");
  EXPECT_EQ(strip_inline_rst(":pep:`8` and :rfc:`2822`"), "PEP 8 and RFC 2822");
  EXPECT_EQ(strip_inline_rst("escaped\\ text and \\*star"), "escapedtext and *star");
}

TEST(DataRst, KeepsProseDropsCodeAndMarkup) {
  const std::string rst = R"(.. _tut-intro:

**********************
An Informal Tour
**********************

In the following examples, input and output are distinguished by prompts. Comments
in Python start with the hash character.

Some examples::

   # this is the first comment
   spam = 1

>>> 2 + 2
4

.. note::
   :noindex:

   Division always returns a floating-point number.

.. code-block:: python

   print("hidden")

Numbers
=======

* The interpreter acts as a calculator.
* Expression syntax is straightforward.

.. function:: len(s)

   Return the length of an object.

+-------+-------+
| a     | b     |
+-------+-------+
)";
  std::string out;
  RstStats stats;
  rst_to_corpus(rst, out, stats);
  EXPECT_EQ(out,
            "In the following examples, input and output are distinguished by prompts.\n"
            "Comments in Python start with the hash character.\n"
            "Some examples:\n"
            "Division always returns a floating-point number.\n"
            "\n"
            "The interpreter acts as a calculator.\n"
            "Expression syntax is straightforward.\n"
            "Return the length of an object.\n"
            "\n");
  EXPECT_EQ(stats.documents, 2U);
  EXPECT_EQ(stats.sentences, 7U);
}

TEST(DataVocabTrainer, LearnsPiecesThatCoverTheCorpus) {
  const BasicTokenizer basic(true);
  WordCounts counts;
  BasicTokens scratch;
  const std::string text =
      "The tokenizer splits words. Tokenizers split words into pieces; splitting words again "
      "and again makes the pieces longer. Words, words, words!";
  for (int i = 0; i < 3; ++i) count_words(basic, text, counts, scratch);
  VocabTrainerOptions options;
  options.vocab_size = 80;
  VocabTrainerStats stats;
  const auto tokens = train_wordpiece_vocab(counts, options, &stats);
  ASSERT_EQ(tokens.size(), 80U);
  EXPECT_EQ((std::vector<std::string>(tokens.begin(), tokens.begin() + 5)),
            (std::vector<std::string>{"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"}));
  EXPECT_GT(stats.merges, 10U);
  // Deterministic.
  EXPECT_EQ(train_wordpiece_vocab(counts, options), tokens);
  const Vocabulary vocab = Vocabulary::from_tokens(tokens);
  const BertTokenizer tokenizer(vocab);
  // Every training word is covered (the alphabet has each character in both forms), and the
  // most frequent word became a single piece.
  for (const auto& token : tokenizer.tokenize(text)) EXPECT_NE(token, "[UNK]");
  EXPECT_EQ(tokenizer.tokenize("words"), (std::vector<std::string>{"words"}));
  // Without padding, merging stops at min_frequency.
  options.vocab_size = 5000;
  options.pad_to_size = false;
  EXPECT_LT(train_wordpiece_vocab(counts, options).size(), 5000U);
  options.pad_to_size = true;
  const auto padded = train_wordpiece_vocab(counts, options);
  EXPECT_EQ(padded.size(), 5000U);
  const auto first_unused = std::find(padded.begin(), padded.end(), "[unused0]") - padded.begin();
  ASSERT_LT(first_unused, 5000);
  EXPECT_EQ(padded.back(), "[unused" + std::to_string(4999 - first_unused) + "]");
}

}  // namespace
}  // namespace pf::data
