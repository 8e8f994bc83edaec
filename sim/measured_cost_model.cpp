#include "sim/measured_cost_model.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <limits>
#include <stdexcept>
#include <utility>

#include <nlohmann/json.hpp>

#include "common/json_fields.h"
#include "sim/communication.h"
#include "sim/machine_processors.h"
#include "sim/op_names.h"

namespace pf::sim {
namespace {

using nlohmann::json;
using sched::OpKind;

class Reader {
 public:
  explicit Reader(const std::string& source) : source_(source) {}

  [[noreturn]] void fail(const std::string& path, const std::string& what) const {
    throw std::invalid_argument(source_ + ": field '" + path + "' " + what);
  }

  const json& object(const json& parent, const char* field, const std::string& path) const {
    const auto it = parent.find(field);
    if (it == parent.end()) fail(path, "is missing");
    if (!it->is_object()) fail(path, "must be an object, got " + it->dump());
    return *it;
  }

  // `owner` names what the entry describes (e.g. " (pipeline 0, chunk 1)"), after the path.
  double number(const json& parent, const char* field, const std::string& prefix,
                std::optional<double> fallback = std::nullopt,
                const std::string& owner = std::string()) const {
    const std::string path = prefix + field + owner;
    const auto it = parent.find(field);
    if (it == parent.end()) {
      if (!fallback) fail(path, "is missing");
      return *fallback;
    }
    if (!it->is_number()) fail(path, "must be a number, got " + it->dump());
    const double value = it->get<double>();
    if (!std::isfinite(value) || value < 0.0) {
      fail(path, "= " + it->dump() + " (must be finite and >= 0)");
    }
    return value;
  }

  // Indices are bounded, but the lookup tables are sparse (maps), so a large index costs nothing.
  int integer(const json& parent, const char* field, const std::string& prefix,
              std::optional<int> fallback = std::nullopt) const {
    return json_fields::integer_field<int>(parent, field, source_, 0, kMaxProfileIndex, fallback,
                                           prefix);
  }

  LinkProfile link(const json& parent, const char* field, bool with_message) const {
    const std::string prefix = std::string(field) + ".";
    const json& node = object(parent, field, field);
    LinkProfile link;
    link.bandwidth = number(node, "bandwidth", prefix);
    if (link.bandwidth <= 0.0) fail(prefix + "bandwidth", "must be > 0");
    link.latency_s = number(node, "latency_s", prefix);
    if (with_message) link.message_bytes = number(node, "message_bytes", prefix);
    return link;
  }

