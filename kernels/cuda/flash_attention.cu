// Fused ("flash") attention, FlashAttention-2's algorithm in fp32 SIMT arithmetic, or with TF32
// tensor cores (WMMA, fp32 accumulation) for the products where asked and head_dim <= 64: per
// (sequence, head) pair and block of 64 query rows, the forward walks the keys in blocks of 64,
// keeps a running row maximum and row sum (online softmax) and accumulates dropout(P) V in
// registers; no [S, S] matrix reaches global memory. It saves one log-sum-exp per query row. The
// backward recomputes P = exp(scale Q K^T + mask - lse) per tile, one block per key block
// accumulating dK and dV in registers over the query blocks; dQ's per-key-block partial sums go
// to the workspace and one more kernel adds them in key-block order, so the result repeats bit
// for bit (no atomics). The mask and the dropout keep bit are those of the batched path
// (rows.cu): kMaskedLogit added to padded keys, stream index pair * S * S + query * S + key.
#include <mma.h>

#include <cmath>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/ops_cuda.h"
#include "kernels/ops.h"
#include "kernels/rng.h"

namespace pf::kernels::cuda {
namespace {

// A block of 256 threads as a 16 x 16 grid covers a 64 x 64 tile: thread (ty, tx) owns rows
// ty + 16 i and columns tx + 16 j (i, j < 4), so a warp's 32 lanes read 16 consecutive columns
// of two rows from shared memory (no bank conflicts with rows padded by one float).
constexpr int kTile = 64;
constexpr int kFlashThreads = 256;
constexpr int kGrid = 16;                  // threads along each side of the tile
constexpr int kPerThread = kTile / kGrid;  // rows (or columns) of a tile per thread
constexpr int kScoreStride = kTile + 1;

// The arguments every fused kernel shares.
struct FlashParams {
  const float* qkv;
  std::int64_t ld_qkv;
  const std::int64_t* mask;  // [batch, seq], 1 keep / 0 padding; null: no mask
  std::int64_t seq, heads, head_dim, hidden;
  std::int64_t query_blocks;  // blocks of kTile rows per sequence
  float scale;
  bool dropout;
  std::uint64_t key;  // stream_key(seed)
  std::uint32_t threshold;
  float keep_scale;  // 1 / (1 - dropout)
};

// Shared-memory row stride of a [kTile, kDim] tile (a variable template: device code may read
// it, where a constexpr host function would need --expt-relaxed-constexpr).
template <int kDim>
constexpr int kDimStride = kDim + 1;

template <int kDim>
constexpr std::size_t forward_shared_bytes() {
  return sizeof(float) * (3 * kTile * kDimStride<kDim> + kTile * kScoreStride);
}

template <int kDim>
constexpr std::size_t backward_shared_bytes() {
  return sizeof(float) * (4 * kTile * kDimStride<kDim> + 2 * kTile * kScoreStride + 2 * kTile);
}

// Rows first_row .. first_row + kTile - 1 of a [seq, head_dim] head (leading dimension ld) into
// a [kTile, kDim] shared tile, zeros past the sequence's end and past head_dim (so partial tiles
// add nothing to the products).
template <int kDim, int kStride = kDimStride<kDim>>
__device__ void load_tile(float* tile, const float* head, std::int64_t ld, std::int64_t first_row,
                          std::int64_t seq, std::int64_t head_dim) {
  for (int e = static_cast<int>(threadIdx.x); e < kTile * kDim; e += kFlashThreads) {
    const int r = e / kDim;
    const int c = e % kDim;
    const std::int64_t row = first_row + r;
    tile[r * kStride + c] = row < seq && c < head_dim ? head[row * ld + c] : 0.0F;
  }
}

// Max and sum over the 16 lanes that hold one tile row (lanes 0-15 or 16-31 of a warp). The
// butterfly gives every lane the same bits.
__device__ inline float row_max16(float value) {
  for (int offset = kGrid / 2; offset > 0; offset /= 2) {
    value = fmaxf(value, __shfl_xor_sync(0xffffffffU, value, offset));
  }
  return value;
}
__device__ inline float row_sum16(float value) {
  for (int offset = kGrid / 2; offset > 0; offset /= 2) {
    value += __shfl_xor_sync(0xffffffffU, value, offset);
  }
  return value;
}

// The logit the batched path's softmax sees: scale * score, plus kMaskedLogit for padded keys.
__device__ inline float masked_logit(const FlashParams& p, const std::int64_t* mask, float score,
                                     std::int64_t key) {
  float value = score * p.scale;
  if (mask != nullptr && mask[key] == 0) value += static_cast<float>(kMaskedLogit);
  return value;
}

// Dropout's keep bit of probability (query, key) of pair `pair`: the batched path's index.
__device__ inline bool keep_element(const FlashParams& p, std::int64_t pair, std::int64_t query,
                                    std::int64_t key) {
  const auto index = static_cast<std::uint64_t>((pair * p.seq + query) * p.seq + key);
  return bits_for_key(p.key, index) >= p.threshold;
}

// Block x: pair * query_blocks + query block. Writes ctx rows and lse[pair * seq + row].
template <int kDim>
__global__ void __launch_bounds__(kFlashThreads)
    flash_forward_kernel(FlashParams p, float* lse, float* ctx, std::int64_t ld_ctx) {
  constexpr int kCols = kDim / kGrid;  // head columns per thread
  extern __shared__ float shared[];
  float* q_tile = shared;
  float* k_tile = q_tile + kTile * kDimStride<kDim>;
  float* v_tile = k_tile + kTile * kDimStride<kDim>;
  float* p_tile = v_tile + kTile * kDimStride<kDim>;  // dropout(exp(logit - max))
  const int tx = static_cast<int>(threadIdx.x) % kGrid;
  const int ty = static_cast<int>(threadIdx.x) / kGrid;
  const std::int64_t pair = blockIdx.x / p.query_blocks;
  const std::int64_t q0 = (blockIdx.x % p.query_blocks) * kTile;
  const std::int64_t b = pair / p.heads;
  const std::int64_t h = pair % p.heads;
  const float* sequence = p.qkv + b * p.seq * p.ld_qkv + h * p.head_dim;
  const std::int64_t* mask = p.mask == nullptr ? nullptr : p.mask + b * p.seq;
  load_tile<kDim>(q_tile, sequence, p.ld_qkv, q0, p.seq, p.head_dim);

  float row_max[kPerThread], row_sum[kPerThread], acc[kPerThread][kCols];
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    row_max[i] = -INFINITY;
    row_sum[i] = 0.0F;
#pragma unroll
    for (int j = 0; j < kCols; ++j) acc[i][j] = 0.0F;
  }
  for (std::int64_t k0 = 0; k0 < p.seq; k0 += kTile) {
    __syncthreads();  // the previous block's tiles are read
    load_tile<kDim>(k_tile, sequence + p.hidden, p.ld_qkv, k0, p.seq, p.head_dim);
    load_tile<kDim>(v_tile, sequence + 2 * p.hidden, p.ld_qkv, k0, p.seq, p.head_dim);
    __syncthreads();
    float s[kPerThread][kPerThread] = {};
    for (int c = 0; c < kDim; ++c) {
      float qv[kPerThread], kv[kPerThread];
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) qv[i] = q_tile[(ty + kGrid * i) * kDimStride<kDim> + c];
#pragma unroll
      for (int j = 0; j < kPerThread; ++j) kv[j] = k_tile[(tx + kGrid * j) * kDimStride<kDim> + c];
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) {
#pragma unroll
        for (int j = 0; j < kPerThread; ++j) s[i][j] = fmaf(qv[i], kv[j], s[i][j]);
      }
    }
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const std::int64_t query = q0 + ty + kGrid * i;
      // Keys past the sequence's end get -inf: weight exactly 0. Key k0 (tx = 0, j = 0) is
      // always inside, so the row's maximum is finite.
      float tile_max = -INFINITY;
#pragma unroll
      for (int j = 0; j < kPerThread; ++j) {
        const std::int64_t key = k0 + tx + kGrid * j;
        s[i][j] = key < p.seq ? masked_logit(p, mask, s[i][j], key) : -INFINITY;
        tile_max = fmaxf(tile_max, s[i][j]);
      }
      const float new_max = fmaxf(row_max[i], row_max16(tile_max));
      const float correction = expf(row_max[i] - new_max);  // 0 on the first block
      row_max[i] = new_max;
      float partial = 0.0F;
#pragma unroll
      for (int j = 0; j < kPerThread; ++j) {
        const std::int64_t key = k0 + tx + kGrid * j;
        const float e = expf(s[i][j] - new_max);
        partial += e;
        float weight = e;
        if (p.dropout) {
          weight = key < p.seq && query < p.seq && keep_element(p, pair, query, key)
                       ? e * p.keep_scale
                       : 0.0F;
        }
        p_tile[(ty + kGrid * i) * kScoreStride + tx + kGrid * j] = weight;
      }
      row_sum[i] = row_sum[i] * correction + row_sum16(partial);
#pragma unroll
      for (int j = 0; j < kCols; ++j) acc[i][j] *= correction;
    }
    __syncthreads();  // p_tile is whole
    for (int c = 0; c < kTile; ++c) {
      float pv[kPerThread], vv[kCols];
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) pv[i] = p_tile[(ty + kGrid * i) * kScoreStride + c];
#pragma unroll
      for (int j = 0; j < kCols; ++j) vv[j] = v_tile[c * kDimStride<kDim> + tx + kGrid * j];
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) {
#pragma unroll
        for (int j = 0; j < kCols; ++j) acc[i][j] = fmaf(pv[i], vv[j], acc[i][j]);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const std::int64_t query = q0 + ty + kGrid * i;
    if (query >= p.seq) continue;
    const float inverse = 1.0F / row_sum[i];
    float* out = ctx + (b * p.seq + query) * ld_ctx + h * p.head_dim;
#pragma unroll
    for (int j = 0; j < kCols; ++j) {
      const int col = tx + kGrid * j;
      if (col < p.head_dim) out[col] = acc[i][j] * inverse;
    }
    if (tx == 0) lse[pair * p.seq + query] = row_max[i] + logf(row_sum[i]);
  }
}

