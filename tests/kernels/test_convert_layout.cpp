// The bf16 conversion's walk over its operand (kernels/cuda/convert_layout.h), checked on the
// CPU by replaying the kernel's index arithmetic: every element of every matrix is converted
// once, into the packed place, and nothing else is touched. The GPU's own test of the products
// (test_kernels_cuda) found a layout that converted only the first row of each operand.
#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <string>

#include "kernels/cuda/convert_layout.h"

namespace pf::kernels::cuda {
namespace {

struct Case {
  std::int64_t rows, cols, src_ld, src_stride, count, dst_ld, dst_stride;
  bool aligned;
};

std::string name(const Case& c) {
  return std::to_string(c.count) + " x " + std::to_string(c.rows) + "x" + std::to_string(c.cols) +
         " ld " + std::to_string(c.src_ld) + "->" + std::to_string(c.dst_ld) + " stride " +
         std::to_string(c.src_stride) + "->" + std::to_string(c.dst_stride);
}

// src offset -> dst offset for every element the kernel converts (as its loops run).
std::map<std::int64_t, std::int64_t> walk(const ConvertLayout& l) {
  std::map<std::int64_t, std::int64_t> moved;
  for (std::int64_t row = 0; row < l.total_rows(); ++row) {
    const std::int64_t matrix = row / l.rows;
    const std::int64_t r = row - matrix * l.rows;
    for (std::int64_t v = 0; v < l.vectors_per_row(); ++v) {
      for (int e = 0; e < l.width; ++e) {
        const std::int64_t column = v * l.width + e;
        const std::int64_t from = matrix * l.src_step + r * l.src_ld + column;
        const std::int64_t to = matrix * l.dst_step + r * l.dst_ld + column;
        EXPECT_TRUE(moved.emplace(from, to).second) << "element " << from << " converted twice";
      }
    }
  }
  return moved;
}

TEST(ConvertLayout, EveryElementOfEveryMatrixOnceIntoItsPackedPlace) {
  const Case cases[] = {
      {64, 96, 96, 0, 1, 96, 0, true},                   // one packed matrix (the bug's case)
      {64, 96, 96, 0, 1, 96, 0, false},                  // unaligned: one element at a time
      {3, 5, 5, 0, 1, 5, 0, true},                       // odd sizes
      {16, 8, 8, 128, 4, 8, 128, true},                  // a packed batch
      {16, 8, 12, 200, 3, 8, 128, true},                 // strided, padded source rows
      {7, 9, 16, 0, 1, 9, 0, true},                      // a padded single matrix
      {128, 128, 128, 16384 + 64, 2, 128, 16384, true},  // a batch with gaps between matrices
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(name(c));
    const ConvertLayout l = convert_layout(c.rows, c.cols, c.src_ld, c.src_stride, c.count,
                                           c.dst_ld, c.dst_stride, c.aligned);
    const auto moved = walk(l);
    ASSERT_EQ(static_cast<std::int64_t>(moved.size()), c.count * c.rows * c.cols);
    for (std::int64_t m = 0; m < c.count; ++m) {
      for (std::int64_t r = 0; r < c.rows; ++r) {
        for (std::int64_t col = 0; col < c.cols; ++col) {
          const auto it = moved.find(m * c.src_stride + r * c.src_ld + col);
          ASSERT_NE(it, moved.end())
              << "matrix " << m << " element (" << r << ", " << col << ") not converted";
          EXPECT_EQ(it->second, m * c.dst_stride + r * c.dst_ld + col);
        }
      }
    }
  }
}

TEST(ConvertLayout, PackedOperandsBecomeOneRowAndVectorizeOnlyWhenEverythingAllows) {
  const ConvertLayout packed = convert_layout(64, 96, 96, 0, 1, 96, 0, true);
  EXPECT_EQ(packed.total_rows(), 1);
  EXPECT_EQ(packed.cols, 64 * 96);
  EXPECT_EQ(packed.width, 4);
  EXPECT_EQ(convert_layout(64, 96, 96, 0, 1, 96, 0, false).width, 1);
  EXPECT_EQ(convert_layout(3, 5, 5, 0, 1, 5, 0, true).width, 1);  // 15 elements
  EXPECT_EQ(convert_layout(16, 8, 12, 200, 3, 8, 128, true).width, 4);
  EXPECT_EQ(convert_layout(16, 8, 10, 200, 3, 8, 128, true).width, 1);  // ld 10
}

}  // namespace
}  // namespace pf::kernels::cuda
