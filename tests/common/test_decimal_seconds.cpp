// common/decimal_seconds.h: step times as plain decimals with at least three significant digits.
#include "common/decimal_seconds.h"

#include <gtest/gtest.h>

#include <limits>

namespace pf {
namespace {

TEST(DecimalSeconds, ThreeDecimalsFromATenthOfASecond) {
  EXPECT_EQ(decimal_seconds(0.369), "0.369");
  EXPECT_EQ(decimal_seconds(0.1), "0.100");
  EXPECT_EQ(decimal_seconds(12.34567), "12.346");
  EXPECT_EQ(decimal_seconds(0.0), "0.000");
}

TEST(DecimalSeconds, ThreeSignificantDigitsBelowIt) {
  EXPECT_EQ(decimal_seconds(0.0999), "0.0999");
  EXPECT_EQ(decimal_seconds(0.0123), "0.0123");
  EXPECT_EQ(decimal_seconds(0.000812), "0.000812");
  EXPECT_EQ(decimal_seconds(-0.00123), "-0.00123");
  // At most nine decimals: never an exponent a decimal pattern would not read.
  EXPECT_EQ(decimal_seconds(1.5e-12), "0.000000000");
}

TEST(DecimalSeconds, NonFiniteValuesAsPrintfWrites) {
  EXPECT_EQ(decimal_seconds(std::numeric_limits<double>::infinity()), "inf");
  EXPECT_EQ(decimal_seconds(std::numeric_limits<double>::quiet_NaN()), "nan");
}

}  // namespace
}  // namespace pf