 private:
  std::string source_;
};

}  // namespace

Profile profile_from_json(const json& root, const std::string& source) {
  const Reader read(source);
  if (!root.is_object()) throw std::invalid_argument(source + ": expected a JSON object");
  const auto version = root.find("format_version");
  if (version == root.end()) read.fail("format_version", "is missing");
  if (!version->is_number_integer() || version->get<long long>() != kProfileFormatVersion) {
    read.fail("format_version", "= " + version->dump() + " (this simulator reads version " +
                                    std::to_string(kProfileFormatVersion) + ")");
  }
  Profile profile;
  profile.description = json_fields::string_field(root, "description", source, std::string());
  const auto chunks = root.find("chunks");
  if (chunks == root.end()) read.fail("chunks", "is missing");
  if (!chunks->is_array() || chunks->empty()) read.fail("chunks", "must be a non-empty array");
  for (std::size_t i = 0; i < chunks->size(); ++i) {
    const json& node = (*chunks)[i];
    const std::string prefix = "chunks[" + std::to_string(i) + "].";
    if (!node.is_object()) read.fail(prefix.substr(0, prefix.size() - 1), "must be an object");
    ChunkProfile c;
    c.pipeline = read.integer(node, "pipeline", prefix, -1);
    c.chunk = read.integer(node, "chunk", prefix);
    c.forward_s = read.number(node, "forward_s", prefix);
    c.backward_s = read.number(node, "backward_s", prefix);
    c.backward_input_s = read.number(node, "backward_input_s", prefix, c.backward_s / 2.0);
    c.backward_weight_s = read.number(node, "backward_weight_s", prefix, c.backward_s / 2.0);
    // The memory fields name their chunk too: a profile lists many, and the bytes of one are
    // what a user edits or a tool writes.
    const std::string owner = " (pipeline " +
                              (c.pipeline < 0 ? std::string("any") : std::to_string(c.pipeline)) +
                              ", chunk " + std::to_string(c.chunk) + ")";
    c.activation_bytes = read.number(node, "activation_bytes", prefix, 0.0, owner);
    c.static_bytes = read.number(node, "static_bytes", prefix, 0.0, owner);
    c.gradient_bytes = read.number(node, "gradient_bytes", prefix, 0.0, owner);
    profile.chunks.push_back(c);
  }
  profile.communication = read.link(root, "communication", true);
  profile.reduction =
      root.contains("reduction") ? read.link(root, "reduction", false) : profile.communication;
  if (root.contains("host_link")) profile.host_link = read.link(root, "host_link", false);
  profile.optimizer_step_s = read.number(root, "optimizer_step_s", "", 0.0);
  if (root.contains("shared_processor")) {
    const json& node = read.object(root, "shared_processor", "shared_processor");
    profile.shared_processor_capacity = read.number(node, "capacity", "shared_processor.");
    if (!(profile.shared_processor_capacity > 0.0)) {
      read.fail("shared_processor.capacity", "must be > 0 (instructions at full speed at once)");
    }
    profile.shared_processor_replicas = read.integer(node, "replicas", "shared_processor.", 1);
    if (profile.shared_processor_replicas < 1) {
      read.fail("shared_processor.replicas", "must be >= 1 (data-parallel replicas)");
    }
    if (node.contains("machines")) {
      const json& machines = node.at("machines");
      if (!machines.is_array() || machines.empty() ||
          machines.size() % static_cast<std::size_t>(profile.shared_processor_replicas) != 0) {
        read.fail("shared_processor.machines",
                  "must be a list of every rank's machine, a whole number of the " +
                      std::to_string(profile.shared_processor_replicas) + " replicas' ranks");
      }
      for (std::size_t r = 0; r < machines.size(); ++r) {
        const json& m = machines[r];
        if (!m.is_number_integer() || m.get<std::int64_t>() < 0 ||
            m.get<std::int64_t>() >= static_cast<std::int64_t>(machines.size())) {
          read.fail("shared_processor.machines[" + std::to_string(r) + "]",
                    "must be an integer from 0 to " + std::to_string(machines.size() - 1));
        }
        profile.shared_processor_machines.push_back(m.get<int>());
      }
    }
  }
  profile.kfac_task_overhead_s =
      read.number(root, "kfac_task_overhead_s", "", kDefaultKfacTaskOverheadS);
  if (root.contains("kfac_task_overheads")) {
    const json& node = read.object(root, "kfac_task_overheads", "kfac_task_overheads");
    for (const auto& [key, ignored] : node.items()) {
      (void)ignored;
      if (std::find(kKfacOverheadFields.begin(), kKfacOverheadFields.end(), key) ==
          kKfacOverheadFields.end()) {
        read.fail("kfac_task_overheads." + key,
                  "is unknown (allowed: curvature_a_s, curvature_b_s, curvature_sync_s, "
                  "invert_a_s, invert_b_s, precondition_s)");
      }
    }
    for (std::size_t i = 0; i < kKfacOverheadFields.size(); ++i) {
      const std::string field(kKfacOverheadFields[i]);
      if (node.contains(field)) {
        profile.kfac_kind_overheads_s[i] = read.number(node, field.c_str(), "kfac_task_overheads.");
      }
    }
  }
  if (const auto kfac = root.find("kfac"); kfac != root.end()) {
    if (!kfac->is_array()) read.fail("kfac", "must be an array");
    for (std::size_t i = 0; i < kfac->size(); ++i) {
      const json& node = (*kfac)[i];
      const std::string prefix = "kfac[" + std::to_string(i) + "].";
      if (!node.is_object()) read.fail(prefix.substr(0, prefix.size() - 1), "must be an object");
      KfacProfile k;
      k.layer = read.integer(node, "layer", prefix, -1);
      if (const auto linear = node.find("linear"); linear != node.end()) {
        k.linear =
            sched::linear_kind_from_string(json_fields::string(*linear, source, prefix + "linear"));
        if (!k.linear) {
          read.fail(prefix + "linear", "= " + linear->dump() +
                                           " (allowed: query, key, value, attention_out, "
                                           "ffn_in, ffn_out)");
        }
      }
      k.curvature_a_s = read.number(node, "curvature_a_s", prefix);
      k.curvature_b_s = read.number(node, "curvature_b_s", prefix);
      k.invert_a_s = read.number(node, "invert_a_s", prefix);
      k.invert_b_s = read.number(node, "invert_b_s", prefix);
      k.precondition_s = read.number(node, "precondition_s", prefix);
      k.curvature_sync_s =
          node.contains("curvature_sync_s") ? read.number(node, "curvature_sync_s", prefix) : -1.0;
      k.bytes = read.number(
          node, "bytes", prefix, 0.0,
          " (layer " + (k.layer < 0 ? std::string("any") : std::to_string(k.layer)) + ", " +
              (k.linear ? std::string(sched::to_string(*k.linear)) : std::string("any Linear")) +
              ")");
      profile.kfac.push_back(k);
    }
  }
  return profile;
}

SharedProcessors shared_processors_of(const Profile& profile, int replicas) {
  if (replicas < 0) {
    throw std::invalid_argument("shared processor: " + std::to_string(replicas) +
                                " data-parallel replicas (must be >= 1)");
  }
  SharedProcessors shared;
  if (profile.shared_processor_capacity > 0.0) {
    shared.workers_per_processor = std::numeric_limits<int>::max();
    const int profiled = std::max(1, profile.shared_processor_replicas);
    shared.capacity = profile.shared_processor_capacity * profiled /
                      static_cast<double>(replicas > 0 ? replicas : profiled);
    const auto& machines = profile.shared_processor_machines;
    if (spans_machines(machines) && (replicas == 0 || replicas == profiled)) {
      return processors_by_machine(machines, static_cast<int>(machines.size()) / profiled,
                                   profile.shared_processor_capacity * profiled);
    }
  }
  return shared;
}

Profile profile_from_json_file(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) throw std::invalid_argument("cannot open profile file " + path.string());
  json root;
  try {
    root = json_fields::parse_bounded(in, path.string());
  } catch (const json::exception& e) {
    throw std::invalid_argument(path.string() + ": not valid JSON: " + e.what());
  }
  return profile_from_json(root, path.string());
}

