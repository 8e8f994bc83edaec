// reStructuredText (Sphinx sources such as python3.11-doc's *.rst.txt) to BERT's input format:
// prose only, one sentence per line, a blank line between documents (a document is a section).
// What is dropped and kept is listed in docs/data.md.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace pf::data {

struct RstStats {
  std::size_t files = 0;
  std::size_t input_bytes = 0;
  std::size_t documents = 0;
  std::size_t sentences = 0;
  std::size_t output_bytes = 0;
};

// Inline markup of one paragraph to plain text: roles (:func:`~a.b` -> b, :ref:`text <x>` ->
// text), ``literals``, `links <url>`_, *emphasis*, **strong**, footnote references, escapes.
std::string strip_inline_rst(std::string_view text);

// One .rst source to sentences; appends to `out` and updates `stats`.
void rst_to_corpus(std::string_view rst, std::string& out, RstStats& stats);

// Every *.rst.txt / *.rst / *.txt file under `directory` (sorted paths, recursive).
std::vector<std::string> find_rst_files(const std::string& directory);

}  // namespace pf::data
