#pragma once
// The one place that maps a backend's device to its ops implementation, so that code above it
// (the model, K-FAC, the trainer) never names a device: CpuOps for the CPU backend, CudaOps for
// a CUDA backend (in builds with CUDA; float only).
#include <memory>

#include "kernels/backend_ops.h"
#include "runtime/tensor/backend.h"

namespace pf::kernels {

// Ops issuing on `stream` (null: the backend's default stream) of `backend`, which must outlive
// them. Throws std::invalid_argument for a device this build or this T has no ops for, and for
// AttentionAlgorithm::kFused on the CPU (it has the batched algorithm only).
template <typename T>
std::unique_ptr<BackendOps<T>> make_ops(
    tensor::Backend& backend, tensor::Stream* stream = nullptr,
    GemmPrecision precision = GemmPrecision::kFp32,
    AttentionAlgorithm attention = AttentionAlgorithm::kBatchedGemm);

// True when this build has the CUDA ops (and a device may be used).
bool cuda_ops_compiled();

}  // namespace pf::kernels
