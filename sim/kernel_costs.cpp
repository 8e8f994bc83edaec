#include "sim/kernel_costs.h"

#include <algorithm>
#include <cmath>

namespace pf::sim {
namespace {

// Blocked factorizations (cuSOLVER, MAGMA, Eigen) advance one panel of this many columns per
// dependent step; each step pays the class latency.
constexpr double kPanelColumns = 256.0;

bool is_matrix_function(OpClass op_class) {
  return op_class == OpClass::kFactorization || op_class == OpClass::kTriangularSolve ||
         op_class == OpClass::kEigendecomposition;
}

}  // namespace

Kernel gemm_kernel(Precision precision, double m, double n, double k, double element_bytes,
                   int count) {
  Kernel kernel;
  kernel.op_class = OpClass::kGemm;
  kernel.precision = precision;
  kernel.flops = 2.0 * m * n * k;
  kernel.bytes = element_bytes * (m * k + k * n + m * n);
  kernel.size = std::min({m, n, k});
  kernel.mean_size = m > 0.0 && n > 0.0 && k > 0.0 ? 3.0 / (1.0 / m + 1.0 / n + 1.0 / k) : 0.0;
  kernel.count = count;
  return kernel;
}

Kernel memory_kernel(double bytes, int count) {
  Kernel kernel;
  kernel.bytes = bytes;
  kernel.count = count;
  return kernel;
}

ElementWork per_element(double elements, const ElementWork& each) {
  return {elements * each.flops, elements * each.exponentials, elements * each.error_functions,
          elements * each.random_numbers};
}

Kernel elementwise_kernel(double bytes, const ElementWork& work, int count) {
  Kernel kernel = memory_kernel(bytes, count);
  kernel.flops = work.flops;
  kernel.exponentials = work.exponentials;
  kernel.error_functions = work.error_functions;
  kernel.random_numbers = work.random_numbers;
  return kernel;
}

Kernel optimizer_step_kernel(double params, int count) {
  return elementwise_kernel(28.0 * params, per_element(params, {.flops = 16, .exponentials = 1}),
                            count);
}

double kernel_seconds(const DeviceSpec& device, const Kernel& kernel) {
  double peak = device.peak_fp32_flops;
  double efficiency = device.efficiency(kernel.op_class);
  if (kernel.op_class == OpClass::kGemm) {
    peak = device.peak_flops(kernel.precision);
    efficiency = device.gemm_efficiency(kernel.precision);
  } else if (kernel.op_class == OpClass::kAttention) {
    peak = device.peak_flops(kernel.precision);
  }
  const ClassRate& elementwise = device.classes[static_cast<std::size_t>(OpClass::kMemory)];
  double compute = 0.0;
  if (kernel.op_class == OpClass::kMemory) {
    compute = kernel.flops * elementwise.element_flop_s +
              kernel.exponentials * elementwise.exponential_s +
              kernel.error_functions * elementwise.error_function_s +
              kernel.random_numbers * elementwise.random_number_s;
  } else if (kernel.flops > 0.0) {
    const double flops =
        kernel.inverse_solve && device.inverse_solve == InverseSolve::kLowerTriangle
            ? kernel.flops / 3.0
            : kernel.flops;
    const bool mean = device.classes[static_cast<std::size_t>(kernel.op_class)].size_measure ==
                          SizeMeasure::kHarmonicMean &&
                      kernel.mean_size > 0.0;
    compute = flops / (peak * efficiency *
                       device.size_factor(kernel.op_class, mean ? kernel.mean_size : kernel.size));
  }
  // The memory class's cache curve applies to element-wise kernels only, so that a change of it
  // moves only that class (a product's bytes are mostly reused from caches anyway).
  const double cache = kernel.op_class == OpClass::kMemory
                           ? device.size_factor(OpClass::kMemory, kernel.bytes)
                           : 1.0;
  const double memory =
      kernel.bytes / (device.memory_bandwidth * device.efficiency(OpClass::kMemory) * cache);
  const double panels = is_matrix_function(kernel.op_class)
                            ? std::max(1.0, std::ceil(kernel.size / kPanelColumns))
                            : 1.0;
  const double roofline_exponent = elementwise.roofline_exponent;
  const double busy =
      kernel.op_class == OpClass::kMemory && roofline_exponent > 0.0 && compute > 0.0 &&
              memory > 0.0
          ? std::max(compute, memory) *
                std::pow(1.0 + std::pow(std::min(compute, memory) / std::max(compute, memory),
                                        roofline_exponent),
                         1.0 / roofline_exponent)
          : std::max(compute, memory);
  return device.latency_s(kernel.op_class) * panels + busy;
}

PricedKernels price(const DeviceSpec& device, const Kernels& kernels) {
  PricedKernels priced;
  for (const Kernel& kernel : kernels) {
    const double seconds = kernel_seconds(device, kernel);
    const double host = kernel.curvature_host ? device.curvature_host_overhead_s : 0.0;
    for (int i = 0; i < kernel.count; ++i) {
      priced.seconds.push_back(seconds);
      priced.host_sync.push_back(kernel.host_sync);
      priced.host_s.push_back(host);
    }
  }
  return priced;
}

double queued_seconds(std::span<const QueuedPart> parts, double launch_overhead_s) {
  double host = 0.0, device = 0.0;
  for (const QueuedPart& part : parts) {
    const auto& k = *part.kernels;
    const double launch =
        part.launch_overhead_s >= 0.0 ? part.launch_overhead_s : launch_overhead_s;
    for (int r = 0; r < part.repeat; ++r) {
      for (std::size_t i = 0; i < k.seconds.size(); ++i) {
        host += launch + k.host_s[i];
        device = std::max(device, host) + k.seconds[i];
        if (k.host_sync[i]) host = device;
      }
    }
  }
  return device;
}

double queued_seconds(const PricedKernels& priced, double launch_overhead_s, int repeat) {
  const QueuedPart part{&priced, repeat, -1.0};
  return queued_seconds(std::span<const QueuedPart>(&part, 1), launch_overhead_s);
}

double instruction_seconds(const DeviceSpec& device, std::span<const QueuedPart> parts,
                           bool backward) {
  return queued_seconds(parts, backward ? device.backward_launch_s() : device.launch_overhead_s);
}

double instruction_seconds(const DeviceSpec& device, const PricedKernels& kernels, bool backward) {
  const QueuedPart part{&kernels, 1, -1.0};
  return instruction_seconds(device, std::span<const QueuedPart>(&part, 1), backward);
}

double total_flops(const Kernels& kernels) {
  double flops = 0.0;
  for (const Kernel& k : kernels) flops += k.count * k.flops;
  return flops;
}

double total_bytes(const Kernels& kernels) {
  double bytes = 0.0;
  for (const Kernel& k : kernels) bytes += k.count * k.bytes;
  return bytes;
}

int total_kernels(const Kernels& kernels) {
  int count = 0;
  for (const Kernel& k : kernels) count += k.count;
  return count;
}

}  // namespace pf::sim
