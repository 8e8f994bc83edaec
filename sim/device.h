#pragma once
// What the analytic cost model needs to know about an accelerator: peak FLOP/s per precision,
// how much of it matrix products achieve, memory bandwidth, and the link to its pipeline
// neighbours. Presets (dense peaks, per GPU): h100, h200, b200, a100, v100, p100; or a JSON file.
#include <array>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "sim/kfac_overheads.h"

namespace pf::sim {

enum class Precision { kFp32, kTf32, kBf16, kFp16 };
std::string_view to_string(Precision precision);
Precision precision_from_string(std::string_view name);  // throws naming the allowed values
// Bytes of one activation / gradient element: 4 for fp32 and tf32 (tf32 only changes the
// tensor-core arithmetic), 2 for bf16 and fp16.
int element_bytes(Precision precision);

// Classes of device work, each with its own achieved rate and per-kernel latency
// (sim/kernel_costs.h prices a kernel of a class):
// - gemm: dense matrix products (Linear layers, K-FAC curvature and preconditioning) at the
//   precision's peak;
// - attention: the batched per-head products of attention (Q K^T, probabilities x V);
// - memory: bandwidth-bound element-wise work (bias, GELU, softmax, LayerNorm, dropout, copies);
// - factorization: Cholesky (potrf) of a K-FAC factor, fp32 peak;
// - triangular_solve: the triangular solves / inverse that turn a Cholesky factor into the
//   inverse, fp32 peak;
// - eigendecomposition: symmetric eigensolver (syevd), fp32 peak.
enum class OpClass : std::uint8_t {
  kGemm,
  kAttention,
  kMemory,
  kFactorization,
  kTriangularSolve,
  kEigendecomposition
};
inline constexpr int kNumOpClasses = 6;
std::string_view to_string(OpClass op_class);
OpClass op_class_from_string(std::string_view name);  // throws naming the allowed values

// Achieved rate of one class: a fraction of its peak (FLOP/s, or the memory bandwidth for the
// memory class) and a fixed device time per kernel (per panel for factorizations, see
// kernel_costs.h). efficiency <= 0 means "not set": 1 for memory, the fp32 gemm efficiency for
// triangular solves (blocked into products), matmul_efficiency for the other FLOP classes.
//
// Optional shape terms (their defaults leave a device without them as it was):
// - half_efficiency_size h > 0: the efficiency of a kernel of size s (the smallest dimension of a
//   product, the order of a factorization, solve or eigendecomposition) is
//     efficiency x 1 / (1 + (h / s)^size_exponent)
//   so small and skinny products, and small factorizations, run slower (h is the size at which
//   a kernel reaches half the class efficiency). 0: no curve.
// - memory class: the size is a kernel's bytes, and the bandwidth falls from the caches' to
//   memory's once the data outgrows the caches: the bandwidth term of an element-wise kernel is
//   multiplied by 1 + (beyond_cache_slowdown - 1) x 1 / (1 + (h / bytes)^size_exponent)
//   (h: the bytes half-way between the two, beyond_cache_slowdown: how much slower beyond them;
//   1: no change). A CPU has a second cliff, from its last-level cache to memory, far beyond the
//   first (L2 to L3): outer_cache_bytes h2 > 0 multiplies the term once more by
//   1 + (beyond_outer_cache_slowdown - 1) x 1 / (1 + (h2 / bytes)^size_exponent). 0: one cliff.
// - element_flop_s, exponential_s, error_function_s, random_number_s (memory class): device
//   time per element-wise FLOP, per evaluation of exp / tanh (softmax, cross-entropy, the
//   pooler; the optimizer's square root too), per erf (GELU) and per random number (dropout's
//   mask). An element-wise kernel takes
//     max(bytes / bandwidth, flops x element_flop_s + exps x exponential_s +
//         erfs x error_function_s + draws x random_number_s)
//   so GELU and LayerNorm can be compute-bound where an add of the same bytes is not. 0:
//   element-wise arithmetic is free (bandwidth-bound only).
// - roofline_exponent q >= 1 (memory class): the two terms above combine as
//     (compute^q + bandwidth^q)^(1/q)
//   instead of their max: a core that computes while it waits for memory overlaps the two only
//   in part, most where one term dwarfs the other (q = 1: no overlap, their sum; q -> infinity:
//   the max). A LayerNorm or GELU past the caches, where both terms are comparable, is slower
//   than either. 0: the max.
// - size_measure (gemm and attention classes): which size of a product the curve reads: its
// smallest dimension
//   (the default), or the harmonic mean of its three, 3 / (1/m + 1/n + 1/k), so that a product
//   is as efficient as its shape as a whole allows: wide products (all three dimensions large)
//   approach the class efficiency, skinny ones (any dimension small) fall off smoothly.
enum class SizeMeasure : std::uint8_t { kSmallest, kHarmonicMean };
struct ClassRate {
  double efficiency = 0.0;
  double latency_s = 0.0;
  double half_efficiency_size = 0.0;
  double size_exponent = 1.0;
  double beyond_cache_slowdown = 1.0;
  double outer_cache_bytes = 0.0;
  double beyond_outer_cache_slowdown = 1.0;
  double element_flop_s = 0.0;
  double exponential_s = 0.0;
  double error_function_s = 0.0;
  double random_number_s = 0.0;
  double roofline_exponent = 0.0;
  SizeMeasure size_measure = SizeMeasure::kSmallest;
};

// How a runtime forms a Cholesky inverse after the factorization: solving L L^T X = I against
// every column of I (2 d^3 FLOPs; PyTorch's cholesky_inverse as PipeFisher's harness runs it),
// or the lower triangle from L's trailing blocks, copied onto the upper one (2 d^3 / 3, as
// LAPACK's potri; this project's CPU runtime since 2026-11-28, kfac/cholesky_inverse_columns.h).
enum class InverseSolve { kIdentity, kLowerTriangle };

struct DeviceSpec {
  std::string name = "custom";
  // Dense peak FLOP/s; 0 where the device has no such mode (e.g. no tf32 before A100).
  double peak_fp32_flops = 0.0;
  double peak_tf32_flops = 0.0;
  double peak_bf16_flops = 0.0;
  double peak_fp16_flops = 0.0;
  double matmul_efficiency = 0.7;  // achieved fraction of peak for the model's matrix products
  double memory_bandwidth = 0.0;   // bytes/s
  double link_bandwidth = 0.0;     // bytes/s per direction to a neighbour
  double link_latency_s = 0.0;     // per message
  // The host link (PCIe to host memory), per direction: K-FAC offload transfers
  // (docs/offload.md). 0: not known (a run that offloads refuses it). Optional in JSON files.
  double host_bandwidth = 0.0;  // bytes/s
  double host_latency_s = 0.0;  // per transfer
  // Device memory per GPU in bytes (the presets: nvidia-smi's total). 0: not known; the parallel
  // model's cluster of one device type then assumes 80 GiB. Optional in JSON files ("memory_gb",
  // GB = 1e9 bytes).
  double memory_bytes = 0.0;
  // Per-class rates (indexed by OpClass) and, for dense products, a per-precision efficiency
  // (indexed by Precision; <= 0: the gemm class's).
  std::array<ClassRate, kNumOpClasses> classes{};
  std::array<double, 4> gemm_efficiency_by_precision{};
  // Host time to issue one kernel (framework dispatch + driver launch). Kernels queue behind it:
  // a run of small kernels costs (kernels x launch overhead), not their device time.
  double launch_overhead_s = 0.0;
  // The same for backward kernels; < 0: launch_overhead_s. (Eager frameworks dispatch the
  // forward from Python and the backward from a C++ autograd engine.)
  double backward_launch_overhead_s = -1.0;
  // Host time per K-FAC factor whose curvature is computed, before its kernels are issued: the
  // K-FAC library's bookkeeping (PipeFisher's asdl, in Python: the hooks that save the factor's
  // inputs or output gradients in the forward and backward, and the loop around its product).
  // 0: none (this project's runtime, the presets).
  double curvature_host_overhead_s = 0.0;
  // The runtime's Cholesky inverse (the triangular solve's FLOPs, kfac_kernels.h); the presets
  // and files without the field: kIdentity.
  InverseSolve inverse_solve = InverseSolve::kIdentity;
  // The K-FAC task overhead of the analytic models (sim/kfac_overheads.h): what every K-FAC task
  // pays whatever its size, and each piece of a divided task again; per kind where given, else
  // kfac_task_overhead_s. Files without the fields: 10 us for every kind.
  double kfac_task_overhead_s = kDefaultKfacTaskOverheadS;
  KfacKindOverheads kfac_kind_overheads_s{};
  double kfac_overhead(sched::OpKind kind) const {
    return kfac_overhead_of(kind, kfac_task_overhead_s, kfac_kind_overheads_s);
  }

