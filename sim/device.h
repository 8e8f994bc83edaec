#pragma once
// What the analytic cost model needs to know about an accelerator: peak FLOP/s per precision,
// how much of it matrix products achieve, memory bandwidth, and the link to its pipeline
// neighbours. Presets (dense peaks, per GPU): h100, h200, a100, v100, p100; or a JSON file.
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace pf::sim {

enum class Precision { kFp32, kTf32, kBf16, kFp16 };
std::string_view to_string(Precision precision);
Precision precision_from_string(std::string_view name);  // throws naming the allowed values
// Bytes of one activation / gradient element: 4 for fp32 and tf32 (tf32 only changes the
// tensor-core arithmetic), 2 for bf16 and fp16.
int element_bytes(Precision precision);

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
//  "matmul_efficiency": E, "memory_bandwidth": B, "link_bandwidth": B, "link_latency_s": S}
// fp32 is required; the other precisions are optional (absent = unsupported).
DeviceSpec device_from_json(const nlohmann::json& json, std::string_view source);
DeviceSpec device_from_json_file(const std::filesystem::path& path);
nlohmann::json device_to_json(const DeviceSpec& device);
// A preset name or a path to a JSON file.
DeviceSpec resolve_device(std::string_view name_or_path);

}  // namespace pf::sim
