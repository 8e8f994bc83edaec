// The per-class device model (sim/kernel_costs.h) and its calibration (sim/calibration.h):
// launch floor, per-class rates, the fit recovering known parameters, measurement-file errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/model/bert_config.h"
#include "scheduler/compile.h"
#include "sim/analytic_cost_model.h"
#include "sim/bert_costs.h"
#include "sim/bert_kernels.h"
#include "sim/calibration.h"
#include "sim/cpu_device.h"
#include "sim/device.h"
#include "sim/kernel_costs.h"
#include "sim/kfac_kernels.h"
#include "sim/profile_measurements.h"
#include "sim/simulator.h"
#include "tests/sim/error_message.h"

namespace pf::sim {
namespace {

using test::error_of;

// A device with simple numbers: 1 TFLOP/s fp32, 100 GB/s.
DeviceSpec simple_device() {
  DeviceSpec d;
  d.name = "simple";
  d.peak_fp32_flops = 1e12;
  d.matmul_efficiency = 0.5;
  d.memory_bandwidth = 1e11;
  d.link_bandwidth = 1e10;
  return d;
}

TEST(SimKernelCosts, LaunchFloorBoundsARunOfSmallKernels) {
  DeviceSpec d = simple_device();
  d.launch_overhead_s = 10e-6;
  // 100 tiny element-wise kernels of 1 KB: device time 10 ns each, so the host's launches bound
  // the run: 100 x 10 us (the last one then runs its 10 ns).
  const PricedKernels tiny = price(d, {memory_kernel(1e3, 100)});
  EXPECT_NEAR(queued_seconds(tiny, d.launch_overhead_s), 100 * 10e-6 + 1e-8, 1e-12);
  // One large product: launch once, then its device time 2 x 1024^3 / (0.5 x 1e12).
  const PricedKernels big = price(d, {gemm_kernel(Precision::kFp32, 1024, 1024, 1024, 4.0)});
  EXPECT_NEAR(queued_seconds(big, d.launch_overhead_s), 10e-6 + 2.0 * std::pow(1024, 3) / 0.5e12,
              1e-12);
  // A host sync makes the next launch wait for the device.
  Kernel synced = memory_kernel(1e7);  // 100 us
  synced.host_sync = true;
  const PricedKernels with_sync = price(d, {synced, memory_kernel(1e3)});
  EXPECT_NEAR(queued_seconds(with_sync, d.launch_overhead_s), 10e-6 + 100e-6 + 10e-6 + 1e-8, 1e-12);
}

TEST(SimKernelCosts, ChangingOneClassMovesOnlyItsOperations) {
  const DeviceSpec base = simple_device();
  // Shapes large enough to stay compute-bound even at 5% of the memory bandwidth.
  const Kernel gemm = gemm_kernel(Precision::kFp32, 2048, 2048, 2048, 4.0);
  Kernel attention = gemm;
  attention.op_class = OpClass::kAttention;
  const Kernel memory = memory_kernel(1e8);
  Kernel potrf;  // the Cholesky factorization of a 4096 x 4096 factor
  for (const Kernel& k : inversion_kernels(4096)) {
    if (k.op_class == OpClass::kFactorization) potrf = k;
  }
  auto all = [&](const DeviceSpec& d) {
    return std::array<double, 4>{kernel_seconds(d, gemm), kernel_seconds(d, attention),
                                 kernel_seconds(d, memory), kernel_seconds(d, potrf)};
  };
  const auto before = all(base);
  const OpClass classes[] = {OpClass::kGemm, OpClass::kAttention, OpClass::kMemory,
                             OpClass::kFactorization};
  for (int c = 0; c < 4; ++c) {
    DeviceSpec changed = base;
    changed.classes[static_cast<std::size_t>(classes[c])].efficiency = 0.05;
    const auto after = all(changed);
    for (int o = 0; o < 4; ++o) {
      if (o == c) {
        EXPECT_GT(after[o], before[o] * 1.5) << "class " << c << " op " << o;
      } else {
        EXPECT_DOUBLE_EQ(after[o], before[o]) << "class " << c << " op " << o;
      }
    }
  }
  // The triangular solves that finish the inverse inherit the fp32 gemm rate (blocked trsm).
  DeviceSpec slower_gemm = base;
  slower_gemm.classes[static_cast<std::size_t>(OpClass::kGemm)].efficiency = 0.05;
  EXPECT_DOUBLE_EQ(slower_gemm.efficiency(OpClass::kTriangularSolve), 0.05);
  // A factorization latency is paid per 256-column panel: 16 panels at d = 4096.
  DeviceSpec slow = base;
  slow.classes[static_cast<std::size_t>(OpClass::kFactorization)].latency_s = 1e-3;
  EXPECT_NEAR(kernel_seconds(slow, potrf) - kernel_seconds(base, potrf), 16e-3, 1e-12);
}

TEST(SimKernelCosts, ShapeTermsMoveOnlyTheirClass) {
  const DeviceSpec base = simple_device();
  const Kernel gemm = gemm_kernel(Precision::kFp32, 4096, 64, 2048, 4.0);  // skinny: size 64
  Kernel attention = gemm;
  attention.op_class = OpClass::kAttention;
  const Kernel add = memory_kernel(1e8);
  const Kernel gelu = elementwise_kernel(8e6, per_element(1e6, {.flops = 4, .error_functions = 1}));
  const Kernel dropout =
      elementwise_kernel(8e6, per_element(1e6, {.flops = 2, .random_numbers = 1}));
  const Kernel softmax = elementwise_kernel(8e6, per_element(1e6, {.flops = 4, .exponentials = 1}));
  Kernel potrf;
  for (const Kernel& k : inversion_kernels(1024)) {
    if (k.op_class == OpClass::kFactorization) potrf = k;
  }
  EXPECT_EQ(gemm.size, 64.0);
  EXPECT_EQ(potrf.size, 1024.0);
  auto all = [&](const DeviceSpec& d) {
    return std::array<double, 7>{kernel_seconds(d, gemm),    kernel_seconds(d, attention),
                                 kernel_seconds(d, add),     kernel_seconds(d, gelu),
                                 kernel_seconds(d, dropout), kernel_seconds(d, potrf),
                                 kernel_seconds(d, softmax)};
  };
  const auto before = all(base);
  // Without the new terms an element-wise kernel is bandwidth-bound whatever its arithmetic.
  EXPECT_DOUBLE_EQ(before[3], 8e6 / 1e11);
  auto rate = [](DeviceSpec& d, OpClass c) -> ClassRate& {
    return d.classes[static_cast<std::size_t>(c)];
  };
  struct Change {
    const char* what;
    std::function<void(DeviceSpec&)> apply;
    std::vector<int> moved;  // indices into all()
  };
  const std::vector<Change> changes = {
      {"gemm curve",
       [&](DeviceSpec& d) { rate(d, OpClass::kGemm).half_efficiency_size = 128; },
       {0}},
      {"attention curve",
       [&](DeviceSpec& d) { rate(d, OpClass::kAttention).half_efficiency_size = 128; },
       {1}},
      {"factorization curve",
       [&](DeviceSpec& d) {
         rate(d, OpClass::kFactorization).half_efficiency_size = 2048;
         rate(d, OpClass::kFactorization).size_exponent = 2.0;
       },
       {5}},
      {"memory cache curve",
       [&](DeviceSpec& d) {
         rate(d, OpClass::kMemory).half_efficiency_size = 1e6;
         rate(d, OpClass::kMemory).beyond_cache_slowdown = 3.0;
       },
       {2, 3, 4, 6}},
      {"outer cache cliff",
       [&](DeviceSpec& d) {
         rate(d, OpClass::kMemory).outer_cache_bytes = 1e6;
         rate(d, OpClass::kMemory).beyond_outer_cache_slowdown = 3.0;
       },
       {2, 3, 4, 6}},
      {"element flops",
       [&](DeviceSpec& d) { rate(d, OpClass::kMemory).element_flop_s = 1e-9; },
       {3, 4, 6}},
      {"exponentials", [&](DeviceSpec& d) { rate(d, OpClass::kMemory).exponential_s = 1e-8; }, {6}},
      {"error functions",
       [&](DeviceSpec& d) { rate(d, OpClass::kMemory).error_function_s = 1e-8; },
       {3}},
      {"random numbers",
       [&](DeviceSpec& d) { rate(d, OpClass::kMemory).random_number_s = 1e-8; },
       {4}},
  };
  for (const Change& change : changes) {
    DeviceSpec changed = base;
    change.apply(changed);
    const auto after = all(changed);
    for (int o = 0; o < static_cast<int>(before.size()); ++o) {
      const bool moves =
          std::find(change.moved.begin(), change.moved.end(), o) != change.moved.end();
      if (moves) {
        EXPECT_GT(after[o], before[o] * 1.2) << change.what << " op " << o;
      } else {
        EXPECT_DOUBLE_EQ(after[o], before[o]) << change.what << " op " << o;
      }
    }
  }
  // The curve: half the class efficiency at the half size, as the formula says elsewhere.
  DeviceSpec curved = base;
  rate(curved, OpClass::kGemm).half_efficiency_size = 64;
  rate(curved, OpClass::kGemm).size_exponent = 3.0;
  EXPECT_NEAR(kernel_seconds(curved, gemm) / kernel_seconds(base, gemm), 2.0, 1e-12);
  EXPECT_NEAR(curved.size_factor(OpClass::kGemm, 128), 1.0 / (1.0 + 0.125), 1e-12);
  // Element-wise compute: max(bandwidth, flops + evaluations + draws).
  DeviceSpec work = base;
  rate(work, OpClass::kMemory).element_flop_s = 1e-10;
  rate(work, OpClass::kMemory).error_function_s = 2e-9;
  rate(work, OpClass::kMemory).exponential_s = 3e-9;
  EXPECT_NEAR(kernel_seconds(work, gelu), 1e6 * (4 * 1e-10 + 2e-9), 1e-15);
  EXPECT_NEAR(kernel_seconds(work, softmax), 1e6 * (4 * 1e-10 + 3e-9), 1e-15);
}

TEST(SimKernelCosts, RooflineExponentOverlapsComputeAndBandwidthOfElementWiseWorkOnly) {
  DeviceSpec base = simple_device();
  auto& memory = base.classes[static_cast<std::size_t>(OpClass::kMemory)];
  memory.element_flop_s = 1e-11;
  memory.error_function_s = 7e-11;        // GELU: 1e6 x (4e-11 + 7e-11) = 1.1e-4 s of arithmetic
  const double bandwidth_s = 8e6 / 1e11;  // and 8e-5 s of bytes
  const Kernel gelu = elementwise_kernel(8e6, per_element(1e6, {.flops = 4, .error_functions = 1}));
  const Kernel add = memory_kernel(8e6);  // no element-wise work priced: bytes only
  const Kernel gemm = gemm_kernel(Precision::kFp32, 512, 512, 512, 4.0);
  Kernel attention = gemm;
  attention.op_class = OpClass::kAttention;
  Kernel potrf;
  for (const Kernel& k : inversion_kernels(1024)) {
    if (k.op_class == OpClass::kFactorization) potrf = k;
  }
  ASSERT_NEAR(kernel_seconds(base, gelu), 1.1e-4, 1e-15);  // 0: the max of the two
  auto with = [&](double exponent) {
    DeviceSpec d = base;
    d.classes[static_cast<std::size_t>(OpClass::kMemory)].roofline_exponent = exponent;
    return d;
  };
  EXPECT_NEAR(kernel_seconds(with(1.0), gelu), 1.1e-4 + bandwidth_s, 1e-15);  // no overlap
  EXPECT_NEAR(kernel_seconds(with(2.0), gelu), std::hypot(1.1e-4, bandwidth_s), 1e-15);
  EXPECT_NEAR(kernel_seconds(with(64.0), gelu), 1.1e-4, 1e-9);  // towards the max
  for (const double exponent : {1.0, 2.0, 4.0}) {
    const DeviceSpec d = with(exponent);
    EXPECT_DOUBLE_EQ(kernel_seconds(d, add), kernel_seconds(base, add)) << exponent;
    EXPECT_DOUBLE_EQ(kernel_seconds(d, gemm), kernel_seconds(base, gemm)) << exponent;
    EXPECT_DOUBLE_EQ(kernel_seconds(d, attention), kernel_seconds(base, attention)) << exponent;
    EXPECT_DOUBLE_EQ(kernel_seconds(d, potrf), kernel_seconds(base, potrf)) << exponent;
  }
  // The file field: written when set, read back, and refused below 1 with its name.
  const DeviceSpec back = device_from_json(device_to_json(with(2.5)), "round trip");
  EXPECT_DOUBLE_EQ(back.classes[static_cast<std::size_t>(OpClass::kMemory)].roofline_exponent, 2.5);
  EXPECT_FALSE(device_to_json(base)["classes"]["memory"].contains("roofline_exponent"));
  nlohmann::json bad = device_to_json(with(2.5));
  bad["classes"]["memory"]["roofline_exponent"] = 0.5;
  EXPECT_NE(
      error_of([&] { device_from_json(bad, "bad"); }).find("classes.memory.roofline_exponent"),
      std::string::npos);
  bad = device_to_json(base);
  bad["classes"]["gemm"]["roofline_exponent"] = 2.0;
  EXPECT_NE(error_of([&] { device_from_json(bad, "bad"); }).find("classes.gemm.roofline_exponent"),
            std::string::npos);
}

TEST(SimKernelCosts, HarmonicMeanSizeRanksProductsByTheirWholeShape) {
  // The gemm curve on the harmonic mean of m, n, k: a wide product (4096 x 4096 x 4096) is
  // closer to the class efficiency than one of the same smallest dimension but skinny in the
  // others (4096 x 512 x 512: smallest 512, harmonic mean 768 -> efficiency e / (1 + h / 768)).
  DeviceSpec d = simple_device();
  auto& gemm = d.classes[static_cast<std::size_t>(OpClass::kGemm)];
  gemm.half_efficiency_size = 1024;
  gemm.size_measure = SizeMeasure::kHarmonicMean;
  const Kernel wide = gemm_kernel(Precision::kFp32, 4096, 4096, 4096, 4.0);
  const Kernel skinny = gemm_kernel(Precision::kFp32, 4096, 512, 512, 4.0);
  EXPECT_NEAR(wide.mean_size, 4096.0, 1e-9);
  EXPECT_NEAR(skinny.mean_size, 3.0 / (1.0 / 4096 + 2.0 / 512), 1e-9);
  DeviceSpec flat = simple_device();
  const double wide_ratio = kernel_seconds(d, wide) / kernel_seconds(flat, wide);
  const double skinny_ratio = kernel_seconds(d, skinny) / kernel_seconds(flat, skinny);
  EXPECT_NEAR(wide_ratio, 1.0 + 1024.0 / 4096.0, 1e-9);
  EXPECT_NEAR(skinny_ratio, 1.0 + 1024.0 / skinny.mean_size, 1e-9);
  // The smallest dimension (the default) cannot tell a 512 x 4096 x 4096 product from the
  // skinny one; the harmonic mean can.
  const Kernel flat_one = gemm_kernel(Precision::kFp32, 512, 4096, 4096, 4.0);
  gemm.size_measure = SizeMeasure::kSmallest;
  EXPECT_NEAR(kernel_seconds(d, flat_one) / kernel_seconds(flat, flat_one),
              kernel_seconds(d, skinny) / kernel_seconds(flat, skinny), 1e-9);
  // The JSON field: written only when set, read back, and a bad value is named.
  gemm.size_measure = SizeMeasure::kHarmonicMean;
  nlohmann::json json = device_to_json(d);
  EXPECT_EQ(json["classes"]["gemm"]["size_measure"], "harmonic_mean");
  EXPECT_EQ(device_from_json(json, "round trip").classes[0].size_measure,
            SizeMeasure::kHarmonicMean);
  EXPECT_FALSE(device_to_json(flat)["classes"]["gemm"].contains("size_measure"));
  json["classes"]["gemm"]["size_measure"] = "largest";
  EXPECT_NE(error_of([&] { device_from_json(json, "bad"); }).find("smallest, harmonic_mean"),
            std::string::npos);
  // The attention class reads either size too (its per-head products are products); the other
  // classes have one size each.
  json["classes"]["gemm"]["size_measure"] = "smallest";
  json["classes"]["attention"]["size_measure"] = "harmonic_mean";
  EXPECT_EQ(device_from_json(json, "attention").classes[1].size_measure,
            SizeMeasure::kHarmonicMean);
  json["classes"]["memory"]["size_measure"] = "harmonic_mean";
  EXPECT_NE(error_of([&] { device_from_json(json, "bad"); }).find("classes.memory.size_measure"),
            std::string::npos);
}

TEST(SimCalibration, DevicesWithoutShapeTermsKeepTheirFiles) {
  for (const auto& name : device_preset_names()) {
    const nlohmann::json json = device_to_json(device_preset(name));
    for (const auto& [cls, entry] : json.at("classes").items()) {
      EXPECT_FALSE(entry.contains("half_efficiency_size")) << name << " " << cls;
      EXPECT_FALSE(entry.contains("exponential_s")) << name << " " << cls;
      EXPECT_FALSE(entry.contains("error_function_s")) << name << " " << cls;
      EXPECT_FALSE(entry.contains("element_flop_s")) << name << " " << cls;
    }
  }
  DeviceSpec d = simple_device();
  d.classes[static_cast<std::size_t>(OpClass::kGemm)].half_efficiency_size = 96;
  d.classes[static_cast<std::size_t>(OpClass::kGemm)].size_exponent = 2.5;
  d.classes[static_cast<std::size_t>(OpClass::kMemory)].half_efficiency_size = 3e7;
  d.classes[static_cast<std::size_t>(OpClass::kMemory)].beyond_cache_slowdown = 2.0;
  d.classes[static_cast<std::size_t>(OpClass::kMemory)].element_flop_s = 1e-10;
  d.classes[static_cast<std::size_t>(OpClass::kMemory)].exponential_s = 4e-9;
  d.classes[static_cast<std::size_t>(OpClass::kMemory)].error_function_s = 2e-9;
  d.classes[static_cast<std::size_t>(OpClass::kMemory)].random_number_s = 3e-9;
  const DeviceSpec back = device_from_json(device_to_json(d), "round trip");
  const Kernel gelu = elementwise_kernel(
      8e6,
      per_element(1e6, {.flops = 4, .exponentials = 1, .error_functions = 1, .random_numbers = 1}));
  const Kernel gemm = gemm_kernel(Precision::kFp32, 100, 200, 300, 4.0);
  EXPECT_DOUBLE_EQ(kernel_seconds(back, gelu), kernel_seconds(d, gelu));
  EXPECT_DOUBLE_EQ(kernel_seconds(back, memory_kernel(1e9)), kernel_seconds(d, memory_kernel(1e9)));
  // Beyond the caches the bandwidth settles at 1 / slowdown of the caches' (it does not go on
  // falling): 1e12 bytes take twice as long per byte as 1e3 bytes.
  EXPECT_NEAR(kernel_seconds(d, memory_kernel(1e12)) / kernel_seconds(d, memory_kernel(1e3)), 2e9,
              2e9 * 1e-4);
  EXPECT_DOUBLE_EQ(kernel_seconds(back, gemm), kernel_seconds(d, gemm));
  // A second cliff past the last-level cache: 3x slower again beyond 1e9 bytes, and only there.
  DeviceSpec two = d;
  two.classes[static_cast<std::size_t>(OpClass::kMemory)].outer_cache_bytes = 1e9;
  two.classes[static_cast<std::size_t>(OpClass::kMemory)].beyond_outer_cache_slowdown = 3.0;
  const DeviceSpec two_back = device_from_json(device_to_json(two), "round trip");
  EXPECT_DOUBLE_EQ(two_back.classes[static_cast<std::size_t>(OpClass::kMemory)].outer_cache_bytes,
                   1e9);
  for (const double bytes : {1e3, 1e6, 1e8, 1e12}) {
    EXPECT_DOUBLE_EQ(kernel_seconds(two_back, memory_kernel(bytes)),
                     kernel_seconds(two, memory_kernel(bytes)));
  }
  EXPECT_NEAR(kernel_seconds(two, memory_kernel(1e3)) / kernel_seconds(d, memory_kernel(1e3)), 1.0,
              1e-5);
  EXPECT_NEAR(kernel_seconds(two, memory_kernel(1e12)) / kernel_seconds(d, memory_kernel(1e12)),
              3.0, 3e-3);
  EXPECT_NEAR(kernel_seconds(two, memory_kernel(1e12)) / kernel_seconds(two, memory_kernel(1e3)),
              6e9, 6e9 * 1e-3);
  // Without the first cliff the outer one still acts; a file without it has no field of it.
  DeviceSpec outer_only = simple_device();
  outer_only.classes[static_cast<std::size_t>(OpClass::kMemory)].outer_cache_bytes = 1e9;
  outer_only.classes[static_cast<std::size_t>(OpClass::kMemory)].beyond_outer_cache_slowdown = 3.0;
  EXPECT_NEAR(kernel_seconds(outer_only, memory_kernel(1e12)) /
                  kernel_seconds(simple_device(), memory_kernel(1e12)),
              3.0, 3e-3);
  EXPECT_FALSE(device_to_json(d).at("classes").at("memory").contains("outer_cache_bytes"));
  nlohmann::json bad = device_to_json(two);
  bad["classes"]["memory"]["beyond_outer_cache_slowdown"] = 0.5;
  EXPECT_NE(error_of([&] {
              device_from_json(bad, "bad");
            }).find("classes.memory.beyond_outer_cache_slowdown"),
            std::string::npos);
  bad = device_to_json(two);
  bad["classes"]["memory"]["outer_cache_bytes"] = -1.0;
  EXPECT_NE(
      error_of([&] { device_from_json(bad, "bad"); }).find("classes.memory.outer_cache_bytes"),
      std::string::npos);
  bad = device_to_json(d);
  bad["classes"]["gemm"]["outer_cache_bytes"] = 1e6;  // a memory-class field
  EXPECT_NE(error_of([&] { device_from_json(bad, "bad"); }).find("outer_cache_bytes"),
            std::string::npos);
  bad = device_to_json(d);
  bad["classes"]["gemm"]["size_exponent"] = 0.0;
  EXPECT_NE(error_of([&] { device_from_json(bad, "bad"); }).find("classes.gemm.size_exponent"),
            std::string::npos);
  bad = device_to_json(d);
  bad["classes"]["gemm"]["error_function_s"] = 1e-9;  // a memory-class field
  EXPECT_NE(error_of([&] { device_from_json(bad, "bad"); }).find("error_function_s"),
            std::string::npos);
  // Files written before exp and erf were priced apart: their one term prices both, and a
  // specific field given beside it wins.
  nlohmann::json legacy = device_to_json(simple_device());
  legacy["classes"]["memory"]["special_function_s"] = 5e-9;
  const DeviceSpec old_file = device_from_json(legacy, "legacy");
  EXPECT_EQ(old_file.classes[static_cast<std::size_t>(OpClass::kMemory)].exponential_s, 5e-9);
  EXPECT_EQ(old_file.classes[static_cast<std::size_t>(OpClass::kMemory)].error_function_s, 5e-9);
  legacy["classes"]["memory"]["error_function_s"] = 1e-9;
  const DeviceSpec mixed = device_from_json(legacy, "legacy");
  EXPECT_EQ(mixed.classes[static_cast<std::size_t>(OpClass::kMemory)].exponential_s, 5e-9);
  EXPECT_EQ(mixed.classes[static_cast<std::size_t>(OpClass::kMemory)].error_function_s, 1e-9);
}

// Synthetic records: GEMMs of several shapes, element-wise passes, Cholesky inverses.
nlohmann::json synthetic_records() {
  nlohmann::json records = nlohmann::json::array();
  for (double n : {64.0, 256.0, 1024.0, 2048.0}) {
    records.push_back({{"operation", "gemm"}, {"m", n}, {"n", n}, {"k", n}, {"seconds", 1.0}});
  }
  records.push_back({{"operation", "gemm"}, {"m", 4096}, {"n", 64}, {"k", 256}, {"seconds", 1.0}});
  for (double bytes : {1e4, 1e6, 1e8}) {
    records.push_back({{"operation", "memory"}, {"bytes", bytes}, {"seconds", 1.0}});
  }
  for (double d : {128.0, 512.0, 1024.0, 2048.0}) {
    records.push_back({{"operation", "cholesky_inverse"}, {"order", d}, {"seconds", 1.0}});
  }
  return {{"format_version", 1}, {"measurements", records}};
}

TEST(SimCalibration, FitRecoversKnownParametersFromSyntheticDurations) {
  DeviceSpec truth = simple_device();
  truth.classes[static_cast<std::size_t>(OpClass::kGemm)].efficiency = 0.6;
  truth.classes[static_cast<std::size_t>(OpClass::kGemm)].latency_s = 3e-6;
  truth.classes[static_cast<std::size_t>(OpClass::kMemory)].efficiency = 0.8;
  truth.classes[static_cast<std::size_t>(OpClass::kFactorization)].efficiency = 0.2;
  truth.classes[static_cast<std::size_t>(OpClass::kFactorization)].latency_s = 50e-6;
  truth.launch_overhead_s = 5e-6;
  auto measurements = measurements_from_json(synthetic_records(), "synthetic", truth);
  for (auto& m : measurements) m.seconds = predict(truth, m);

  const FitResult fit = fit_device(simple_device(), measurements);
  EXPECT_LT(fit.rms_log_error, 1e-3);
  auto near = [](double got, double want, const char* what) {
    EXPECT_NEAR(got / want, 1.0, 0.03) << what << ": " << got << " vs " << want;
  };
  near(fit.device.gemm_efficiency(Precision::kFp32), 0.6, "gemm efficiency");
  near(fit.device.efficiency(OpClass::kMemory), 0.8, "memory efficiency");
  near(fit.device.efficiency(OpClass::kFactorization), 0.2, "factorization efficiency");
  near(fit.device.latency_s(OpClass::kFactorization), 50e-6, "factorization latency");
  near(fit.device.launch_overhead_s + fit.device.latency_s(OpClass::kGemm), 8e-6,
       "launch + gemm latency");
  for (const auto& r : residuals(fit.device, measurements)) {
    EXPECT_NEAR(r.relative_error, 0.0, 0.01) << r.label;
  }
}

// --keep: a kept parameter stays at the start device's value (and only it: the others are still
// fitted); a rule with a trailing '*' keeps a prefix; a rule that matches nothing is reported.
TEST(SimCalibration, KeptParametersStayAtTheStartValue) {
  DeviceSpec truth = simple_device();
  truth.classes[static_cast<std::size_t>(OpClass::kGemm)].efficiency = 0.6;
  truth.classes[static_cast<std::size_t>(OpClass::kMemory)].efficiency = 0.8;
  truth.launch_overhead_s = 5e-6;
  auto measurements = measurements_from_json(synthetic_records(), "synthetic", truth);
  for (auto& m : measurements) m.seconds = predict(truth, m);
  DeviceSpec start = simple_device();
  start.classes[static_cast<std::size_t>(OpClass::kMemory)].latency_s = 7e-6;  // wrong
  FitOptions options;
  options.keep = {"classes.memory.latency_s", "classes.factorization.*", "no.such.parameter"};
  const FitResult fit = fit_device(start, measurements, options);
  EXPECT_EQ(fit.device.latency_s(OpClass::kMemory), 7e-6);
  EXPECT_EQ(fit.device.efficiency(OpClass::kFactorization),
            start.efficiency(OpClass::kFactorization));
  EXPECT_EQ(fit.device.latency_s(OpClass::kFactorization), 0.0);
  const auto named = [](const std::vector<FitParameter>& params, const std::string& name) {
    return std::any_of(params.begin(), params.end(),
                       [&](const FitParameter& p) { return p.name() == name; });
  };
  EXPECT_TRUE(named(fit.kept, "classes.memory.latency_s"));
  EXPECT_TRUE(named(fit.kept, "classes.factorization.efficiency"));
  EXPECT_TRUE(named(fit.kept, "classes.factorization.latency_s"));
  EXPECT_FALSE(named(fit.parameters, "classes.memory.latency_s"));
  EXPECT_TRUE(named(fit.parameters, "classes.memory.efficiency"));  // still fitted
  EXPECT_NEAR(fit.device.gemm_efficiency(Precision::kFp32), 0.6, 0.03);
  ASSERT_EQ(fit.unmatched_keep.size(), 1U);
  EXPECT_EQ(fit.unmatched_keep[0], "no.such.parameter");
  // Without the rule the same fit moves the latency.
  const FitResult free = fit_device(start, measurements);
  EXPECT_NE(free.device.latency_s(OpClass::kMemory), 7e-6);
}

// GEMMs whose smallest dimension runs 8 ... 2048, element-wise kernels of five kinds (as
// bench_sim_calibrate times) from cache-sized to DRAM-sized, Cholesky inverses 64 ... 4096.
nlohmann::json synthetic_shape_records() {
  nlohmann::json records = nlohmann::json::array();
  for (double small : {8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0}) {
    records.push_back(
        {{"operation", "gemm"}, {"m", small}, {"n", 2048}, {"k", 1024}, {"seconds", 1.0}});
  }
  struct Kind {
    double bytes, flops, exponentials, error_functions, random;
  };
  const Kind kinds[] = {
      {12, 1, 0, 0, 0}, {8, 8, 0, 0, 0}, {8, 4, 1, 0, 0}, {8, 4, 0, 1, 0}, {8, 2, 0, 0, 1}};
  for (double elements : {1e4, 1e5, 1e6, 1e7, 1e8}) {
    for (const Kind& k : kinds) {
      records.push_back({{"operation", "memory"},
                         {"bytes", k.bytes * elements},
                         {"flops", k.flops * elements},
                         {"exponentials", k.exponentials * elements},
                         {"error_functions", k.error_functions * elements},
                         {"random_numbers", k.random * elements},
                         {"seconds", 1.0}});
    }
  }
  for (double d : {64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0}) {
    records.push_back({{"operation", "cholesky_inverse"}, {"order", d}, {"seconds", 1.0}});
  }
  return {{"format_version", 1}, {"measurements", records}};
}

TEST(SimCalibration, FitRecoversKnownShapeTermsFromSyntheticDurations) {
  DeviceSpec truth = simple_device();
  auto rate = [&](OpClass c) -> ClassRate& { return truth.classes[static_cast<std::size_t>(c)]; };
  rate(OpClass::kGemm).efficiency = 0.7;
  rate(OpClass::kGemm).half_efficiency_size = 48;
  rate(OpClass::kGemm).size_exponent = 2.0;
  rate(OpClass::kMemory).efficiency = 0.6;
  rate(OpClass::kMemory).half_efficiency_size = 2e8;
  rate(OpClass::kMemory).size_exponent = 1.5;
  rate(OpClass::kMemory).beyond_cache_slowdown = 2.5;
  rate(OpClass::kMemory).element_flop_s = 1e-10;
  rate(OpClass::kMemory).exponential_s = 2e-9;
  rate(OpClass::kMemory).error_function_s = 1e-9;
  rate(OpClass::kMemory).random_number_s = 5e-9;
  rate(OpClass::kMemory).roofline_exponent = 3.0;
  rate(OpClass::kFactorization).efficiency = 0.3;
  rate(OpClass::kFactorization).half_efficiency_size = 600;
  rate(OpClass::kFactorization).size_exponent = 1.5;
  truth.launch_overhead_s = 2e-6;
  auto measurements = measurements_from_json(synthetic_shape_records(), "synthetic", truth);
  for (auto& m : measurements) m.seconds = predict(truth, m);

  FitOptions options;
  options.max_evaluations = 60000;
  options.restarts = 6;
  const FitResult fit = fit_device(simple_device(), measurements, options);
  EXPECT_LT(fit.rms_log_error, 2e-3);
  const auto& got = fit.device.classes;
  auto near = [](double value, double want, const char* what) {
    EXPECT_NEAR(value / want, 1.0, 0.05) << what << ": " << value << " vs " << want;
  };
  auto at = [&](OpClass c) { return got[static_cast<std::size_t>(c)]; };
  near(fit.device.gemm_efficiency(Precision::kFp32), 0.7, "gemm efficiency");
  near(at(OpClass::kGemm).half_efficiency_size, 48, "gemm half-efficiency size");
  near(at(OpClass::kGemm).size_exponent, 2.0, "gemm size exponent");
  near(at(OpClass::kMemory).half_efficiency_size, 2e8, "memory half-way bytes");
  near(at(OpClass::kMemory).beyond_cache_slowdown, 2.5, "memory slowdown beyond the caches");
  near(at(OpClass::kMemory).element_flop_s, 1e-10, "element flop");
  near(at(OpClass::kMemory).exponential_s, 2e-9, "exponential");
  near(at(OpClass::kMemory).error_function_s, 1e-9, "error function");
  near(at(OpClass::kMemory).random_number_s, 5e-9, "random number");
  near(at(OpClass::kMemory).roofline_exponent, 3.0, "roofline exponent");
  near(at(OpClass::kFactorization).half_efficiency_size, 600, "factorization half size");
  near(at(OpClass::kFactorization).size_exponent, 1.5, "factorization size exponent");
  for (const auto& r : residuals(fit.device, measurements)) {
    EXPECT_NEAR(r.relative_error, 0.0, 0.01) << r.label;
  }
}

// A CPU's element-wise bandwidth in three plateaus (its L2, its last-level cache, memory): the
// fit recovers both cliffs from adds of 100 KB ... 400 MB, starting from where the start device
// places them (this-cpu: at the caches sysfs lists), and only such a start fits the outer one.
TEST(SimCalibration, FitRecoversTwoCacheCliffs) {
  DeviceSpec truth = simple_device();
  ClassRate& memory = truth.classes[static_cast<std::size_t>(OpClass::kMemory)];
  memory.efficiency = 0.25;
  memory.half_efficiency_size = 2.2e6;
  memory.size_exponent = 4.0;
  memory.beyond_cache_slowdown = 3.0;
  memory.outer_cache_bytes = 6e7;
  memory.beyond_outer_cache_slowdown = 2.0;
  truth.launch_overhead_s = 1e-6;
  nlohmann::json records = nlohmann::json::array();
  for (double bytes = 1e5; bytes < 5e8; bytes *= 1.6) {
    records.push_back({{"operation", "memory"}, {"bytes", bytes}, {"seconds", 1.0}});
  }
  auto measurements = measurements_from_json({{"format_version", 1}, {"measurements", records}},
                                             "synthetic", truth);
  for (auto& m : measurements) m.seconds = predict(truth, m);

  DeviceSpec start = simple_device();
  start.classes[static_cast<std::size_t>(OpClass::kMemory)].half_efficiency_size = 2e6;
  start.classes[static_cast<std::size_t>(OpClass::kMemory)].outer_cache_bytes = 3e8;
  FitOptions options;
  options.max_evaluations = 40000;
  const FitResult fit = fit_device(start, measurements, options);
  EXPECT_LT(fit.rms_log_error, 1e-2);
  const ClassRate& got = fit.device.classes[static_cast<std::size_t>(OpClass::kMemory)];
  EXPECT_NEAR(got.half_efficiency_size / 2.2e6, 1.0, 0.1);
  EXPECT_NEAR(got.beyond_cache_slowdown / 3.0, 1.0, 0.05);
  EXPECT_NEAR(got.outer_cache_bytes / 6e7, 1.0, 0.1);
  EXPECT_NEAR(got.beyond_outer_cache_slowdown / 2.0, 1.0, 0.05);
  for (const auto& r : residuals(fit.device, measurements)) {
    EXPECT_NEAR(r.relative_error, 0.0, 0.03) << r.label;
  }
  const auto names = [](const std::vector<FitParameter>& params) {
    std::vector<std::string> out;
    for (const auto& p : params) out.push_back(p.name());
    return out;
  };
  const auto fitted = names(fit.parameters);
  EXPECT_NE(std::find(fitted.begin(), fitted.end(), "classes.memory.outer_cache_bytes"),
            fitted.end());
  // One cliff only from a start that places none: the records alone do not add the second.
  const auto one = names(fit_device(simple_device(), measurements).parameters);
  EXPECT_EQ(std::find(one.begin(), one.end(), "classes.memory.outer_cache_bytes"), one.end());
  EXPECT_NE(std::find(one.begin(), one.end(), "classes.memory.beyond_cache_slowdown"), one.end());
}

TEST(SimCalibration, HeldOutRecordsAreNotFitted) {
  DeviceSpec truth = simple_device();
  truth.classes[static_cast<std::size_t>(OpClass::kGemm)].efficiency = 0.3;
  auto measurements = measurements_from_json(synthetic_records(), "synthetic", truth);
  for (auto& m : measurements) m.seconds = predict(truth, m);
  hold_out(measurements, "operation=gemm");
  for (const auto& p : parameters_of(measurements)) {
    EXPECT_NE(p.kind, FitParameter::Kind::kGemmPrecisionEfficiency) << p.name();
  }
  hold_out(measurements, "operation=memory");
  hold_out(measurements, "operation=cholesky_inverse");
  EXPECT_NE(error_of([&] { fit_device(simple_device(), measurements); }).find("no measurement"),
            std::string::npos);
  EXPECT_NE(error_of([&] { hold_out(measurements, "model"); }).find("FIELD=VALUE"),
            std::string::npos);
}

TEST(SimCalibration, BadMeasurementFilesNameTheRecordAndField) {
  const DeviceSpec d = simple_device();
  auto parse = [&](const nlohmann::json& json) {
    return error_of([&] { measurements_from_json(json, "m.json", d); });
  };
  EXPECT_NE(parse({{"measurements", nlohmann::json::array()}}).find("format_version"),
            std::string::npos);
  const nlohmann::json bad_op = {{"format_version", 1},
                                 {"measurements", {{{"operation", "conv"}, {"seconds", 1.0}}}}};
  EXPECT_NE(parse(bad_op).find("measurements[0].'operation'"), std::string::npos) << parse(bad_op);
  const nlohmann::json negative = {
      {"format_version", 1},
      {"measurements", {{{"operation", "memory"}, {"bytes", 1e6}, {"seconds", -1.0}}}}};
  EXPECT_NE(parse(negative).find("'seconds'"), std::string::npos) << parse(negative);
  const nlohmann::json no_bf16 = {{"format_version", 1},
                                  {"measurements",
                                   {{{"operation", "gemm"},
                                     {"m", 8},
                                     {"n", 8},
                                     {"k", 8},
                                     {"precision", "bf16"},
                                     {"seconds", 1.0}}}}};
  EXPECT_NE(parse(no_bf16).find("bf16"), std::string::npos) << parse(no_bf16);
  // The field of files written before exp and erf were priced apart: refused, naming the two.
  const nlohmann::json legacy = {
      {"format_version", 1},
      {"measurements",
       {{{"operation", "memory"}, {"bytes", 8e6}, {"special_functions", 1e6}, {"seconds", 1.0}}}}};
  EXPECT_NE(parse(legacy).find("measurements[0].'special_functions'"), std::string::npos)
      << parse(legacy);
  EXPECT_NE(parse(legacy).find("error_functions"), std::string::npos) << parse(legacy);
}

TEST(SimCalibration, KernelCountsAreBoundedBeforeTheKernelsAreBuilt) {
  // A few hundred bytes must not ask for gigabytes: "count" per record and kernels per file.
  const DeviceSpec d = simple_device();
  auto inversions = [](int count, int records) {
    nlohmann::json list = nlohmann::json::array();
    for (int i = 0; i < records; ++i) {
      list.push_back(
          {{"operation", "cholesky_inverse"}, {"order", 64}, {"count", count}, {"seconds", 1.0}});
    }
    return nlohmann::json{{"format_version", 1}, {"measurements", list}};
  };
  const std::string too_many =
      error_of([&] { measurements_from_json(inversions(1 << 20, 1), "m.json", d); });
  EXPECT_NE(
      too_many.find("m.json: measurements[0].'count' = 1048576 (must be an integer in [1, 65536])"),
      std::string::npos)
      << too_many;
  const std::string too_large =
      error_of([&] { measurements_from_json(inversions(kMaxMeasurementCount, 17), "m.json", d); });
  EXPECT_NE(too_large.find("measurements[16]: the measurements so far describe"), std::string::npos)
      << too_large;
  EXPECT_EQ(measurements_from_json(inversions(kMaxMeasurementCount, 1), "m.json", d).size(), 1U);
}

// A measured profile turned into calibration records (pipefisher_train --calibration-out)
// describes the same kernels the analytic cost model prices for the same schedule: a profile
// holding the analytic model's own durations is predicted exactly by the device, record by
// record. So a device fitted to a training run's records prices that run's instructions.
TEST(SimCalibration, ProfileRecordsPriceWhatTheAnalyticModelPrices) {
  const DeviceSpec device = device_preset("v100");
  Workload w;
  w.config = model::bert_preset("mini");
  w.seq_len = 64;
  w.micro_batch_size = 4;
  w.precision = Precision::kFp32;
  for (const int workers : {1, 2}) {
    sched::ScheduleParams params;
    params.kind = workers == 1 ? sched::ScheduleKind::kGPipe : sched::ScheduleKind::kOneFOneB;
    params.workers = workers;
    params.microbatches = 4;
    params.num_layers = w.config.num_layers;
    const auto schedule = sched::compile(params);
    const AnalyticCostModel costs(w, device, 0.0);

    Profile profile;
    for (int worker = 0; worker < schedule.num_workers(); ++worker) {
      for (const auto& in : schedule.streams[static_cast<std::size_t>(worker)]) {
        if (in.microbatch != 0 ||
            (in.kind != sched::OpKind::kForward && in.kind != sched::OpKind::kBackward)) {
          continue;
        }
        auto it = std::find_if(profile.chunks.begin(), profile.chunks.end(),
                               [&](const ChunkProfile& c) { return c.chunk == in.chunk; });
        if (it == profile.chunks.end()) {
          profile.chunks.push_back({.pipeline = in.pipeline, .chunk = in.chunk});
          it = profile.chunks.end() - 1;
        }
        const double seconds = costs.duration(schedule, worker, in);
        (in.kind == sched::OpKind::kForward ? it->forward_s : it->backward_s) = seconds;
      }
    }
    ASSERT_EQ(profile.chunks.size(), static_cast<std::size_t>(workers));
    for (const auto linear : {sched::LinearKind::kQuery, sched::LinearKind::kFfnIn}) {
      KfacProfile k;
      k.layer = 1;
      k.linear = linear;
      sched::Instruction in;
      in.layer = 1;
      in.linear = linear;
      in.chunk = workers - 1;
      in.microbatch = 0;
      const auto priced = [&](sched::OpKind kind) {
        in.kind = kind;
        return costs.duration(schedule, workers - 1, in);
      };
      k.curvature_a_s = priced(sched::OpKind::kCurvatureA);
      k.curvature_b_s = priced(sched::OpKind::kCurvatureB);
      k.invert_a_s = priced(sched::OpKind::kInvertA);
      k.invert_b_s = priced(sched::OpKind::kInvertB);
      k.precondition_s = priced(sched::OpKind::kPrecondition);
      profile.kfac.push_back(k);
    }
    sched::Instruction step;
    step.kind = sched::OpKind::kOptimizerStep;
    profile.optimizer_step_s = costs.duration(schedule, 0, step);

    const auto json = measurements_from_profile(
        profile, schedule, {w.config, w.seq_len, w.micro_batch_size, w.precision},
        {{"run", "p" + std::to_string(workers)}});
    const auto measurements = measurements_from_json(json, "profile records", device);
    // 2 records per chunk, 5 per Linear, the optimizer step.
    ASSERT_EQ(measurements.size(), 2 * profile.chunks.size() + 5 * profile.kfac.size() + 1);
    for (const auto& m : measurements) {
      EXPECT_EQ(m.record.at("run"), "p" + std::to_string(workers));
      if (m.operation == "optimizer_step" && workers > 1) continue;  // the mean worker's
      EXPECT_NEAR(predict(device, m) / m.seconds, 1.0, 1e-9) << m.label << ", p = " << workers;
    }
  }
  // A profile entry for a chunk the schedule does not hold is named.
  sched::ScheduleParams one;
  one.kind = sched::ScheduleKind::kGPipe;
  one.workers = 1;
  one.microbatches = 2;
  one.num_layers = 4;
  Profile stray;
  stray.chunks.push_back({.pipeline = 0, .chunk = 3, .forward_s = 1.0, .backward_s = 2.0});
  EXPECT_NE(error_of([&] {
              measurements_from_profile(stray, sched::compile(one),
                                        {w.config, w.seq_len, w.micro_batch_size, w.precision});
            }).find("chunk 3"),
            std::string::npos);
}

// One price for an instruction (docs/simulator.md): records written from the simulator's own
// durations (as pipefisher_train --calibration-out writes a run's) fit back the device that
// produced them, and the fitted device's simulated step is the records' sum. The device is one
// where the host runs far ahead during a forward (1 us a launch against device-bound kernels)
// and the backward is launch-bound (12 us a launch): there the time a backward adds behind its
// forward on one queue is well below the backward priced from an empty queue.
TEST(SimCalibration, FittedDeviceSimulatesTheStepItsInstructionRecordsSum) {
  DeviceSpec truth = device_preset("h200");
  truth.launch_overhead_s = 1e-6;
  truth.backward_launch_overhead_s = 12e-6;
  const FitParameter fp32_products{FitParameter::Kind::kGemmPrecisionEfficiency,
                                   static_cast<int>(Precision::kFp32)};
  fp32_products.set(truth, 0.4);
  truth.classes[static_cast<std::size_t>(OpClass::kMemory)].efficiency = 0.1;
  Workload w;
  w.config = model::bert_preset("mini");
  w.seq_len = 128;
  w.precision = Precision::kFp32;
  sched::ScheduleParams params;
  params.kind = sched::ScheduleKind::kOneFOneB;
  params.workers = 1;
  params.microbatches = 4;
  params.num_layers = w.config.num_layers;
  const auto schedule = sched::compile(params);
  const std::vector<int> sizes = {1, 4, 16, 64};

  // The step the simulator gives a device, and the records of one micro-batch's forward and
  // backward and of the optimizer step, at the simulator's durations.
  const auto step_seconds = [&](const DeviceSpec& device, int b) {
    Workload at = w;
    at.micro_batch_size = b;
    return simulate(schedule, AnalyticCostModel(at, device, 0.0)).step_time_s;
  };
  nlohmann::json records = nlohmann::json::array();
  std::vector<double> record_sums;  // per size: 4 x (forward + backward) + optimizer step
  for (const int b : sizes) {
    Workload at = w;
    at.micro_batch_size = b;
    const AnalyticCostModel costs(at, truth, 0.0);
    Profile profile;
    profile.chunks.push_back({.pipeline = 0, .chunk = 0});
    for (const auto& in : schedule.streams[0]) {
      if (in.microbatch != 0) continue;
      if (in.kind == sched::OpKind::kForward)
        profile.chunks[0].forward_s = costs.duration(schedule, 0, in);
      if (in.kind == sched::OpKind::kBackward)
        profile.chunks[0].backward_s = costs.duration(schedule, 0, in);
    }
    sched::Instruction step;
    step.kind = sched::OpKind::kOptimizerStep;
    profile.optimizer_step_s = costs.duration(schedule, 0, step);
    record_sums.push_back(4.0 * (profile.chunks[0].forward_s + profile.chunks[0].backward_s) +
                          profile.optimizer_step_s);
    EXPECT_NEAR(step_seconds(truth, b) / record_sums.back(), 1.0, 1e-9) << "b = " << b;
    const auto json =
        measurements_from_profile(profile, schedule, {w.config, w.seq_len, b, w.precision});
    for (const auto& r : json.at("measurements")) records.push_back(r);
  }
  // GEMMs timed alone set the product rate apart from the element-wise one (every chunk record
  // grows with the tokens in both).
  for (const double m : {512.0, 2048.0, 8192.0}) {
    records.push_back(
        {{"operation", "gemm"}, {"m", m}, {"n", 1024}, {"k", 1024}, {"seconds", 1.0}});
  }
  auto measurements = measurements_from_json({{"format_version", 1}, {"measurements", records}},
                                             "simulated records", truth);
  ASSERT_EQ(measurements.size(), 3 * sizes.size() + 3);
  for (auto& m : measurements) {
    if (m.operation == "gemm") m.seconds = predict(truth, m);
    EXPECT_NEAR(predict(truth, m) / m.seconds, 1.0, 1e-9) << m.label;
  }

  // The regime tells the two pricings apart: at b = 4 the backward queued behind its forward adds
  // at least 15% less than the backward alone.
  const Measurement* forward4 = nullptr;
  const Measurement* backward4 = nullptr;
  for (const auto& m : measurements) {
    if (m.record.value("micro_batch_size", 0) != 4) continue;
    if (m.operation == "chunk_forward") forward4 = &m;
    if (m.operation == "chunk_backward") backward4 = &m;
  }
  ASSERT_NE(forward4, nullptr);
  ASSERT_NE(backward4, nullptr);
  const PricedKernels f = price(truth, forward4->timed), bw = price(truth, backward4->timed);
  const std::array<QueuedPart, 2> queue = {QueuedPart{&f, 1, truth.launch_overhead_s},
                                           QueuedPart{&bw, 1, truth.backward_launch_s()}};
  const double behind_forward =
      queued_seconds(queue, truth.launch_overhead_s) - queued_seconds(f, truth.launch_overhead_s);
  EXPECT_LT(behind_forward, 0.85 * backward4->seconds);

  // Fit the two launch overheads and the two rates from a start that has them wrong; every other
  // parameter is the truth's.
  const std::vector<std::string> fitted = {"launch_overhead_s", "backward_launch_overhead_s",
                                           fp32_products.name(), "classes.memory.efficiency"};
  FitOptions options;
  for (const auto& p : parameters_of(measurements)) {
    if (std::find(fitted.begin(), fitted.end(), p.name()) == fitted.end()) {
      options.keep.push_back(p.name());
    }
  }
  DeviceSpec start = truth;
  start.launch_overhead_s = 5e-6;
  start.backward_launch_overhead_s = 5e-6;
  fp32_products.set(start, 0.7);
  start.classes[static_cast<std::size_t>(OpClass::kMemory)].efficiency = 0.5;
  const FitResult fit = fit_device(start, measurements, options);
  ASSERT_EQ(fit.parameters.size(), fitted.size());
  EXPECT_LT(fit.rms_log_error, 1e-3);
  const auto near = [](double got, double want, const char* what) {
    EXPECT_NEAR(got / want, 1.0, 0.03) << what << ": " << got << " vs " << want;
  };
  near(fit.device.launch_overhead_s, 1e-6, "launch overhead");
  near(fit.device.backward_launch_overhead_s, 12e-6, "backward launch overhead");
  near(fit.device.gemm_efficiency(Precision::kFp32), 0.4, "gemm efficiency");
  near(fit.device.efficiency(OpClass::kMemory), 0.1, "memory efficiency");
  // The fitted device's simulated one-worker step is the records' sum.
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    EXPECT_NEAR(step_seconds(fit.device, sizes[i]) / record_sums[i], 1.0, 0.01)
        << "b = " << sizes[i];
  }
}

// pipefisher_train stores activations in fp32 whatever its product precision: a workload's
// storage precision moves every kernel's bytes (and the stash), its product precision only the
// products' arithmetic.
TEST(SimKernelCosts, StoragePrecisionMovesTheBytesAndProductPrecisionTheArithmetic) {
  Workload bf16_in_fp32;
  bf16_in_fp32.config = model::bert_preset("mini");
  bf16_in_fp32.micro_batch_size = 4;
  bf16_in_fp32.precision = Precision::kBf16;
  bf16_in_fp32.storage_precision = Precision::kFp32;
  Workload tf32 = bf16_in_fp32;
  tf32.precision = Precision::kTf32;
  tf32.storage_precision.reset();
  Workload bf16 = bf16_in_fp32;
  bf16.storage_precision.reset();
  EXPECT_EQ(bf16_in_fp32.storage_bytes(), 4.0);
  EXPECT_EQ(bf16.storage_bytes(), 2.0);
  EXPECT_EQ(tf32.storage_bytes(), 4.0);
  const auto flat = [](const PieceKernels& piece) {
    Kernels all = piece.forward;
    all.insert(all.end(), piece.backward_input.begin(), piece.backward_input.end());
    all.insert(all.end(), piece.backward_weight.begin(), piece.backward_weight.end());
    return all;
  };
  int products = 0, in_16_bits = 0;
  for (const auto& kernels_of : std::vector<std::function<PieceKernels(const Workload&)>>{
           [](const Workload& w) { return encoder_layer_kernels(w); }, embeddings_kernels,
           heads_kernels}) {
    const Kernels mixed = flat(kernels_of(bf16_in_fp32));
    const Kernels as_tf32 = flat(kernels_of(tf32));
    const Kernels as_bf16 = flat(kernels_of(bf16));
    ASSERT_EQ(mixed.size(), as_tf32.size());
    ASSERT_EQ(mixed.size(), as_bf16.size());
    for (std::size_t i = 0; i < mixed.size(); ++i) {
      // The same bytes as the 4-byte run, the same arithmetic as the bf16 run.
      EXPECT_EQ(mixed[i].bytes, as_tf32[i].bytes) << i;
      EXPECT_EQ(mixed[i].flops, as_bf16[i].flops) << i;
      EXPECT_EQ(mixed[i].precision, as_bf16[i].precision) << i;
      if (mixed[i].op_class != OpClass::kMemory) {
        ++products;
        EXPECT_EQ(mixed[i].precision, Precision::kBf16) << i;
      }
      if (as_bf16[i].bytes < mixed[i].bytes) ++in_16_bits;
    }
  }
  EXPECT_GT(products, 0);
  EXPECT_GT(in_16_bits, 0);  // the storage precision reaches the kernels
  EXPECT_EQ(encoder_layer_activation_bytes(bf16_in_fp32), encoder_layer_activation_bytes(tf32));
  EXPECT_EQ(encoder_layer_activation_bytes(bf16_in_fp32),
            2.0 * encoder_layer_activation_bytes(bf16));
  EXPECT_EQ(boundary_bytes(bf16_in_fp32), 2.0 * boundary_bytes(bf16));
  // On a device, the element-wise part of a layer prices as the tf32 run's, the products at the
  // bf16 rate: halving the bf16 gemm efficiency moves the mixed run and not the tf32 one.
  DeviceSpec device = device_preset("h100");
  const AnalyticCostModel mixed_costs(bf16_in_fp32, device, 0.0);
  const AnalyticCostModel tf32_costs(tf32, device, 0.0);
  sched::ScheduleParams params;
  params.kind = sched::ScheduleKind::kGPipe;
  params.workers = 1;
  params.microbatches = 1;
  params.num_layers = bf16_in_fp32.config.num_layers;
  const auto schedule = sched::compile(params);
  sched::Instruction forward;
  forward.kind = sched::OpKind::kForward;
  forward.chunk = 0;
  device.gemm_efficiency_by_precision[static_cast<std::size_t>(Precision::kBf16)] = 0.1;
  const AnalyticCostModel slower_mixed(bf16_in_fp32, device, 0.0);
  const AnalyticCostModel slower_tf32(tf32, device, 0.0);
  EXPECT_GT(slower_mixed.duration(schedule, 0, forward),
            mixed_costs.duration(schedule, 0, forward) * 1.01);
  EXPECT_DOUBLE_EQ(slower_tf32.duration(schedule, 0, forward),
                   tf32_costs.duration(schedule, 0, forward));
}

// chunk_forward_backward: a forward and its backward between one pair of events (bench_model_cuda)
// prices as the forward record plus the backward record (each an instruction), and
// dispatches its backward part at the backward launch overhead.
TEST(SimCalibration, ForwardBackwardRecordsTimeBothPasses) {
  DeviceSpec device = device_preset("h100");
  const nlohmann::json base = {{"model", "mini"},
                               {"seq_len", 64},
                               {"micro_batch_size", 4},
                               {"precision", "bf16"},
                               {"storage_precision", "fp32"},
                               {"layers", 2},
                               {"embeddings", true},
                               {"head", true},
                               {"seconds", 1e-3}};
  nlohmann::json records = nlohmann::json::array();
  for (const char* op : {"chunk_forward", "chunk_backward", "chunk_forward_backward"}) {
    nlohmann::json r = base;
    r["operation"] = op;
    records.push_back(r);
  }
  const nlohmann::json file = {{"format_version", 1}, {"measurements", records}};
  const auto m = measurements_from_json(file, "fb", device);
  ASSERT_EQ(m.size(), 3U);
  EXPECT_FALSE(m[2].backward.empty());
  EXPECT_TRUE(m[2].before.empty());
  // Each instruction priced as the simulator prices it: the backward record is the backward
  // alone (no forward queued ahead of it), and forward + backward is the sum of the two records
  // on any device.
  EXPECT_TRUE(m[1].before.empty());
  EXPECT_EQ(total_kernels(m[2].timed), total_kernels(m[0].timed));
  EXPECT_EQ(total_kernels(m[2].backward), total_kernels(m[1].timed));
  EXPECT_NEAR(predict(device, m[2]), predict(device, m[0]) + predict(device, m[1]),
              1e-12 * predict(device, m[2]));
  // The storage precision reached the record: 4-byte elements, as in a tf32 record.
  nlohmann::json as_tf32 = file;
  for (auto& r : as_tf32["measurements"]) {
    r["precision"] = "tf32";
    r.erase("storage_precision");
  }
  const auto t = measurements_from_json(as_tf32, "fb tf32", device);
  EXPECT_EQ(total_bytes(m[2].timed) + total_bytes(m[2].backward),
            total_bytes(t[2].timed) + total_bytes(t[2].backward));
  // Launch-bound (a huge device): forward kernels at the launch overhead, backward ones at the
  // backward launch overhead.
  DeviceSpec fast = device;
  fast.peak_fp32_flops = fast.peak_tf32_flops = fast.peak_bf16_flops = fast.peak_fp16_flops = 1e30;
  fast.memory_bandwidth = 1e30;
  fast.launch_overhead_s = 1e-6;
  fast.backward_launch_overhead_s = 3e-6;
  const double expected = 1e-6 * total_kernels(m[2].timed) + 3e-6 * total_kernels(m[2].backward);
  EXPECT_NEAR(predict(fast, m[2]), expected, 1e-9);
  // Forward and backward together cannot tell the two launch overheads apart: such a record
  // alone fits one, a backward timed apart the other.
  const auto fits_backward_launch = [](const std::vector<Measurement>& fitted) {
    const auto params = parameters_of(fitted);
    return std::any_of(params.begin(), params.end(), [](const FitParameter& p) {
      return p.kind == FitParameter::Kind::kBackwardLaunch;
    });
  };
  EXPECT_FALSE(fits_backward_launch({m[0], m[2]}));
  EXPECT_TRUE(fits_backward_launch({m[1], m[2]}));
  // pipefisher_train's records of a bf16 run say that it stores fp32.
  sched::ScheduleParams one;
  one.kind = sched::ScheduleKind::kGPipe;
  one.workers = 1;
  one.microbatches = 1;
  one.num_layers = 4;
  Profile profile;
  profile.chunks.push_back({.pipeline = 0, .chunk = 0, .forward_s = 1.0, .backward_s = 2.0});
  const auto written = measurements_from_profile(
      profile, sched::compile(one), {model::bert_preset("mini"), 64, 4, Precision::kBf16});
  EXPECT_EQ(written.at("measurements").at(0).at("storage_precision"), "fp32");
  const auto fp32_run = measurements_from_profile(
      profile, sched::compile(one), {model::bert_preset("mini"), 64, 4, Precision::kFp32});
  EXPECT_FALSE(fp32_run.at("measurements").at(0).contains("storage_precision"));
  // A bad storage precision is named.
  nlohmann::json bad = file;
  bad["measurements"][0]["storage_precision"] = "fp8";
  EXPECT_NE(error_of([&] {
              measurements_from_json(bad, "bad", device);
            }).find("measurements[0].'storage_precision'"),
            std::string::npos);
}

// A layer_curvature record (PipeFisher's harness): timed after its micro-batch's forward and
// backward, one product per factor without a running average where the record says so; the
// curvature host overhead is paid once per factor, moves only curvature work, and is fitted
// back from synthetic records.
TEST(SimCalibration, CurvatureHostOverheadIsPerFactorAndOnlyCurvatures) {
  const DeviceSpec device = device_preset("v100");
  const nlohmann::json defaults = {{"model", "base"},
                                   {"seq_len", 128},
                                   {"precision", "fp32"},
                                   {"input_requires_grad", false},
                                   {"separate_grad_accumulation", true},
                                   {"running_average", false}};
  nlohmann::json records = nlohmann::json::array();
  for (int b : {1, 4, 16, 64}) {
    for (const char* op : {"layer_forward", "layer_backward", "layer_curvature", "layer_inversion",
                           "layer_precondition"}) {
      records.push_back({{"operation", op}, {"micro_batch_size", b}, {"seconds", 1e-3}});
    }
  }
  const nlohmann::json file = {
      {"format_version", 1}, {"defaults", defaults}, {"measurements", records}};
  auto m = measurements_from_json(file, "curvature", device);
  const Measurement& curvature = m[2];
  ASSERT_EQ(curvature.operation, "layer_curvature");
  EXPECT_EQ(total_kernels(curvature.timed), 12);  // one product per factor
  EXPECT_FALSE(curvature.before.empty());
  EXPECT_FALSE(curvature.before_backward.empty());
  nlohmann::json averaged = file;
  averaged["defaults"]["running_average"] = true;
  EXPECT_EQ(total_kernels(measurements_from_json(averaged, "avg", device)[2].timed), 24);
  // Launch-bound (a huge device): 12 factors x (launch + host overhead).
  DeviceSpec fast = device;
  fast.peak_fp32_flops = 1e30;
  fast.memory_bandwidth = 1e30;
  fast.launch_overhead_s = 1e-6;
  fast.curvature_host_overhead_s = 100e-6;
  EXPECT_NEAR(predict(fast, curvature), 12 * 101e-6, 1e-9);
  // Only curvature records move with it; the analytic model's curvature tasks too.
  DeviceSpec slower = device;
  slower.launch_overhead_s = 20e-6;
  DeviceSpec more = slower;
  more.curvature_host_overhead_s = 300e-6;
  for (const auto& r : m) {
    if (r.operation == "layer_curvature") {
      // Host-bound at micro-batch 1; at 64 the overhead may hide behind the backward's tail.
      const int b = r.record.at("micro_batch_size").get<int>();
      if (b == 1) {
        EXPECT_GT(predict(more, r), predict(slower, r) + 1e-3) << r.label;
      } else {
        EXPECT_GE(predict(more, r), predict(slower, r)) << r.label;
      }
    } else {
      EXPECT_DOUBLE_EQ(predict(more, r), predict(slower, r)) << r.label;
    }
  }
  EXPECT_NEAR(
      queued_seconds(price(more, curvature_kernels(Precision::kFp32, 128, 768, 4.0)), 0.0) -
          queued_seconds(price(slower, curvature_kernels(Precision::kFp32, 128, 768, 4.0)), 0.0),
      300e-6, 1e-12);
  // The fit recovers it (with the other parameters) from synthetic durations.
  DeviceSpec truth = device;
  truth.classes[static_cast<std::size_t>(OpClass::kGemm)].efficiency = 0.8;
  truth.classes[static_cast<std::size_t>(OpClass::kAttention)].efficiency = 0.5;
  truth.classes[static_cast<std::size_t>(OpClass::kMemory)].efficiency = 0.7;
  truth.launch_overhead_s = 40e-6;
  truth.backward_launch_overhead_s = 20e-6;
  truth.curvature_host_overhead_s = 200e-6;
  for (auto& r : m) r.seconds = predict(truth, r);
  // (Every inversion record is the same 12 factors: its latency and efficiency are kept.)
  FitOptions options;
  options.keep = {"classes.factorization.*"};
  const FitResult fit = fit_device(device, m, options);
  EXPECT_LT(fit.rms_log_error, 1e-2);
  EXPECT_NEAR(fit.device.curvature_host_overhead_s / 200e-6, 1.0, 0.03);
  EXPECT_NEAR(fit.device.launch_overhead_s / 40e-6, 1.0, 0.03);
}

// One model's layer_inversion records all invert the same 12 factors: one equation for the
// factorization's latency and rate, so only the latency is fitted; Cholesky inverses of two
// orders (or both models' layers) fit both.
TEST(SimCalibration, AFactorizationAtOneSetOfOrdersFitsItsLatencyOnly) {
  const DeviceSpec device = device_preset("v100");
  auto fits = [&](const nlohmann::json& records) {
    const auto m = measurements_from_json(
        {{"format_version", 1}, {"defaults", {{"seq_len", 128}}}, {"measurements", records}},
        "inversion", device);
    std::vector<std::string> names;
    for (const auto& p : parameters_of(m)) names.push_back(p.name());
    const auto has = [&](const std::string& n) {
      return std::find(names.begin(), names.end(), n) != names.end();
    };
    return std::pair{has("classes.factorization.efficiency"),
                     has("classes.factorization.latency_s")};
  };
  nlohmann::json one_model = nlohmann::json::array();
  for (int b : {1, 8, 64}) {
    one_model.push_back({{"operation", "layer_inversion"},
                         {"model", "large"},
                         {"micro_batch_size", b},
                         {"seconds", 0.08}});
  }
  EXPECT_EQ(fits(one_model), std::pair(false, true));
  nlohmann::json both_models = one_model;
  both_models.push_back({{"operation", "layer_inversion"},
                         {"model", "base"},
                         {"micro_batch_size", 1},
                         {"seconds", 0.05}});
  EXPECT_EQ(fits(both_models), std::pair(true, true));
  const nlohmann::json one_order = {
      {{"operation", "cholesky_inverse"}, {"order", 1024}, {"seconds", 0.01}}};
  EXPECT_EQ(fits(one_order), std::pair(false, true));
  nlohmann::json two_orders = one_order;
  two_orders.push_back({{"operation", "cholesky_inverse"}, {"order", 2048}, {"seconds", 0.05}});
  EXPECT_EQ(fits(two_orders), std::pair(true, true));
}

// A device written to a file (calibrate --no-fit --out, as scripts/calibrate_from_training.sh
// writes its start) fits as the device itself: a class whose efficiency is not set still follows
// its rule after the round trip (triangular solves the fitted fp32 gemm rate), not the value the
// rule gave when the file was written.
TEST(SimCalibration, AStartDeviceReadBackFromItsFileFitsTheSame) {
  DeviceSpec truth = simple_device();
  truth.classes[static_cast<std::size_t>(OpClass::kGemm)].efficiency = 0.35;
  truth.classes[static_cast<std::size_t>(OpClass::kFactorization)].efficiency = 0.2;
  auto measurements = measurements_from_json(synthetic_records(), "synthetic", truth);
  for (auto& m : measurements) m.seconds = predict(truth, m);
  const DeviceSpec start = simple_device();
  const DeviceSpec from_file = device_from_json(device_to_json(start), "start file");
  EXPECT_FALSE(device_to_json(start).at("classes").at("triangular_solve").contains("efficiency"));
  const FitResult direct = fit_device(start, measurements);
  const FitResult via_file = fit_device(from_file, measurements);
  for (const auto& m : measurements) {
    EXPECT_DOUBLE_EQ(predict(via_file.device, m), predict(direct.device, m)) << m.label;
  }
  EXPECT_DOUBLE_EQ(via_file.device.efficiency(OpClass::kTriangularSolve),
                   via_file.device.gemm_efficiency(Precision::kFp32));
}

TEST(SimCalibration, DeviceJsonRoundTripsTheClasses) {
  DeviceSpec d = simple_device();
  d.classes[static_cast<std::size_t>(OpClass::kAttention)].efficiency = 0.25;
  d.classes[static_cast<std::size_t>(OpClass::kEigendecomposition)].latency_s = 1e-4;
  d.gemm_efficiency_by_precision[static_cast<std::size_t>(Precision::kFp32)] = 0.45;
  d.launch_overhead_s = 7e-6;
  d.backward_launch_overhead_s = 3e-6;
  const DeviceSpec back = device_from_json(device_to_json(d), "round trip");
  EXPECT_DOUBLE_EQ(back.efficiency(OpClass::kAttention), 0.25);
  EXPECT_DOUBLE_EQ(back.latency_s(OpClass::kEigendecomposition), 1e-4);
  EXPECT_DOUBLE_EQ(back.gemm_efficiency(Precision::kFp32), 0.45);
  EXPECT_DOUBLE_EQ(back.launch_overhead_s, 7e-6);
  EXPECT_DOUBLE_EQ(back.backward_launch_s(), 3e-6);
  nlohmann::json bad = device_to_json(d);
  bad["classes"]["gemm"]["efficiency"] = 1.5;
  EXPECT_NE(error_of([&] { device_from_json(bad, "bad"); }).find("classes.gemm.efficiency"),
            std::string::npos);
  bad = device_to_json(d);
  bad["classes"]["tensor"] = nlohmann::json::object();
  EXPECT_NE(error_of([&] { device_from_json(bad, "bad"); }).find("tensor"), std::string::npos);
}

// A device for this machine's CPU (sim/cpu_device.h): its peaks from its clock and vectors.
TEST(CpuDevice, PeaksFollowTheClockAndTheVectorTier) {
  // The AMD EPYC core of sim/calibration/cpu_start.json: AVX2 at 2.45 GHz.
  const DeviceSpec avx2 = cpu_device(2.45e9, 2);
  EXPECT_DOUBLE_EQ(avx2.peak_flops(Precision::kFp32), 2.45e9 * 32);
  EXPECT_DOUBLE_EQ(avx2.memory_bandwidth, 2.45e9 * 64);
  EXPECT_EQ(avx2.name, "this-cpu (AVX2, 2.45 GHz)");
  const DeviceSpec avx512 = cpu_device(2.7e9, 3);
  EXPECT_DOUBLE_EQ(avx512.peak_flops(Precision::kFp32), 2.7e9 * 64);
  EXPECT_DOUBLE_EQ(avx512.memory_bandwidth, 2.7e9 * 128);
  EXPECT_DOUBLE_EQ(cpu_device(3e9, 0).peak_flops(Precision::kFp32), 3e9 * 8);
  EXPECT_DOUBLE_EQ(cpu_device(3e9, 1).peak_flops(Precision::kFp32), 3e9 * 16);
  // As cpu_start.json: the runtime's triangular inverse, efficiency 0.5 before a fit.
  const DeviceSpec start = device_from_json_file("sim/calibration/cpu_start.json");
  EXPECT_EQ(avx2.inverse_solve, start.inverse_solve);
  EXPECT_DOUBLE_EQ(avx2.matmul_efficiency, start.matmul_efficiency);
  EXPECT_THROW(cpu_device(0.0, 2), std::invalid_argument);
  EXPECT_THROW(cpu_device(std::nan(""), 2), std::invalid_argument);
  EXPECT_THROW(cpu_device(2e9, 4), std::invalid_argument);
  EXPECT_THROW(cpu_device(2e9, -1), std::invalid_argument);
}

// The caches place the memory class's cliffs for a fit to start from, and price nothing yet.
TEST(CpuDevice, CachesPlaceTheMemoryCliffs) {
  const std::vector<CacheLevel> xeon = {{1, 48.0 * 1024}, {2, 2048.0 * 1024}, {3, 300.0 * 1048576}};
  const DeviceSpec device = cpu_device(2.7e9, 3, xeon);
  const ClassRate& memory = device.classes[static_cast<std::size_t>(OpClass::kMemory)];
  EXPECT_DOUBLE_EQ(memory.half_efficiency_size, 2048.0 * 1024);
  EXPECT_DOUBLE_EQ(memory.outer_cache_bytes, 300.0 * 1048576);
  const DeviceSpec bare = cpu_device(2.7e9, 3);
  for (const double bytes : {1e4, 3e6, 1e9}) {
    EXPECT_DOUBLE_EQ(kernel_seconds(device, memory_kernel(bytes)),
                     kernel_seconds(bare, memory_kernel(bytes)));
  }
  EXPECT_EQ(bare.classes[static_cast<std::size_t>(OpClass::kMemory)].half_efficiency_size, 0.0);
  // An L2 and no further level: one cliff; a last level without an L2: the one cliff there.
  const DeviceSpec l2 = cpu_device(2.7e9, 3, {{1, 32768.0}, {2, 1048576.0}});
  EXPECT_DOUBLE_EQ(l2.classes[static_cast<std::size_t>(OpClass::kMemory)].half_efficiency_size,
                   1048576.0);
  EXPECT_EQ(l2.classes[static_cast<std::size_t>(OpClass::kMemory)].outer_cache_bytes, 0.0);
  const DeviceSpec l3 = cpu_device(2.7e9, 3, {{1, 32768.0}, {3, 8388608.0}});
  EXPECT_DOUBLE_EQ(l3.classes[static_cast<std::size_t>(OpClass::kMemory)].half_efficiency_size,
                   8388608.0);
  EXPECT_EQ(l3.classes[static_cast<std::size_t>(OpClass::kMemory)].outer_cache_bytes, 0.0);
}

TEST(CpuDevice, CacheSizesAreReadAsSysfsWritesThem) {
  EXPECT_DOUBLE_EQ(cache_size_bytes("48K"), 48.0 * 1024);
  EXPECT_DOUBLE_EQ(cache_size_bytes("32M"), 32.0 * 1048576);
  EXPECT_DOUBLE_EQ(cache_size_bytes("1G"), 1073741824.0);
  EXPECT_DOUBLE_EQ(cache_size_bytes("4096"), 4096.0);
  EXPECT_EQ(cache_size_bytes(""), 0.0);
  EXPECT_EQ(cache_size_bytes("K"), 0.0);
  EXPECT_EQ(cache_size_bytes("12Q"), 0.0);
  EXPECT_EQ(cache_size_bytes("-4K"), 0.0);
  // A sysfs tree of its own: L1d, L1i (left out), L2, L3.
  const auto root =
      std::filesystem::temp_directory_path() /
      ("pf_cpu_caches_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()));
  const std::vector<std::array<const char*, 3>> entries = {{"1", "Data", "48K"},
                                                           {"1", "Instruction", "32K"},
                                                           {"2", "Unified", "2048K"},
                                                           {"3", "Unified", "307200K"}};
  for (std::size_t i = 0; i < entries.size(); ++i) {
    const auto dir = root / ("index" + std::to_string(i));
    std::filesystem::create_directories(dir);
    std::ofstream(dir / "level") << entries[i][0] << "\n";
    std::ofstream(dir / "type") << entries[i][1] << "\n";
    std::ofstream(dir / "size") << entries[i][2] << "\n";
  }
  const std::vector<CacheLevel> caches = cpu_data_caches(root.string());
  std::filesystem::remove_all(root);
  ASSERT_EQ(caches.size(), 3u);
  EXPECT_EQ(caches[0].level, 1);
  EXPECT_DOUBLE_EQ(caches[1].bytes, 2048.0 * 1024);
  EXPECT_EQ(caches[2].level, 3);
  EXPECT_DOUBLE_EQ(caches[2].bytes, 307200.0 * 1024);
  EXPECT_TRUE(cpu_data_caches((root / "missing").string()).empty());
}

TEST(CpuDevice, ThisCpuIsMeasured) {
#if defined(__x86_64__)
  const double clock = measure_core_clock_hz();
  EXPECT_GT(clock, 0.3e9);  // a core of this century, even on a busy machine
  EXPECT_LT(clock, 7e9);    // no core runs a dependent chain faster than this
  const DeviceSpec device = resolve_device("this-cpu");
  EXPECT_EQ(device.name.rfind("this-cpu (", 0), 0u) << device.name;
  EXPECT_GE(device.peak_flops(Precision::kFp32), 0.3e9 * 8);
#else
  EXPECT_THROW(resolve_device("this-cpu"), std::runtime_error);
#endif
  try {
    (void)resolve_device("no-such-device");
    FAIL() << "an unknown device was accepted";
  } catch (const std::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find("this-cpu"), std::string::npos) << error.what();
  }
}

}  // namespace
}  // namespace pf::sim
