#pragma once
// Checks of numeric command-line values (CLI11 validators) whose messages say what is wrong in
// the user's terms. CLI11's own NonNegativeNumber and PositiveNumber are ranges up to the largest
// double, and a bad value printed that bound in 300 digits ("Value -5 not in range 0.000000 to
// 17976931348623157081...").
//   --device-memory-budget: '-5' is negative (must be >= 0)
//   --kfac-max-refresh: '0' is not > 0
//   --kfac-spill-budget: '2' is outside 0 to 1
// CLI11 puts the flag's name before the message; the programs turn it into exit status 2.
// Header-only, like the rest of common/ (every user links CLI11).
#include <cmath>
#include <cstdlib>
#include <sstream>
#include <string>

#include <CLI/CLI.hpp>

namespace pf::cli_checks {

namespace detail {
// The value as a finite number, or the message saying it is not one.
inline std::string parse(const std::string& text, double& value) {
  char* end = nullptr;
  value = std::strtod(text.c_str(), &end);
  if (text.empty() || end != text.c_str() + text.size()) return "'" + text + "' is not a number";
  if (!std::isfinite(value)) return "'" + text + "' is not a finite number";
  return {};
}

inline std::string number(double value) {
  std::ostringstream out;
  out << value;
  return out.str();
}
}  // namespace detail

// >= 0.
inline CLI::Validator non_negative() {
  return CLI::Validator(
      [](std::string& text) {
        double value = 0.0;
        std::string error = detail::parse(text, value);
        if (error.empty() && value < 0.0) error = "'" + text + "' is negative (must be >= 0)";
        return error;
      },
      "NONNEGATIVE");
}

// > 0.
inline CLI::Validator positive() {
  return CLI::Validator(
      [](std::string& text) {
        double value = 0.0;
        std::string error = detail::parse(text, value);
        if (error.empty() && value <= 0.0) error = "'" + text + "' is not > 0";
        return error;
      },
      "POSITIVE");
}

// low <= value <= high.
inline CLI::Validator between(double low, double high) {
  const std::string range = detail::number(low) + " to " + detail::number(high);
  return CLI::Validator(
      [low, high, range](std::string& text) {
        double value = 0.0;
        std::string error = detail::parse(text, value);
        if (error.empty() && (value < low || value > high))
          error = "'" + text + "' is outside " + range;
        return error;
      },
      "[" + range + "]");
}

}  // namespace pf::cli_checks
