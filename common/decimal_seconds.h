#pragma once
// Seconds as a plain decimal ("0.369", "0.00123") for the summaries programs print and scripts
// read with a decimal pattern: three decimals, more below 0.1 s so that at least three
// significant digits show (a tiny model's step reads 0.000812, not 0.001 or 0.000). Never an
// exponent; 0 and non-finite values print as std::fixed would.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

namespace pf {

inline std::string decimal_seconds(double seconds) {
  int decimals = 3;
  const double magnitude = std::abs(seconds);
  if (std::isfinite(magnitude) && magnitude > 0.0 && magnitude < 0.1) {
    decimals = std::min(9, 2 - static_cast<int>(std::floor(std::log10(magnitude))));
  }
  char text[64];
  std::snprintf(text, sizeof(text), "%.*f", decimals, seconds);
  return text;
}

}  // namespace pf
