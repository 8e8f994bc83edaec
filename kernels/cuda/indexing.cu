// Index checks, row gather / scatter-add (embeddings, masked positions) and the pointer arrays
// of the batched attention products.
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/ops_cuda.h"

namespace pf::kernels::cuda {
namespace {

__global__ void check_indices_kernel(const std::int64_t* ids, std::int64_t rows, std::int64_t limit,
                                     unsigned long long* bad_row) {
  for (std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; r < rows;
       r += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    if (ids[r] < 0 || ids[r] >= limit) atomicMin(bad_row, static_cast<unsigned long long>(r));
  }
}

__global__ void gather_rows_kernel(const float* table, std::int64_t ldt, std::int64_t table_rows,
                                   const std::int64_t* ids, float* out, std::int64_t ldo,
                                   std::int64_t rows, std::int64_t cols, bool accumulate_output) {
  const std::int64_t count = rows * cols;
  for (std::int64_t index = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       index < count; index += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t r = index / cols;
    const std::int64_t c = index % cols;
    const std::int64_t id = ids[r];
    if (id < 0 || id >= table_rows) continue;
    const float value = table[id * ldt + c];
    if (accumulate_output) {
      out[r * ldo + c] += value;
    } else {
      out[r * ldo + c] = value;
    }
  }
}

__global__ void scatter_add_rows_kernel(const float* dout, std::int64_t ldd,
                                        const std::int64_t* ids, float* dtable, std::int64_t ldt,
                                        std::int64_t table_rows, std::int64_t rows,
                                        std::int64_t cols, std::int64_t skip_id) {
  const std::int64_t count = rows * cols;
  for (std::int64_t index = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       index < count; index += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t r = index / cols;
    const std::int64_t c = index % cols;
    const std::int64_t id = ids[r];
    if (id < 0 || id >= table_rows || id == skip_id) continue;
    atomicAdd(dtable + id * ldt + c, dout[r * ldd + c]);
  }
}

__global__ void attention_pointers_kernel(float* qkv, std::int64_t ld_qkv, float* ctx,
                                          std::int64_t ld_ctx, float* scores, std::int64_t heads,
                                          std::int64_t seq, std::int64_t head_dim,
                                          std::int64_t pairs, AttentionPointers pointers) {
  const std::int64_t pair = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (pair >= pairs) return;
  const std::int64_t b = pair / heads;
  const std::int64_t h = pair % heads;
  const std::int64_t hidden = heads * head_dim;
  float* rows = qkv + b * seq * ld_qkv + h * head_dim;
  pointers.q[pair] = rows;
  pointers.k[pair] = rows + hidden;
  pointers.v[pair] = rows + 2 * hidden;
  pointers.ctx[pair] = ctx + b * seq * ld_ctx + h * head_dim;
  pointers.scores[pair] = scores + pair * seq * seq;
}

}  // namespace

void check_indices(const std::int64_t* ids, std::int64_t rows, std::int64_t limit,
                   unsigned long long* bad_row, cudaStream_t stream) {
  if (rows == 0) return;
  check_indices_kernel<<<grid_for(rows), kThreads, 0, stream>>>(ids, rows, limit, bad_row);
  CUDA_CHECK(cudaGetLastError());
}

void gather_rows(ConstMatrixView<float> table, const std::int64_t* ids, MatrixView<float> out,
                 bool accumulate_output, cudaStream_t stream) {
  if (out.size() == 0) return;
  gather_rows_kernel<<<grid_for(out.size()), kThreads, 0, stream>>>(
      table.data, table.ld, table.rows, ids, out.data, out.ld, out.rows, out.cols,
      accumulate_output);
  CUDA_CHECK(cudaGetLastError());
}

void scatter_add_rows(ConstMatrixView<float> dout, const std::int64_t* ids,
                      MatrixView<float> dtable, std::int64_t skip_id, cudaStream_t stream) {
  if (dout.size() == 0) return;
  scatter_add_rows_kernel<<<grid_for(dout.size()), kThreads, 0, stream>>>(
      dout.data, dout.ld, ids, dtable.data, dtable.ld, dtable.rows, dout.rows, dout.cols, skip_id);
  CUDA_CHECK(cudaGetLastError());
}

void fill_attention_pointers(float* qkv, std::int64_t ld_qkv, float* ctx, std::int64_t ld_ctx,
                             float* scores, std::int64_t batch, std::int64_t heads,
                             std::int64_t seq, std::int64_t head_dim, AttentionPointers pointers,
                             cudaStream_t stream) {
  const std::int64_t pairs = batch * heads;
  if (pairs == 0) return;
  attention_pointers_kernel<<<grid_for(pairs), kThreads, 0, stream>>>(
      qkv, ld_qkv, ctx, ld_ctx, scores, heads, seq, head_dim, pairs, pointers);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace pf::kernels::cuda