// row_dot[pair * seq + i] = dO_i . O_i, one warp per row (the softmax backward's sum_j dP'_ij
// P_ij, where dP' is the gradient after dropout's backward).
__global__ void flash_row_dot_kernel(const float* ctx, std::int64_t ld_ctx, const float* dctx,
                                     std::int64_t ld_dctx, std::int64_t pairs, std::int64_t seq,
                                     std::int64_t heads, std::int64_t head_dim, float* row_dot) {
  const std::int64_t row =
      static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (row >= pairs * seq) return;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::int64_t pair = row / seq;
  const std::int64_t token = (pair / heads) * seq + row % seq;
  const std::int64_t column = (pair % heads) * head_dim;
  const float* o = ctx + token * ld_ctx + column;
  const float* d_o = dctx + token * ld_dctx + column;
  float dot = 0.0F;
  for (std::int64_t c = lane; c < head_dim; c += 32) dot = fmaf(o[c], d_o[c], dot);
  dot = warp_sum(dot);
  if (lane == 0) row_dot[row] = dot;
}

// Block x: pair * key_blocks + key block. dK and dV of the block's keys into dqkv; the block's
// share of dQ into dq_partials[key block][pair][seq][head_dim].
template <int kDim>
__global__ void __launch_bounds__(kFlashThreads)
    flash_backward_kernel(FlashParams p, const float* lse, const float* dctx, std::int64_t ld_dctx,
                          const float* row_dot, float* dq_partials, float* dqkv,
                          std::int64_t ld_dqkv) {
  constexpr int kCols = kDim / kGrid;
  extern __shared__ float shared[];
  float* k_tile = shared;
  float* v_tile = k_tile + kTile * kDimStride<kDim>;
  float* q_tile = v_tile + kTile * kDimStride<kDim>;
  float* do_tile = q_tile + kTile * kDimStride<kDim>;
  float* p_tile = do_tile + kTile * kDimStride<kDim>;  // dropout(P) [query][key]
  float* ds_tile = p_tile + kTile * kScoreStride;      // dS [query][key]
  float* lse_tile = ds_tile + kTile * kScoreStride;
  float* dot_tile = lse_tile + kTile;
  const int tx = static_cast<int>(threadIdx.x) % kGrid;
  const int ty = static_cast<int>(threadIdx.x) / kGrid;
  const std::int64_t key_blocks = p.query_blocks;  // the same blocks of kTile
  const std::int64_t pair = blockIdx.x / key_blocks;
  const std::int64_t key_block = blockIdx.x % key_blocks;
  const std::int64_t k0 = key_block * kTile;
  const std::int64_t pairs = static_cast<std::int64_t>(gridDim.x) / key_blocks;
  const std::int64_t b = pair / p.heads;
  const std::int64_t h = pair % p.heads;
  const float* sequence = p.qkv + b * p.seq * p.ld_qkv + h * p.head_dim;
  const float* d_out = dctx + b * p.seq * ld_dctx + h * p.head_dim;
  const std::int64_t* mask = p.mask == nullptr ? nullptr : p.mask + b * p.seq;
  load_tile<kDim>(k_tile, sequence + p.hidden, p.ld_qkv, k0, p.seq, p.head_dim);
  load_tile<kDim>(v_tile, sequence + 2 * p.hidden, p.ld_qkv, k0, p.seq, p.head_dim);

  // dk, dv: keys k0 + ty + 16 i, head columns tx + 16 j.
  float dk[kPerThread][kCols] = {}, dv[kPerThread][kCols] = {};
  for (std::int64_t q0 = 0; q0 < p.seq; q0 += kTile) {
    __syncthreads();  // the previous query block's tiles are read
    load_tile<kDim>(q_tile, sequence, p.ld_qkv, q0, p.seq, p.head_dim);
    load_tile<kDim>(do_tile, d_out, ld_dctx, q0, p.seq, p.head_dim);
    for (int r = static_cast<int>(threadIdx.x); r < kTile; r += kFlashThreads) {
      const std::int64_t query = q0 + r;
      lse_tile[r] = query < p.seq ? lse[pair * p.seq + query] : 0.0F;
      dot_tile[r] = query < p.seq ? row_dot[pair * p.seq + query] : 0.0F;
    }
    __syncthreads();
    // s = Q K^T and dp = dO V^T: queries q0 + ty + 16 i, keys k0 + tx + 16 j.
    float s[kPerThread][kPerThread] = {}, dp[kPerThread][kPerThread] = {};
    for (int c = 0; c < kDim; ++c) {
      float qv[kPerThread], dov[kPerThread], kv[kPerThread], vv[kPerThread];
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) {
        qv[i] = q_tile[(ty + kGrid * i) * kDimStride<kDim> + c];
        dov[i] = do_tile[(ty + kGrid * i) * kDimStride<kDim> + c];
      }
#pragma unroll
      for (int j = 0; j < kPerThread; ++j) {
        kv[j] = k_tile[(tx + kGrid * j) * kDimStride<kDim> + c];
        vv[j] = v_tile[(tx + kGrid * j) * kDimStride<kDim> + c];
      }
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) {
#pragma unroll
        for (int j = 0; j < kPerThread; ++j) {
          s[i][j] = fmaf(qv[i], kv[j], s[i][j]);
          dp[i][j] = fmaf(dov[i], vv[j], dp[i][j]);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int r = ty + kGrid * i;
      const std::int64_t query = q0 + r;
#pragma unroll
      for (int j = 0; j < kPerThread; ++j) {
        const int c = tx + kGrid * j;
        const std::int64_t key = k0 + c;
        float weight = 0.0F;  // what multiplied V in the forward: dropout(P)
        float ds = 0.0F;      // d(score): scale * P * (dP' - rowsum(dO O))
        if (query < p.seq && key < p.seq) {
          const float prob = expf(masked_logit(p, mask, s[i][j], key) - lse_tile[r]);
          float grad = dp[i][j];
          weight = prob;
          if (p.dropout) {
            const bool keep = keep_element(p, pair, query, key);
            weight = keep ? prob * p.keep_scale : 0.0F;
            grad = keep ? grad * p.keep_scale : 0.0F;
          }
          ds = p.scale * prob * (grad - dot_tile[r]);
        }
        p_tile[r * kScoreStride + c] = weight;
        ds_tile[r * kScoreStride + c] = ds;
      }
    }
    __syncthreads();  // p_tile and ds_tile are whole
    // dV += dropout(P)^T dO and dK += dS^T Q over the block's queries.
    for (int r = 0; r < kTile; ++r) {
      float pw[kPerThread], dsv[kPerThread], dov[kCols], qv[kCols];
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) {
        pw[i] = p_tile[r * kScoreStride + ty + kGrid * i];
        dsv[i] = ds_tile[r * kScoreStride + ty + kGrid * i];
      }
#pragma unroll
      for (int j = 0; j < kCols; ++j) {
        dov[j] = do_tile[r * kDimStride<kDim> + tx + kGrid * j];
        qv[j] = q_tile[r * kDimStride<kDim> + tx + kGrid * j];
      }
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) {
#pragma unroll
        for (int j = 0; j < kCols; ++j) {
          dv[i][j] = fmaf(pw[i], dov[j], dv[i][j]);
          dk[i][j] = fmaf(dsv[i], qv[j], dk[i][j]);
        }
      }
    }
    // This key block's share of dQ = dS K: queries q0 + ty + 16 i, head columns tx + 16 j.
    float dq[kPerThread][kCols] = {};
    for (int c = 0; c < kTile; ++c) {
      float dsv[kPerThread], kv[kCols];
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) dsv[i] = ds_tile[(ty + kGrid * i) * kScoreStride + c];
#pragma unroll
      for (int j = 0; j < kCols; ++j) kv[j] = k_tile[c * kDimStride<kDim> + tx + kGrid * j];
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) {
#pragma unroll
        for (int j = 0; j < kCols; ++j) dq[i][j] = fmaf(dsv[i], kv[j], dq[i][j]);
      }
    }
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const std::int64_t query = q0 + ty + kGrid * i;
      if (query >= p.seq) continue;
      float* out = dq_partials + ((key_block * pairs + pair) * p.seq + query) * p.head_dim;
