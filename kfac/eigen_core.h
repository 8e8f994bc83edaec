#pragma once
// Include Eigen through this header (before any other Eigen header). GCC 12 reports
// -Wuninitialized / -Wmaybe-uninitialized inside its own AVX-512 intrinsics (the `__Y = __Y`
// idiom of _mm512_undefined_ps, GCC bug 105593) wherever Eigen's GEMM kernels are inlined with
// -march=native. The diagnostic state is taken from where avx512fintrin.h is first included, so
// silencing just that inclusion keeps the warnings on for our own code.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#if !defined(__clang__)  // a GCC-only warning: clang (the fuzz build) rejects the name
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <Eigen/Core>
#pragma GCC diagnostic pop
