#pragma once
// Which library runs the CPU's dense kernels (the matrix products, and K-FAC's SYRK, TRSM and
// Cholesky): OpenBLAS where CMake found it, unless its run-time dispatch took this CPU for an
// older one. Debian 12's OpenBLAS (0.3.21) does not know recent Xeons (Emerald Rapids, model
// 207) and runs its Prescott (SSE3) kernels there: 15 GFLOP/s per core against Eigen's 84 with
// AVX-512 (docs/benchmarks.md, "OpenBLAS on a CPU it does not know"). OpenBLAS fixes its kernels
// when it loads (OPENBLAS_CORETYPE read then); before its first call the process selects them
// again, for this CPU's vectors, through OpenBLAS's own start-up routine (gotoblas_dynamic_init,
// as OPENBLAS_CORETYPE would have); Eigen's kernels only where that is not possible. The choice
// is made once per process.
#include <string>
#include <string_view>

namespace pf::kernels::cpu {

enum class DenseLibrary { kOpenBlas, kEigen };

// Vector instruction tiers: 0 SSE, 1 AVX, 2 AVX2 with FMA, 3 AVX-512 (common/cpu_vectors.h:
// this CPU's, pf::cpu_vector_tier()).
// The tier of an OpenBLAS x86-64 kernel set by its core name (openblas_get_corename(), any case);
// -1 for a name this table does not know (a newer core: trusted).
int openblas_core_tier(std::string_view core_name);
// The widest vectors this build's Eigen was compiled for (-march decides).
int eigen_build_tier();

// The OpenBLAS core to select at start-up (pure, tested): the core of Eigen's tier (SkylakeX for
// AVX-512, Haswell for AVX2, ...) when the loaded OpenBLAS runs kernels of a known, narrower tier
// on a CPU that runs Eigen's, no OPENBLAS_CORETYPE named a core and `requested` (the override
// below) is not "eigen"; empty otherwise.
std::string openblas_core_to_select(std::string_view openblas_core, int eigen_tier, int cpu_tier,
                                    bool coretype_named, std::string_view requested = {});

struct DenseLibraryChoice {
  DenseLibrary library = DenseLibrary::kEigen;
  std::string openblas_core;  // empty in a build without OpenBLAS
  std::string loaded_core;    // OpenBLAS's own choice, where this process selected another
  std::string summary;        // one line for a program's output, e.g. "OpenBLAS (SkylakeX)"
};

// The rule (pure, tested): OpenBLAS unless it is absent (empty core name) or its kernels' tier is
// known and below what Eigen was built for; then Eigen, and the summary says why and which
// OPENBLAS_CORETYPE would give OpenBLAS's kernels of Eigen's tier. `requested` "openblas" or
// "eigen" overrides the rule (std::invalid_argument for another value, or for "openblas" in a
// build without it); empty: the rule. `loaded_core`: the core OpenBLAS took when it loaded,
// where the process then selected `openblas_core` (the summary says so); empty otherwise.
DenseLibraryChoice choose_dense_library(std::string_view openblas_core, int eigen_tier,
                                        std::string_view requested = {},
                                        std::string_view loaded_core = {});

// The environment variable that overrides the rule for a process (benchmarks side by side, the
// tests of the other library's path): openblas or eigen.
inline constexpr const char* kDenseLibraryVariable = "PF_CPU_DENSE_LIBRARY";

// This process's choice (the loaded OpenBLAS's core name, selected again where
// openblas_core_to_select says so, against eigen_build_tier(); or PF_CPU_DENSE_LIBRARY), made on
// the first call, which must come before any OpenBLAS call; every thread sees the same. Throws
// std::invalid_argument for a bad PF_CPU_DENSE_LIBRARY: programs call it at start-up, before
// any kernel (and any OpenMP region) does.
const DenseLibraryChoice& dense_library();

// True when the matrix products and K-FAC's kernels call OpenBLAS.
inline bool use_openblas() {
  return dense_library().library == DenseLibrary::kOpenBlas;
}

}  // namespace pf::kernels::cpu
