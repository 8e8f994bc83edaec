// The choice of the CPU's dense library (kernels/cpu/dense_library.h): the rule, the override,
// and the process's choice.
#include "kernels/cpu/dense_library.h"

#include "common/cpu_vectors.h"

#include <gtest/gtest.h>

#if PF_HAVE_CBLAS
#include <cblas.h>
#endif

#include <stdexcept>
#include <string>

namespace pf::kernels::cpu {
namespace {

TEST(DenseLibrary, OpenBlasCoresAreRankedByTheirVectors) {
  EXPECT_EQ(openblas_core_tier("Prescott"), 0);
  EXPECT_EQ(openblas_core_tier("Nehalem"), 0);
  EXPECT_EQ(openblas_core_tier("Sandybridge"), 1);
  EXPECT_EQ(openblas_core_tier("Haswell"), 2);
  EXPECT_EQ(openblas_core_tier("Zen"), 2);
  EXPECT_EQ(openblas_core_tier("SkylakeX"), 3);
  EXPECT_EQ(openblas_core_tier("COOPERLAKE"), 3);  // any case
  EXPECT_EQ(openblas_core_tier("sapphirerapids"), 3);
  EXPECT_EQ(openblas_core_tier("SomeFutureCore"), -1);
  EXPECT_EQ(openblas_core_tier(""), -1);
}

TEST(DenseLibrary, OpenBlasUnlessItsKernelsAreNarrowerThanEigens) {
  EXPECT_EQ(choose_dense_library("SkylakeX", 3).library, DenseLibrary::kOpenBlas);
  EXPECT_EQ(choose_dense_library("Haswell", 2).library, DenseLibrary::kOpenBlas);
  EXPECT_EQ(choose_dense_library("Zen", 2).library, DenseLibrary::kOpenBlas);
  EXPECT_EQ(choose_dense_library("Prescott", 0).library, DenseLibrary::kOpenBlas);
  EXPECT_EQ(choose_dense_library("SomeFutureCore", 3).library, DenseLibrary::kOpenBlas);
  EXPECT_EQ(choose_dense_library("SkylakeX", 3).summary, "OpenBLAS (SkylakeX)");

  // Debian 12's OpenBLAS on an Emerald Rapids Xeon: Prescott kernels, 6x slower than Eigen's.
  const auto prescott = choose_dense_library("Prescott", 3);
  EXPECT_EQ(prescott.library, DenseLibrary::kEigen);
  EXPECT_EQ(prescott.openblas_core, "Prescott");
  EXPECT_EQ(prescott.summary,
            "Eigen (AVX-512): OpenBLAS runs its Prescott kernels (SSE) on this CPU; "
            "OPENBLAS_CORETYPE=SkylakeX gives it AVX-512 ones");
  const auto haswell = choose_dense_library("Haswell", 3);
  EXPECT_EQ(haswell.library, DenseLibrary::kEigen);
  EXPECT_NE(haswell.summary.find("OPENBLAS_CORETYPE=SkylakeX"), std::string::npos);
  const auto on_avx2 = choose_dense_library("Nehalem", 2);
  EXPECT_EQ(on_avx2.library, DenseLibrary::kEigen);
  EXPECT_NE(on_avx2.summary.find("OPENBLAS_CORETYPE=Haswell"), std::string::npos);

  const auto without = choose_dense_library("", 3);
  EXPECT_EQ(without.library, DenseLibrary::kEigen);
  EXPECT_EQ(without.summary, "Eigen (AVX-512; built without OpenBLAS)");
}

TEST(DenseLibrary, OpenBlasKernelsNarrowerThanEigensAreSelectedAgainForEigensTier) {
  // Debian 12's OpenBLAS on an Emerald Rapids Xeon (AVX-512), in an AVX-512 build.
  EXPECT_EQ(openblas_core_to_select("Prescott", 3, 3, false), "SkylakeX");
  EXPECT_EQ(openblas_core_to_select("Haswell", 3, 3, false), "SkylakeX");
  EXPECT_EQ(openblas_core_to_select("Prescott", 2, 3, false), "Haswell");  // an AVX2 build
  EXPECT_EQ(openblas_core_to_select("Nehalem", 1, 1, false), "Sandybridge");
  EXPECT_EQ(openblas_core_to_select("Prescott", 3, 3, false, "openblas"), "SkylakeX");
  // Kept: kernels as wide as Eigen's (or wider), a core this table does not know, no OpenBLAS.
  EXPECT_EQ(openblas_core_to_select("SkylakeX", 3, 3, false), "");
  EXPECT_EQ(openblas_core_to_select("Zen", 2, 2, false), "");
  EXPECT_EQ(openblas_core_to_select("SkylakeX", 2, 3, false), "");
  EXPECT_EQ(openblas_core_to_select("SomeFutureCore", 3, 3, false), "");
  EXPECT_EQ(openblas_core_to_select("", 3, 3, false), "");
  // Kept: a CPU without Eigen's vectors, a core named by OPENBLAS_CORETYPE, Eigen requested.
  EXPECT_EQ(openblas_core_to_select("Prescott", 3, 2, false), "");
  EXPECT_EQ(openblas_core_to_select("Prescott", 3, 3, true), "");
  EXPECT_EQ(openblas_core_to_select("Prescott", 3, 3, false, "eigen"), "");
}

TEST(DenseLibrary, TheSummarySaysWhenTheProcessSelectedOpenBlasKernels) {
  const auto selected = choose_dense_library("SkylakeX", 3, "", "Prescott");
  EXPECT_EQ(selected.library, DenseLibrary::kOpenBlas);
  EXPECT_EQ(selected.loaded_core, "Prescott");
  EXPECT_EQ(selected.summary,
            "OpenBLAS (SkylakeX, selected at start-up: OpenBLAS took this CPU for Prescott)");
  EXPECT_EQ(choose_dense_library("SkylakeX", 3, "openblas", "Prescott").summary,
            "OpenBLAS (SkylakeX, selected at start-up: OpenBLAS took this CPU for Prescott; "
            "PF_CPU_DENSE_LIBRARY=openblas)");
  // An OpenBLAS that kept narrow kernels after all: Eigen's, as for the loaded core.
  EXPECT_EQ(choose_dense_library("Prescott", 3, "", "Nehalem").library, DenseLibrary::kEigen);
}

TEST(DenseLibrary, TheCpuRunsTheVectorsThisBuildWasCompiledFor) {
  EXPECT_GE(cpu_vector_tier(), eigen_build_tier());
}

TEST(DenseLibrary, TheVariableOverridesTheRuleAndIsChecked) {
  const auto eigen = choose_dense_library("SkylakeX", 3, "eigen");
  EXPECT_EQ(eigen.library, DenseLibrary::kEigen);
  EXPECT_EQ(eigen.summary, "Eigen (AVX-512; PF_CPU_DENSE_LIBRARY=eigen)");
  const auto openblas = choose_dense_library("Prescott", 3, "openblas");
  EXPECT_EQ(openblas.library, DenseLibrary::kOpenBlas);
  EXPECT_EQ(openblas.summary, "OpenBLAS (Prescott; PF_CPU_DENSE_LIBRARY=openblas)");
  EXPECT_EQ(choose_dense_library("", 2, "eigen").library, DenseLibrary::kEigen);
  try {
    (void)choose_dense_library("SkylakeX", 3, "mkl");
    FAIL() << "an unknown library was accepted";
  } catch (const std::invalid_argument& error) {
    EXPECT_STREQ(error.what(), "PF_CPU_DENSE_LIBRARY=mkl: expected openblas or eigen");
  }
  try {
    (void)choose_dense_library("", 3, "openblas");
    FAIL() << "OpenBLAS was chosen in a build without it";
  } catch (const std::invalid_argument& error) {
    EXPECT_STREQ(error.what(),
                 "PF_CPU_DENSE_LIBRARY=openblas: this build has no OpenBLAS (CMake's PF_CPU_BLAS)");
  }
}

TEST(DenseLibrary, TheProcessChoiceFollowsTheRuleOrTheVariable) {
  const auto& choice = dense_library();
  EXPECT_EQ(&choice, &dense_library());  // made once
  EXPECT_FALSE(choice.summary.empty());
  EXPECT_EQ(use_openblas(), choice.library == DenseLibrary::kOpenBlas);
  const char* requested = std::getenv(kDenseLibraryVariable);
  const auto expected =
      choose_dense_library(choice.openblas_core, eigen_build_tier(),
                           requested != nullptr ? requested : "", choice.loaded_core);
  EXPECT_EQ(choice.library, expected.library);
  EXPECT_EQ(choice.summary, expected.summary);
#if PF_HAVE_CBLAS
  EXPECT_FALSE(choice.openblas_core.empty());
  // OpenBLAS's kernels were selected again only where the rule asked for them, and not below
  // Eigen's vectors then (on this machine: what the process runs is what the rule judged).
  EXPECT_EQ(choice.openblas_core, openblas_get_corename());
  const std::string_view request = requested != nullptr ? requested : "";
  if (!choice.loaded_core.empty()) {
    EXPECT_FALSE(openblas_core_to_select(choice.loaded_core, eigen_build_tier(), cpu_vector_tier(),
                                         false, request)
                     .empty());
  }
  // Nothing is left to select: the kernels OpenBLAS runs now are as wide as Eigen's, or were
  // named by OPENBLAS_CORETYPE, or Eigen was asked for (Debian's OpenBLAS has the routines).
  EXPECT_EQ(openblas_core_to_select(choice.openblas_core, eigen_build_tier(), cpu_vector_tier(),
                                    std::getenv("OPENBLAS_CORETYPE") != nullptr, request),
            "")
      << choice.summary;
#else
  EXPECT_TRUE(choice.openblas_core.empty());
#endif
}

}  // namespace
}  // namespace pf::kernels::cpu
