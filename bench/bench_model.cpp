// Forward + backward of one BERT pretraining batch (sequence 128, 20 masked positions, NSP),
// dropout on, fp32, as a training step does it (gradients accumulate; no optimizer). Reports
// sequences per second (items_per_second). Threads: --threads=N (default 2) sets OpenMP and
// Eigen. bias_backward/...: the bias gradient's column sum (kernels::bias_backward) at the step's
// largest shapes (the FFN's 4096x1024 and the MLM decoder's 640x30522) against Eigen's
// colwise().sum() of the same row-major matrix (eigen_colwise:1, what bias_backward did before).
// gemm/...: the step's matrix products (BERT-mini's, and BERT-Large's at 32 x 128 tokens) through
// kernels::gemm (OpenBLAS where CMake found it) against Eigen's GEMM on the same row-major data
// (eigen:1, what kernels::gemm did before), on the --threads threads. dropout/...: see BM_Dropout.
#include <omp.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>
#include <Eigen/Core>

#include "bench/dense_library_context.h"
#include "kernels/cpu/eigen_maps.h"
#include "kernels/ops.h"
#include "kernels/rng.h"
#include "runtime/model/bert_chunk.h"
#include "runtime/tensor/cpu_backend.h"

namespace {

using pf::model::BertChunk;

void train_step(benchmark::State& state, const std::string& preset) {
  const auto config = pf::model::bert_preset(preset);
  const std::int64_t batch_size = state.range(0);
  pf::tensor::CpuBackend backend;
  BertChunk<float> model(config, pf::model::whole_model(config), backend);
  model.init_weights(1);
  const auto batch = pf::model::make_random_batch(config, batch_size, 128, 20, 7);
  pf::model::ForwardOptions options;
  std::uint64_t seed = 0;
  // Warm-up step outside the timing: sizes the arenas and touches every page once.
  model.forward(0, batch, {}, options);
  model.backward(0, {}, {});
  for (auto _ : state) {
    options.seed = ++seed;
    const auto result = model.forward(0, batch, {}, options);
    benchmark::DoNotOptimize(result.losses->total());
    model.backward(0, {}, {});
  }
  state.SetItemsProcessed(state.iterations() * batch_size);
  state.counters["threads"] = Eigen::nbThreads();
}

void BM_TrainStepTiny(benchmark::State& state) {
  train_step(state, "tiny");
}
void BM_TrainStepMini(benchmark::State& state) {
  train_step(state, "mini");
}

void BM_BiasBackward(benchmark::State& state) {
  const std::int64_t rows = state.range(0);
  const std::int64_t cols = state.range(1);
  const bool eigen_colwise = state.range(2) != 0;
  std::vector<float> dy(static_cast<std::size_t>(rows * cols));
  for (std::size_t i = 0; i < dy.size(); ++i) dy[i] = static_cast<float>(i % 97) * 0.01F - 0.5F;
  std::vector<float> dbias(static_cast<std::size_t>(cols), 0.0F);
  const pf::kernels::ConstMatrixView<float> view(dy.data(), rows, cols);
  for (auto _ : state) {
    if (eigen_colwise) {
      Eigen::Map<Eigen::Matrix<float, 1, Eigen::Dynamic>> db(dbias.data(), cols);
      db += pf::kernels::cpu::map(view).colwise().sum();
    } else {
      pf::kernels::bias_backward<float>(view, dbias.data());
    }
    benchmark::DoNotOptimize(dbias.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * rows * cols *
                          static_cast<std::int64_t>(sizeof(float)));
}

// Dropout at p = 0.1 of the step's hidden activations (4096 x 256) and of one layer's attention
// probabilities (32 x 4 x 128 rows of 128), through kernels::dropout_forward against the loop it
// ran before (branchy:1: the same mask with `keep ? x * scale : 0` on floats, which GCC leaves as
// a branch per element, unvectorised), on the --threads threads.
void BM_Dropout(benchmark::State& state) {
  const std::int64_t rows = state.range(0);
  const std::int64_t cols = state.range(1);
  const bool branchy = state.range(2) != 0;
  std::vector<float> x(static_cast<std::size_t>(rows * cols)), y(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 89) * 0.01F - 0.4F;
  const pf::kernels::ConstMatrixView<float> in(x.data(), rows, cols);
  const pf::kernels::MatrixView<float> out(y.data(), rows, cols);
  constexpr float kProbability = 0.1F;
  std::uint64_t seed = 0;
  for (auto _ : state) {
    ++seed;
    if (branchy) {
      const auto threshold = pf::kernels::dropout_threshold(kProbability);
      const float scale = 1.0F / (1.0F - kProbability);
      const std::uint64_t key = pf::kernels::stream_key(seed);
#pragma omp parallel for schedule(static)
      for (std::int64_t i = 0; i < rows; ++i) {
        const float* row_in = in.row(i);
        float* row_out = out.row(i);
        const auto base = static_cast<std::uint64_t>(i * cols);
#pragma omp simd
        for (std::int64_t j = 0; j < cols; ++j) {
          const bool keep =
              pf::kernels::bits_for_key(key, base + static_cast<std::uint64_t>(j)) >= threshold;
          row_out[j] = keep ? row_in[j] * scale : 0.0F;
        }
      }
    } else {
      pf::kernels::dropout_forward<float>(in, out, kProbability, seed);
    }
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * rows * cols);
}

// C = op(A) B, A m x k (or k x m when transposed: the weight gradients' dy^T x), row-major.
void BM_Gemm(benchmark::State& state) {
  const std::int64_t m = state.range(0), n = state.range(1), k = state.range(2);
  const bool transpose_a = state.range(3) != 0;
  const bool eigen = state.range(4) != 0;
  std::vector<float> a(static_cast<std::size_t>(m * k)), b(static_cast<std::size_t>(k * n)),
      c(static_cast<std::size_t>(m * n));
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>(i % 89) * 0.01F - 0.4F;
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = static_cast<float>(i % 83) * 0.01F - 0.4F;
  const pf::kernels::ConstMatrixView<float> va(a.data(), transpose_a ? k : m, transpose_a ? m : k);
  const pf::kernels::ConstMatrixView<float> vb(b.data(), k, n);
  const pf::kernels::MatrixView<float> vc(c.data(), m, n);
  for (auto _ : state) {
    if (eigen) {
      auto out = pf::kernels::cpu::map(vc);
      if (transpose_a) {
        out.noalias() = pf::kernels::cpu::map(va).transpose() * pf::kernels::cpu::map(vb);
      } else {
        out.noalias() = pf::kernels::cpu::map(va) * pf::kernels::cpu::map(vb);
      }
    } else {
      pf::kernels::gemm<float>(
          va, transpose_a ? pf::kernels::Transpose::kYes : pf::kernels::Transpose::kNo, vb,
          pf::kernels::Transpose::kNo, vc);
    }
    benchmark::DoNotOptimize(c.data());
    benchmark::ClobberMemory();
  }
  state.counters["GFLOP/s"] = benchmark::Counter(2.0 * static_cast<double>(m * n * k),
                                                 benchmark::Counter::kIsIterationInvariantRate);
}

}  // namespace

BENCHMARK(BM_Gemm)
    ->Name("gemm")
    ->ArgNames({"m", "n", "k", "ta", "eigen"})
    // BERT-mini (4096 tokens, hidden 256, FFN 1024, MLM decoder over 640 positions): QKV,
    // FFN in, FFN out, decoder, and the FFN-in weight gradient.
    ->Args({4096, 768, 256, 0, 0})
    ->Args({4096, 768, 256, 0, 1})
    ->Args({4096, 1024, 256, 0, 0})
    ->Args({4096, 1024, 256, 0, 1})
    ->Args({4096, 256, 1024, 0, 0})
    ->Args({4096, 256, 1024, 0, 1})
    ->Args({640, 30522, 256, 0, 0})
    ->Args({640, 30522, 256, 0, 1})
    ->Args({1024, 256, 4096, 1, 0})
    ->Args({1024, 256, 4096, 1, 1})
    // BERT-Large (4096 tokens, hidden 1024, FFN 4096): FFN in.
    ->Args({4096, 4096, 1024, 0, 0})
    ->Args({4096, 4096, 1024, 0, 1})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_Dropout)
    ->Name("dropout")
    ->ArgNames({"rows", "cols", "branchy"})
    ->Args({4096, 256, 0})
    ->Args({4096, 256, 1})
    ->Args({16384, 128, 0})
    ->Args({16384, 128, 1})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(BM_BiasBackward)
    ->Name("bias_backward")
    ->ArgNames({"rows", "cols", "eigen_colwise"})
    ->Args({4096, 1024, 0})
    ->Args({4096, 1024, 1})
    ->Args({640, 30522, 0})
    ->Args({640, 30522, 1})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(BM_TrainStepTiny)
    ->Name("train_step/tiny")
    ->ArgName("batch")
    ->Arg(2)
    ->Arg(32)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_TrainStepMini)
    ->Name("train_step/mini")
    ->ArgName("batch")
    ->Arg(32)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

int main(int argc, char** argv) {
  int threads = 2;
  std::vector<char*> rest;
  for (int i = 0; i < argc; ++i) {
    if (std::strncmp(argv[i], "--threads=", 10) == 0) {
      threads = std::atoi(argv[i] + 10);
    } else {
      rest.push_back(argv[i]);
    }
  }
  if (threads < 1) threads = 1;
  omp_set_num_threads(threads);
  Eigen::setNbThreads(threads);
  if (!pf::bench::add_dense_library_context(argv[0])) return 2;
  int count = static_cast<int>(rest.size());
  benchmark::Initialize(&count, rest.data());
  if (benchmark::ReportUnrecognizedArguments(count, rest.data())) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
