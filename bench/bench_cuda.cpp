// The CUDA ops on a GPU, timed with CUDA events (manual time, the median of the repetitions is
// what docs/benchmarks.md quotes): GEMMs of BERT-Large's shapes in bf16-operands / BF16 / TF32 /
// fp32 (fp32 storage; registered in that order so that a run cut short still compares the bf16
// paths), the bf16-operand product alone and the fp32 -> bf16 conversion alone (the two parts of
// bf16-operands), bf16 storage, attention forward+backward at sequence 128 and 512 (batched
// GEMMs beside the fused kernels), LayerNorm forward+backward. bench/torch_cuda_bench.py times the
// same work in PyTorch.
#include <benchmark/benchmark.h>
#include <cuda_bf16.h>

#include <cstdio>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cuda/cublas_gemm.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/ops_cuda.h"

namespace {

using pf::kernels::AttentionShape;
using pf::kernels::GemmPrecision;
using pf::kernels::MatrixView;
using pf::kernels::Transpose;
namespace cuda = pf::kernels::cuda;

// One backend and one device buffer pool for the whole program.
struct Device {
  cuda::CudaBackend backend{0};
  cuda::CudaStream stream;
};
Device& device() {
  static Device instance;  // the benchmark program's one device context
  return instance;
}

// A device array of `count` floats, normal(0, 1).
struct DeviceArray {
  explicit DeviceArray(std::size_t count, float scale = 1.0F) : bytes(count * sizeof(float)) {
    data = static_cast<float*>(device().backend.allocate(bytes));
    std::vector<float> host(count);
    std::mt19937 rng(static_cast<unsigned>(count));
    std::normal_distribution<float> normal(0.0F, scale);
    for (auto& v : host) v = normal(rng);
    CUDA_CHECK(cudaMemcpy(data, host.data(), bytes, cudaMemcpyHostToDevice));
  }
  ~DeviceArray() { device().backend.deallocate(data, bytes); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  float* data = nullptr;
  std::size_t bytes = 0;
};

// A device array of `count` floats set to zero on the device: outputs and scratch, where
// drawing values on the host would only cost time.
struct DeviceZeros {
  explicit DeviceZeros(std::size_t count) : bytes(count * sizeof(float)) {
    data = static_cast<float*>(device().backend.allocate(bytes));
    CUDA_CHECK(cudaMemset(data, 0, bytes));
  }
  ~DeviceZeros() { device().backend.deallocate(data, bytes); }
  DeviceZeros(const DeviceZeros&) = delete;
  DeviceZeros& operator=(const DeviceZeros&) = delete;
  float* data = nullptr;
  std::size_t bytes = 0;
};

// One array of each size for the GEMM benchmarks, filled once: drawing 16M normal values on the
// host takes about a second, which a session's time limit cannot spend per benchmark.
DeviceArray& shared_array(std::size_t count) {
  static std::map<std::size_t, std::unique_ptr<DeviceArray>> arrays;  // the program's lifetime
  auto& slot = arrays[count];
  if (!slot) slot = std::make_unique<DeviceArray>(count);
  return *slot;
}

// Times `body` with CUDA events on the benchmark stream: each iteration runs it `inner` times.
template <typename Body>
void time_on_gpu(benchmark::State& state, int inner, Body&& body) {
  cudaStream_t stream = device().stream.get();
  cudaEvent_t start = nullptr;
  cudaEvent_t stop = nullptr;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < 3; ++i) body();  // warm-up (cuBLAS heuristics, scratch growth)
  CUDA_CHECK(cudaStreamSynchronize(stream));
  for (auto _ : state) {
    CUDA_CHECK(cudaEventRecord(start, stream));
    for (int i = 0; i < inner; ++i) body();
    CUDA_CHECK(cudaEventRecord(stop, stream));
    CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0.0F;
    CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    state.SetIterationTime(1e-3 * ms / inner);
  }
  CUDA_CHECK(cudaEventDestroy(start));
  CUDA_CHECK(cudaEventDestroy(stop));
}

// C [m, n] = A [m, k] B[n, k]^T (a Linear forward: x W^T).
void BM_Gemm(benchmark::State& state) {
  const auto m = state.range(0), n = state.range(1), k = state.range(2);
  const auto precision = static_cast<GemmPrecision>(state.range(3));
  DeviceArray& a = shared_array(static_cast<std::size_t>(m * k));
  DeviceArray& b = shared_array(static_cast<std::size_t>(n * k));
  DeviceArray& c = shared_array(static_cast<std::size_t>(m * n));
  cuda::CudaOps ops(device().backend, &device().stream, precision);
  time_on_gpu(state, 10, [&] {
    ops.gemm({a.data, m, k}, Transpose::kNo, {b.data, n, k}, Transpose::kYes, {c.data, m, n}, 1.0F,
             0.0F);
  });
  const double flops = 2.0 * static_cast<double>(m * n * k);
  state.counters["TFLOP/s"] =
      benchmark::Counter(flops * 1e-12, benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(std::string(pf::kernels::to_string(precision)));
}

// bf16-operands' product alone: bf16 A and B converted before the timing, fp32 C, fp32
// accumulation. BM_Gemm's bf16-operands minus this is the conversions' cost, the most a cached
// bf16 copy of the weights (B) could save with BM_ConvertToBf16 of B's shape.
void BM_GemmBf16OperandsProductOnly(benchmark::State& state) {
  const auto m = state.range(0), n = state.range(1), k = state.range(2);
  auto& backend = device().backend;
  cudaStream_t stream = device().stream.get();
  const auto bf16_bytes = [](std::int64_t count) { return static_cast<std::size_t>(count) * 2; };
  auto* a = static_cast<__nv_bfloat16*>(backend.allocate(bf16_bytes(m * k)));
  auto* b = static_cast<__nv_bfloat16*>(backend.allocate(bf16_bytes(n * k)));
  cuda::convert_to_bf16({shared_array(static_cast<std::size_t>(m * k)).data, m, k}, 0, 1, {a, m, k},
                        0, stream);
  cuda::convert_to_bf16({shared_array(static_cast<std::size_t>(n * k)).data, n, k}, 0, 1, {b, n, k},
                        0, stream);
  DeviceArray& c = shared_array(static_cast<std::size_t>(m * n));
  cuda::CublasHandle handle;
  handle.set_stream(stream);
  time_on_gpu(state, 10, [&] {
    cuda::gemm_bf16_operands(handle, {a, m, k}, Transpose::kNo, {b, n, k}, Transpose::kYes,
                             {c.data, m, n}, 1.0F, 0.0F);
  });
  state.counters["TFLOP/s"] = benchmark::Counter(2.0 * static_cast<double>(m * n * k) * 1e-12,
                                                 benchmark::Counter::kIsIterationInvariantRate);
  CUDA_CHECK(cudaStreamSynchronize(stream));
  backend.deallocate(a, bf16_bytes(m * k));
  backend.deallocate(b, bf16_bytes(n * k));
}

// One fp32 -> bf16 conversion of a packed rows x cols matrix (reads 4, writes 2 bytes an
// element).
void BM_ConvertToBf16(benchmark::State& state) {
  const auto rows = state.range(0), cols = state.range(1);
  auto& backend = device().backend;
  cudaStream_t stream = device().stream.get();
  const auto count = static_cast<std::size_t>(rows * cols);
  auto* out = static_cast<__nv_bfloat16*>(backend.allocate(count * 2));
  const float* in = shared_array(count).data;
  time_on_gpu(state, 10, [&] {
    cuda::convert_to_bf16({in, rows, cols}, 0, 1, {out, rows, cols}, 0, stream);
  });
  state.counters["GB/s"] = benchmark::Counter(6.0 * static_cast<double>(count),
                                              benchmark::Counter::kIsIterationInvariantRate);
  CUDA_CHECK(cudaStreamSynchronize(stream));
  backend.deallocate(out, count * 2);
}

// bf16 storage, fp32 accumulation (what autocast runs).
void BM_GemmBf16Storage(benchmark::State& state) {
  const auto m = state.range(0), n = state.range(1), k = state.range(2);
  auto& backend = device().backend;
  const auto bytes = [](std::int64_t count) { return static_cast<std::size_t>(count) * 2; };
  void* a = backend.allocate(bytes(m * k));
  void* b = backend.allocate(bytes(n * k));
  void* c = backend.allocate(bytes(m * n));
  CUDA_CHECK(cudaMemset(a, 0x3C, bytes(m * k)));  // 0x3C3C: about 0.0115 in bf16
  CUDA_CHECK(cudaMemset(b, 0x3C, bytes(n * k)));
  cuda::CublasHandle handle;
  handle.set_stream(device().stream.get());
  time_on_gpu(state, 10, [&] {
    cuda::gemm_bf16(handle, a, m, k, Transpose::kNo, b, n, k, Transpose::kYes, c, m, n);
  });
  state.counters["TFLOP/s"] = benchmark::Counter(2.0 * static_cast<double>(m * n * k) * 1e-12,
                                                 benchmark::Counter::kIsIterationInvariantRate);
  backend.deallocate(a, bytes(m * k));
  backend.deallocate(b, bytes(n * k));
  backend.deallocate(c, bytes(m * n));
}

// Attention core forward + backward (BERT-Large heads: 16 x 64), with the padding mask and
// dropout 0.1 on the probabilities; arguments batch, seq, GemmPrecision, AttentionAlgorithm
// (0 batched GEMMs, 1 fused). The fused kernels use fp32 FMA under fp32 and TF32 tensor cores
// under the other precisions.
void BM_AttentionForwardBackward(benchmark::State& state) {
  const AttentionShape shape{state.range(0), state.range(1), 16, 64};
  const auto precision = static_cast<GemmPrecision>(state.range(2));
  const auto algorithm = static_cast<pf::kernels::AttentionAlgorithm>(state.range(3));
  const std::int64_t tokens = shape.tokens(), hidden = shape.hidden();
  cuda::CudaOps ops(device().backend, &device().stream, precision, algorithm);
  // The inputs drawn once per size for the whole program (16 instances x repetitions would
  // otherwise spend most of a session's limit drawing them), the outputs zeroed on the device.
  const DeviceArray& qkv = shared_array(static_cast<std::size_t>(tokens * 3 * hidden));
  const DeviceArray& dctx = shared_array(static_cast<std::size_t>(tokens * hidden));
  DeviceZeros ctx(static_cast<std::size_t>(tokens * hidden)),
      dqkv(static_cast<std::size_t>(tokens * 3 * hidden)),
      saved(static_cast<std::size_t>(ops.attention_saved_size(shape))),
      work(static_cast<std::size_t>(ops.attention_workspace_size(shape)));
  std::vector<std::int64_t> mask(static_cast<std::size_t>(tokens), 1);
  auto* d_mask = static_cast<std::int64_t*>(device().backend.allocate(mask.size() * 8));
  CUDA_CHECK(cudaMemcpy(d_mask, mask.data(), mask.size() * 8, cudaMemcpyHostToDevice));
  time_on_gpu(state, 5, [&] {
    ops.attention_forward(shape, {qkv.data, tokens, 3 * hidden}, d_mask, 0.1F, 1, saved.data,
                          work.data, {ctx.data, tokens, hidden});
    ops.attention_backward(shape, {qkv.data, tokens, 3 * hidden}, d_mask,
                           {ctx.data, tokens, hidden}, saved.data, {dctx.data, tokens, hidden},
                           0.1F, 1, work.data, {dqkv.data, tokens, 3 * hidden});
  });
  // 2 products forward, 4 backward, each 2 B N S^2 D (the fused backward's recomputation of
  // Q K^T is not counted: the rate compares the two algorithms on the same work).
  const double flops = 6.0 * 2.0 * static_cast<double>(shape.batch * shape.heads) *
                       static_cast<double>(shape.seq * shape.seq * shape.head_dim);
  state.counters["TFLOP/s"] =
      benchmark::Counter(flops * 1e-12, benchmark::Counter::kIsIterationInvariantRate);
  // What the forward keeps for the backward (per micro-batch and layer in the model).
  state.counters["saved_MiB"] =
      static_cast<double>(ops.attention_saved_size(shape)) * 4.0 / (1024.0 * 1024.0);
  state.SetLabel(std::string(pf::kernels::to_string(precision)) + " " +
                 std::string(pf::kernels::to_string(algorithm)));
  device().backend.deallocate(d_mask, mask.size() * 8);
}

void BM_LayerNormForwardBackward(benchmark::State& state) {
  const auto rows = state.range(0), cols = state.range(1);
  cuda::CudaOps ops(device().backend, &device().stream);
  const auto size = static_cast<std::size_t>(rows * cols);
  DeviceArray x(size), y(size), dy(size), dx(size), gamma(static_cast<std::size_t>(cols)),
      beta(static_cast<std::size_t>(cols)), dgamma(static_cast<std::size_t>(cols)),
      dbeta(static_cast<std::size_t>(cols)), mean(static_cast<std::size_t>(rows)),
      rstd(static_cast<std::size_t>(rows));
  time_on_gpu(state, 10, [&] {
    ops.layernorm_forward({x.data, rows, cols}, gamma.data, beta.data, 1e-12F, {y.data, rows, cols},
                          mean.data, rstd.data);
    ops.layernorm_backward({x.data, rows, cols}, {dy.data, rows, cols}, gamma.data, mean.data,
                           rstd.data, {dx.data, rows, cols}, dgamma.data, dbeta.data);
  });
  // Bytes: forward reads x, writes y; backward reads x, dy, writes dx (and reads them for sums).
  state.counters["GB/s"] = benchmark::Counter(7.0 * static_cast<double>(size) * 4.0,
                                              benchmark::Counter::kIsIterationInvariantRate);
}

// One BERT-Large encoder layer (hidden 1024, 16 heads, FFN 4096), B = 32, S = 128, dropout 0.1,
// forward + backward through CudaOps, the sequence of ops of runtime/model's layer: fused QKV,
// attention, output projection, dropout + residual, LayerNorm, FFN with bias+GELU, dropout +
// residual, LayerNorm; the backward in reverse (parameter gradients accumulated).
void BM_BertLayerForwardBackward(benchmark::State& state) {
  const auto precision = static_cast<GemmPrecision>(state.range(0));
  const auto algorithm = static_cast<pf::kernels::AttentionAlgorithm>(state.range(1));
  const std::int64_t B = 32, S = 128, H = 1024, N = 16, I = 4096, T = B * S;
  const AttentionShape shape{B, S, N, H / N};
  cuda::CudaOps ops(device().backend, &device().stream, precision, algorithm);
  const auto n = [](std::int64_t count) { return static_cast<std::size_t>(count); };
  DeviceArray w_qkv(n(3 * H * H), 0.02F), b_qkv(n(3 * H)), w_o(n(H * H), 0.02F), b_o(n(H)),
      w_i(n(I * H), 0.02F), b_i(n(I)), w_out(n(H * I), 0.02F), b_out(n(H)), g1(n(H)), be1(n(H)),
      g2(n(H)), be2(n(H));
  DeviceArray dw_qkv(n(3 * H * H)), db_qkv(n(3 * H)), dw_o(n(H * H)), db_o(n(H)), dw_i(n(I * H)),
      db_i(n(I)), dw_out(n(H * I)), db_out(n(H)), dg1(n(H)), dbe1(n(H)), dg2(n(H)), dbe2(n(H));
  DeviceArray x(n(T * H)), qkv(n(T * 3 * H)), probs(n(ops.attention_saved_size(shape))),
      work(n(ops.attention_workspace_size(shape))), ctx(n(T * H)), h1_pre(n(T * H)), h1(n(T * H)),
      mean1(n(T)), rstd1(n(T)), ffn_pre(n(T * I)), act(n(T * I)), h2_pre(n(T * H)), y(n(T * H)),
      mean2(n(T)), rstd2(n(T)), dy(n(T * H)), d_h2(n(T * H)), d_tmp(n(T * H)), d_act(n(T * I)),
      d_h1(n(T * H)), d_ctx(n(T * H)), d_qkv(n(T * 3 * H)), dx(n(T * H));
  std::vector<std::int64_t> mask(n(T), 1);
  auto* d_mask = static_cast<std::int64_t*>(device().backend.allocate(mask.size() * 8));
  CUDA_CHECK(cudaMemcpy(d_mask, mask.data(), mask.size() * 8, cudaMemcpyHostToDevice));
  const auto m = [](DeviceArray& a, std::int64_t rows, std::int64_t cols) {
    return MatrixView<float>(a.data, rows, cols);
  };
  const float p = 0.1F;
  time_on_gpu(state, 3, [&] {
    // forward
    ops.linear_forward(m(x, T, H), m(w_qkv, 3 * H, H), b_qkv.data, m(qkv, T, 3 * H));
    ops.attention_forward(shape, m(qkv, T, 3 * H), d_mask, p, 1, probs.data, work.data,
                          m(ctx, T, H));
    ops.linear_forward(m(ctx, T, H), m(w_o, H, H), b_o.data, m(h1_pre, T, H));
    ops.dropout_add_forward(m(h1_pre, T, H), m(x, T, H), m(h1_pre, T, H), p, 2);
    ops.layernorm_forward(m(h1_pre, T, H), g1.data, be1.data, 1e-12F, m(h1, T, H), mean1.data,
                          rstd1.data);
    ops.linear_forward(m(h1, T, H), m(w_i, I, H), nullptr, m(ffn_pre, T, I));
    ops.bias_gelu_forward(m(ffn_pre, T, I), b_i.data, m(act, T, I));
    ops.linear_forward(m(act, T, I), m(w_out, H, I), b_out.data, m(h2_pre, T, H));
    ops.dropout_add_forward(m(h2_pre, T, H), m(h1, T, H), m(h2_pre, T, H), p, 3);
    ops.layernorm_forward(m(h2_pre, T, H), g2.data, be2.data, 1e-12F, m(y, T, H), mean2.data,
                          rstd2.data);
    // backward
    ops.layernorm_backward(m(h2_pre, T, H), m(dy, T, H), g2.data, mean2.data, rstd2.data,
                           m(d_h2, T, H), dg2.data, dbe2.data);
    ops.dropout_backward(m(d_h2, T, H), m(d_tmp, T, H), p, 3, 0);
    ops.linear_backward(m(act, T, I), m(w_out, H, I), m(d_tmp, T, H), m(d_act, T, I),
                        m(dw_out, H, I), db_out.data);
    ops.gelu_backward(m(ffn_pre, T, I), m(d_act, T, I), m(d_act, T, I));
    ops.linear_backward(m(h1, T, H), m(w_i, I, H), m(d_act, T, I), m(d_h1, T, H), m(dw_i, I, H),
                        db_i.data);
    ops.accumulate(m(d_h2, T, H), m(d_h1, T, H));
    ops.layernorm_backward(m(h1_pre, T, H), m(d_h1, T, H), g1.data, mean1.data, rstd1.data,
                           m(d_h1, T, H), dg1.data, dbe1.data);
    ops.dropout_backward(m(d_h1, T, H), m(d_tmp, T, H), p, 2, 0);
    ops.linear_backward(m(ctx, T, H), m(w_o, H, H), m(d_tmp, T, H), m(d_ctx, T, H), m(dw_o, H, H),
                        db_o.data);
    ops.attention_backward(shape, m(qkv, T, 3 * H), d_mask, m(ctx, T, H), probs.data,
                           m(d_ctx, T, H), p, 1, work.data, m(d_qkv, T, 3 * H));
    ops.linear_backward(m(x, T, H), m(w_qkv, 3 * H, H), m(d_qkv, T, 3 * H), m(dx, T, H),
                        m(dw_qkv, 3 * H, H), db_qkv.data);
    ops.accumulate(m(d_h1, T, H), m(dx, T, H));
  });
  const double flops =
      3.0 * (2.0 * static_cast<double>(T) * (H * 3 * H + H * H + 2 * H * I) +
             4.0 * static_cast<double>(B * N) * static_cast<double>(S * S * (H / N)));
  state.counters["TFLOP/s"] =
      benchmark::Counter(flops * 1e-12, benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(std::string(pf::kernels::to_string(precision)) + " " +
                 std::string(pf::kernels::to_string(algorithm)));
  device().backend.deallocate(d_mask, mask.size() * 8);
}

constexpr int kFp32 = static_cast<int>(GemmPrecision::kFp32);
constexpr int kTf32 = static_cast<int>(GemmPrecision::kTf32);
constexpr int kBf16 = static_cast<int>(GemmPrecision::kBf16);
constexpr int kBf16Operands = static_cast<int>(GemmPrecision::kBf16Operands);

// BERT-Large, 32 x 128 tokens: QKV (3072 x 1024), FFN in (4096 x 1024), FFN out (1024 x 4096).
void gemm_shapes(benchmark::internal::Benchmark* b) {
  // The bf16 paths first: the comparison a time-limited run must not lose.
  for (const int p : {kBf16Operands, kBf16, kTf32, kFp32}) {
    b->Args({4096, 3072, 1024, p});
    b->Args({4096, 4096, 1024, p});
    b->Args({4096, 1024, 4096, p});
  }
}

BENCHMARK(BM_Gemm)->Apply(gemm_shapes)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_GemmBf16OperandsProductOnly)
    ->Args({4096, 3072, 1024})
    ->Args({4096, 4096, 1024})
    ->Args({4096, 1024, 4096})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
// The products' operands: activations 4096 x 1024 and 4096 x 4096, weights 3072 x 1024 and
// 1024 x 4096.
BENCHMARK(BM_ConvertToBf16)
    ->Args({4096, 1024})
    ->Args({4096, 4096})
    ->Args({3072, 1024})
    ->Args({1024, 4096})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_GemmBf16Storage)
    ->Args({4096, 3072, 1024})
    ->Args({4096, 4096, 1024})
    ->Args({4096, 1024, 4096})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
// Batched GEMMs and fused beside each other per precision: BERT-Large's 32 x 128 tokens, and
// the same 4096 tokens as 8 x 512.
void attention_shapes(benchmark::internal::Benchmark* b) {
  constexpr int kBatched = static_cast<int>(pf::kernels::AttentionAlgorithm::kBatchedGemm);
  constexpr int kFused = static_cast<int>(pf::kernels::AttentionAlgorithm::kFused);
  for (const auto& [batch, seq] : {std::pair{32, 128}, std::pair{8, 512}}) {
    for (const int p : {kFp32, kTf32, kBf16, kBf16Operands}) {
      b->Args({batch, seq, p, kBatched});
      b->Args({batch, seq, p, kFused});
    }
  }
}
BENCHMARK(BM_AttentionForwardBackward)
    ->Apply(attention_shapes)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
// Arguments: GemmPrecision, AttentionAlgorithm (0 batched, 1 fused).
BENCHMARK(BM_BertLayerForwardBackward)
    ->Args({kFp32, 0})
    ->Args({kTf32, 0})
    ->Args({kTf32, 1})
    ->Args({kBf16, 0})
    ->Args({kBf16, 1})
    ->Args({kBf16Operands, 0})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_LayerNormForwardBackward)
    ->Args({4096, 1024})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

}  // namespace

int main(int argc, char** argv) {
  if (cuda::device_count() == 0) {
    std::printf("bench_cuda: no CUDA device, nothing measured\n");
    return 0;
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