  // Efficiency and latency of a class after the defaults above.
  double efficiency(OpClass op_class) const;
  double gemm_efficiency(Precision precision) const;
  double latency_s(OpClass op_class) const { return classes[static_cast<int>(op_class)].latency_s; }
  // The class's shape factor in (0, 1] for a kernel of size s (ClassRate); 1 without a curve or
  // for s <= 0 (size unknown).
  double size_factor(OpClass op_class, double size) const;
  double backward_launch_s() const {
    return backward_launch_overhead_s < 0.0 ? launch_overhead_s : backward_launch_overhead_s;
  }

  // Peak for the given precision; throws (naming the device) when the device lacks the mode.
  double peak_flops(Precision precision) const;
  // Peak used for K-FAC's fp32 matrix products: tf32 tensor cores where the device has them
  // and the run is not strict fp32, the fp32 peak otherwise.
  double kfac_matmul_peak(Precision precision) const;
  // Throws std::invalid_argument naming `source`, the field and the value.
  void validate(std::string_view source) const;
};

DeviceSpec device_preset(std::string_view name);  // throws with the list of presets
std::vector<std::string> device_preset_names();

// {"name": "...", "peak_flops": {"fp32": F, "tf32": F, "bf16": F, "fp16": F},
//  "matmul_efficiency": E, "memory_bandwidth": B, "link_bandwidth": B, "link_latency_s": S,
//  optional: "launch_overhead_s": S, "backward_launch_overhead_s": S,
//            "curvature_host_overhead_s": S,
//            "inverse_solve": "identity" | "lower_triangle" (InverseSolve),
//            "host_bandwidth": B, "host_latency_s": S (PCIe to host memory),
//            "memory_gb": G (device memory, GB = 1e9 bytes),
//            "kfac_task_overhead_s": S (every K-FAC kind; default 1e-5),
//            "kfac_task_overheads": {"curvature_a_s": S, "curvature_b_s": S,
//                                    "curvature_sync_s": S, "invert_a_s": S, "invert_b_s": S,
//                                    "precondition_s": S} (each optional: a kind's own),
//            "classes": {"gemm": {"efficiency": E, "latency_s": S, "by_precision": {"bf16": E},
//                                 "half_efficiency_size": D, "size_exponent": P},
//                        "attention": {...},
//                        "memory": {..., "beyond_cache_slowdown": K, "outer_cache_bytes": B,
//                                   "beyond_outer_cache_slowdown": K, "element_flop_s": S,
//                                   "exponential_s": S, "error_function_s": S,
//                                   "random_number_s": S},
//                        "factorization": {...}, "triangular_solve": {...},
//                        "eigendecomposition": {...}}}
// fp32 is required; the other precisions are optional (absent = unsupported). Files without the
// optional fields price every product at matmul_efficiency with no latencies (the first model).
// "special_function_s" (files written before exp and erf were priced apart) sets both
// exponential_s and error_function_s; either of those, when given too, overrides it.
DeviceSpec device_from_json(const nlohmann::json& json, std::string_view source);
DeviceSpec device_from_json_file(const std::filesystem::path& path);
nlohmann::json device_to_json(const DeviceSpec& device);
// A preset name, "this-cpu" (this machine's CPU, one core, its peaks measured: sim/cpu_device.h)
// or a path to a JSON file.
DeviceSpec resolve_device(std::string_view name_or_path);

}  // namespace pf::sim
