// K-FAC operations of one Linear layer on the host (fp32, Eigen + OpenMP): curvature (SYRK),
// damped inversion (Cholesky and eigen), preconditioning. Sizes: BERT-Large's 1024 x 1024
// attention Linear and its 4096 x 1024 FFN-in (d_out x d_in), T = 4096 tokens (32 x 128).
// Threads: PF_THREADS (default 2) for both OpenMP and Eigen.
#include "kfac/eigen_core.h"  // first: silences GCC 12's AVX-512 false positives in Eigen

#include <benchmark/benchmark.h>
#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <ctime>
#include <random>
#include <string>
#include <vector>

#include "bench/dense_library_context.h"
#include "kfac/factors.h"
#include "kfac/inverse.h"
#include "kfac/precondition.h"
#include "runtime/optim/adamw.h"
#include "runtime/optim/lamb.h"

namespace {

using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

RowMatrix random_matrix(Eigen::Index rows, Eigen::Index cols, unsigned seed) {
  std::mt19937 generator(seed);
  std::normal_distribution<float> normal(0.0F, 1.0F);
  RowMatrix matrix(rows, cols);
  for (Eigen::Index i = 0; i < matrix.size(); ++i) matrix.data()[i] = normal(generator);
  return matrix;
}

// A full-rank symmetric positive definite factor with a spread spectrum: the Gram matrix of 256
// random rows plus a diagonal from 0.01 to 1 (cheap to build even at 4096).
Eigen::MatrixXf random_factor(Eigen::Index dim) {
  constexpr Eigen::Index kRows = 256;
  const auto x = random_matrix(kRows, dim, 5);
  Eigen::MatrixXf factor = Eigen::MatrixXf::Zero(dim, dim);
  pf::kfac::add_gram_lower(factor, x.data(), kRows, dim, 1.0F / static_cast<float>(kRows));
  pf::kfac::fill_upper_from_lower(factor);
  factor.diagonal() += Eigen::VectorXf::LinSpaced(dim, 0.01F, 1.0F);
  return factor;
}

double process_cpu_seconds() {
  timespec now{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &now);
  return static_cast<double>(now.tv_sec) + 1e-9 * static_cast<double>(now.tv_nsec);
}

// The shared machine is often oversubscribed, which inflates wall time but not CPU time: besides
// FLOP per wall second we report FLOP per CPU second of the whole process (all threads), and the
// process's CPU seconds per wall second ("threads busy").
class FlopMeter {
 public:
  explicit FlopMeter(benchmark::State& state) : state_(state), start_(process_cpu_seconds()) {}
  FlopMeter(const FlopMeter&) = delete;
  FlopMeter& operator=(const FlopMeter&) = delete;
  void finish(double flops_per_iteration) {
    const double cpu = process_cpu_seconds() - start_;
    const auto iterations = static_cast<double>(state_.iterations());
    if (flops_per_iteration > 0) {
      state_.counters["FLOP/s"] =
          benchmark::Counter(flops_per_iteration, benchmark::Counter::kIsIterationInvariantRate);
      state_.counters["FLOP/cpu_s"] = flops_per_iteration * iterations / cpu;
    }
    state_.counters["cpu_s/s"] = benchmark::Counter(cpu, benchmark::Counter::kIsRate);
  }
  ~FlopMeter() = default;

