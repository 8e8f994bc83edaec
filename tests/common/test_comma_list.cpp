// common/comma_list.h: the one parser of comma-separated command-line lists, and its one error
// format (flag, whole value, item position, item).
#include "common/comma_list.h"

#include <limits>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <gtest/gtest.h>

namespace pf {
namespace {

std::string error_of(std::string_view text, int max_value = std::numeric_limits<int>::max()) {
  try {
    parse_positive_int_list(text, "--stages", max_value);
  } catch (const std::invalid_argument& error) {
    return error.what();
  }
  return "(no error)";
}

TEST(CommaList, ParsesPositiveIntegers) {
  EXPECT_EQ(parse_positive_int_list("3,1", "--x"), (std::vector<int>{3, 1}));
  EXPECT_EQ(parse_positive_int_list("12", "--x"), std::vector<int>{12});
  EXPECT_EQ(parse_positive_int_list(" 2 , 4 ", "--x"), (std::vector<int>{2, 4}));
  EXPECT_EQ(parse_positive_int_list("007", "--x"), std::vector<int>{7});
  EXPECT_EQ(parse_positive_int_list("2147483647", "--x"),
            std::vector<int>{std::numeric_limits<int>::max()});
  EXPECT_EQ(parse_positive_int_list("8,8", "--x", 8), (std::vector<int>{8, 8}));
}

TEST(CommaList, EachBadItemIsNamedWithItsFlagValueAndPosition) {
  EXPECT_EQ(error_of(""), "--stages '': item 1 is empty");
  EXPECT_EQ(error_of("2,,4"), "--stages '2,,4': item 2 is empty");
  EXPECT_EQ(error_of("2,4,"), "--stages '2,4,': item 3 is empty");
  EXPECT_EQ(error_of(" , 2"), "--stages ' , 2': item 1 is empty");
  EXPECT_EQ(error_of("3,x"), "--stages '3,x': item 2 'x' is not a positive integer");
  EXPECT_EQ(error_of("-1,2"), "--stages '-1,2': item 1 '-1' is not a positive integer");
  EXPECT_EQ(error_of("+1"), "--stages '+1': item 1 '+1' is not a positive integer");
  EXPECT_EQ(error_of("1,0"), "--stages '1,0': item 2 '0' is not a positive integer");
  EXPECT_EQ(error_of("1.5"), "--stages '1.5': item 1 '1.5' is not a positive integer");
  EXPECT_EQ(error_of("2 4"), "--stages '2 4': item 1 '2 4' is not a positive integer");
  EXPECT_EQ(error_of("4;2"), "--stages '4;2': item 1 '4;2' is not a positive integer");
  // Bounded digit by digit: no overflow, whatever the length.
  EXPECT_EQ(error_of("1,99999999999"), "--stages '1,99999999999': item 2 '99999999999' exceeds " +
                                           std::to_string(std::numeric_limits<int>::max()));
  EXPECT_NE(error_of(std::string(400, '9')).find("' exceeds 2147483647"), std::string::npos);
  EXPECT_EQ(error_of("3,9", 8), "--stages '3,9': item 2 '9' exceeds 8");
}

TEST(CommaList, ParsesNonNegativeIntegers) {
  EXPECT_EQ(parse_non_negative_int_list("0,0,1,1", "--machines"), (std::vector<int>{0, 0, 1, 1}));
  EXPECT_EQ(parse_non_negative_int_list("3, 2147483647", "--machines"),
            (std::vector<int>{3, std::numeric_limits<int>::max()}));
  const auto error = [](std::string_view text) {
    try {
      parse_non_negative_int_list(text, "--machines");
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  EXPECT_EQ(error("0,-1"), "--machines '0,-1': item 2 '-1' is not an integer >= 0");
  EXPECT_EQ(error("0,1.5"), "--machines '0,1.5': item 2 '1.5' is not an integer >= 0");
  EXPECT_EQ(error(","), "--machines ',': item 1 is empty");
  EXPECT_EQ(error("99999999999"), "--machines '99999999999': item 1 '99999999999' exceeds " +
                                      std::to_string(std::numeric_limits<int>::max()));
}

TEST(CommaList, SplitsNamedItems) {
  EXPECT_EQ(split_comma_list("1f1b, chimera", "--schedules"),
            (std::vector<std::string_view>{"1f1b", "chimera"}));
  EXPECT_THROW(split_comma_list("1f1b,", "--schedules"), std::invalid_argument);
  try {
    split_comma_list("a,,b", "--schedules");
    FAIL() << "no error";
  } catch (const std::invalid_argument& error) {
    EXPECT_STREQ(error.what(), "--schedules 'a,,b': item 2 is empty");
  }
}

}  // namespace
}  // namespace pf
