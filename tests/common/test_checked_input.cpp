// The shared checked readers: JSON integers range-checked as 64-bit values before narrowing,
// overflow-checked size arithmetic, and the exit-status convention.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <new>
#include <string>

#include <nlohmann/json.hpp>

#include "common/checked_arithmetic.h"
#include "common/exit_codes.h"
#include "common/input_error.h"
#include "common/json_fields.h"

namespace pf {
namespace {

using nlohmann::json;

std::string error_of(const auto& fn) {
  try {
    fn();
  } catch (const std::invalid_argument& error) {
    return error.what();
  }
  return "(no error)";
}

TEST(JsonFields, IntegerWithinRangeIsReturned) {
  const json doc = json::parse(R"({"a": 12, "b": -3})");
  EXPECT_EQ(json_fields::integer_field<int>(doc, "a", "f.json", 0, 100), 12);
  EXPECT_EQ(json_fields::integer_field<int>(doc, "b", "f.json", -5, 5), -3);
  EXPECT_EQ(json_fields::integer_field<int>(doc, "c", "f.json", 0, 100, 7), 7);
}

TEST(JsonFields, A64BitValueIsAnErrorNotTruncated) {
  // 4294967297 = 2^32 + 1 narrows to 1 as a 32-bit int: it must be refused, naming everything.
  const json doc = json::parse(R"({"layers": 4294967297})");
  EXPECT_EQ(
      error_of([&] { json_fields::integer_field<int>(doc, "layers", "config.json", 1, 4096); }),
      "config.json: field 'layers' = 4294967297 (allowed: an integer in [1, 4096])");
}

TEST(JsonFields, HugeUnsignedValuesDoNotWrapToNegative) {
  // 2^64 - 1 is stored as uint64 by nlohmann; read as int64 it would be -1.
  const json doc = json::parse(R"({"x": 18446744073709551615, "y": 9223372036854775808})");
  const auto lo = std::numeric_limits<std::int64_t>::min();
  const auto hi = std::numeric_limits<std::int64_t>::max();
  EXPECT_NE(error_of([&] {
              json_fields::integer_field<std::int64_t>(doc, "x", "f", -1, 5);
            }).find("18446744073709551615"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              json_fields::integer_field<std::int64_t>(doc, "y", "f", lo, hi);
            }).find("9223372036854775808"),
            std::string::npos);
}

TEST(JsonFields, NonIntegersAndMissingFieldsAreErrors) {
  const json doc = json::parse(R"({"f": 1.5, "b": true, "s": "3", "n": null})");
  for (const char* key : {"f", "b", "s", "n"}) {
    EXPECT_NE(error_of([&] {
                json_fields::integer_field<int>(doc, key, "f.json", 0, 9);
              }).find("(allowed: an integer in [0, 9])"),
              std::string::npos)
        << key;
  }
  EXPECT_EQ(error_of([&] { json_fields::integer_field<int>(doc, "absent", "f.json", 0, 9); }),
            "f.json: field 'absent' is missing (required: an integer in [0, 9])");
}

TEST(JsonFields, StringsAreCheckedAndLongValuesAreShortenedInMessages) {
  const json doc = {{"name", 5}, {"long", std::string(1000, 'x')}};
  EXPECT_EQ(error_of([&] { json_fields::string_field(doc, "name", "device.json"); }),
            "device.json: field 'name' = 5 (allowed: a string)");
  EXPECT_EQ(json_fields::string_field(doc, "long", "d"), std::string(1000, 'x'));
  const std::string message =
      error_of([&] { json_fields::integer_field<int>(doc, "long", "d", 0, 1); });
  EXPECT_LT(message.size(), 200U) << message;
}

TEST(JsonFields, DeepNestingIsRefusedWhileParsing) {
  const auto nested = [](int levels) {
    return std::string(static_cast<std::size_t>(levels), '[') +
           std::string(static_cast<std::size_t>(levels), ']');
  };
  EXPECT_NO_THROW(json_fields::parse_bounded(nested(json_fields::kMaxNesting), "f.json"));
  for (const int levels : {json_fields::kMaxNesting + 1, 1000000}) {
    try {
      (void)json_fields::parse_bounded(nested(levels), "f.json");
      ADD_FAILURE() << levels << " levels accepted";
    } catch (const std::invalid_argument& error) {
      EXPECT_STREQ(error.what(),
                   "f.json: JSON nested deeper than 256 levels (allowed: at most 256)");
    }
  }
  const std::string objects = R"({"a": )" + nested(300) + "}";
  EXPECT_THROW((void)json_fields::parse_bounded(objects, "f.json"), std::invalid_argument);
  // Syntax errors stay nlohmann's, for the caller to word.
  EXPECT_THROW((void)json_fields::parse_bounded(std::string("{"), "f.json"), json::parse_error);
  // A number beyond a double is nlohmann's out_of_range, which callers catching parse errors let
  // escape (the fuzzer's finding): it is an error naming the file.
  try {
    (void)json_fields::parse_bounded(std::string(R"({"p": 0.1E4901161})"), "f.json");
    ADD_FAILURE() << "an overflowing number accepted";
  } catch (const std::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find("f.json: not valid JSON here"), std::string::npos)
        << error.what();
  }
}

TEST(CheckedArithmetic, OverflowIsReportedNotWrapped) {
  EXPECT_EQ(checked_mul<std::uint64_t>(1ULL << 58, 288), std::nullopt);
  EXPECT_EQ(checked_mul<std::uint64_t>(1ULL << 20, 288), (1ULL << 20) * 288);
  EXPECT_EQ(checked_add<int>(std::numeric_limits<int>::max(), 1), std::nullopt);
  EXPECT_EQ(checked_add<int>(2147483646, 1), 2147483647);
  EXPECT_EQ(checked_mul<int>(4, 600000000), std::nullopt);
}

TEST(ExitCodes, BadInputIsTwoAndInternalFailureIsOne) {
  EXPECT_EQ(exit_code_for(std::invalid_argument("x")), kExitBadInput);
  EXPECT_EQ(exit_code_for(InputError("x")), kExitBadInput);
  EXPECT_EQ(exit_code_for(std::out_of_range("x")), kExitBadInput);
  try {
    const json unfinished = json::parse("{");
    ADD_FAILURE() << unfinished.dump();
  } catch (const json::exception& error) {
    EXPECT_EQ(exit_code_for(error), kExitBadInput);
  }
  EXPECT_EQ(exit_code_for(std::bad_alloc()), kExitInternalError);
  EXPECT_EQ(exit_code_for(std::runtime_error("device lost")), kExitInternalError);
  EXPECT_EQ(exit_code_for(std::logic_error("bug")), kExitInternalError);
}

}  // namespace
}  // namespace pf
