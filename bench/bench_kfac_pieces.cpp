// Divisible K-FAC inversion on the host (fp32, Eigen + OpenMP): the monolithic damped_inverse,
// the blocked Cholesky chain (inverse_chain.h) whole and cut into pieces, and the alternative the
// chain was chosen over, a warm-started Newton-Schulz iteration X <- X (2I - M X) (two GEMMs per
// step) started from the previous refresh's inverse. Counters: rel_error = ||X - X_ref||_F /
// ||X_ref||_F against a double-precision inverse; ns_steps = Newton-Schulz steps to reach the
// Cholesky chain's own error (or the cap, 40, when it does not get there; "diverged" = 1 when the
// residual grew instead). Threads: PF_THREADS (default 2) for both OpenMP and Eigen.
#include "kfac/eigen_core.h"  // first: silences GCC 12's AVX-512 false positives in Eigen

#include <benchmark/benchmark.h>
#include <omp.h>

#include <Eigen/Dense>
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <random>
#include <string>

#include "bench/dense_library_context.h"
#include "kfac/factors.h"
#include "kfac/inverse.h"
#include "kfac/inverse_chain.h"
#include "kfac/pieces.h"

namespace {

using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
constexpr float kDamping = 1e-3F;

// A curvature factor a^T a / T from T = 2n random tokens whose features have a decaying scale
// (like activations: a few large directions, many small), refreshed from new tokens: the
// previous refresh's factor is the same distribution with other samples.
Eigen::MatrixXf curvature_factor(Eigen::Index n, unsigned seed) {
  std::mt19937 generator(seed);
  std::normal_distribution<float> normal(0.0F, 1.0F);
  const Eigen::Index tokens = 2 * n;
  RowMatrix a(tokens, n);
  for (Eigen::Index t = 0; t < tokens; ++t) {
    for (Eigen::Index j = 0; j < n; ++j) {
      a(t, j) = normal(generator) / (1.0F + 0.05F * static_cast<float>(j));
    }
  }
  Eigen::MatrixXf factor = Eigen::MatrixXf::Zero(n, n);
  pf::kfac::add_gram_lower(factor, a.data(), tokens, n, 1.0F / static_cast<float>(tokens));
  pf::kfac::fill_upper_from_lower(factor);
  return factor;
}

Eigen::MatrixXd reference_inverse(const Eigen::MatrixXf& factor, float damping = kDamping) {
  Eigen::MatrixXd damped = factor.cast<double>();
  damped.diagonal().array() += damping;
  return damped.llt().solve(Eigen::MatrixXd::Identity(factor.rows(), factor.cols()));
}

double relative_error(const Eigen::MatrixXf& x, const Eigen::MatrixXd& reference) {
  return (x.cast<double>() - reference).norm() / reference.norm();
}

void BM_InverseMonolithic(benchmark::State& state) {
  const Eigen::Index n = state.range(0);
  const Eigen::MatrixXf factor = curvature_factor(n, 1);
  Eigen::MatrixXf inverse;
  for (auto _ : state) {
    inverse =
        pf::kfac::damped_inverse(factor, kDamping, pf::kfac::InverseMethod::kCholesky).inverse;
    benchmark::DoNotOptimize(inverse.data());
  }
  state.counters["rel_error"] = relative_error(inverse, reference_inverse(factor));
}

// The chain cut into `pieces` equal shares (1 = the whole chain in one piece).
void BM_InverseChain(benchmark::State& state) {
  const Eigen::Index n = state.range(0);
  const int pieces = static_cast<int>(state.range(1));
  const Eigen::MatrixXf factor = curvature_factor(n, 1);
  Eigen::MatrixXf inverse;
  for (auto _ : state) {
    pf::kfac::InverseChain chain(factor, kDamping);
    for (int p = 0; p < pieces; ++p) {
      chain.run(pf::kfac::kPieceUnits * p / pieces, pf::kfac::kPieceUnits * (p + 1) / pieces);
    }
    inverse = chain.take().inverse;
    benchmark::DoNotOptimize(inverse.data());
  }
  state.counters["rel_error"] = relative_error(inverse, reference_inverse(factor));
}

// Newton-Schulz from the previous refresh's inverse, to the chain's error; damping = second
// argument / 1000 (the factors' largest eigenvalues are ~3, their smallest ~1e-3).
void BM_NewtonSchulzWarm(benchmark::State& state) {
  const Eigen::Index n = state.range(0);
  const float damping = static_cast<float>(state.range(1)) / 1000.0F;
  const Eigen::MatrixXf previous = curvature_factor(n, 2);
  const Eigen::MatrixXf factor = curvature_factor(n, 1);
  const Eigen::MatrixXd reference = reference_inverse(factor, damping);
  pf::kfac::InverseChain chain(factor, damping);
  chain.run(0, pf::kfac::kPieceUnits);
  const double target = relative_error(chain.take().inverse, reference);
  const Eigen::MatrixXf start =
      pf::kfac::damped_inverse(previous, damping, pf::kfac::InverseMethod::kCholesky).inverse;
  Eigen::MatrixXf damped = factor;
  damped.diagonal().array() += damping;
  constexpr int kMaxSteps = 40;
  int steps = 0;
  double error = 0.0;
  bool diverged = false;
  for (auto _ : state) {
    Eigen::MatrixXf x = start;
    Eigen::MatrixXf mx(n, n);
    steps = 0;
    error = relative_error(x, reference);
    diverged = false;
    while (steps < kMaxSteps && error > target) {
      mx.noalias() = damped * x;  // GEMM 1
      mx = -mx;
      mx.diagonal().array() += 2.0F;
      const Eigen::MatrixXf next = x * mx;  // GEMM 2
      x = 0.5F * (next + next.transpose());
      ++steps;
      state.PauseTiming();
      const double next_error = relative_error(x, reference);
      diverged = !(next_error < 2.0 * error) || !std::isfinite(next_error);
      error = next_error;
      state.ResumeTiming();
      if (diverged) break;
    }
    benchmark::DoNotOptimize(x.data());
  }
  state.counters["ns_steps"] = steps;
  state.counters["rel_error"] = error;
  state.counters["chain_rel_error"] = target;
  state.counters["diverged"] = diverged ? 1.0 : 0.0;
}

// One Newton-Schulz step alone (two n x n GEMMs), to price a step against a chain piece.
void BM_NewtonSchulzStep(benchmark::State& state) {
  const Eigen::Index n = state.range(0);
  const Eigen::MatrixXf damped = curvature_factor(n, 1);
  Eigen::MatrixXf x = Eigen::MatrixXf::Identity(n, n);
  Eigen::MatrixXf mx(n, n);
  for (auto _ : state) {
    mx.noalias() = damped * x;
    Eigen::MatrixXf next = x * mx;
    benchmark::DoNotOptimize(next.data());
  }
}

BENCHMARK(BM_InverseMonolithic)
    ->Arg(256)
    ->Arg(1024)
    ->Arg(2048)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_InverseChain)
    ->Args({256, 1})
    ->Args({1024, 1})
    ->Args({1024, 8})
    ->Args({1024, 32})
    ->Args({2048, 1})
    ->Args({2048, 32})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_NewtonSchulzWarm)
    ->Args({256, 1})
    ->Args({256, 100})
    ->Args({1024, 1})
    ->Args({1024, 100})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_NewtonSchulzStep)
    ->Arg(256)
    ->Arg(1024)
    ->Arg(2048)
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