#pragma unroll
      for (int j = 0; j < kCols; ++j) {
        const int col = tx + kGrid * j;
        if (col < p.head_dim) out[col] = dq[i][j];
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const std::int64_t key = k0 + ty + kGrid * i;
    if (key >= p.seq) continue;
    float* row = dqkv + (b * p.seq + key) * ld_dqkv + h * p.head_dim;
#pragma unroll
    for (int j = 0; j < kCols; ++j) {
      const int col = tx + kGrid * j;
      if (col < p.head_dim) {
        row[p.hidden + col] = dk[i][j];
        row[2 * p.hidden + col] = dv[i][j];
      }
    }
  }
}

// --- tensor cores (TF32 WMMA, fp32 accumulation), head_dim <= 64: the same algorithm with every
// product of two tiles as 16 x 16 x 8 WMMA fragments, 8 warps sharing a 64 x 64 output as two
// fragments each (warp w: fragment row w / 2, columns 2 (w % 2) and 2 (w % 2) + 1). Tiles are
// kept in shared memory with rows of kTcStride floats (WMMA wants a multiple of 4 floats and
// fragments at 32-byte boundaries: 16 rows x 68 floats x 4 bytes = 4352 = 136 x 32). The softmax,
// mask and dropout stay the SIMT kernels' code on the 16 x 16 thread grid.
namespace wmma = nvcuda::wmma;
constexpr int kTcDim = 64;
constexpr int kTcStride = kTcDim + 4;
constexpr int kTcTileFloats = kTile * kTcStride;  // one [64, 68] tile: 17408 bytes
constexpr int kTcFragmentsPerWarp = 2;
constexpr std::size_t kTcForwardSharedBytes = sizeof(float) * 5 * kTcTileFloats;
constexpr std::size_t kTcBackwardSharedBytes = sizeof(float) * (7 * kTcTileFloats + 2 * kTile);

