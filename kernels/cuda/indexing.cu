// Index checks, row gather / scatter-add (embeddings, masked positions) and the pointer arrays
// of the batched attention products.
#include <algorithm>
#include <cub/device/device_radix_sort.cuh>
#include <limits>
#include <stdexcept>
#include <string>

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

// Sort keys: the id, or `table_rows` (sorted last, skipped) for a row that adds nothing.
__global__ void scatter_keys_kernel(const std::int64_t* ids, std::int64_t rows,
                                    std::int64_t table_rows, std::int64_t skip_id, unsigned* keys,
                                    int* order) {
  for (std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; r < rows;
       r += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t id = ids[r];
    const bool adds = id >= 0 && id < table_rows && id != skip_id;
    keys[r] = static_cast<unsigned>(adds ? id : table_rows);
    order[r] = static_cast<int>(r);
  }
}

// Block per sorted position; the first position of each id's run adds the run's rows into its
// table row, column by column, in row order (the CPU's order).
__global__ void scatter_runs_kernel(const float* dout, std::int64_t ldd, const unsigned* keys,
                                    const int* order, std::int64_t rows, unsigned skipped,
                                    float* dtable, std::int64_t ldt, std::int64_t cols) {
  for (std::int64_t start = blockIdx.x; start < rows; start += gridDim.x) {
    const unsigned key = keys[start];
    if (key == skipped || (start > 0 && keys[start - 1] == key)) continue;
    float* row = dtable + static_cast<std::int64_t>(key) * ldt;
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      float total = row[c];
      for (std::int64_t j = start; j < rows && keys[j] == key; ++j) {
        total += dout[static_cast<std::int64_t>(order[j]) * ldd + c];
      }
      row[c] = total;
    }
  }
}

// Where the sort's arrays sit in the workspace (256-byte aligned), and its own scratch.
struct ScatterWorkspace {
  std::size_t keys_in, keys_out, order_in, order_out, sort, sort_bytes, total;
};

std::size_t align_up(std::size_t bytes) {
  return (bytes + 255) / 256 * 256;
}

int key_bits(std::int64_t table_rows) {  // enough bits for the ids and the skip key
  int bits = 1;
  while (bits < 32 && (std::int64_t{1} << bits) <= table_rows) ++bits;
  return bits;
}

ScatterWorkspace scatter_workspace(std::int64_t rows, std::int64_t table_rows) {
  if (rows > std::numeric_limits<int>::max() ||
      table_rows >= static_cast<std::int64_t>(std::numeric_limits<unsigned>::max())) {
    throw std::invalid_argument("cuda::scatter_add_rows: " + std::to_string(rows) + " rows into " +
                                std::to_string(table_rows) +
                                " table rows (at most 2^31 - 1 rows and 2^32 - 1 table rows)");
  }
  std::size_t sort_bytes = 0;
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      nullptr, sort_bytes, static_cast<const unsigned*>(nullptr), static_cast<unsigned*>(nullptr),
      static_cast<const int*>(nullptr), static_cast<int*>(nullptr), static_cast<int>(rows), 0,
      key_bits(table_rows)));
  const std::size_t array = align_up(static_cast<std::size_t>(rows) * 4);
  ScatterWorkspace w{};
  w.keys_in = 0;
  w.keys_out = array;
  w.order_in = 2 * array;
  w.order_out = 3 * array;
  w.sort = 4 * array;
  w.sort_bytes = sort_bytes;
  w.total = w.sort + align_up(sort_bytes);
  return w;
}

template <typename T>
__global__ void attention_pointers_kernel(T* qkv, std::int64_t ld_qkv, T* ctx, std::int64_t ld_ctx,
                                          T* scores, std::int64_t heads, std::int64_t seq,
                                          std::int64_t head_dim, std::int64_t pairs,
                                          AttentionPointersOf<T> pointers) {
  const std::int64_t pair = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (pair >= pairs) return;
  const std::int64_t b = pair / heads;
  const std::int64_t h = pair % heads;
  const std::int64_t hidden = heads * head_dim;
  T* rows = qkv + b * seq * ld_qkv + h * head_dim;
  pointers.q[pair] = rows;
  pointers.k[pair] = rows + hidden;
  pointers.v[pair] = rows + 2 * hidden;
  if (ctx != nullptr) pointers.ctx[pair] = ctx + b * seq * ld_ctx + h * head_dim;
  pointers.scores[pair] = scores + pair * seq * seq;
}