json profile_to_json(const Profile& profile) {
  json chunks = json::array();
  for (const ChunkProfile& c : profile.chunks) {
    json node = {{"chunk", c.chunk},
                 {"forward_s", c.forward_s},
                 {"backward_s", c.backward_s},
                 {"activation_bytes", c.activation_bytes},
                 {"static_bytes", c.static_bytes},
                 {"gradient_bytes", c.gradient_bytes}};
    if (c.pipeline >= 0) node["pipeline"] = c.pipeline;
    if (c.backward_input_s >= 0) node["backward_input_s"] = c.backward_input_s;
    if (c.backward_weight_s >= 0) node["backward_weight_s"] = c.backward_weight_s;
    chunks.push_back(node);
  }
  auto link = [](const LinkProfile& l, bool with_message) {
    json node = {{"bandwidth", l.bandwidth}, {"latency_s", l.latency_s}};
    if (with_message) node["message_bytes"] = l.message_bytes;
    return node;
  };
  json root = {{"format_version", kProfileFormatVersion},
               {"description", profile.description},
               {"chunks", chunks},
               {"communication", link(profile.communication, true)},
               {"reduction", link(profile.reduction, false)},
               {"optimizer_step_s", profile.optimizer_step_s},
               {"kfac_task_overhead_s", profile.kfac_task_overhead_s}};
  if (profile.host_link.bandwidth > 0.0) root["host_link"] = link(profile.host_link, false);
  if (profile.shared_processor_capacity > 0.0) {
    root["shared_processor"] = {{"capacity", profile.shared_processor_capacity},
                                {"replicas", profile.shared_processor_replicas}};
    if (!profile.shared_processor_machines.empty())
      root["shared_processor"]["machines"] = profile.shared_processor_machines;
  }
  json by_kind = json::object();
  for (std::size_t i = 0; i < kKfacOverheadFields.size(); ++i) {
    if (profile.kfac_kind_overheads_s[i]) {
      by_kind[std::string(kKfacOverheadFields[i])] = *profile.kfac_kind_overheads_s[i];
    }
  }
  if (!by_kind.empty()) root["kfac_task_overheads"] = by_kind;
  if (!profile.kfac.empty()) {
    json kfac = json::array();
    for (const KfacProfile& k : profile.kfac) {
      json node = {{"curvature_a_s", k.curvature_a_s},   {"curvature_b_s", k.curvature_b_s},
                   {"invert_a_s", k.invert_a_s},         {"invert_b_s", k.invert_b_s},
                   {"precondition_s", k.precondition_s}, {"bytes", k.bytes}};
      if (k.layer >= 0) node["layer"] = k.layer;
      if (k.linear) node["linear"] = std::string(sched::to_string(*k.linear));
      if (k.curvature_sync_s >= 0) node["curvature_sync_s"] = k.curvature_sync_s;
      kfac.push_back(node);
    }
    root["kfac"] = kfac;
  }
  return root;
}

