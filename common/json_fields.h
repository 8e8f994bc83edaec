#pragma once
// The one checked way to read values from a JSON document that came from a file: integers are
// range-checked as 64-bit values before they are narrowed (4294967297 is an error, never 1), and
// every error is a std::invalid_argument of the form
//   "<source>: field '<field>' = <value> (allowed: an integer in [lo, hi])".
#include <concepts>
#include <cstdint>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

#include <nlohmann/json.hpp>

namespace pf::json_fields {

[[noreturn]] inline void fail(std::string_view source, std::string_view field,
                              const nlohmann::json& value, std::string_view allowed) {
  // A hostile document may carry a megabyte-long value: quote only its beginning.
  std::string shown = value.dump();
  if (shown.size() > 80) shown = shown.substr(0, 77) + "...";
  throw std::invalid_argument(std::string(source) + ": field '" + std::string(field) +
                              "' = " + shown + " (allowed: " + std::string(allowed) + ")");
}

[[noreturn]] inline void fail_missing(std::string_view source, std::string_view field,
                                      std::string_view allowed) {
  throw std::invalid_argument(std::string(source) + ": field '" + std::string(field) +
                              "' is missing (required: " + std::string(allowed) + ")");
}

inline std::string integer_range(std::int64_t lo, std::int64_t hi) {
  return "an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
}

// `value` as a T when it is a JSON integer (not a float, not a boolean) within [lo, hi].
template <std::integral T>
T integer(const nlohmann::json& value, std::string_view source, std::string_view field, T lo,
          T hi) {
  static_assert(sizeof(T) <= sizeof(std::int64_t));
  static_assert(std::is_signed_v<T> || sizeof(T) < sizeof(std::uint64_t),
                "read unsigned 64-bit fields as std::int64_t with a bound");
  const auto wide_lo = static_cast<std::int64_t>(lo);
  const auto wide_hi = static_cast<std::int64_t>(hi);
  if (!value.is_number_integer()) fail(source, field, value, integer_range(wide_lo, wide_hi));
  // nlohmann keeps non-negative integers as uint64: compare before converting, so that 2^64 - 1
  // does not become -1.
  if (value.is_number_unsigned()) {
    const auto unsigned_value = value.get<std::uint64_t>();
    if (wide_hi < 0 || unsigned_value > static_cast<std::uint64_t>(wide_hi)) {
      fail(source, field, value, integer_range(wide_lo, wide_hi));
    }
    const auto result = static_cast<std::int64_t>(unsigned_value);
    if (result < wide_lo) fail(source, field, value, integer_range(wide_lo, wide_hi));
    return static_cast<T>(result);
  }
  const auto result = value.get<std::int64_t>();
  if (result < wide_lo || result > wide_hi) {
    fail(source, field, value, integer_range(wide_lo, wide_hi));
  }
  return static_cast<T>(result);
}

// Field `key` of `object` (the error names `prefix` + key); `fallback` when absent, or an error
// when absent and no fallback is given.
template <std::integral T>
T integer_field(const nlohmann::json& object, std::string_view key, std::string_view source, T lo,
                T hi, std::optional<T> fallback = std::nullopt, std::string_view prefix = {}) {
  const std::string field = std::string(prefix) + std::string(key);
  const auto it = object.find(std::string(key));
  if (it == object.end()) {
    if (!fallback) fail_missing(source, field, integer_range(lo, hi));
    return *fallback;
  }
  return integer<T>(*it, source, field, lo, hi);
}

inline std::string string(const nlohmann::json& value, std::string_view source,
                          std::string_view field) {
  if (!value.is_string()) fail(source, field, value, "a string");
  return value.get<std::string>();
}

inline std::string string_field(const nlohmann::json& object, std::string_view key,
                                std::string_view source,
                                std::optional<std::string> fallback = std::nullopt,
                                std::string_view prefix = {}) {
  const std::string field = std::string(prefix) + std::string(key);
  const auto it = object.find(std::string(key));
  if (it == object.end()) {
    if (!fallback) fail_missing(source, field, "a string");
    return *fallback;
  }
  return string(*it, source, field);
}

// Documents nested deeper than this are refused while parsing: nlohmann parses any depth without
// recursion, but copying, comparing and dumping a document recurse once per level, so a file of
// a million '[' would overflow the stack at the first error message that quotes it.
inline constexpr int kMaxNesting = 256;

// nlohmann::json::parse(input) that throws std::invalid_argument naming `source` as soon as the
// document nests deeper than kMaxNesting, or when a number does not fit a double (1E4901161:
// nlohmann's out_of_range, which callers expecting parse errors would let escape); syntax errors
// stay nlohmann::json::parse_error for the caller to word.
template <typename Input>
nlohmann::json parse_bounded(Input&& input, std::string_view source) {
  const auto limit_depth = [source](int depth, nlohmann::json::parse_event_t event,
                                    nlohmann::json&) {
    if (depth >= kMaxNesting && (event == nlohmann::json::parse_event_t::object_start ||
                                 event == nlohmann::json::parse_event_t::array_start)) {
      throw std::invalid_argument(std::string(source) + ": JSON nested deeper than " +
                                  std::to_string(kMaxNesting) + " levels (allowed: at most " +
                                  std::to_string(kMaxNesting) + ")");
    }
    return true;
  };
  try {
    return nlohmann::json::parse(std::forward<Input>(input), limit_depth);
  } catch (const nlohmann::json::out_of_range& error) {
    throw std::invalid_argument(std::string(source) + ": not valid JSON here: " + error.what() +
                                " (allowed: numbers within the range of a double)");
  }
}

}  // namespace pf::json_fields
