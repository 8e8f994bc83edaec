// BertChunk on a GPU, timed with CUDA events: forward + backward (fused, dropout 0.1) of one
// pipeline stage of BERT-Large (24 layers / 8 stages = 3 encoder layers, hidden 1024, 16 heads),
// micro-batch 32 x sequence 128, in fp32 / TF32 / BF16 / bf16-operands matrix products, through
// the model code the runtime executes (not a hand-written op sequence as bench_cuda's layer).
// TFLOP/s counts the GEMM and attention-product flops (3x the forward's); MFU = TFLOP/s / the
// device's peak.
#include <benchmark/benchmark.h>

#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_check.h"
#include "runtime/model/batch.h"
#include "runtime/model/bert_chunk.h"
#include "runtime/tensor/tensor.h"

namespace {

namespace cuda = pf::kernels::cuda;
using pf::kernels::GemmPrecision;

struct Device {
  cuda::CudaBackend backend{0};
  cuda::CudaStream stream;
};
Device& device() {
  static Device instance;  // the benchmark program's one device context
  return instance;
}

pf::tensor::Tensor random_device(std::int64_t rows, std::int64_t cols, float scale) {
  std::vector<float> host(static_cast<std::size_t>(rows * cols));
  std::mt19937 rng(static_cast<unsigned>(host.size()));
  std::normal_distribution<float> normal(0.0F, scale);
  for (auto& v : host) v = normal(rng);
  auto tensor = pf::tensor::Tensor::empty(device().backend, {rows, cols}, pf::tensor::DType::kF32);
  device().backend.copy(tensor.raw_data(), host.data(), host.size() * sizeof(float),
                        pf::tensor::CopyKind::kHostToDevice);
  return tensor;
}

void BM_BertStageForwardBackward(benchmark::State& state) {
  const auto precision = static_cast<GemmPrecision>(state.range(0));
  const auto config = pf::model::bert_preset("large");
  const int layers = 3;
  const std::int64_t B = 32, S = 128, H = config.hidden_size, I = config.intermediate_size;
  const std::int64_t N = config.num_heads, T = B * S;
  pf::model::BertChunk<float> chunk(config, {8, layers, false, false}, device().backend,
                                    &device().stream, precision);
  chunk.init_weights(1);
  const auto batch = pf::model::make_random_batch(config, B, S, 20, 1);
  const auto input = random_device(T, H, 1.0F);
  const auto grad_output = random_device(T, H, 1e-3F);
  auto grad_input = pf::tensor::Tensor::empty(device().backend, {T, H}, pf::tensor::DType::kF32);
  pf::model::ForwardOptions options;
  options.seed = 7;
  const auto step = [&] {
    chunk.forward(0, batch, {input.data<float>(), T, H}, options);
    chunk.backward(0, {grad_output.data<float>(), T, H}, {grad_input.data<float>(), T, H});
  };
  cudaStream_t stream = device().stream.get();
  cudaEvent_t start = nullptr;
  cudaEvent_t stop = nullptr;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < 2; ++i) step();  // warm-up: arenas, cuBLAS heuristics
  CUDA_CHECK(cudaStreamSynchronize(stream));
  for (auto _ : state) {
    CUDA_CHECK(cudaEventRecord(start, stream));
    step();
    CUDA_CHECK(cudaEventRecord(stop, stream));
    CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0.0F;
    CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    state.SetIterationTime(1e-3 * ms);
  }
  CUDA_CHECK(cudaEventDestroy(start));
  CUDA_CHECK(cudaEventDestroy(stop));
  const double per_layer =
      2.0 * static_cast<double>(T) * static_cast<double>(H * 3 * H + H * H + 2 * H * I) +
      4.0 * static_cast<double>(B * N) * static_cast<double>(S * S * (H / N));
  state.counters["TFLOP/s"] = benchmark::Counter(3.0 * layers * per_layer * 1e-12,
                                                 benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(std::string(pf::kernels::to_string(precision)));
}

BENCHMARK(BM_BertStageForwardBackward)
    ->Arg(static_cast<int>(GemmPrecision::kFp32))
    ->Arg(static_cast<int>(GemmPrecision::kTf32))
    ->Arg(static_cast<int>(GemmPrecision::kBf16))
    ->Arg(static_cast<int>(GemmPrecision::kBf16Operands))
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace

int main(int argc, char** argv) {
  if (cuda::device_count() == 0) {
    std::printf("bench_model_cuda: no CUDA device, nothing measured\n");
    return 0;
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