template <typename T>
void launch_attention_pointers(T* qkv, std::int64_t ld_qkv, T* ctx, std::int64_t ld_ctx, T* scores,
                               std::int64_t batch, std::int64_t heads, std::int64_t seq,
                               std::int64_t head_dim, AttentionPointersOf<T> pointers,
                               cudaStream_t stream) {
  const std::int64_t pairs = batch * heads;
  if (pairs == 0) return;
  attention_pointers_kernel<<<grid_for(pairs), kThreads, 0, stream>>>(
      qkv, ld_qkv, ctx, ld_ctx, scores, heads, seq, head_dim, pairs, pointers);
  CUDA_CHECK(cudaGetLastError());
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

std::size_t scatter_add_rows_workspace(std::int64_t rows, std::int64_t table_rows) {
  return scatter_workspace(rows, table_rows).total;
}

void scatter_add_rows(ConstMatrixView<float> dout, const std::int64_t* ids,
                      MatrixView<float> dtable, std::int64_t skip_id, void* workspace,
                      std::size_t workspace_bytes, cudaStream_t stream) {
  if (dout.size() == 0) return;
  const auto w = scatter_workspace(dout.rows, dtable.rows);
  if (workspace_bytes < w.total) {
    throw std::invalid_argument("cuda::scatter_add_rows: a workspace of " +
                                std::to_string(workspace_bytes) + " bytes, " +
                                std::to_string(w.total) + " needed");
  }
  auto* base = static_cast<unsigned char*>(workspace);
  auto* keys_in = reinterpret_cast<unsigned*>(base + w.keys_in);
  auto* keys_out = reinterpret_cast<unsigned*>(base + w.keys_out);
  auto* order_in = reinterpret_cast<int*>(base + w.order_in);
  auto* order_out = reinterpret_cast<int*>(base + w.order_out);
  scatter_keys_kernel<<<grid_for(dout.rows), kThreads, 0, stream>>>(ids, dout.rows, dtable.rows,
                                                                    skip_id, keys_in, order_in);
  CUDA_CHECK(cudaGetLastError());
  std::size_t sort_bytes = w.sort_bytes;
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(base + w.sort, sort_bytes, keys_in, keys_out, order_in,
                                             order_out, static_cast<int>(dout.rows), 0,
                                             key_bits(dtable.rows), stream));
  const auto blocks = static_cast<unsigned>(std::min<std::int64_t>(dout.rows, 65535));
  scatter_runs_kernel<<<blocks, kThreads, 0, stream>>>(
      dout.data, dout.ld, keys_out, order_out, dout.rows, static_cast<unsigned>(dtable.rows),
      dtable.data, dtable.ld, dout.cols);
  CUDA_CHECK(cudaGetLastError());
}

void fill_attention_pointers(float* qkv, std::int64_t ld_qkv, float* ctx, std::int64_t ld_ctx,
                             float* scores, std::int64_t batch, std::int64_t heads,
                             std::int64_t seq, std::int64_t head_dim, AttentionPointers pointers,
                             cudaStream_t stream) {
  launch_attention_pointers(qkv, ld_qkv, ctx, ld_ctx, scores, batch, heads, seq, head_dim, pointers,
                            stream);
}

void fill_attention_pointers(const __nv_bfloat16* qkv, std::int64_t ld_qkv,
                             const __nv_bfloat16* ctx, std::int64_t ld_ctx,
                             const __nv_bfloat16* scores, std::int64_t batch, std::int64_t heads,
                             std::int64_t seq, std::int64_t head_dim,
                             AttentionOperandPointers pointers, cudaStream_t stream) {
  launch_attention_pointers(qkv, ld_qkv, ctx, ld_ctx, scores, batch, heads, seq, head_dim, pointers,
                            stream);
}

}  // namespace pf::kernels::cuda