using TcAccumulator = wmma::fragment<wmma::accumulator, 16, 16, 8, float>;
template <typename Layout>
using TcMatrixA = wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, Layout>;
template <typename Layout>
using TcMatrixB = wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, Layout>;

template <typename Fragment>
__device__ inline void round_to_tf32(Fragment& fragment) {
#pragma unroll
  for (int t = 0; t < fragment.num_elements; ++t)
    fragment.x[t] = wmma::__float_to_tf32(fragment.x[t]);
}

// acc += A B over a depth of kTile (= kTcDim) for the fragment at (row block, column block) of a
// 64 x 64 product. A is [rows, depth] (row_major: a[r * kTcStride + k]; col_major: stored
// transposed, a[k * kTcStride + r]); B is [depth, cols] (row_major: b[k * kTcStride + c];
// col_major: stored transposed, b[c * kTcStride + k]).
template <typename LayoutA, typename LayoutB>
__device__ inline void tc_product(TcAccumulator& acc, const float* a, const float* b, int row_block,
                                  int col_block) {
  constexpr bool kATransposed = std::is_same_v<LayoutA, wmma::col_major>;
  constexpr bool kBTransposed = std::is_same_v<LayoutB, wmma::col_major>;
#pragma unroll 2
  for (int k = 0; k < kTile; k += 8) {
    TcMatrixA<LayoutA> fa;
    TcMatrixB<LayoutB> fb;
    const float* pa =
        kATransposed ? a + k * kTcStride + row_block * 16 : a + row_block * 16 * kTcStride + k;
    const float* pb =
        kBTransposed ? b + col_block * 16 * kTcStride + k : b + k * kTcStride + col_block * 16;
    wmma::load_matrix_sync(fa, pa, kTcStride);
    wmma::load_matrix_sync(fb, pb, kTcStride);
    round_to_tf32(fa);
    round_to_tf32(fb);
    wmma::mma_sync(acc, fa, fb, acc);
  }
}

