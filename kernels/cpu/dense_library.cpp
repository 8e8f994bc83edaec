#include "kernels/cpu/dense_library.h"

#include "common/cpu_vectors.h"

#include <Eigen/Core>
#include <algorithm>
#include <array>
#include <cctype>
#include <cstdlib>
#include <stdexcept>
#include <utility>

#if PF_HAVE_CBLAS
#include <cblas.h>
#include <dlfcn.h>
#endif

namespace pf::kernels::cpu {

namespace {

std::string lower_case(std::string_view text) {
  std::string lowered(text);
  std::transform(lowered.begin(), lowered.end(), lowered.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return lowered;
}

// The OpenBLAS core whose kernels use each tier's vectors (what OPENBLAS_CORETYPE may name).
constexpr std::array<const char*, 4> kCoreOfTier = {"Nehalem", "Sandybridge", "Haswell",
                                                    "SkylakeX"};

const char* core_of_tier(int tier) {
  return kCoreOfTier[static_cast<std::size_t>(std::clamp(tier, 0, 3))];
}

#if PF_HAVE_CBLAS
// Makes the loaded OpenBLAS select its kernels again, for `core`: its start-up routine run once
// more with OPENBLAS_CORETYPE naming the core, as if the variable had been set when it loaded
// (driver/others/dynamic.c: gotoblas_dynamic_quit forgets the core, gotoblas_dynamic_init picks
// one). Both are exported by OpenBLAS's DYNAMIC_ARCH builds (Debian's); false where they are
// absent. Only before any OpenBLAS call, on one thread: the kernel table is not guarded.
bool select_openblas_core(const std::string& core) {
  using Routine = void (*)();
  auto* quit = reinterpret_cast<Routine>(dlsym(RTLD_DEFAULT, "gotoblas_dynamic_quit"));
  auto* init = reinterpret_cast<Routine>(dlsym(RTLD_DEFAULT, "gotoblas_dynamic_init"));
  if (quit == nullptr || init == nullptr) return false;
  // The variable only for the call: child processes and later readers see the environment the
  // process was given.
  if (setenv("OPENBLAS_CORETYPE", core.c_str(), 1) != 0) return false;
  quit();
  init();
  unsetenv("OPENBLAS_CORETYPE");
  return true;
}

std::string loaded_openblas_core() {
  const char* core = openblas_get_corename();
  return core != nullptr && *core != '\0' ? core : "unknown";
}
#endif

}  // namespace

std::string openblas_core_to_select(std::string_view openblas_core, int eigen_tier, int cpu_tier,
                                    bool coretype_named, std::string_view requested) {
  if (openblas_core.empty() || coretype_named || requested == "eigen") return {};
  const int core_tier = openblas_core_tier(openblas_core);
  if (core_tier < 0 || core_tier >= eigen_tier || cpu_tier < eigen_tier) return {};
  return core_of_tier(eigen_tier);
}

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
                                        std::string_view requested, std::string_view loaded_core) {
  DenseLibraryChoice choice;
  choice.openblas_core = std::string(openblas_core);
  choice.loaded_core = std::string(loaded_core);
  // Where this process selected OpenBLAS's kernels itself, after the core OpenBLAS took.
  const std::string selected =
      loaded_core.empty()
          ? std::string()
          : ", selected at start-up: OpenBLAS took this CPU for " + std::string(loaded_core);
  if (!requested.empty()) {
    const std::string source = std::string(kDenseLibraryVariable) + "=" + std::string(requested);
    if (requested == "eigen") {
      choice.library = DenseLibrary::kEigen;
      choice.summary = std::string("Eigen (") + vector_tier_name(eigen_tier) + "; " + source + ")";
      return choice;
    }
    if (requested != "openblas") {
      throw std::invalid_argument(source + ": expected openblas or eigen");
    }
    if (openblas_core.empty()) {
      throw std::invalid_argument(source + ": this build has no OpenBLAS (CMake's PF_CPU_BLAS)");
    }
    choice.library = DenseLibrary::kOpenBlas;
    choice.summary = "OpenBLAS (" + choice.openblas_core + selected + "; " + source + ")";
    return choice;
  }
  if (openblas_core.empty()) {
    choice.library = DenseLibrary::kEigen;
    choice.summary =
        std::string("Eigen (") + vector_tier_name(eigen_tier) + "; built without OpenBLAS)";
    return choice;
  }
  const int core_tier = openblas_core_tier(openblas_core);
  if (core_tier < 0 || core_tier >= eigen_tier) {
    choice.library = DenseLibrary::kOpenBlas;
    choice.summary = "OpenBLAS (" + choice.openblas_core + selected + ")";
    return choice;
  }
  choice.library = DenseLibrary::kEigen;
  choice.summary = std::string("Eigen (") + vector_tier_name(eigen_tier) + "): OpenBLAS runs its " +
                   choice.openblas_core + " kernels (" + vector_tier_name(core_tier) +
                   ") on this CPU; OPENBLAS_CORETYPE=" + core_of_tier(eigen_tier) + " gives it " +
                   vector_tier_name(eigen_tier) + " ones";
  return choice;
}

const DenseLibraryChoice& dense_library() {
  // OpenBLAS picks its kernels once, when it loads; so is this.
  static const DenseLibraryChoice choice = [] {
    const char* requested = std::getenv(kDenseLibraryVariable);
    const std::string_view request = requested != nullptr ? requested : "";
#if PF_HAVE_CBLAS
    const std::string loaded = loaded_openblas_core();
    const std::string wanted =
        openblas_core_to_select(loaded, eigen_build_tier(), cpu_vector_tier(),
                                std::getenv("OPENBLAS_CORETYPE") != nullptr, request);
    if (wanted.empty() || !select_openblas_core(wanted)) {
      return choose_dense_library(loaded, eigen_build_tier(), request);
    }
    // What OpenBLAS took now (a build without that core keeps another); the rule judges it.
    const std::string selected = loaded_openblas_core();
    return choose_dense_library(selected, eigen_build_tier(), request,
                                selected != loaded ? loaded : std::string());
#else
    return choose_dense_library("", eigen_build_tier(), request);
#endif
  }();
  return choice;
}

}  // namespace pf::kernels::cpu
