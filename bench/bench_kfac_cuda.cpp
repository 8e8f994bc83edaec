// K-FAC and the fused optimizers on a GPU, timed with CUDA events: damped inversion of one
// factor (cuSOLVER Cholesky potrf + potri, and the syevd eigen path) at d = 768, 1024, 3072, 4096,
// the same as a divided chain (InverseChainCuda: whole, and in 8 pieces as a refresh runs it),
// curvature x^T x of T = 4096 tokens (cuBLAS SYRK), preconditioning of BERT-Large's 1024 x 1024
// and 4096 x 1024 weights, and one optimizer step over a BERT-Large encoder layer's parameters.
// bench/torch_cuda_bench.py --only kfac,optim times the same in PyTorch.
#include <benchmark/benchmark.h>

#include <cstdio>
#include <random>
#include <vector>

#include "kernels/cuda/cuda_check.h"
#include "kfac/cuda/inverse_chain_cuda.h"
#include "kfac/cuda/kfac_cuda.h"
#include "runtime/optim/cuda/fused_optimizers.h"

namespace {

namespace kcuda = pf::kernels::cuda;
using pf::kfac::InverseMethod;
using pf::kfac::cuda::KfacCuda;

struct Device {
  kcuda::CudaBackend backend{0};
  kcuda::CudaStream stream;
};
Device& device() {
  static Device instance;  // the benchmark program's one device context
  return instance;
}

struct DeviceArray {
  explicit DeviceArray(std::size_t count) : bytes(count * sizeof(float)) {
    data = static_cast<float*>(device().backend.allocate(bytes));
    std::vector<float> host(count);
    std::mt19937 rng(static_cast<unsigned>(count));
    std::normal_distribution<float> normal(0.0F, 1.0F);
    for (auto& v : host) v = normal(rng);
    CUDA_CHECK(cudaMemcpy(data, host.data(), bytes, cudaMemcpyHostToDevice));
  }
  ~DeviceArray() { device().backend.deallocate(data, bytes); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  float* data = nullptr;
  std::size_t bytes = 0;
};

template <typename Body>
void time_on_gpu(benchmark::State& state, int inner, Body&& body) {
  cudaStream_t stream = device().stream.get();
  cudaEvent_t start = nullptr;
  cudaEvent_t stop = nullptr;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < 2; ++i) body();
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

// A full-rank SPD factor like bench_kfac's: the Gram matrix of 256 random rows plus a ramp.
void make_factor(KfacCuda& kfac, float* factor, std::int64_t d) {
  DeviceArray rows(static_cast<std::size_t>(256 * d));
  CUDA_CHECK(cudaMemsetAsync(factor, 0, static_cast<std::size_t>(d * d) * sizeof(float),
                             device().stream.get()));
  kfac.add_gram_lower(factor, d, rows.data, 256, 1.0F / 256.0F);
  kfac.fill_upper_from_lower(factor, d);
  std::vector<float> ramp(static_cast<std::size_t>(d * d), 0.0F);
  for (std::int64_t i = 0; i < d; ++i) {
    ramp[static_cast<std::size_t>(i * d + i)] =
        0.01F + 0.99F * static_cast<float>(i) / static_cast<float>(d);
  }
  DeviceArray diagonal(ramp.size());
  CUDA_CHECK(cudaMemcpy(diagonal.data, ramp.data(), diagonal.bytes, cudaMemcpyHostToDevice));
  kfac.blend(factor, diagonal.data, d, 1.0F, 1.0F);
  CUDA_CHECK(cudaStreamSynchronize(device().stream.get()));
}

void BM_Inverse(benchmark::State& state) {
  const auto d = state.range(0);
  const auto method = state.range(1) == 0 ? InverseMethod::kCholesky : InverseMethod::kEigen;
  KfacCuda kfac(device().backend, &device().stream);
  DeviceArray factor(static_cast<std::size_t>(d * d)), inverse(static_cast<std::size_t>(d * d));
  make_factor(kfac, factor.data, d);
  time_on_gpu(state, method == InverseMethod::kEigen ? 1 : 3, [&] {
    const auto result = kfac.damped_inverse(factor.data, d, 1e-3F, method, inverse.data, "bench");
    if (result.fell_back_to_eigen) state.SkipWithError("Cholesky fell back");
  });
  state.SetLabel(method == InverseMethod::kEigen ? "syevd" : "potrf+potri");
}

// The divided inversion (kfac/inverse_chain.h's steps on the GPU) against potrf + potri: its
// cost of dividing (blocked steps, one host wait per chain) beside BM_Inverse's figure. Arg 1:
// the pieces (1: the chain whole; 8: eight equal shares of its FLOPs, as a refresh's bubbles
// take them).
void BM_InverseChain(benchmark::State& state) {
  const auto d = state.range(0);
  const auto pieces = static_cast<int>(state.range(1));
  KfacCuda kfac(device().backend, &device().stream);
  DeviceArray factor(static_cast<std::size_t>(d * d));
  make_factor(kfac, factor.data, d);
  time_on_gpu(state, 3, [&] {
    pf::kfac::cuda::InverseChainCuda chain(kfac, factor.data, d, 1e-3F, "bench");
    for (int p = 0; p < pieces; ++p) {
      chain.run(pf::kfac::kPieceUnits * p / pieces, pf::kfac::kPieceUnits * (p + 1) / pieces);
    }
    if (chain.take().status.fell_back_to_eigen) state.SkipWithError("Cholesky fell back");
  });
  state.SetLabel(std::to_string(pieces) + (pieces == 1 ? " piece" : " pieces"));
}

void BM_Curvature(benchmark::State& state) {
  const auto d = state.range(0);
  const std::int64_t tokens = 4096;
  KfacCuda kfac(device().backend, &device().stream);
  DeviceArray x(static_cast<std::size_t>(tokens * d)), sum(static_cast<std::size_t>(d * d));
  time_on_gpu(state, 5, [&] { kfac.add_gram_lower(sum.data, d, x.data, tokens, 1.0F / 4096); });
  // SYRK does half the products of a full x^T x; the rate counts the full 2 T d^2.
  state.counters["TFLOP/s"] = benchmark::Counter(2.0 * static_cast<double>(tokens * d * d) * 1e-12,
                                                 benchmark::Counter::kIsIterationInvariantRate);
}

// The curvature divided by token blocks, as the pass's pieces run it (each piece a SYRK over
// its rows into the same sum): arg 1 the pieces (1: whole). With BM_InverseChain and
// BM_PreconditionRows, (t(8) - t(1)) / 7 is what a piece costs beyond its share of the work:
// the per-task overhead the cost models charge every piece (kfac_task_overhead_s, 10 us by
// default, docs/pipefisher.md).
void BM_CurvaturePieces(benchmark::State& state) {
  const auto d = state.range(0);
  const auto pieces = state.range(1);
  const std::int64_t tokens = 4096;
  KfacCuda kfac(device().backend, &device().stream);
  DeviceArray x(static_cast<std::size_t>(tokens * d)), sum(static_cast<std::size_t>(d * d));
  time_on_gpu(state, 5, [&] {
    for (std::int64_t p = 0; p < pieces; ++p) {
      const std::int64_t begin = tokens * p / pieces, end = tokens * (p + 1) / pieces;
      kfac.add_gram_lower(sum.data, d, x.data + begin * d, end - begin, 1.0F / 4096);
    }
  });
  state.SetLabel(std::to_string(pieces) + (pieces == 1 ? " piece" : " pieces"));
}

// The preconditioning divided by gradient rows (KfacCuda::precondition_rows, as the executor's
// pieces run it): arg 2 the pieces.
void BM_PreconditionRows(benchmark::State& state) {
  const auto d_out = state.range(0), d_in = state.range(1);
  const auto pieces = static_cast<int>(state.range(2));
  KfacCuda kfac(device().backend, &device().stream);
  DeviceArray a_inv(static_cast<std::size_t>(d_in * d_in)),
      b_inv(static_cast<std::size_t>(d_out * d_out)), grad(static_cast<std::size_t>(d_out * d_in)),
      bias(static_cast<std::size_t>(d_out)), out(static_cast<std::size_t>(d_out * d_in)),
      out_bias(static_cast<std::size_t>(d_out));
  time_on_gpu(state, 5, [&] {
    for (int p = 0; p < pieces; ++p) {
      kfac.precondition_rows(a_inv.data, b_inv.data, grad.data, bias.data, d_out, d_in,
                             pf::kfac::kPieceUnits * p / pieces,
                             pf::kfac::kPieceUnits * (p + 1) / pieces, out.data, out_bias.data);
    }
  });
  state.SetLabel(std::to_string(pieces) + (pieces == 1 ? " piece" : " pieces"));
}

void BM_Precondition(benchmark::State& state) {
  const auto d_out = state.range(0), d_in = state.range(1);
  KfacCuda kfac(device().backend, &device().stream);
  DeviceArray a_inv(static_cast<std::size_t>(d_in * d_in)),
      b_inv(static_cast<std::size_t>(d_out * d_out)), grad(static_cast<std::size_t>(d_out * d_in)),
      bias(static_cast<std::size_t>(d_out));
  time_on_gpu(state, 5, [&] {
    kfac.precondition(a_inv.data, b_inv.data, grad.data, bias.data, d_out, d_in, grad.data,
                      bias.data);
  });
  state.counters["TFLOP/s"] = benchmark::Counter(
      2.0 * static_cast<double>(d_out * d_in) * static_cast<double>(d_out + d_in) * 1e-12,
      benchmark::Counter::kIsIterationInvariantRate);
}

// One BERT-Large encoder layer's parameters: QKV, output, FFN in/out weights and biases, two
// LayerNorms (12.6 M values).
std::vector<std::int64_t> layer_sizes() {
  return {3 * 1024 * 1024, 3 * 1024, 1024 * 1024, 1024, 1024, 1024,
          4096 * 1024,     4096,     1024 * 4096, 1024, 1024, 1024};
}

void BM_OptimizerStep(benchmark::State& state) {
  const auto which = state.range(0);
  std::vector<std::unique_ptr<DeviceArray>> storage;
  std::vector<pf::optim::ParamView> params;
  int index = 0;
  for (const auto size : layer_sizes()) {
    storage.push_back(std::make_unique<DeviceArray>(static_cast<std::size_t>(size)));
    storage.push_back(std::make_unique<DeviceArray>(static_cast<std::size_t>(size)));
    params.push_back({"p" + std::to_string(index++),
                      storage[storage.size() - 2]->data,
                      storage.back()->data,
                      static_cast<std::size_t>(size),
                      {size},
                      size <= 4096});
  }
  auto& backend = device().backend;
  pf::optim::cuda::CudaAdamW adamw(backend, &device().stream);
  pf::optim::cuda::CudaLamb lamb(backend, &device().stream);
  pf::optim::cuda::CudaSgd sgd(backend, &device().stream);
  time_on_gpu(state, 10, [&] {
    if (which == 0) adamw.step(params, 1e-4F);
    if (which == 1) lamb.step(params, 1e-4F, 1.0);  // a given global norm: no host wait
    if (which == 2) sgd.step(params, 1e-4F);
  });
  state.SetLabel(which == 0 ? "AdamW" : which == 1 ? "LAMB" : "SGD momentum");
}

BENCHMARK(BM_Inverse)
    ->ArgsProduct({{768, 1024, 3072, 4096}, {0, 1}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_InverseChain)
    ->ArgsProduct({{768, 1024, 3072, 4096}, {1, 8}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_Curvature)
    ->Arg(768)
    ->Arg(1024)
    ->Arg(3072)
    ->Arg(4096)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_CurvaturePieces)
    ->ArgsProduct({{1024, 4096}, {1, 8}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_PreconditionRows)
    ->ArgsProduct({{1024, 4096}, {1024}, {1, 8}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_Precondition)
    ->Args({1024, 1024})
    ->Args({4096, 1024})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_OptimizerStep)->Arg(0)->Arg(1)->Arg(2)->UseManualTime()->Unit(benchmark::kMicrosecond);

}  // namespace

int main(int argc, char** argv) {
  if (kcuda::device_count() == 0) {
    std::printf("bench_kfac_cuda: no CUDA device, nothing measured\n");
    return 0;
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