// out (a [64, 64] shared tile) = A B, each warp its two fragments.
template <typename LayoutA, typename LayoutB>
__device__ inline void tc_product_to_tile(float* out, const float* a, const float* b) {
  const int warp = static_cast<int>(threadIdx.x) / 32;
#pragma unroll
  for (int f = 0; f < kTcFragmentsPerWarp; ++f) {
    const int row_block = warp / 2;
    const int col_block = 2 * (warp % 2) + f;
    TcAccumulator acc;
    wmma::fill_fragment(acc, 0.0F);
    tc_product<LayoutA, LayoutB>(acc, a, b, row_block, col_block);
    wmma::store_matrix_sync(out + row_block * 16 * kTcStride + col_block * 16, acc, kTcStride,
                            wmma::mem_row_major);
  }
}

__global__ void __launch_bounds__(kFlashThreads)
    flash_forward_tc_kernel(FlashParams p, float* lse, float* ctx, std::int64_t ld_ctx) {
  extern __shared__ __align__(128) float tc_shared[];
  float* q_tile = tc_shared;
  float* k_tile = q_tile + kTcTileFloats;
  float* v_tile = k_tile + kTcTileFloats;
  float* o_tile = v_tile + kTcTileFloats;  // the running dropout(P) V, rescaled per key block
  float* s_tile = o_tile + kTcTileFloats;  // Q K^T, then the block's weights
  const int tx = static_cast<int>(threadIdx.x) % kGrid;
  const int ty = static_cast<int>(threadIdx.x) / kGrid;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const std::int64_t pair = blockIdx.x / p.query_blocks;
  const std::int64_t q0 = (blockIdx.x % p.query_blocks) * kTile;
  const std::int64_t b = pair / p.heads;
  const std::int64_t h = pair % p.heads;
  const float* sequence = p.qkv + b * p.seq * p.ld_qkv + h * p.head_dim;
  const std::int64_t* mask = p.mask == nullptr ? nullptr : p.mask + b * p.seq;
  load_tile<kTcDim, kTcStride>(q_tile, sequence, p.ld_qkv, q0, p.seq, p.head_dim);
  for (int e = static_cast<int>(threadIdx.x); e < kTcTileFloats; e += kFlashThreads) {
    o_tile[e] = 0.0F;
  }
  float row_max[kPerThread], row_sum[kPerThread];
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    row_max[i] = -INFINITY;
    row_sum[i] = 0.0F;
  }
  for (std::int64_t k0 = 0; k0 < p.seq; k0 += kTile) {
    __syncthreads();  // the previous block's tiles are read (and o_tile written)
    load_tile<kTcDim, kTcStride>(k_tile, sequence + p.hidden, p.ld_qkv, k0, p.seq, p.head_dim);
    load_tile<kTcDim, kTcStride>(v_tile, sequence + 2 * p.hidden, p.ld_qkv, k0, p.seq, p.head_dim);
    __syncthreads();
    tc_product_to_tile<wmma::row_major, wmma::col_major>(s_tile, q_tile, k_tile);  // Q K^T
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int r = ty + kGrid * i;
      const std::int64_t query = q0 + r;
      float logits[kPerThread];
      float tile_max = -INFINITY;
#pragma unroll
      for (int j = 0; j < kPerThread; ++j) {
        const std::int64_t key = k0 + tx + kGrid * j;
        const float score = s_tile[r * kTcStride + tx + kGrid * j];
        logits[j] = key < p.seq ? masked_logit(p, mask, score, key) : -INFINITY;
        tile_max = fmaxf(tile_max, logits[j]);
      }
      const float new_max = fmaxf(row_max[i], row_max16(tile_max));
      const float correction = expf(row_max[i] - new_max);
      row_max[i] = new_max;
      float partial = 0.0F;
#pragma unroll
      for (int j = 0; j < kPerThread; ++j) {
        const std::int64_t key = k0 + tx + kGrid * j;
        const float e = expf(logits[j] - new_max);
        partial += e;
        float weight = e;
        if (p.dropout) {
          weight = key < p.seq && query < p.seq && keep_element(p, pair, query, key)
                       ? e * p.keep_scale
                       : 0.0F;
        }
        s_tile[r * kTcStride + tx + kGrid * j] = weight;  // only this thread reads or writes it
      }
      row_sum[i] = row_sum[i] * correction + row_sum16(partial);
      // This thread's share of row r of O: columns tx + 16 j (kTcDim / kGrid = kPerThread).
#pragma unroll
      for (int j = 0; j < kPerThread; ++j) o_tile[r * kTcStride + tx + kGrid * j] *= correction;
    }
    __syncthreads();  // weights and rescaled O are whole; O += weights V, two fragments a warp
