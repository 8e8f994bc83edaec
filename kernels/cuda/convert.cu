// fp32 -> bf16 conversion of product operands (GemmPrecision::kBf16Operands): one pass over the
// fp32 matrix, four elements a thread where the layout allows (16-byte loads, 8-byte stores),
// rounding to nearest even as __float2bfloat16_rn does.
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/convert_layout.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/ops_cuda.h"

namespace pf::kernels::cuda {
namespace {

constexpr int kVector = 4;
constexpr std::int64_t kMaxGridRows = 65535;  // gridDim.y's limit
constexpr std::int64_t kMaxGridColumns = 65536;

struct alignas(8) Bf16x4 {
  __nv_bfloat162 low;
  __nv_bfloat162 high;
};

// Row r of matrix m (r + m * rows = the grid's row index) at src + m * src_stride + r * src_ld.
// blockIdx.y strides over the rows (one division a row, not an element), x over a row's vectors.
template <int kWidth>
__global__ void convert_kernel(const float* src, std::int64_t src_ld, std::int64_t src_stride,
                               __nv_bfloat16* dst, std::int64_t dst_ld, std::int64_t dst_stride,
                               std::int64_t rows, std::int64_t total_rows,
                               std::int64_t vectors_per_row) {
  for (std::int64_t row = blockIdx.y; row < total_rows; row += gridDim.y) {
    const std::int64_t matrix = row / rows;
    const std::int64_t r = row - matrix * rows;
    const float* in = src + matrix * src_stride + r * src_ld;
    __nv_bfloat16* out = dst + matrix * dst_stride + r * dst_ld;
    for (std::int64_t v = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
         v < vectors_per_row; v += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
      if constexpr (kWidth == kVector) {
        const float4 x = reinterpret_cast<const float4*>(in)[v];
        reinterpret_cast<Bf16x4*>(out)[v] = {__float22bfloat162_rn(make_float2(x.x, x.y)),
                                             __float22bfloat162_rn(make_float2(x.z, x.w))};
      } else {
        out[v] = __float2bfloat16_rn(in[v]);
      }
    }
  }
}

bool aligned(const void* pointer, std::uintptr_t bytes) {
  return reinterpret_cast<std::uintptr_t>(pointer) % bytes == 0;
}

}  // namespace

void convert_to_bf16(ConstMatrixView<float> src, std::int64_t src_stride, std::int64_t count,
                     MatrixView<__nv_bfloat16> dst, std::int64_t dst_stride, cudaStream_t stream) {
  if (src.rows == 0 || src.cols == 0 || count == 0) return;
  const ConvertLayout l =
      convert_layout(src.rows, src.cols, src.ld, src_stride, count, dst.ld, dst_stride,
                     aligned(src.data, sizeof(float4)) && aligned(dst.data, sizeof(Bf16x4)));
  const std::int64_t vectors_per_row = l.vectors_per_row();
  const std::int64_t total_rows = l.total_rows();
  const std::int64_t column_blocks = (vectors_per_row + kThreads - 1) / kThreads;
  const dim3 grid(
      static_cast<unsigned>(column_blocks < kMaxGridColumns ? column_blocks : kMaxGridColumns),
      static_cast<unsigned>(total_rows < kMaxGridRows ? total_rows : kMaxGridRows));
  if (l.width == kVector) {
    convert_kernel<kVector><<<grid, kThreads, 0, stream>>>(src.data, l.src_ld, l.src_step, dst.data,
                                                           l.dst_ld, l.dst_step, l.rows, total_rows,
                                                           vectors_per_row);
  } else {
    convert_kernel<1><<<grid, kThreads, 0, stream>>>(src.data, l.src_ld, l.src_step, dst.data,
                                                     l.dst_ld, l.dst_step, l.rows, total_rows,
                                                     vectors_per_row);
  }
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace pf::kernels::cuda
