#include "sim/device.h"

#include "sim/cpu_device.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <fstream>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "common/json_fields.h"

namespace pf::sim {
namespace {

std::string join(const std::vector<std::string>& names) {
  std::string text;
  for (const auto& name : names) text += (text.empty() ? "" : ", ") + name;
  return text;
}

// Dense peaks from the vendors' data sheets (REFERENCE.md "Devices" for the bf16/fp16 and memory
// figures). tf32/bf16 are absent (0) on V100 and P100; P100 is the PCIe card (18.7 TFLOP/s fp16).
// Link: NVLink per direction (H100/H200 450 GB/s, A100 300 GB/s, V100 150 GB/s), PCIe 3.0 x16 for
// P100. matmul_efficiency 0.7: with it the model reproduces NVIDIA's BERT-Large phase-1 anchor on
// an A100 (317 seq/s TF32) within a few percent (docs/simulator.md, tests/sim).
// Host link: what a pinned-memory copy achieves over the card's PCIe x16 (about 80% of the
// per-direction peak: Gen5 64 GB/s on H100/H200, Gen4 32 GB/s on A100, Gen3 16 GB/s on V100 and
// P100), 10 us per transfer.
DeviceSpec make(std::string name, double fp32, double tf32, double bf16, double fp16, double memory,
                double link, double latency, double host, double capacity) {
  DeviceSpec d;
  d.name = std::move(name);
  d.peak_fp32_flops = fp32;
  d.peak_tf32_flops = tf32;
  d.peak_bf16_flops = bf16;
  d.peak_fp16_flops = fp16;
  d.matmul_efficiency = 0.7;
  d.memory_bandwidth = memory;
  d.link_bandwidth = link;
  d.link_latency_s = latency;
  d.host_bandwidth = host;
  d.host_latency_s = 10e-6;
  d.memory_bytes = capacity;
  return d;
}

constexpr double kMiB = 1024.0 * 1024.0;
constexpr double kGiB = 1024.0 * kMiB;

}  // namespace

std::string_view to_string(Precision precision) {
  switch (precision) {
    case Precision::kFp32:
      return "fp32";
    case Precision::kTf32:
      return "tf32";
    case Precision::kBf16:
      return "bf16";
    case Precision::kFp16:
      return "fp16";
  }
  return "fp32";
}

Precision precision_from_string(std::string_view name) {
  if (name == "fp32") return Precision::kFp32;
  if (name == "tf32") return Precision::kTf32;
  if (name == "bf16") return Precision::kBf16;
  if (name == "fp16") return Precision::kFp16;
  throw std::invalid_argument("unknown precision '" + std::string(name) +
                              "' (allowed: fp32, tf32, bf16, fp16)");
}

namespace {
constexpr std::array<std::string_view, kNumOpClasses> kOpClassNames = {
    "gemm", "attention", "memory", "factorization", "triangular_solve", "eigendecomposition"};
constexpr std::array<std::string_view, 4> kPrecisionNames = {"fp32", "tf32", "bf16", "fp16"};
}  // namespace

std::string_view to_string(OpClass op_class) {
  return kOpClassNames[static_cast<std::size_t>(op_class)];
}

OpClass op_class_from_string(std::string_view name) {
  for (int i = 0; i < kNumOpClasses; ++i) {
    if (kOpClassNames[static_cast<std::size_t>(i)] == name) return static_cast<OpClass>(i);
  }
  std::string allowed;
  for (const auto n : kOpClassNames) allowed += (allowed.empty() ? "" : ", ") + std::string(n);
  throw std::invalid_argument("unknown operation class '" + std::string(name) +
                              "' (allowed: " + allowed + ")");
}

double DeviceSpec::efficiency(OpClass op_class) const {
  const double set = classes[static_cast<std::size_t>(op_class)].efficiency;
  if (set > 0.0) return set;
  if (op_class == OpClass::kMemory) return 1.0;
  // Triangular solves with many right-hand sides are blocked into fp32 products (trsm).
  if (op_class == OpClass::kTriangularSolve) return gemm_efficiency(Precision::kFp32);
  return matmul_efficiency;
}

double DeviceSpec::size_factor(OpClass op_class, double size) const {
  const ClassRate& rate = classes[static_cast<std::size_t>(op_class)];
  if (!(size > 0.0)) return 1.0;
  // How far a kernel of this size is past the size h: 0 well below it, 1 well above.
  const auto past = [&](double h) { return 1.0 / (1.0 + std::pow(h / size, rate.size_exponent)); };
  if (op_class == OpClass::kMemory) {
    // The bandwidth falls by beyond_cache_slowdown once the bytes outgrow the caches, and by
    // beyond_outer_cache_slowdown more past the last level (and stays there).
    double slowdown = 1.0;
    if (rate.half_efficiency_size > 0.0) {
      slowdown *= 1.0 + (rate.beyond_cache_slowdown - 1.0) * past(rate.half_efficiency_size);
    }
    if (rate.outer_cache_bytes > 0.0) {
      slowdown *= 1.0 + (rate.beyond_outer_cache_slowdown - 1.0) * past(rate.outer_cache_bytes);
    }
    return 1.0 / slowdown;
  }
  // FLOP classes: the efficiency rises with the size.
  return rate.half_efficiency_size > 0.0 ? past(rate.half_efficiency_size) : 1.0;
}

double DeviceSpec::gemm_efficiency(Precision precision) const {
  const double set = gemm_efficiency_by_precision[static_cast<std::size_t>(precision)];
  return set > 0.0 ? set : efficiency(OpClass::kGemm);
}

int element_bytes(Precision precision) {
  return precision == Precision::kBf16 || precision == Precision::kFp16 ? 2 : 4;
}

double DeviceSpec::peak_flops(Precision precision) const {
  double peak = 0.0;
  switch (precision) {
    case Precision::kFp32:
      peak = peak_fp32_flops;
      break;
    case Precision::kTf32:
      peak = peak_tf32_flops;
      break;
    case Precision::kBf16:
      peak = peak_bf16_flops;
      break;
    case Precision::kFp16:
      peak = peak_fp16_flops;
      break;
  }
  if (!(peak > 0.0)) {
    throw std::invalid_argument(
        "device '" + name + "' has no " + std::string(to_string(precision)) + " peak (peak_flops." +
        std::string(to_string(precision)) + " missing): choose another --precision");
  }
  return peak;
}

double DeviceSpec::kfac_matmul_peak(Precision precision) const {
  if (precision != Precision::kFp32 && peak_tf32_flops > 0.0) return peak_tf32_flops;
  return peak_fp32_flops;
}

void DeviceSpec::validate(std::string_view source) const {
  auto check = [&](double value, const char* field, bool may_be_zero) {
    if (!std::isfinite(value) || value < 0.0 || (!may_be_zero && value == 0.0)) {
      throw std::invalid_argument(std::string(source) + ": field '" + field +
                                  "' = " + std::to_string(value) + " (must be finite and " +
                                  (may_be_zero ? ">= 0" : "> 0") + ")");
    }
  };
  check(peak_fp32_flops, "peak_flops.fp32", false);
  check(peak_tf32_flops, "peak_flops.tf32", true);
  check(peak_bf16_flops, "peak_flops.bf16", true);
  check(peak_fp16_flops, "peak_flops.fp16", true);
  check(matmul_efficiency, "matmul_efficiency", false);
  if (matmul_efficiency > 1.0) {
    throw std::invalid_argument(std::string(source) + ": field 'matmul_efficiency' = " +
                                std::to_string(matmul_efficiency) + " (a fraction in (0, 1])");
  }
  check(memory_bandwidth, "memory_bandwidth", false);
  check(link_bandwidth, "link_bandwidth", false);
  check(link_latency_s, "link_latency_s", true);
  check(host_bandwidth, "host_bandwidth", true);
  check(host_latency_s, "host_latency_s", true);
  if (!std::isfinite(memory_bytes) || memory_bytes < 0.0) {
    throw std::invalid_argument(std::string(source) + ": field 'memory_gb' = " +
                                std::to_string(memory_bytes / 1e9) + " (must be finite and >= 0)");
  }
  auto fraction = [&](double value, const std::string& field) {
    if (!std::isfinite(value) || value > 1.0) {
      throw std::invalid_argument(std::string(source) + ": field '" + field +
                                  "' = " + std::to_string(value) +
                                  " (a fraction in (0, 1]; 0 or less: not set)");
    }
  };
  for (int i = 0; i < kNumOpClasses; ++i) {
    const std::string field = "classes." + std::string(kOpClassNames[static_cast<std::size_t>(i)]);
    fraction(classes[static_cast<std::size_t>(i)].efficiency, field + ".efficiency");
    const ClassRate& rate = classes[static_cast<std::size_t>(i)];
    check(rate.latency_s, (field + ".latency_s").c_str(), true);
    check(rate.half_efficiency_size, (field + ".half_efficiency_size").c_str(), true);
    check(rate.size_exponent, (field + ".size_exponent").c_str(), false);
    for (const auto& [slowdown, slowdown_field] :
         {std::pair{rate.beyond_cache_slowdown, ".beyond_cache_slowdown"},
          std::pair{rate.beyond_outer_cache_slowdown, ".beyond_outer_cache_slowdown"}}) {
      if (!(slowdown >= 1.0) || !std::isfinite(slowdown)) {
        throw std::invalid_argument(std::string(source) + ": field '" + field + slowdown_field +
                                    "' = " + std::to_string(slowdown) +
                                    " (must be finite and >= 1)");
      }
    }
    check(rate.outer_cache_bytes, (field + ".outer_cache_bytes").c_str(), true);
    check(rate.element_flop_s, (field + ".element_flop_s").c_str(), true);
    check(rate.exponential_s, (field + ".exponential_s").c_str(), true);
    check(rate.error_function_s, (field + ".error_function_s").c_str(), true);
    check(rate.random_number_s, (field + ".random_number_s").c_str(), true);
    if (!std::isfinite(rate.roofline_exponent) ||
        (rate.roofline_exponent != 0.0 && !(rate.roofline_exponent >= 1.0))) {
      throw std::invalid_argument(
          std::string(source) + ": field '" + field +
          ".roofline_exponent' = " + std::to_string(rate.roofline_exponent) +
          " (must be >= 1, or 0 for the max of the two terms)");
    }
  }
  for (std::size_t p = 0; p < kPrecisionNames.size(); ++p) {
    fraction(gemm_efficiency_by_precision[p],
             "classes.gemm.by_precision." + std::string(kPrecisionNames[p]));
  }
  check(launch_overhead_s, "launch_overhead_s", true);
  if (backward_launch_overhead_s >= 0.0 || !std::isfinite(backward_launch_overhead_s)) {
    check(backward_launch_overhead_s, "backward_launch_overhead_s", true);
  }
  check(curvature_host_overhead_s, "curvature_host_overhead_s", true);
  check_kfac_overheads(kfac_task_overhead_s, kfac_kind_overheads_s, source);
}

std::vector<std::string> device_preset_names() {
  return {"h100", "h200", "b200", "a100", "v100", "p100"};
}

// Datasheet peaks and bandwidths (docs/simulator.md, "Devices"); the memory is nvidia-smi's
// total where known (H100 80 GB, A100 80 GB: 80 GiB; H200 143 771 MiB; B200 183 359 MiB).
DeviceSpec device_preset(std::string_view name) {
  if (name == "h100")
    return make("h100", 67e12, 494.7e12, 989e12, 989e12, 3.35e12, 450e9, 5e-6, 51.2e9, 80 * kGiB);
  if (name == "h200") {
    return make("h200", 67e12, 494.7e12, 989e12, 989e12, 4.8e12, 450e9, 5e-6, 51.2e9,
                143771 * kMiB);
  }
  if (name == "b200") {
    // HGX B200 (1000 W): the 8-GPU datasheet's totals per GPU; memory bandwidth as the driver
    // reports the bus (7680 bits at 3996 MHz, DDR: 7.67 TB/s; the datasheet says 8); NVLink 5
    // 1.8 TB/s per GPU in both directions; PCIe 5.0 x16 to the host CPUs of an HGX B200 system.
    return make("b200", 75e12, 1.125e15, 2.25e15, 2.25e15, 7.67e12, 900e9, 5e-6, 51.2e9,
                183359 * kMiB);
  }
  if (name == "a100")
    return make("a100", 19.5e12, 156e12, 312e12, 312e12, 2.0e12, 300e9, 5e-6, 25.6e9, 80 * kGiB);
  if (name == "v100") {
    return make("v100", 15.7e12, 0.0, 0.0, 125e12, 0.9e12, 150e9, 5e-6, 12.8e9, 32 * kGiB);
  }
  if (name == "p100") {
    return make("p100", 9.3e12, 0.0, 0.0, 18.7e12, 0.732e12, 16e9, 10e-6, 12.8e9, 16 * kGiB);
  }
  throw std::invalid_argument("unknown device '" + std::string(name) +
                              "' (presets: " + join(device_preset_names()) + ", " + kThisCpuDevice +
                              ", or a path to a device JSON file)");
}

DeviceSpec device_from_json(const nlohmann::json& json, std::string_view source) {
  const std::string where(source);
  if (!json.is_object()) throw std::invalid_argument(where + ": expected a JSON object");
  auto number = [&](const nlohmann::json& object, const char* field, const std::string& path,
                    bool required, double fallback) {
    const auto it = object.find(field);
    if (it == object.end()) {
      if (required) {
        throw std::invalid_argument(where + ": missing field '" + path + "'");
      }
      return fallback;
    }
    if (!it->is_number()) {
      throw std::invalid_argument(where + ": field '" + path + "' must be a number, got " +
                                  it->dump());
    }
    return it->get<double>();
  };
  DeviceSpec d;
  d.name = json_fields::string_field(json, "name", where, where);
  const auto peaks = json.find("peak_flops");
  if (peaks == json.end()) throw std::invalid_argument(where + ": missing field 'peak_flops'");
  if (!peaks->is_object()) {
    throw std::invalid_argument(where +
                                ": field 'peak_flops' must be an object of precision -> "
                                "FLOP/s, got " +
                                peaks->dump());
  }
  for (const auto& [key, value] : peaks->items()) {
    if (key != "fp32" && key != "tf32" && key != "bf16" && key != "fp16") {
      throw std::invalid_argument(where + ": unknown precision 'peak_flops." + key +
                                  "' (allowed: fp32, tf32, bf16, fp16)");
    }
    (void)value;
  }
  d.peak_fp32_flops = number(*peaks, "fp32", "peak_flops.fp32", true, 0.0);
  d.peak_tf32_flops = number(*peaks, "tf32", "peak_flops.tf32", false, 0.0);
  d.peak_bf16_flops = number(*peaks, "bf16", "peak_flops.bf16", false, 0.0);
  d.peak_fp16_flops = number(*peaks, "fp16", "peak_flops.fp16", false, 0.0);
  const auto classes = json.find("classes");
  if (classes != json.end()) {
    if (!classes->is_object()) {
      throw std::invalid_argument(where +
                                  ": field 'classes' must be an object of class -> "
                                  "{efficiency, latency_s}, got " +
                                  classes->dump());
    }
    for (const auto& [key, value] : classes->items()) {
      OpClass op_class{};
      try {
        op_class = op_class_from_string(key);
      } catch (const std::invalid_argument& e) {
        throw std::invalid_argument(where + ": field 'classes." + key + "': " + e.what());
      }
      const std::string path = "classes." + key;
      if (!value.is_object()) {
        throw std::invalid_argument(where + ": field '" + path +
                                    "' must be an object {efficiency, latency_s}, got " +
                                    value.dump());
      }
      const bool memory = op_class == OpClass::kMemory;
      for (const auto& [field, ignored] : value.items()) {
        (void)ignored;
        if (field != "efficiency" && field != "latency_s" &&
            !(field == "by_precision" && op_class == OpClass::kGemm) &&
            field != "half_efficiency_size" && field != "size_exponent" &&
            !(field == "size_measure" &&
              (op_class == OpClass::kGemm || op_class == OpClass::kAttention)) &&
            !(memory && (field == "element_flop_s" || field == "exponential_s" ||
                         field == "error_function_s" || field == "special_function_s" ||
                         field == "beyond_cache_slowdown" || field == "random_number_s" ||
                         field == "roofline_exponent" || field == "outer_cache_bytes" ||
                         field == "beyond_outer_cache_slowdown"))) {
          throw std::invalid_argument(
              where + ": unknown field '" + path + "." + field +
              "' (allowed: efficiency, latency_s" +
              (op_class == OpClass::kGemm        ? ", by_precision, size_measure"
               : op_class == OpClass::kAttention ? ", size_measure"
                                                 : "") +
              ", half_efficiency_size, size_exponent" +
              (memory ? ", beyond_cache_slowdown, outer_cache_bytes, "
                        "beyond_outer_cache_slowdown, element_flop_s, exponential_s, "
                        "error_function_s, random_number_s, roofline_exponent"
                      : "") +
              ")");
        }
      }
      auto& rate = d.classes[static_cast<std::size_t>(op_class)];
      rate.efficiency = number(value, "efficiency", path + ".efficiency", false, 0.0);
      rate.latency_s = number(value, "latency_s", path + ".latency_s", false, 0.0);
      rate.half_efficiency_size =
          number(value, "half_efficiency_size", path + ".half_efficiency_size", false, 0.0);
      rate.size_exponent = number(value, "size_exponent", path + ".size_exponent", false, 1.0);
      if (const auto measure = value.find("size_measure"); measure != value.end()) {
        if (!measure->is_string() || (*measure != "smallest" && *measure != "harmonic_mean")) {
          throw std::invalid_argument(where + ": field '" + path + ".size_measure' = " +
                                      measure->dump() + " (allowed: smallest, harmonic_mean)");
        }
        rate.size_measure =
            *measure == "harmonic_mean" ? SizeMeasure::kHarmonicMean : SizeMeasure::kSmallest;
      }
      rate.beyond_cache_slowdown =
          number(value, "beyond_cache_slowdown", path + ".beyond_cache_slowdown", false, 1.0);
      rate.outer_cache_bytes =
          number(value, "outer_cache_bytes", path + ".outer_cache_bytes", false, 0.0);
      rate.beyond_outer_cache_slowdown = number(value, "beyond_outer_cache_slowdown",
                                                path + ".beyond_outer_cache_slowdown", false, 1.0);
      rate.element_flop_s = number(value, "element_flop_s", path + ".element_flop_s", false, 0.0);
      const double special_function_s =
          number(value, "special_function_s", path + ".special_function_s", false, 0.0);
      rate.exponential_s =
          number(value, "exponential_s", path + ".exponential_s", false, special_function_s);
      rate.error_function_s =
          number(value, "error_function_s", path + ".error_function_s", false, special_function_s);
      rate.random_number_s =
          number(value, "random_number_s", path + ".random_number_s", false, 0.0);
      rate.roofline_exponent =
          number(value, "roofline_exponent", path + ".roofline_exponent", false, 0.0);
      const auto by_precision = value.find("by_precision");
      if (by_precision != value.end()) {
        if (!by_precision->is_object()) {
          throw std::invalid_argument(where + ": field '" + path +
                                      ".by_precision' must be an object of precision -> "
                                      "efficiency, got " +
                                      by_precision->dump());
        }
        for (const auto& [precision, ignored] : by_precision->items()) {
          (void)ignored;
          Precision p{};
          try {
            p = precision_from_string(precision);
          } catch (const std::invalid_argument& e) {
            throw std::invalid_argument(where + ": field '" + path + ".by_precision." + precision +
                                        "': " + e.what());
          }
          d.gemm_efficiency_by_precision[static_cast<std::size_t>(p)] = number(
              *by_precision, precision.c_str(), path + ".by_precision." + precision, true, 0.0);
        }
      }
    }
  }
  // matmul_efficiency may be left out when the gemm class sets its own.
  const bool gemm_set = d.classes[static_cast<std::size_t>(OpClass::kGemm)].efficiency > 0.0;
  d.matmul_efficiency = number(json, "matmul_efficiency", "matmul_efficiency", !gemm_set,
                               d.classes[static_cast<std::size_t>(OpClass::kGemm)].efficiency);
  d.memory_bandwidth = number(json, "memory_bandwidth", "memory_bandwidth", true, 0.0);
  d.link_bandwidth = number(json, "link_bandwidth", "link_bandwidth", true, 0.0);
  d.link_latency_s = number(json, "link_latency_s", "link_latency_s", true, 0.0);
  d.launch_overhead_s = number(json, "launch_overhead_s", "launch_overhead_s", false, 0.0);
  d.host_bandwidth = number(json, "host_bandwidth", "host_bandwidth", false, 0.0);
  d.host_latency_s = number(json, "host_latency_s", "host_latency_s", false, 0.0);
  d.memory_bytes = number(json, "memory_gb", "memory_gb", false, 0.0) * 1e9;
  d.backward_launch_overhead_s =
      number(json, "backward_launch_overhead_s", "backward_launch_overhead_s", false, -1.0);
  d.curvature_host_overhead_s =
      number(json, "curvature_host_overhead_s", "curvature_host_overhead_s", false, 0.0);
  d.kfac_task_overhead_s = number(json, "kfac_task_overhead_s", "kfac_task_overhead_s", false,
                                  kDefaultKfacTaskOverheadS);
  if (const auto by_kind = json.find("kfac_task_overheads"); by_kind != json.end()) {
    if (!by_kind->is_object()) {
      throw std::invalid_argument(where +
                                  ": field 'kfac_task_overheads' must be an object of K-FAC "
                                  "kind -> seconds, got " +
                                  by_kind->dump());
    }
    for (const auto& [key, ignored] : by_kind->items()) {
      (void)ignored;
      if (std::find(kKfacOverheadFields.begin(), kKfacOverheadFields.end(), key) ==
          kKfacOverheadFields.end()) {
        throw std::invalid_argument(where + ": unknown field 'kfac_task_overheads." + key +
                                    "' (allowed: curvature_a_s, curvature_b_s, curvature_sync_s, "
                                    "invert_a_s, invert_b_s, precondition_s)");
      }
    }
    for (std::size_t i = 0; i < kKfacOverheadFields.size(); ++i) {
      const std::string field(kKfacOverheadFields[i]);
      if (by_kind->contains(field)) {
        d.kfac_kind_overheads_s[i] =
            number(*by_kind, field.c_str(), "kfac_task_overheads." + field, true, 0.0);
      }
    }
  }
  if (const auto solve = json.find("inverse_solve"); solve != json.end()) {
    if (*solve == "identity") {
      d.inverse_solve = InverseSolve::kIdentity;
    } else if (*solve == "lower_triangle") {
      d.inverse_solve = InverseSolve::kLowerTriangle;
    } else {
      throw std::invalid_argument(where + ": field 'inverse_solve' = " + solve->dump() +
                                  " (must be \"identity\" or \"lower_triangle\")");
    }
  }
  d.validate(where);
  return d;
}

DeviceSpec device_from_json_file(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) throw std::invalid_argument("cannot open device file " + path.string());
  nlohmann::json json;
  try {
    json = json_fields::parse_bounded(in, path.string());
  } catch (const nlohmann::json::exception& e) {
    throw std::invalid_argument(path.string() + ": not valid JSON: " + e.what());
  }
  return device_from_json(json, path.string());
}