#pragma unroll
    for (int f = 0; f < kTcFragmentsPerWarp; ++f) {
      const int row_block = warp / 2;
      const int col_block = 2 * (warp % 2) + f;
      float* out = o_tile + row_block * 16 * kTcStride + col_block * 16;
      TcAccumulator acc;
      wmma::load_matrix_sync(acc, out, kTcStride, wmma::mem_row_major);
      tc_product<wmma::row_major, wmma::row_major>(acc, s_tile, v_tile, row_block, col_block);
      wmma::store_matrix_sync(out, acc, kTcStride, wmma::mem_row_major);
    }
  }
  __syncthreads();  // O is whole
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int r = ty + kGrid * i;
    const std::int64_t query = q0 + r;
    if (query >= p.seq) continue;
    const float inverse = 1.0F / row_sum[i];
    float* out = ctx + (b * p.seq + query) * ld_ctx + h * p.head_dim;
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int col = tx + kGrid * j;
      if (col < p.head_dim) out[col] = o_tile[r * kTcStride + col] * inverse;
    }
    if (tx == 0) lse[pair * p.seq + query] = row_max[i] + logf(row_sum[i]);
  }
}

// The backward of flash_backward_kernel with WMMA products: dK and dV accumulate in each warp's
// fragments across the query blocks (no rescaling is needed there), dQ's share goes through a
// staging tile to the partial sums.
__global__ void __launch_bounds__(kFlashThreads)
    flash_backward_tc_kernel(FlashParams p, const float* lse, const float* dctx,
                             std::int64_t ld_dctx, const float* row_dot, float* dq_partials,
                             float* dqkv, std::int64_t ld_dqkv) {
  extern __shared__ __align__(128) float tc_shared[];
  float* k_tile = tc_shared;
  float* v_tile = k_tile + kTcTileFloats;
  float* q_tile = v_tile + kTcTileFloats;
  float* do_tile = q_tile + kTcTileFloats;
  float* p_tile = do_tile + kTcTileFloats;  // Q K^T, then dropout(P) [query][key]
  float* ds_tile = p_tile + kTcTileFloats;  // dO V^T, then dS [query][key]
  float* stage = ds_tile + kTcTileFloats;   // dQ's share [query][dim]; dK, dV at the end
  float* lse_tile = stage + kTcTileFloats;
  float* dot_tile = lse_tile + kTile;
  const int tx = static_cast<int>(threadIdx.x) % kGrid;
  const int ty = static_cast<int>(threadIdx.x) / kGrid;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const std::int64_t key_blocks = p.query_blocks;
  const std::int64_t pair = blockIdx.x / key_blocks;
  const std::int64_t key_block = blockIdx.x % key_blocks;
  const std::int64_t k0 = key_block * kTile;
  const std::int64_t pairs = static_cast<std::int64_t>(gridDim.x) / key_blocks;
  const std::int64_t b = pair / p.heads;
  const std::int64_t h = pair % p.heads;
  const float* sequence = p.qkv + b * p.seq * p.ld_qkv + h * p.head_dim;
  const float* d_out = dctx + b * p.seq * ld_dctx + h * p.head_dim;
  const std::int64_t* mask = p.mask == nullptr ? nullptr : p.mask + b * p.seq;
  load_tile<kTcDim, kTcStride>(k_tile, sequence + p.hidden, p.ld_qkv, k0, p.seq, p.head_dim);
  load_tile<kTcDim, kTcStride>(v_tile, sequence + 2 * p.hidden, p.ld_qkv, k0, p.seq, p.head_dim);
  // dK and dV [key][dim]: this warp's two fragments of each.
  TcAccumulator dk[kTcFragmentsPerWarp], dv[kTcFragmentsPerWarp];
#pragma unroll
  for (int f = 0; f < kTcFragmentsPerWarp; ++f) {
    wmma::fill_fragment(dk[f], 0.0F);
    wmma::fill_fragment(dv[f], 0.0F);
  }
  const int row_block = warp / 2;
  for (std::int64_t q0 = 0; q0 < p.seq; q0 += kTile) {
    __syncthreads();  // the previous query block's tiles are read
    load_tile<kTcDim, kTcStride>(q_tile, sequence, p.ld_qkv, q0, p.seq, p.head_dim);
    load_tile<kTcDim, kTcStride>(do_tile, d_out, ld_dctx, q0, p.seq, p.head_dim);
    for (int r = static_cast<int>(threadIdx.x); r < kTile; r += kFlashThreads) {
      const std::int64_t query = q0 + r;
      lse_tile[r] = query < p.seq ? lse[pair * p.seq + query] : 0.0F;
      dot_tile[r] = query < p.seq ? row_dot[pair * p.seq + query] : 0.0F;
    }
    __syncthreads();
    tc_product_to_tile<wmma::row_major, wmma::col_major>(p_tile, q_tile, k_tile);    // Q K^T
    tc_product_to_tile<wmma::row_major, wmma::col_major>(ds_tile, do_tile, v_tile);  // dO V^T
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int r = ty + kGrid * i;
      const std::int64_t query = q0 + r;
#pragma unroll
      for (int j = 0; j < kPerThread; ++j) {
        const int c = tx + kGrid * j;
        const std::int64_t key = k0 + c;
        float weight = 0.0F;
        float ds = 0.0F;
        if (query < p.seq && key < p.seq) {
          const float prob =
              expf(masked_logit(p, mask, p_tile[r * kTcStride + c], key) - lse_tile[r]);
          float grad = ds_tile[r * kTcStride + c];
          weight = prob;
          if (p.dropout) {
            const bool keep = keep_element(p, pair, query, key);
            weight = keep ? prob * p.keep_scale : 0.0F;
            grad = keep ? grad * p.keep_scale : 0.0F;
          }
          ds = p.scale * prob * (grad - dot_tile[r]);
        }
        p_tile[r * kTcStride + c] = weight;  // only this thread reads or writes these two
        ds_tile[r * kTcStride + c] = ds;
      }
    }
    __syncthreads();  // weights and dS are whole
#pragma unroll
    for (int f = 0; f < kTcFragmentsPerWarp; ++f) {
      const int col_block = 2 * (warp % 2) + f;
      // dV += weights^T dO and dK += dS^T Q (the [query][key] tiles read transposed).
      tc_product<wmma::col_major, wmma::row_major>(dv[f], p_tile, do_tile, row_block, col_block);
      tc_product<wmma::col_major, wmma::row_major>(dk[f], ds_tile, q_tile, row_block, col_block);
    }
    tc_product_to_tile<wmma::row_major, wmma::row_major>(stage, ds_tile, k_tile);  // dS K
    __syncthreads();  // the share of dQ is whole
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int r = ty + kGrid * i;
      const std::int64_t query = q0 + r;
      if (query >= p.seq) continue;
      float* out = dq_partials + ((key_block * pairs + pair) * p.seq + query) * p.head_dim;
#pragma unroll
      for (int j = 0; j < kPerThread; ++j) {
        const int col = tx + kGrid * j;
        if (col < p.head_dim) out[col] = stage[r * kTcStride + col];
      }
    }
  }
