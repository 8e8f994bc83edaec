#pragma once
// A GPU cluster as the parallel cost model sees it: nodes of identical GPUs joined by NVLink
// inside a node and a network between nodes (per-GPU injection bandwidth and latency), host
// memory behind PCIe, and NVMe. Presets dgx-a100 (Selene-like: DGX A100 80 GB, 8 x HDR 200 Gb/s
// per node), dgx-h100 and dgx-b200 (8 x NDR 400 Gb/s per node), or a JSON file (format in
// docs/scale.md).
//
// Collectives are priced on the link they cross: a group of n ranks spaced `stride` apart
// (Megatron's rank order: tensor-parallel ranks adjacent, then data-parallel, then pipeline) is
// inside one node when n x stride <= gpus_per_node and pays NVLink, otherwise the network.
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "sim/device.h"

namespace pf::sim {

struct Link {
  double bandwidth = 0.0;  // bytes/s per direction per GPU
  double latency_s = 0.0;  // per message
};

// How ranks are numbered (consecutive ranks fill a node): which groups are adjacent.
//   megatron:       tensor-parallel ranks adjacent, then data-parallel replicas, then stages
//                   (Megatron-LM's order; the parallel cost model's default);
//   pipeline-inner: tensor-parallel ranks adjacent, then pipeline stages, then replicas: the
//                   runtime's order (rank = replica x p + worker, t = 1; runtime/executor/
//                   executor.h), which mpirun's by-slot mapping puts on consecutive GPUs.
enum class RankOrder { kMegatron, kPipelineInner };
std::string_view to_string(RankOrder order);
RankOrder rank_order_from_string(std::string_view name);  // throws naming the allowed values
// The distance between neighbouring members of each kind of group.
struct RankStrides {
  int tensor = 1;
  int data = 1;
  int pipeline = 1;
};
RankStrides rank_strides(RankOrder order, int tensor_parallel, int data_parallel, int stages);

struct ClusterSpec {
  std::string name = "custom";
  DeviceSpec device;              // the GPU (peaks, class rates)
  double gpu_memory_bytes = 0.0;  // capacity per GPU
  int gpus_per_node = 8;
  int num_nodes = 0;               // 0: as many as asked for
  Link nvlink;                     // inside a node
  Link network;                    // between nodes, per GPU (its share of the node's NICs)
  double host_bandwidth = 0.0;     // PCIe, bytes/s per GPU
  double host_memory_bytes = 0.0;  // per node
  double nvme_bandwidth = 0.0;     // bytes/s per node

  int total_gpus() const { return num_nodes * gpus_per_node; }
  // The link a group of `ranks` ranks spaced `stride` apart crosses.
  Link link_for(int ranks, int stride) const;
  // Throws std::invalid_argument naming `source`, the field and the value.
  void validate(std::string_view source) const;
};

// All-reduce of `bytes` over `ranks` ranks on `link`: the cheaper of a ring
//   2 (n - 1) / n x bytes / bandwidth + 2 (n - 1) x latency
// and a (pipelined, double binary) tree
//   2 x bytes / bandwidth + 2 ceil(log2 n) x latency,
// as NCCL picks between them. 0 for n <= 1.
double allreduce_seconds(double bytes, int ranks, const Link& link);
// Ring all-gather / reduce-scatter: (n - 1) / n x bytes / bandwidth + (n - 1) x latency (bytes =
// the whole gathered buffer).
double allgather_seconds(double bytes, int ranks, const Link& link);

ClusterSpec cluster_preset(std::string_view name);  // throws with the list of presets
std::vector<std::string> cluster_preset_names();
// {"name", "device": preset or {device JSON}, "gpu_memory_gb", "gpus_per_node", "num_nodes",
//  "nvlink": {"bandwidth_gbps", "latency_us"}, "network": {...}, "host_bandwidth_gbps",
//  "host_memory_gb", "nvme_bandwidth_gbps"} (GB = 1e9 bytes; bandwidths in GB/s).
ClusterSpec cluster_from_json(const nlohmann::json& json, std::string_view source);
nlohmann::json cluster_to_json(const ClusterSpec& cluster);
// A preset name or a path to a JSON file.
ClusterSpec resolve_cluster(std::string_view name_or_path);
// A single-node "cluster" around a device alone: its link as both NVLink and network.
ClusterSpec cluster_of_device(const DeviceSpec& device);

}  // namespace pf::sim