nlohmann::json device_to_json(const DeviceSpec& d) {
  nlohmann::json peaks = {{"fp32", d.peak_fp32_flops}};
  if (d.peak_tf32_flops > 0) peaks["tf32"] = d.peak_tf32_flops;
  if (d.peak_bf16_flops > 0) peaks["bf16"] = d.peak_bf16_flops;
  if (d.peak_fp16_flops > 0) peaks["fp16"] = d.peak_fp16_flops;
  nlohmann::json json = {{"name", d.name},
                         {"peak_flops", peaks},
                         {"matmul_efficiency", d.matmul_efficiency},
                         {"memory_bandwidth", d.memory_bandwidth},
                         {"link_bandwidth", d.link_bandwidth},
                         {"link_latency_s", d.link_latency_s},
                         {"launch_overhead_s", d.launch_overhead_s}};
  if (d.backward_launch_overhead_s >= 0.0) {
    json["backward_launch_overhead_s"] = d.backward_launch_overhead_s;
  }
  if (d.curvature_host_overhead_s > 0.0) {
    json["curvature_host_overhead_s"] = d.curvature_host_overhead_s;
  }
  if (d.inverse_solve == InverseSolve::kLowerTriangle) json["inverse_solve"] = "lower_triangle";
  // The K-FAC overheads only where they differ from the default: files without them stay as they
  // were.
  if (d.kfac_task_overhead_s != kDefaultKfacTaskOverheadS) {
    json["kfac_task_overhead_s"] = d.kfac_task_overhead_s;
  }
  nlohmann::json by_kind = nlohmann::json::object();
  for (std::size_t i = 0; i < kKfacOverheadFields.size(); ++i) {
    if (d.kfac_kind_overheads_s[i]) {
      by_kind[std::string(kKfacOverheadFields[i])] = *d.kfac_kind_overheads_s[i];
    }
  }
  if (!by_kind.empty()) json["kfac_task_overheads"] = by_kind;
  if (d.host_bandwidth > 0.0) {
    json["host_bandwidth"] = d.host_bandwidth;
    json["host_latency_s"] = d.host_latency_s;
  }
  if (d.memory_bytes > 0.0) json["memory_gb"] = d.memory_bytes / 1e9;
  nlohmann::json classes = nlohmann::json::object();
  for (int i = 0; i < kNumOpClasses; ++i) {
    const auto op_class = static_cast<OpClass>(i);
    nlohmann::json entry = {{"latency_s", d.latency_s(op_class)}};
    const ClassRate& rate = d.classes[static_cast<std::size_t>(i)];
    // An efficiency only where it is set: one that is not follows its rule when the file is read
    // (triangular solves the fp32 gemm rate, the other FLOP classes matmul_efficiency), so that a
    // start device written to a file fits as the device itself does.
    if (rate.efficiency > 0.0) entry["efficiency"] = rate.efficiency;
    // The optional shape terms only when set: files without them stay as they were.
    if (rate.half_efficiency_size > 0.0 || rate.outer_cache_bytes > 0.0) {
      entry["size_exponent"] = rate.size_exponent;
    }
    if (rate.half_efficiency_size > 0.0) {
      entry["half_efficiency_size"] = rate.half_efficiency_size;
      if (op_class == OpClass::kMemory) entry["beyond_cache_slowdown"] = rate.beyond_cache_slowdown;
    }
    if (rate.outer_cache_bytes > 0.0) {
      entry["outer_cache_bytes"] = rate.outer_cache_bytes;
      entry["beyond_outer_cache_slowdown"] = rate.beyond_outer_cache_slowdown;
    }
    if (rate.size_measure == SizeMeasure::kHarmonicMean) entry["size_measure"] = "harmonic_mean";
    if (rate.element_flop_s > 0.0) entry["element_flop_s"] = rate.element_flop_s;
    if (rate.exponential_s > 0.0) entry["exponential_s"] = rate.exponential_s;
    if (rate.error_function_s > 0.0) entry["error_function_s"] = rate.error_function_s;
    if (rate.random_number_s > 0.0) entry["random_number_s"] = rate.random_number_s;
    if (rate.roofline_exponent > 0.0) entry["roofline_exponent"] = rate.roofline_exponent;
    if (op_class == OpClass::kGemm) {
      nlohmann::json by_precision = nlohmann::json::object();
      for (std::size_t p = 0; p < kPrecisionNames.size(); ++p) {
        if (d.gemm_efficiency_by_precision[p] > 0.0) {
          by_precision[std::string(kPrecisionNames[p])] = d.gemm_efficiency_by_precision[p];
        }
      }
      if (!by_precision.empty()) entry["by_precision"] = by_precision;
    }
    classes[std::string(to_string(op_class))] = entry;
  }
  json["classes"] = classes;
  return json;
}

DeviceSpec resolve_device(std::string_view name_or_path) {
  if (name_or_path == kThisCpuDevice) return this_cpu_device();
  const auto names = device_preset_names();
  for (const auto& name : names) {
    if (name == name_or_path) return device_preset(name);
  }
  const std::filesystem::path path(name_or_path);
  if (path.extension() == ".json" || std::filesystem::exists(path)) {
    return device_from_json_file(path);
  }
  return device_preset(name_or_path);  // throws with the list of presets
}

}  // namespace pf::sim