// dK, then dV, through the staging tile to dqkv.
#pragma unroll
  for (int which = 0; which < 2; ++which) {
    __syncthreads();  // the stage's previous contents are read
#pragma unroll
    for (int f = 0; f < kTcFragmentsPerWarp; ++f) {
      const int col_block = 2 * (warp % 2) + f;
      wmma::store_matrix_sync(stage + row_block * 16 * kTcStride + col_block * 16,
                              which == 0 ? dk[f] : dv[f], kTcStride, wmma::mem_row_major);
    }
    __syncthreads();
    const std::int64_t column = (which == 0 ? 1 : 2) * p.hidden + h * p.head_dim;
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int r = ty + kGrid * i;
      const std::int64_t key = k0 + r;
      if (key >= p.seq) continue;
      float* row = dqkv + (b * p.seq + key) * ld_dqkv + column;
#pragma unroll
      for (int j = 0; j < kPerThread; ++j) {
        const int col = tx + kGrid * j;
        if (col < p.head_dim) row[col] = stage[r * kTcStride + col];
      }
    }
  }
}

// dQ = the key blocks' partial sums, added in key-block order, into dqkv's query columns.
__global__ void flash_dq_sum_kernel(const float* dq_partials, std::int64_t key_blocks,
                                    std::int64_t pairs, std::int64_t seq, std::int64_t heads,
                                    std::int64_t head_dim, float* dqkv, std::int64_t ld_dqkv) {
  const std::int64_t total = pairs * seq * head_dim;
  for (std::int64_t e = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    float sum = 0.0F;
    for (std::int64_t block = 0; block < key_blocks; ++block) sum += dq_partials[block * total + e];
    const std::int64_t col = e % head_dim;
    const std::int64_t query = (e / head_dim) % seq;
    const std::int64_t pair = e / (head_dim * seq);
    const std::int64_t token = (pair / heads) * seq + query;
    dqkv[token * ld_dqkv + (pair % heads) * head_dim + col] = sum;
  }
}

std::int64_t blocks_of(std::int64_t seq) {
  return (seq + kTile - 1) / kTile;
}

void check_fused_shape(const AttentionShape& shape, const char* op) {
  if (shape.head_dim > kFusedAttentionMaxHeadDim) {
    throw std::invalid_argument(
        std::string(op) +
        ": the fused attention takes head_dim <= " + std::to_string(kFusedAttentionMaxHeadDim) +
        ", got " + std::to_string(shape.head_dim) + " (use AttentionAlgorithm::kBatchedGemm)");
  }
  if (shape.batch * shape.heads * blocks_of(shape.seq) > 0x7FFFFFFF) {
    throw std::invalid_argument(std::string(op) + ": too many (sequence, head) blocks");
  }
}

FlashParams flash_params(const AttentionShape& shape, ConstMatrixView<float> qkv,
                         const std::int64_t* attention_mask, float dropout, std::uint64_t seed) {
  const bool active = dropout > 0.0F;
  return {qkv.data,
          qkv.ld,
          attention_mask,
          shape.seq,
          shape.heads,
          shape.head_dim,
          shape.hidden(),
          blocks_of(shape.seq),
          1.0F / std::sqrt(static_cast<float>(shape.head_dim)),
          active,
          stream_key(seed),
          active ? dropout_threshold(dropout) : 0U,
          active ? 1.0F / (1.0F - dropout) : 1.0F};
}

