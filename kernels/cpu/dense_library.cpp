#include "kernels/cpu/dense_library.h"

#include <Eigen/Core>
#include <algorithm>
#include <array>
#include <cctype>
#include <cstdlib>
#include <stdexcept>
#include <utility>

#if PF_HAVE_CBLAS
#include <cblas.h>
#endif

namespace pf::kernels::cpu {

namespace {

std::string lower_case(std::string_view text) {
  std::string lowered(text);
  std::transform(lowered.begin(), lowered.end(), lowered.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return lowered;
}

constexpr std::array<const char*, 4> kTierNames = {"SSE", "AVX", "AVX2", "AVX-512"};
// The OpenBLAS core whose kernels use each tier's vectors (what OPENBLAS_CORETYPE may name).
constexpr std::array<const char*, 4> kCoreOfTier = {"Nehalem", "Sandybridge", "Haswell",
                                                    "SkylakeX"};

const char* tier_name(int tier) {
  return tier >= 0 && tier < 4 ? kTierNames[static_cast<std::size_t>(tier)] : "unknown";
}

}  // namespace

int openblas_core_tier(std::string_view core_name) {
  // OpenBLAS's x86-64 DYNAMIC_ARCH cores (driver/others/dynamic.c), by the widest vectors their
  // kernels use.
  static const std::array<std::pair<const char*, int>, 26> kCores = {{
      {"skylakex", 3},    {"cooperlake", 3},  {"sapphirerapids", 3}, {"haswell", 2},
      {"zen", 2},         {"sandybridge", 1}, {"bulldozer", 1},      {"piledriver", 1},
      {"steamroller", 1}, {"excavator", 1},   {"prescott", 0},       {"core2", 0},
      {"penryn", 0},      {"dunnington", 0},  {"nehalem", 0},        {"atom", 0},
      {"nano", 0},        {"opteron", 0},     {"opteron_sse3", 0},   {"barcelona", 0},
      {"bobcat", 0},      {"katmai", 0},      {"coppermine", 0},     {"northwood", 0},
      {"banias", 0},      {"athlon", 0},
  }};
  const std::string name = lower_case(core_name);
  for (const auto& [core, tier] : kCores) {
    if (name == core) return tier;
  }
  return -1;
}

int eigen_build_tier() {
#if defined(EIGEN_VECTORIZE_AVX512)
  return 3;
#elif defined(EIGEN_VECTORIZE_AVX2) && defined(EIGEN_VECTORIZE_FMA)
  return 2;
#elif defined(EIGEN_VECTORIZE_AVX)
  return 1;
#else
  return 0;
#endif
}

DenseLibraryChoice choose_dense_library(std::string_view openblas_core, int eigen_tier,
                                        std::string_view requested) {
  DenseLibraryChoice choice;
  choice.openblas_core = std::string(openblas_core);
  if (!requested.empty()) {
    const std::string source = std::string(kDenseLibraryVariable) + "=" + std::string(requested);
    if (requested == "eigen") {
      choice.library = DenseLibrary::kEigen;
      choice.summary = std::string("Eigen (") + tier_name(eigen_tier) + "; " + source + ")";
      return choice;
    }
    if (requested != "openblas") {
      throw std::invalid_argument(source + ": expected openblas or eigen");
    }
    if (openblas_core.empty()) {
      throw std::invalid_argument(source + ": this build has no OpenBLAS (CMake's PF_CPU_BLAS)");
    }
    choice.library = DenseLibrary::kOpenBlas;
    choice.summary = "OpenBLAS (" + choice.openblas_core + "; " + source + ")";
    return choice;
  }
  if (openblas_core.empty()) {
    choice.library = DenseLibrary::kEigen;
    choice.summary = std::string("Eigen (") + tier_name(eigen_tier) + "; built without OpenBLAS)";
    return choice;
  }
  const int core_tier = openblas_core_tier(openblas_core);
  if (core_tier < 0 || core_tier >= eigen_tier) {
    choice.library = DenseLibrary::kOpenBlas;
    choice.summary = "OpenBLAS (" + choice.openblas_core + ")";
    return choice;
  }
  choice.library = DenseLibrary::kEigen;
  choice.summary = std::string("Eigen (") + tier_name(eigen_tier) + "): OpenBLAS runs its " +
                   choice.openblas_core + " kernels (" + tier_name(core_tier) +
                   ") on this CPU; OPENBLAS_CORETYPE=" +
                   kCoreOfTier[static_cast<std::size_t>(std::clamp(eigen_tier, 0, 3))] +
                   " gives it " + tier_name(eigen_tier) + " ones";
  return choice;
}

const DenseLibraryChoice& dense_library() {
  // OpenBLAS picks its kernels once, when it loads; so is this.
  static const DenseLibraryChoice choice = [] {
    const char* requested = std::getenv(kDenseLibraryVariable);
    const std::string_view request = requested != nullptr ? requested : "";
#if PF_HAVE_CBLAS
    const char* core = openblas_get_corename();
    return choose_dense_library(core != nullptr && *core != '\0' ? core : "unknown",
                                eigen_build_tier(), request);
#else
    return choose_dense_library("", eigen_build_tier(), request);
#endif
  }();
  return choice;
}

}  // namespace pf::kernels::cpu
