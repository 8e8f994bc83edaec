#pragma once
// The CPU's CBLAS (OpenBLAS where CMake found it, PF_HAVE_CBLAS) runs every call on its caller's
// thread: the threading is ours (kernels/cpu/gemm.cpp cuts products into blocks by shape only),
// and a BLAS thread pool under our OpenMP threads would oversubscribe the cores and make the bits
// depend on the thread count. Call before a CBLAS call; it sets the library once per process (the
// setting is process-wide). A no-op without CBLAS.
namespace pf::kernels::cpu {
void use_one_blas_thread_per_call();
}  // namespace pf::kernels::cpu