template <int kDim>
void launch_forward(const FlashParams& params, unsigned blocks, float* lse, MatrixView<float> ctx,
                    cudaStream_t stream) {
  constexpr std::size_t bytes = forward_shared_bytes<kDim>();
  CUDA_CHECK(cudaFuncSetAttribute(flash_forward_kernel<kDim>,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(bytes)));
  flash_forward_kernel<kDim>
      <<<blocks, kFlashThreads, bytes, stream>>>(params, lse, ctx.data, ctx.ld);
  CUDA_CHECK(cudaGetLastError());
}

template <int kDim>
void launch_backward(const FlashParams& params, unsigned blocks, const float* lse,
                     ConstMatrixView<float> dctx, const float* row_dot, float* dq_partials,
                     MatrixView<float> dqkv, cudaStream_t stream) {
  constexpr std::size_t bytes = backward_shared_bytes<kDim>();
  CUDA_CHECK(cudaFuncSetAttribute(flash_backward_kernel<kDim>,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(bytes)));
  flash_backward_kernel<kDim><<<blocks, kFlashThreads, bytes, stream>>>(
      params, lse, dctx.data, dctx.ld, row_dot, dq_partials, dqkv.data, dqkv.ld);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace

std::int64_t fused_attention_saved_size(const AttentionShape& shape) {
  return shape.batch * shape.heads * shape.seq;
}

std::int64_t fused_attention_workspace_size(const AttentionShape& shape) {
  const std::int64_t rows = shape.batch * shape.heads * shape.seq;
  return rows + blocks_of(shape.seq) * rows * shape.head_dim;
}

void fused_attention_forward(const AttentionShape& shape, ConstMatrixView<float> qkv,
                             const std::int64_t* attention_mask, float dropout, std::uint64_t seed,
                             bool tensor_cores, float* log_sum_exp, MatrixView<float> ctx,
                             cudaStream_t stream) {
  check_fused_shape(shape, "cuda::fused_attention_forward");
  const FlashParams params = flash_params(shape, qkv, attention_mask, dropout, seed);
  const auto blocks = static_cast<unsigned>(shape.batch * shape.heads * params.query_blocks);
  if (tensor_cores && shape.head_dim <= kTcDim) {
    CUDA_CHECK(cudaFuncSetAttribute(flash_forward_tc_kernel,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(kTcForwardSharedBytes)));
    flash_forward_tc_kernel<<<blocks, kFlashThreads, kTcForwardSharedBytes, stream>>>(
        params, log_sum_exp, ctx.data, ctx.ld);
    CUDA_CHECK(cudaGetLastError());
  } else if (shape.head_dim <= 64) {
    launch_forward<64>(params, blocks, log_sum_exp, ctx, stream);
  } else {
    launch_forward<128>(params, blocks, log_sum_exp, ctx, stream);
  }
}

void fused_attention_backward(const AttentionShape& shape, ConstMatrixView<float> qkv,
                              const std::int64_t* attention_mask, ConstMatrixView<float> ctx,
                              const float* log_sum_exp, ConstMatrixView<float> dctx, float dropout,
                              std::uint64_t seed, bool tensor_cores, float* workspace,
                              MatrixView<float> dqkv, cudaStream_t stream) {
  check_fused_shape(shape, "cuda::fused_attention_backward");
  const FlashParams params = flash_params(shape, qkv, attention_mask, dropout, seed);
  const std::int64_t pairs = shape.batch * shape.heads;
  const std::int64_t rows = pairs * shape.seq;
  float* row_dot = workspace;
  float* dq_partials = workspace + rows;
  flash_row_dot_kernel<<<warp_rows_grid(rows), kThreads, 0, stream>>>(
      ctx.data, ctx.ld, dctx.data, dctx.ld, pairs, shape.seq, shape.heads, shape.head_dim, row_dot);
  CUDA_CHECK(cudaGetLastError());
  const auto blocks = static_cast<unsigned>(pairs * params.query_blocks);
  if (tensor_cores && shape.head_dim <= kTcDim) {
    CUDA_CHECK(cudaFuncSetAttribute(flash_backward_tc_kernel,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(kTcBackwardSharedBytes)));
    flash_backward_tc_kernel<<<blocks, kFlashThreads, kTcBackwardSharedBytes, stream>>>(
        params, log_sum_exp, dctx.data, dctx.ld, row_dot, dq_partials, dqkv.data, dqkv.ld);
    CUDA_CHECK(cudaGetLastError());
  } else if (shape.head_dim <= 64) {
    launch_backward<64>(params, blocks, log_sum_exp, dctx, row_dot, dq_partials, dqkv, stream);
  } else {
    launch_backward<128>(params, blocks, log_sum_exp, dctx, row_dot, dq_partials, dqkv, stream);
  }
  flash_dq_sum_kernel<<<grid_for(rows * shape.head_dim), kThreads, 0, stream>>>(
      dq_partials, params.query_blocks, pairs, shape.seq, shape.heads, shape.head_dim, dqkv.data,
      dqkv.ld);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace pf::kernels::cuda