 private:
  benchmark::State& state_;
  double start_;
};

// Curvature factor d x d from T tokens: add_gram_lower (one SYRK per thread over token slices).
// FLOP counted as the full product 2 T d^2 (the reference's count; SYRK does half the work).
void BM_Curvature(benchmark::State& state) {
  const auto dim = state.range(0);
  const auto tokens = state.range(1);
  const auto x = random_matrix(tokens, dim, 1);
  Eigen::MatrixXf factor = Eigen::MatrixXf::Zero(dim, dim);
  FlopMeter meter(state);
  for (auto _ : state) {
    pf::kfac::add_gram_lower(factor, x.data(), tokens, dim, 1.0F / static_cast<float>(tokens));
    benchmark::DoNotOptimize(factor.data());
  }
  meter.finish(2.0 * static_cast<double>(tokens) * static_cast<double>(dim * dim));
}

// The same with one call of Eigen's rankUpdate (which Eigen does not thread), for comparison.
void BM_CurvatureEigenRankUpdate(benchmark::State& state) {
  const auto dim = state.range(0);
  const auto tokens = state.range(1);
  const auto x = random_matrix(tokens, dim, 1);
  const Eigen::Map<const Eigen::MatrixXf> xt(x.data(), dim, tokens);
  Eigen::MatrixXf factor = Eigen::MatrixXf::Zero(dim, dim);
  FlopMeter meter(state);
  for (auto _ : state) {
    factor.selfadjointView<Eigen::Lower>().rankUpdate(xt, 1.0F / static_cast<float>(tokens));
    benchmark::DoNotOptimize(factor.data());
  }
  meter.finish(2.0 * static_cast<double>(tokens) * static_cast<double>(dim * dim));
}

// Damped inverse by Cholesky: d^3 / 3 for the factorization plus 2 d^3 / 3 for the inverse
// (the reference's count; the solve against I actually does 2 d^3).
void BM_InvertCholesky(benchmark::State& state) {
  const auto dim = state.range(0);
  const auto factor = random_factor(dim);
  FlopMeter meter(state);
  for (auto _ : state) {
    auto result = pf::kfac::damped_inverse(factor, 1e-3F, pf::kfac::InverseMethod::kCholesky);
    benchmark::DoNotOptimize(result.inverse.data());
  }
  const auto d = static_cast<double>(dim);
  meter.finish(d * d * d);
}

// Damped inverse by symmetric eigendecomposition (time only: no standard FLOP count).
void BM_InvertEigen(benchmark::State& state) {
  const auto dim = state.range(0);
  const auto factor = random_factor(dim);
  FlopMeter meter(state);
  for (auto _ : state) {
    auto result = pf::kfac::damped_inverse(factor, 1e-3F, pf::kfac::InverseMethod::kEigen);
    benchmark::DoNotOptimize(result.inverse.data());
  }
  meter.finish(0.0);
}

// dW = B^-1 G A^-1 for G d_out x d_in: 2 d_out d_in (d_in + d_out) FLOP.
void BM_Precondition(benchmark::State& state) {
  const auto d_out = state.range(0);
  const auto d_in = state.range(1);
  const auto a_inv = random_factor(d_in);
  const auto b_inv = random_factor(d_out);
  const auto grad = random_matrix(d_out, d_in, 3);
  RowMatrix out(d_out, d_in);
  FlopMeter meter(state);
  for (auto _ : state) {
    pf::kfac::precondition(a_inv, b_inv, grad.data(), nullptr, d_out, d_in, out.data(), nullptr);
    benchmark::DoNotOptimize(out.data());
  }
  meter.finish(pf::kfac::precondition_flops(d_out, d_in));
}

// One optimizer step over a parameter of range(0) Ki elements, split into 1 Mi-element tensors as
// a model's are (the LAMB trust ratio is per tensor). Reported as GB/s of parameter-sized arrays
// touched: AdamW reads p, g, m, v and writes p, m, v (7 arrays); LAMB reads g for the global
// norm, then updates the moments with both trust-ratio norms (6), then applies (4): 11 arrays.
template <typename Optimizer>
void optimizer_step(benchmark::State& state, double arrays_touched) {
  const auto total = static_cast<std::size_t>(state.range(0)) * 1024;
  const std::size_t tensor = std::min<std::size_t>(total, std::size_t{1} << 20);
  std::vector<float> values(total, 0.5F), grads(total, 1e-3F);
  std::vector<pf::optim::ParamView> params;
  for (std::size_t offset = 0; offset < total; offset += tensor) {
    const auto size = std::min(tensor, total - offset);
    params.push_back({"p" + std::to_string(offset),
                      values.data() + offset,
                      grads.data() + offset,
                      size,
                      {static_cast<std::int64_t>(size)},
                      false});
  }
  Optimizer optimizer;
  FlopMeter meter(state);
  for (auto _ : state) {
    optimizer.step(params, 1e-3F);
    benchmark::DoNotOptimize(values.data());
  }
  meter.finish(0.0);
  state.counters["bytes/s"] = benchmark::Counter(arrays_touched * 4.0 * static_cast<double>(total),
                                                 benchmark::Counter::kIsIterationInvariantRate);
}
void BM_AdamWStep(benchmark::State& state) {
  optimizer_step<pf::optim::AdamW>(state, 7.0);
}
void BM_LambStep(benchmark::State& state) {
  optimizer_step<pf::optim::Lamb>(state, 11.0);
}

// Sizes: 64 is the smoke-test size; 1024 and 4096 are BERT-Large's; 16384 Ki = 16 Mi parameters.
BENCHMARK(BM_Curvature)
    ->Args({64, 256})
    ->Args({1024, 4096})
    ->Args({4096, 4096})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_CurvatureEigenRankUpdate)
    ->Args({64, 256})
    ->Args({1024, 4096})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_InvertCholesky)
    ->Arg(64)
    ->Arg(1024)
    ->Arg(4096)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_InvertEigen)
    ->Arg(64)
    ->Arg(1024)
    ->Arg(4096)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_AdamWStep)->Arg(64)->Arg(16384)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_LambStep)->Arg(64)->Arg(16384)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_Precondition)
    ->Args({64, 64})
    ->Args({1024, 1024})
    ->Args({4096, 1024})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace

int main(int argc, char** argv) {
  const char* threads_env = std::getenv("PF_THREADS");
  const int threads = threads_env != nullptr ? std::max(1, std::atoi(threads_env)) : 2;
  omp_set_num_threads(threads);
  Eigen::setNbThreads(threads);
  if (!pf::bench::add_dense_library_context(argv[0])) return 2;
  benchmark::AddCustomContext("threads", std::to_string(threads));
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
