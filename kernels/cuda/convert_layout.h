#pragma once
// How convert_to_bf16 (convert.cu) walks its operand: host-side arithmetic only, so that the CPU
// test suite checks it (tests/kernels/test_convert_layout.cpp) although the kernel runs only on
// a GPU. The kernel converts `total_rows()` rows; row i is row i % rows of matrix i / rows, at
// src + matrix * src_step + row * src_ld (dst likewise), `cols` elements each, `width` at a time.
#include <cstdint>

namespace pf::kernels::cuda {

struct ConvertLayout {
  std::int64_t rows = 0, cols = 0, count = 0;
  std::int64_t src_ld = 0, dst_ld = 0, src_step = 0, dst_step = 0;
  int width = 1;  // elements a thread converts at once (4: 16-byte loads)
  std::int64_t total_rows() const { return rows * count; }
  std::int64_t vectors_per_row() const { return cols / width; }
};

// `count` matrices of rows x cols, `src_stride` / `dst_stride` elements apart. Packed matrices
// (leading dimension cols, one right after another, or a single one) become one long row, so
// the whole grid works on it where a short row (a 128-column probability matrix) would leave
// most threads idle. `aligned`: both base pointers are 16-byte aligned.
inline ConvertLayout convert_layout(std::int64_t rows, std::int64_t cols, std::int64_t src_ld,
                                    std::int64_t src_stride, std::int64_t count,
                                    std::int64_t dst_ld, std::int64_t dst_stride, bool aligned) {
  constexpr int kVector = 4;
  ConvertLayout l{rows, cols, count, src_ld, dst_ld, src_stride, dst_stride, 1};
  const std::int64_t size = rows * cols;
  if (src_ld == cols && dst_ld == cols &&
      (count == 1 || (src_stride == size && dst_stride == size))) {
    // The row holds every element of every matrix (`cols *= count` here once kept one row of
    // each: what the first GPU run of the bf16-operand tests found, 2026-11-28).
    l.cols = size * count;
    l.rows = 1;
    l.count = 1;
    l.src_ld = l.dst_ld = l.cols;
    l.src_step = l.dst_step = 0;  // one matrix left
  }
  if (aligned && l.cols % kVector == 0 && l.src_ld % kVector == 0 && l.dst_ld % kVector == 0 &&
      l.src_step % kVector == 0 && l.dst_step % kVector == 0) {
    l.width = kVector;
  }
  return l;
}

}  // namespace pf::kernels::cuda
