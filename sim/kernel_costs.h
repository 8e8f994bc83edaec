#pragma once
// Prices work as the device runs it: a sequence of kernels, each of one operation class
// (sim/device.h). A kernel takes
//   latency(class) x panels + max(flops / (peak(precision) x efficiency(class) x shape(size)),
//                                 bytes / (memory_bandwidth x efficiency(memory) x
//                                          cache(bytes)),
//                                 element_work_s)
// where element_work_s = flops x element_flop_s + exponentials x exponential_s +
// error_functions x error_function_s + random_numbers x random_number_s (the memory class's
// per-element compute terms) prices an
// element-wise kernel's arithmetic; the FLOP classes' flops run at their peak x efficiency and an
// element-wise kernel's flops at element_flop_s.
// on the device (panels = ceil(d / 256) for the factorization classes of a d x d matrix, 1
// otherwise: blocked factorizations run one dependent step per panel; shape(size) is the class's
// efficiency curve in the kernel's size and cache(bytes) the memory class's curve in the bytes,
// DeviceSpec::size_factor, 1 without them). The host issues
// the kernels one after another, launch_overhead_s apart, and the device runs each once it is
// issued and the previous one is done:
//   issue_i = issue_{i-1} + launch;  end_i = max(end_{i-1}, issue_i) + device_time_i
// so a run of small kernels costs its launches (the "launch floor") and a run of large ones its
// device time. A kernel with host_sync makes the host wait for it (error-info checks, .item()).
#include <span>
#include <vector>

#include "sim/device.h"

namespace pf::sim {

struct Kernel {
  OpClass op_class = OpClass::kMemory;
  Precision precision = Precision::kFp32;  // arithmetic of gemm / attention kernels
  double flops = 0.0;
  double bytes = 0.0;  // bytes read + written
  // Smallest dimension of a product; matrix order d of a factorization, solve or
  // eigendecomposition (also its panel count); 0: unknown (no shape factor).
  double size = 0.0;
  // A product's harmonic mean dimension 3 / (1/m + 1/n + 1/k) (SizeMeasure::kHarmonicMean);
  // 0: unknown.
  double mean_size = 0.0;
  // Element-wise work of a memory-class kernel beyond its flops: evaluations of exp and tanh
  // (softmax, the pooler), of erf (GELU) and random numbers drawn (dropout). exp and erf are
  // priced apart: on this project's CPU an erf costs about half of softmax's exp per element.
  double exponentials = 0.0;
  double error_functions = 0.0;
  double random_numbers = 0.0;
  int count = 1;  // identical kernels in a row
  bool host_sync = false;
  // The first kernel of one K-FAC factor's curvature: the host spends
  // DeviceSpec::curvature_host_overhead_s (the K-FAC library's bookkeeping for the factor) before
  // issuing it, on top of its launch.
  bool curvature_host = false;
  // A Cholesky inverse's solve against I, whose FLOPs are priced for the device's
  // DeviceSpec::inverse_solve (a third of them for kLowerTriangle).
  bool inverse_solve = false;
};
using Kernels = std::vector<Kernel>;

// Shorthands for the kernel lists of bert_kernels.h and kfac_kernels.h.
Kernel gemm_kernel(Precision precision, double m, double n, double k, double element_bytes,
                   int count = 1);  // 2mnk FLOPs; reads m x k and k x n, writes m x n
Kernel memory_kernel(double bytes, int count = 1);
// Per-element arithmetic of an element-wise kernel (totals over its elements).
struct ElementWork {
  double flops = 0.0;
  double exponentials = 0.0;     // exp, tanh
  double error_functions = 0.0;  // erf
  double random_numbers = 0.0;
};
// `elements` elements, each doing `each` (e.g. {.flops = 4, .error_functions = 1} for GELU).
ElementWork per_element(double elements, const ElementWork& each);
// An element-wise (memory-class) kernel that moves `bytes` and does `work`.
Kernel elementwise_kernel(double bytes, const ElementWork& work, int count = 1);

// One optimizer step over `params` parameters (LAMB / Adam: ~16 FLOPs and a square root per
// parameter for the moments, the update and the trust ratio, the square root priced as an
// exponential-class evaluation; 28 bytes per parameter moved).
Kernel optimizer_step_kernel(double params, int count = 1);

// Device time of one kernel (above). Throws std::invalid_argument when the device lacks the
// kernel's precision.
double kernel_seconds(const DeviceSpec& device, const Kernel& kernel);

// Device times of a kernel list, ready to be queued (the precision checks happen once).
struct PricedKernels {
  std::vector<double> seconds;  // per kernel (one entry per count)
  std::vector<bool> host_sync;
  std::vector<double> host_s;  // host time before the kernel's launch (curvature bookkeeping)
};
PricedKernels price(const DeviceSpec& device, const Kernels& kernels);

// Time from the first launch until the device finishes the last kernel of `priced`, issued by a
// host `launch_overhead_s` per kernel; `repeat` runs the list that many times back to back.
double queued_seconds(const PricedKernels& priced, double launch_overhead_s, int repeat = 1);
// The same for several lists issued back to back (e.g. embeddings, n layers, heads).
struct QueuedPart {
  const PricedKernels* kernels = nullptr;
  int repeat = 1;
  double launch_overhead_s = -1.0;  // < 0: the call's
};
double queued_seconds(std::span<const QueuedPart> parts, double launch_overhead_s);

// What one instruction of a worker costs on a device (a chunk's forward or backward, a K-FAC
// task): its kernels queued from an empty queue (the host starts launching when the instruction
// starts, the device idle), forward work at launch_overhead_s a kernel and backward work at
// backward_launch_s() (a part's own launch_overhead_s >= 0 wins). The one definition both the
// simulator's analytic durations (AnalyticCostModel) and calibrate's prices of the runtime's
// instruction records (chunk_*, sim/calibration.h) use: docs/simulator.md, "One price for an
// instruction".
double instruction_seconds(const DeviceSpec& device, std::span<const QueuedPart> parts,
                           bool backward);
double instruction_seconds(const DeviceSpec& device, const PricedKernels& kernels, bool backward);

// Totals of a list (for FLOP counts and tests).
double total_flops(const Kernels& kernels);
double total_bytes(const Kernels& kernels);
int total_kernels(const Kernels& kernels);

}  // namespace pf::sim