MeasuredCostModel::MeasuredCostModel(Profile profile, std::string source)
    : profile_(std::move(profile)), source_(std::move(source)) {
  check_kfac_overheads(profile_.kfac_task_overhead_s, profile_.kfac_kind_overheads_s, source_);
  for (std::size_t i = 0; i < profile_.chunks.size(); ++i) {
    const ChunkProfile& c = profile_.chunks[i];
    auto& table = c.pipeline < 0 ? chunk_any_pipeline_ : chunk_exact_;
    const auto [slot, inserted] = table.emplace(std::pair{c.pipeline, c.chunk}, i);
    if (!inserted) {
      throw std::invalid_argument(source_ + ": chunks[" + std::to_string(i) + "] repeats chunks[" +
                                  std::to_string(slot->second) + "] (pipeline " +
                                  std::to_string(c.pipeline) + ", chunk " +
                                  std::to_string(c.chunk) + ")");
    }
  }
  for (std::size_t i = 0; i < profile_.kfac.size(); ++i) {
    const KfacProfile& k = profile_.kfac[i];
    const int linear = k.linear ? static_cast<int>(*k.linear) : kAnyLinear;
    const auto [slot, inserted] = kfac_table_.emplace(std::pair{k.layer, linear}, i);
    if (!inserted) {
      throw std::invalid_argument(source_ + ": kfac[" + std::to_string(i) + "] repeats kfac[" +
                                  std::to_string(slot->second) + "]");
    }
  }
}

const ChunkProfile& MeasuredCostModel::chunk(int pipeline, int chunk) const {
  if (const auto exact = chunk_exact_.find({pipeline, chunk}); exact != chunk_exact_.end()) {
    return profile_.chunks[exact->second];
  }
  if (const auto any = chunk_any_pipeline_.find({-1, chunk}); any != chunk_any_pipeline_.end()) {
    return profile_.chunks[any->second];
  }
  throw std::invalid_argument(source_ + ": no entry in 'chunks' for pipeline " +
                              std::to_string(pipeline) + " chunk " + std::to_string(chunk) +
                              " (the profile does not match the schedule)");
}

const KfacProfile& MeasuredCostModel::kfac(int layer, sched::LinearKind linear) const {
  // Most specific first: this layer and Linear, this layer, this Linear in every layer, all.
  for (const int row : {std::max(layer, -1), -1}) {
    for (const int column : {static_cast<int>(linear), kAnyLinear}) {
      if (const auto it = kfac_table_.find({row, column}); it != kfac_table_.end()) {
        return profile_.kfac[it->second];
      }
    }
  }
  throw std::invalid_argument(source_ + ": no entry in 'kfac' for layer " + std::to_string(layer) +
                              " " + std::string(sched::to_string(linear)) +
                              " (profile K-FAC work to simulate it)");
}

