// A rule-based English sentence splitter for turning paragraphs into BERT's input format
// (one sentence per line). Rules (docs/data.md):
//   * a sentence ends after a run of '.', '!' or '?' (plus closing quotes/brackets) that is
//     followed by whitespace and then an uppercase letter, a digit or an opening quote/bracket;
//   * a '.' does not end a sentence after a known abbreviation (Mr., e.g., etc., Fig., ...),
//     a single letter (initials), or a word that already contains a '.' (U.S., e.g.).
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace pf::data {

// Sentences of one paragraph (whitespace runs collapse to one space; empty pieces dropped).
std::vector<std::string> split_sentences(std::string_view paragraph);

// Plain text (paragraphs separated by blank lines; lines within a paragraph are joined) to the
// input format: one sentence per line. Each call is one document; a line with only a form feed,
// or two or more consecutive blank lines, also start a new document (a blank line is written).
std::string paragraphs_to_sentences(std::string_view text);

}  // namespace pf::data
