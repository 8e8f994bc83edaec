// The choice of the CPU's dense library (kernels/cpu/dense_library.h): the rule, the override,
// and the process's choice.
#include "kernels/cpu/dense_library.h"

#include <gtest/gtest.h>

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
  const auto expected = choose_dense_library(choice.openblas_core, eigen_build_tier(),
                                             requested != nullptr ? requested : "");
  EXPECT_EQ(choice.library, expected.library);
  EXPECT_EQ(choice.summary, expected.summary);
#if PF_HAVE_CBLAS
  EXPECT_FALSE(choice.openblas_core.empty());
#else
  EXPECT_TRUE(choice.openblas_core.empty());
#endif
}

}  // namespace
}  // namespace pf::kernels::cpu
