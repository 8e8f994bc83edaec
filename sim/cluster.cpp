#include "sim/cluster.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <stdexcept>

#include <nlohmann/json.hpp>

namespace pf::sim {
namespace {

constexpr double kGB = 1e9;

void require(bool ok, std::string_view source, std::string_view field, double value,
             std::string_view allowed) {
  if (!ok) {
    throw std::invalid_argument(std::string(source) + ": field '" + std::string(field) + "' " +
                                std::string(allowed) + ", got " + std::to_string(value));
  }
}

}  // namespace

std::string_view to_string(RankOrder order) {
  return order == RankOrder::kMegatron ? "megatron" : "pipeline-inner";
}

RankOrder rank_order_from_string(std::string_view name) {
  if (name == "megatron") return RankOrder::kMegatron;
  if (name == "pipeline-inner") return RankOrder::kPipelineInner;
  throw std::invalid_argument("--rank-order '" + std::string(name) +
                              "': expected megatron or pipeline-inner");
}

RankStrides rank_strides(RankOrder order, int tensor_parallel, int data_parallel, int stages) {
  const int t = std::max(1, tensor_parallel), d = std::max(1, data_parallel),
            p = std::max(1, stages);
  if (order == RankOrder::kMegatron) return {1, t, t * d};
  return {1, t * p, t};
}

Link ClusterSpec::link_for(int ranks, int stride) const {
  if (ranks <= 1) return nvlink;
  const long span = static_cast<long>(ranks) * std::max(1, stride);
  return span <= gpus_per_node ? nvlink : network;
}

void ClusterSpec::validate(std::string_view source) const {
  device.validate(std::string(source) + " device");
  require(gpu_memory_bytes > 0 && std::isfinite(gpu_memory_bytes), source, "gpu_memory_gb",
          gpu_memory_bytes / kGB, "must be positive");
  require(gpus_per_node > 0, source, "gpus_per_node", gpus_per_node, "must be positive");
  require(num_nodes >= 0, source, "num_nodes", num_nodes, "must be >= 0 (0: unlimited)");
  for (const auto& [link, label] : {std::pair{&nvlink, "nvlink"}, std::pair{&network, "network"}}) {
    require(link->bandwidth > 0 && std::isfinite(link->bandwidth), source,
            std::string(label) + ".bandwidth_gbps", link->bandwidth / kGB, "must be positive");
    require(link->latency_s >= 0 && std::isfinite(link->latency_s), source,
            std::string(label) + ".latency_us", link->latency_s * 1e6, "must be >= 0");
  }
  require(host_bandwidth >= 0 && std::isfinite(host_bandwidth), source, "host_bandwidth_gbps",
          host_bandwidth / kGB, "must be >= 0");
  require(host_memory_bytes >= 0 && std::isfinite(host_memory_bytes), source, "host_memory_gb",
          host_memory_bytes / kGB, "must be >= 0");
  require(nvme_bandwidth >= 0 && std::isfinite(nvme_bandwidth), source, "nvme_bandwidth_gbps",
          nvme_bandwidth / kGB, "must be >= 0");
}

double allreduce_seconds(double bytes, int ranks, const Link& link) {
  if (ranks <= 1 || bytes <= 0.0) return 0.0;
  const double n = ranks;
  const double ring =
      2.0 * (n - 1.0) / n * bytes / link.bandwidth + 2.0 * (n - 1.0) * link.latency_s;
  const double tree = 2.0 * bytes / link.bandwidth + 2.0 * std::ceil(std::log2(n)) * link.latency_s;
  return std::min(ring, tree);
}

double allgather_seconds(double bytes, int ranks, const Link& link) {
  if (ranks <= 1 || bytes <= 0.0) return 0.0;
  const double n = ranks;
  return (n - 1.0) / n * bytes / link.bandwidth + (n - 1.0) * link.latency_s;
}

std::vector<std::string> cluster_preset_names() {
  return {"dgx-a100", "dgx-h100", "dgx-b200"};
}

ClusterSpec cluster_preset(std::string_view name) {
  ClusterSpec c;
  if (name == "dgx-a100") {
    // Selene-like: DGX A100 80 GB nodes (NVLink 3 / NVSwitch: 600 GB/s bidirectional per GPU),
    // eight 200 Gb/s HDR InfiniBand adapters per node (one per GPU), PCIe 4.0 x16 to the host,
    // 2 TB of host memory, about 25 GB/s of NVMe per node; 560 nodes.
    c.name = "dgx-a100";
    c.device = device_preset("a100");
    c.gpu_memory_bytes = 80.0 * 1024 * 1024 * 1024;
    c.num_nodes = 560;
    c.nvlink = {300e9, 3e-6};
    c.network = {25e9, 6e-6};
    c.host_bandwidth = 25e9;
    c.host_memory_bytes = 2e12;
    c.nvme_bandwidth = 25e9;
  } else if (name == "dgx-h100") {
    // DGX H100 nodes (NVLink 4: 900 GB/s bidirectional per GPU), eight 400 Gb/s NDR adapters per
    // node, PCIe 5.0 x16 to the host, 2 TB of host memory, about 50 GB/s of NVMe; 576 nodes.
    c.name = "dgx-h100";
    c.device = device_preset("h100");
    c.gpu_memory_bytes = 80.0 * 1024 * 1024 * 1024;
    c.num_nodes = 576;
    c.nvlink = {450e9, 3e-6};
    c.network = {50e9, 5e-6};
    c.host_bandwidth = 50e9;
    c.host_memory_bytes = 2e12;
    c.nvme_bandwidth = 50e9;
  } else if (name == "dgx-b200") {
    // DGX B200 nodes (NVLink 5: 1.8 TB/s bidirectional per GPU), eight 400 Gb/s ConnectX-7
    // adapters per node, PCIe 5.0 x16 to the host, 2 TB of host memory, about 50 GB/s of NVMe
    // (eight U.2 drives); 576 nodes, as dgx-h100.
    c.name = "dgx-b200";
    c.device = device_preset("b200");
    c.gpu_memory_bytes = c.device.memory_bytes;
    c.num_nodes = 576;
    c.nvlink = {900e9, 3e-6};
    c.network = {50e9, 5e-6};
    c.host_bandwidth = 50e9;
    c.host_memory_bytes = 2e12;
    c.nvme_bandwidth = 50e9;
  } else {
    std::string known;
    for (const auto& n : cluster_preset_names()) known += (known.empty() ? "" : ", ") + n;
    throw std::invalid_argument("unknown cluster '" + std::string(name) + "' (presets: " + known +
                                ", or a path to a cluster JSON file)");
  }
  c.gpus_per_node = 8;
  return c;
}

ClusterSpec cluster_of_device(const DeviceSpec& device) {
  ClusterSpec c;
  c.name = device.name;
  c.device = device;
  // The device's memory where it says (the presets do), else the 80 GiB of an H100 or A100.
  c.gpu_memory_bytes = device.memory_bytes > 0.0 ? device.memory_bytes : 80.0 * 1024 * 1024 * 1024;
  c.gpus_per_node = 8;
  c.num_nodes = 0;
  c.nvlink = {device.link_bandwidth, device.link_latency_s};
  c.network = {device.link_bandwidth, device.link_latency_s};
  return c;
}

ClusterSpec cluster_from_json(const nlohmann::json& json, std::string_view source) {
  const std::string where(source);
  if (!json.is_object()) throw std::invalid_argument(where + ": expected a JSON object");
  auto number = [&](const nlohmann::json& object, const char* field, const std::string& path,
                    bool required, double fallback) {
    const auto it = object.find(field);
    if (it == object.end()) {
      if (required) throw std::invalid_argument(where + ": missing field '" + path + "'");
      return fallback;
    }
    if (!it->is_number()) {
      throw std::invalid_argument(where + ": field '" + path + "' must be a number, got " +
                                  it->dump());
    }
    return it->get<double>();
  };
  static const char* const kFields[] = {
      "name",   "device",  "gpu_memory_gb",       "gpus_per_node",  "num_nodes",
      "nvlink", "network", "host_bandwidth_gbps", "host_memory_gb", "nvme_bandwidth_gbps"};
  for (const auto& [key, value] : json.items()) {
    bool known = false;
    for (const char* field : kFields) known |= key == field;
    if (!known) throw std::invalid_argument(where + ": unknown field '" + key + "'");
  }
  ClusterSpec c;
  c.name = json.value("name", where);
  const auto device = json.find("device");
  if (device == json.end()) throw std::invalid_argument(where + ": missing field 'device'");
  if (device->is_string()) {
    c.device = resolve_device(device->get<std::string>());
  } else {
    c.device = device_from_json(*device, where + " device");
  }
  c.gpu_memory_bytes = number(json, "gpu_memory_gb", "gpu_memory_gb", true, 0.0) * kGB;
  const double per_node = number(json, "gpus_per_node", "gpus_per_node", true, 0.0);
  const double nodes = number(json, "num_nodes", "num_nodes", false, 0.0);
  if (per_node != std::floor(per_node) || nodes != std::floor(nodes) || per_node > 1e6 ||
      nodes > 1e7) {
    throw std::invalid_argument(where + ": gpus_per_node and num_nodes must be whole numbers");
  }
  c.gpus_per_node = static_cast<int>(per_node);
  c.num_nodes = static_cast<int>(nodes);
  auto link = [&](const char* field) {
    const auto it = json.find(field);
    if (it == json.end()) {
      throw std::invalid_argument(where + ": missing field '" + std::string(field) + "'");
    }
    if (!it->is_object()) {
      throw std::invalid_argument(where + ": field '" + std::string(field) +
                                  "' must be an object {\"bandwidth_gbps\", \"latency_us\"}");
    }
    Link l;
    l.bandwidth =
        number(*it, "bandwidth_gbps", std::string(field) + ".bandwidth_gbps", true, 0.0) * kGB;
    l.latency_s = number(*it, "latency_us", std::string(field) + ".latency_us", true, 0.0) * 1e-6;
    return l;
  };
  c.nvlink = link("nvlink");
  c.network = link("network");
  c.host_bandwidth = number(json, "host_bandwidth_gbps", "host_bandwidth_gbps", false, 0.0) * kGB;
  c.host_memory_bytes = number(json, "host_memory_gb", "host_memory_gb", false, 0.0) * kGB;
  c.nvme_bandwidth = number(json, "nvme_bandwidth_gbps", "nvme_bandwidth_gbps", false, 0.0) * kGB;
  c.validate(where);
  return c;
}

nlohmann::json cluster_to_json(const ClusterSpec& c) {
  return {
      {"name", c.name},
      {"device", device_to_json(c.device)},
      {"gpu_memory_gb", c.gpu_memory_bytes / kGB},
      {"gpus_per_node", c.gpus_per_node},
      {"num_nodes", c.num_nodes},
      {"nvlink",
       {{"bandwidth_gbps", c.nvlink.bandwidth / kGB}, {"latency_us", c.nvlink.latency_s * 1e6}}},
      {"network",
       {{"bandwidth_gbps", c.network.bandwidth / kGB}, {"latency_us", c.network.latency_s * 1e6}}},
      {"host_bandwidth_gbps", c.host_bandwidth / kGB},
      {"host_memory_gb", c.host_memory_bytes / kGB},
      {"nvme_bandwidth_gbps", c.nvme_bandwidth / kGB}};
}

ClusterSpec resolve_cluster(std::string_view name_or_path) {
  for (const auto& name : cluster_preset_names()) {
    if (name == name_or_path) return cluster_preset(name);
  }
  const std::filesystem::path path(name_or_path);
  if (path.extension() == ".json" || std::filesystem::exists(path)) {
    std::ifstream in(path);
    if (!in) throw std::invalid_argument(path.string() + ": cannot open the cluster file");
    nlohmann::json json;
    try {
      json = nlohmann::json::parse(in);
    } catch (const nlohmann::json::parse_error& error) {
      throw std::invalid_argument(path.string() + ": not valid JSON (" + error.what() + ")");
    }
    return cluster_from_json(json, path.string());
  }
  return cluster_preset(name_or_path);  // throws with the list of presets
}

}  // namespace pf::sim
