#pragma once
// A device for this machine's CPU, one core: its nominal peaks from its clock and its vector
// width, the start for fitting it to measurements (`pipefisher_sim calibrate --device
// this-cpu`, scripts/calibrate_from_training.sh). A fit's efficiencies are fractions of these
// peaks and cannot pass 1, so a start below what the kernels reach caps the fit: the shipped
// sim/calibration/cpu_start.json is an AVX2 core at 2.45 GHz (78 GFLOP/s), and an AVX-512 Xeon
// whose OpenBLAS products run at 140 GFLOP/s per core fitted to it 30% slow.
#include <vector>

#include "common/cpu_caches.h"
#include "sim/device.h"

namespace pf::sim {

// The name resolve_device() takes for this CPU.
inline constexpr const char* kThisCpuDevice = "this-cpu";

// fp32 FLOP per cycle of one core by vector tier (common/cpu_vectors.h): two FMA units of the
// tier's width (AVX-512 16 lanes, AVX2 8), AVX a multiply and an add of 8 lanes, SSE of 4.
double cpu_flops_per_cycle(int vector_tier);
// Bytes per cycle one core loads from its first-level cache: two vector loads a cycle (AVX-512
// 128, AVX2 64, AVX and SSE 32), the memory class's reference bandwidth (what memory costs
// beyond the caches is fitted as a slowdown). One load a cycle capped the memory class's fit at
// its bound on the Emerald Rapids Xeon.
double cpu_cache_bytes_per_cycle(int vector_tier);

// The device (pure, tested): fp32 peak clock x FLOP per cycle, memory bandwidth clock x bytes
// per cycle, matmul efficiency 0.5 before a fit, the runtime's triangular inverse
// (inverse_solve lower_triangle) and attention sized by the harmonic mean, as cpu_start.json.
// With the CPU's caches (common/cpu_caches.h) the memory class's two bandwidth cliffs are placed
// for a fit to start from: the first at the L2 (half_efficiency_size; an element-wise kernel the
// simulator prices never fits in an L1), the outer one at the last level beyond it
// (outer_cache_bytes); their slowdowns stay 1, so the device prices nothing differently until
// fitted. Throws std::invalid_argument for a clock that is not positive and finite or a tier
// outside 0-3.
DeviceSpec cpu_device(double clock_hz, int vector_tier, const std::vector<CacheLevel>& caches = {});

// This core's clock while it runs (turbo included), measured: a chain of dependent integer
// register additions retires one per cycle, timed over a few milliseconds, the fastest of several
// tries (a try the machine took the core away from runs slower, never faster). Throws
// std::runtime_error where it cannot measure (a CPU that is not x86-64).
double measure_core_clock_hz();

// cpu_device(measure_core_clock_hz(), cpu_vector_tier(), cpu_data_caches()), named
// "this-cpu (AVX-512, 2.95 GHz)".
DeviceSpec this_cpu_device();

}  // namespace pf::sim
