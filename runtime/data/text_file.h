// Whole-file reading and writing with errors that name the file, and line iteration.
#pragma once

#include <string>
#include <string_view>

namespace pf::data {

// Throws pf::InputError (a std::runtime_error) naming the path when it is not a readable file.
std::string read_text_file(const std::string& path);
// Writes atomically enough for our use: to path + ".tmp", then renames.
void write_text_file(const std::string& path, std::string_view contents);

// Calls fn(line) for each line ('\n'-separated; a final line without '\n' counts; a trailing
// '\r' is removed).
template <class Fn>
void for_each_line(std::string_view text, Fn&& fn) {
  std::size_t start = 0;
  while (start < text.size()) {
    std::size_t end = text.find('\n', start);
    if (end == std::string_view::npos) end = text.size();
    std::string_view line = text.substr(start, end - start);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    fn(line);
    start = end + 1;
  }
}

}  // namespace pf::data
