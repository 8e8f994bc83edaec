#pragma once
// Comma-separated lists given on the command line: "3,1" for --layers-per-stage (pipefisher_sim,
// pipefisher_train), "1,2,4" for search's --micro-batch-sizes, --stages, --tensor-parallel,
// "1f1b,chimera" for its named lists, "0,0,1,1" for pipefisher_sim's --machines. One parser, so
// that every flag refuses a bad list with the same one-line message, naming the flag, the whole
// value, and the offending item and its position:
//   --stages '2,,4': item 2 is empty
//   --layers-per-stage '3,x': item 2 'x' is not a positive integer
//   --micro-batch-sizes '99999999999': item 1 '99999999999' exceeds 2147483647
// The errors are std::invalid_argument, which the programs turn into exit status 2
// (common/exit_codes.h). Header-only: common/ has no library of its own, and both the scheduler
// (below the command lines) and the simulator's commands use it.
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace pf {

namespace comma_list_detail {

inline std::string item_at(std::string_view flag, std::string_view text, std::size_t position) {
  return std::string(flag) + " '" + std::string(text) + "': item " + std::to_string(position);
}

}  // namespace comma_list_detail

// The items of "a,b,c" in order, spaces around each one trimmed ("2, 4" is "2" and "4": what a
// quoted shell argument may hold). Throws std::invalid_argument on an empty item; an empty text
// is one empty item (a list has at least one value).
inline std::vector<std::string_view> split_comma_list(std::string_view text,
                                                      std::string_view flag) {
  std::vector<std::string_view> items;
  std::size_t begin = 0;
  while (true) {
    const std::size_t comma = text.find(',', begin);
    std::string_view item = text.substr(
        begin, comma == std::string_view::npos ? std::string_view::npos : comma - begin);
    while (!item.empty() && item.front() == ' ') item.remove_prefix(1);
    while (!item.empty() && item.back() == ' ') item.remove_suffix(1);
    if (item.empty()) {
      throw std::invalid_argument(comma_list_detail::item_at(flag, text, items.size() + 1) +
                                  " is empty");
    }
    items.push_back(item);
    if (comma == std::string_view::npos) return items;
    begin = comma + 1;
  }
}

namespace comma_list_detail {

// The integers of a list, each in [min_value, max_value] (min_value 0 or 1); `kind` names what an
// item must be, for the message ("a positive integer").
inline std::vector<int> parse_int_list(std::string_view text, std::string_view flag, int min_value,
                                       int max_value, std::string_view kind) {
  std::vector<int> values;
  for (const std::string_view item : split_comma_list(text, flag)) {
    const std::string at = item_at(flag, text, values.size() + 1) + " '" + std::string(item) + "'";
    std::int64_t value = 0;
    for (const char c : item) {
      if (c < '0' || c > '9') throw std::invalid_argument(at + " is not " + std::string(kind));
      value = value * 10 + (c - '0');
      if (value > max_value) {
        throw std::invalid_argument(at + " exceeds " + std::to_string(max_value));
      }
    }
    if (value < min_value) throw std::invalid_argument(at + " is not " + std::string(kind));
    values.push_back(static_cast<int>(value));
  }
  return values;
}

}  // namespace comma_list_detail

// The positive integers of "3,1": decimal digits only (no sign, no spaces inside an item), each
// in [1, max_value]. Throws std::invalid_argument, naming the flag, the value, the item and its
// position, on an empty list or item, an item that is not a positive integer, or one above
// max_value (checked digit by digit, so no value can overflow on the way).
inline std::vector<int> parse_positive_int_list(std::string_view text, std::string_view flag,
                                                int max_value = std::numeric_limits<int>::max()) {
  return comma_list_detail::parse_int_list(text, flag, 1, max_value, "a positive integer");
}

// The same for integers >= 0 ("0,0,1,1": pipefisher_sim's --machines, an id per rank).
inline std::vector<int> parse_non_negative_int_list(
    std::string_view text, std::string_view flag, int max_value = std::numeric_limits<int>::max()) {
  return comma_list_detail::parse_int_list(text, flag, 0, max_value, "an integer >= 0");
}

}  // namespace pf