double MeasuredCostModel::duration(const sched::Schedule& schedule, int /*worker*/,
                                   const sched::Instruction& in) const {
  switch (in.kind) {
    case OpKind::kForward:
      return chunk(in.pipeline, in.chunk).forward_s;
    case OpKind::kBackward:
      return chunk(in.pipeline, in.chunk).backward_s;
    case OpKind::kBackwardInput:
      return chunk(in.pipeline, in.chunk).backward_input_s;
    case OpKind::kBackwardWeight:
      return chunk(in.pipeline, in.chunk).backward_weight_s;
    case OpKind::kSendActivation:
    case OpKind::kRecvActivation:
    case OpKind::kSendGradient:
    case OpKind::kRecvGradient: {
      const LinkProfile& link = profile_.communication;
      const double bytes = in.bytes > 0 ? static_cast<double>(in.bytes) : link.message_bytes;
      return transfer_seconds(bytes, link.bandwidth, link.latency_s);
    }
    case OpKind::kReduceGradPipelines:
    case OpKind::kReduceGradDataParallel: {
      const int participants =
          in.kind == OpKind::kReduceGradPipelines ? 2 : std::max(1, schedule.params.data_parallel);
      double bytes = static_cast<double>(in.bytes);
      if (bytes <= 0.0 && in.chunk >= 0) bytes = chunk(in.pipeline, in.chunk).gradient_bytes;
      return ring_allreduce_seconds(bytes, participants, profile_.reduction.bandwidth,
                                    profile_.reduction.latency_s);
    }
    case OpKind::kOptimizerStep:
      return profile_.optimizer_step_s;
    case OpKind::kCurvatureA:
      return kfac_piece_seconds(kfac(in.layer, in.linear).curvature_a_s,
                                kfac_task_overhead_s(in.kind), in);
    case OpKind::kCurvatureB:
      return kfac_piece_seconds(kfac(in.layer, in.linear).curvature_b_s,
                                kfac_task_overhead_s(in.kind), in);
    case OpKind::kInvertA:
      return kfac_piece_seconds(kfac(in.layer, in.linear).invert_a_s, kfac_task_overhead_s(in.kind),
                                in);
    case OpKind::kInvertB:
      return kfac_piece_seconds(kfac(in.layer, in.linear).invert_b_s, kfac_task_overhead_s(in.kind),
                                in);
    case OpKind::kPrecondition:
      return kfac_piece_seconds(kfac(in.layer, in.linear).precondition_s,
                                kfac_task_overhead_s(in.kind), in);
    case OpKind::kCurvatureSync: {
      // A piece: its share of the whole sync plus the per-task overhead.
      const KfacProfile& k = kfac(in.layer, in.linear);
      if (k.curvature_sync_s >= 0.0) {
        return kfac_piece_seconds(k.curvature_sync_s, kfac_task_overhead_s(in.kind), in);
      }
      const int replicas = std::max(1, schedule.placement.num_pipelines) *
                           std::max(1, schedule.params.data_parallel);
      const auto whole = whole_task(in);
      const double bytes = whole.bytes > 0 ? static_cast<double>(whole.bytes) : k.bytes / 2.0;
      return kfac_piece_seconds(
          ring_allreduce_seconds(bytes, replicas, profile_.reduction.bandwidth,
                                 profile_.reduction.latency_s),
          kfac_task_overhead_s(in.kind), in);
    }
    case OpKind::kBroadcastInverses:
    case OpKind::kBroadcastGradient:
      // The owner sends `bytes` in all over its link.
      return transfer_seconds(static_cast<double>(std::max<std::int64_t>(in.bytes, 0)),
                              profile_.reduction.bandwidth, profile_.reduction.latency_s);
    case OpKind::kPrefetchFactors:
    case OpKind::kWriteBackState:
    case OpKind::kPrefetchInverses:
      return host_transfer_seconds(static_cast<double>(std::max<std::int64_t>(in.bytes, 0)),
                                   profile_.host_link.bandwidth, profile_.host_link.latency_s,
                                   "the profile's host_link (" + source_ + ")");
  }
  return 0.0;
}

double MeasuredCostModel::activation_bytes(const sched::Schedule&, int pipeline, int c) const {
  return chunk(pipeline, c).activation_bytes;
}

double MeasuredCostModel::static_bytes(const sched::Schedule&, int pipeline, int c) const {
  return chunk(pipeline, c).static_bytes;
}

double MeasuredCostModel::kfac_bytes(const sched::Schedule&, int layer,
                                     sched::LinearKind linear) const {
  return kfac(layer, linear).bytes;
}

}  // namespace pf::sim
