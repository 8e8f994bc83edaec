#include "scheduler/schedule_json.h"

#include <fstream>
#include <limits>
#include <stdexcept>
#include <string>

#include "common/input_error.h"
#include "common/json_fields.h"
#include "scheduler/placement.h"
#include "scheduler/validate.h"

namespace pf::sched {
namespace {

using nlohmann::json;

json instruction_to_json(const Instruction& in) {
  json j = json::object();
  j["kind"] = to_string(in.kind);
  const Instruction defaults;
  if (in.pipeline != defaults.pipeline) j["pipeline"] = in.pipeline;
  if (in.step != defaults.step) j["step"] = in.step;
  if (in.chunk != defaults.chunk) j["chunk"] = in.chunk;
  if (in.microbatch != defaults.microbatch) j["microbatch"] = in.microbatch;
  if (in.peer != defaults.peer) j["peer"] = in.peer;
  if (in.pair_id != defaults.pair_id) j["pair_id"] = in.pair_id;
  if (in.bytes != defaults.bytes) j["bytes"] = in.bytes;
  if (in.layer != defaults.layer) j["layer"] = in.layer;
  if (in.linear != defaults.linear) j["linear"] = to_string(in.linear);
  if (in.overlap_next) j["overlap_next"] = true;
  if (is_piece(in)) j["piece"] = json::array({in.piece_begin, in.piece_end});
  return j;
}

// Reads fields of one JSON object with errors that name the path; refuses unknown keys.
class ObjectReader {
 public:
  ObjectReader(const json& object, std::string path) : object_(object), path_(std::move(path)) {
    if (!object_.is_object())
      fail("", "expected an object, got " + std::string(object_.type_name()));
  }

  [[noreturn]] void fail(const std::string& key, const std::string& message) const {
    throw std::invalid_argument(path_ + (key.empty() ? "" : "." + key) + ": " + message);
  }

  const json* find(const std::string& key) {
    const auto it = object_.find(key);
    if (it == object_.end()) return nullptr;
    ++found_;
    return &*it;
  }

  std::int64_t integer(const std::string& key, std::int64_t fallback, std::int64_t lo,
                       std::int64_t hi, bool required = false) {
    const json* value = find(key);
    if (value == nullptr) {
      if (required) fail(key, "missing (an integer is required)");
      return fallback;
    }
    if (!value->is_number_integer()) fail(key, "expected an integer, got " + value->dump());
    const auto result = value->get<std::int64_t>();
    if (result < lo || result > hi) {
      fail(key, std::to_string(result) + " outside [" + std::to_string(lo) + ", " +
                    std::to_string(hi) + "]");
    }
    return result;
  }

  bool boolean(const std::string& key, bool fallback, bool required = false) {
    const json* value = find(key);
    if (value == nullptr) {
      if (required) fail(key, "missing (true or false is required)");
      return fallback;
    }
    if (!value->is_boolean()) fail(key, "expected true or false, got " + value->dump());
    return value->get<bool>();
  }

  std::string text(const std::string& key, bool required) {
    const json* value = find(key);
    if (value == nullptr) {
      if (required) fail(key, "missing (a string is required)");
      return {};
    }
    if (!value->is_string()) fail(key, "expected a string, got " + value->dump());
    return value->get<std::string>();
  }

  const json& array(const std::string& key) {
    const json* value = find(key);
    if (value == nullptr) fail(key, "missing (an array is required)");
    if (!value->is_array()) fail(key, "expected an array, got " + std::string(value->type_name()));
    return *value;
  }

  // Every key of the object must have been asked for.
  void finish() const {
    if (found_ == object_.size()) return;
    std::string unknown;
    for (const auto& item : object_.items()) {
      if (!asked(item.key())) unknown += (unknown.empty() ? "" : ", ") + item.key();
    }
    fail("", "unknown field(s): " + unknown);
  }

  const std::string& path() const { return path_; }
  void remember(const std::string& key) { keys_.push_back(key); }

 private:
  bool asked(const std::string& key) const {
    for (const auto& k : keys_) {
      if (k == key) return true;
    }
    return false;
  }
  const json& object_;
  std::string path_;
  std::size_t found_ = 0;
  std::vector<std::string> keys_;
};

constexpr std::int64_t kIntMax = std::numeric_limits<std::int32_t>::max();
constexpr std::int64_t kInt64Max = std::numeric_limits<std::int64_t>::max();

Instruction instruction_from_json(const json& j, const std::string& path) {
  ObjectReader r(j, path);
  for (const char* key : {"kind", "pipeline", "step", "chunk", "microbatch", "peer", "pair_id",
                          "bytes", "layer", "linear", "overlap_next", "piece"}) {
    r.remember(key);
  }
  Instruction in;
  const std::string kind = r.text("kind", true);
  const auto parsed = op_kind_from_string(kind);
  if (!parsed) {
    std::string allowed;
    for (int k = 0; k < kNumOpKinds; ++k) {
      allowed += (k ? ", " : "") + std::string(to_string(static_cast<OpKind>(k)));
    }
    r.fail("kind", "unknown kind '" + kind + "' (allowed: " + allowed + ")");
  }
  in.kind = *parsed;
  in.pipeline = static_cast<std::int8_t>(r.integer("pipeline", 0, 0, 1));
  // Negative: a pipelined refresh's K-FAC work of the previous window (the validator checks).
  in.step = static_cast<std::int16_t>(r.integer("step", 0, -32767, 32767));
  in.chunk = static_cast<std::int32_t>(r.integer("chunk", -1, -1, kIntMax));
  in.microbatch = static_cast<std::int32_t>(r.integer("microbatch", -1, -1, kIntMax));
  in.peer = static_cast<std::int32_t>(r.integer("peer", -1, -1, kIntMax));
  in.pair_id = r.integer("pair_id", -1, -1, kInt64Max);
  in.bytes = r.integer("bytes", 0, 0, kInt64Max);
  in.layer = static_cast<std::int16_t>(r.integer("layer", -1, -1, kMaxKfacLayer));
  const std::string linear = r.text("linear", false);
  if (!linear.empty()) {
    const auto lk = linear_kind_from_string(linear);
    if (!lk) {
      r.fail("linear", "unknown Linear kind '" + linear +
                           "' (allowed: query, key, value, attention_out, ffn_in, ffn_out)");
    }
    in.linear = *lk;
  }
  in.overlap_next = r.boolean("overlap_next", false);
  if (const json* piece = r.find("piece"); piece != nullptr) {
    // [begin, end) in units of the task's kPieceUnits shares.
    if (!piece->is_array() || piece->size() != 2 || !(*piece)[0].is_number_integer() ||
        !(*piece)[1].is_number_integer()) {
      r.fail("piece", "expected [begin, end] (integers), got " + piece->dump());
    }
    const auto begin = (*piece)[0].get<std::int64_t>();
    const auto end = (*piece)[1].get<std::int64_t>();
    if (begin < 0 || begin >= end || end > kPieceUnits) {
      r.fail("piece", "expected 0 <= begin < end <= " + std::to_string(kPieceUnits) + ", got " +
                          piece->dump());
    }
    if (!is_divisible(in.kind)) {
      r.fail("piece",
             "only curvature, curvature sync, inversion and precondition instructions run in "
             "pieces, not " +
                 std::string(to_string(in.kind)));
    }
    in.piece_begin = static_cast<std::uint16_t>(begin);
    in.piece_end = static_cast<std::uint16_t>(end);
  }
  r.finish();
  return in;
}

ScheduleParams params_from_json(const json& j, const std::string& path) {
  ObjectReader r(j, path);
  for (const char* key :
       {"kind", "workers", "microbatches", "chunks_per_worker", "num_layers", "data_parallel",
        "split_backward", "max_in_flight", "v_shape", "layers_per_chunk"}) {
    r.remember(key);
  }
  ScheduleParams params;
  const std::string kind = r.text("kind", true);
  try {
    params.kind = schedule_kind_from_string(kind);
  } catch (const std::invalid_argument& error) {
    r.fail("kind", error.what());
  }
  params.workers = static_cast<int>(r.integer("workers", 1, 1, kIntMax, true));
  params.microbatches = static_cast<int>(r.integer("microbatches", 1, 1, kIntMax, true));
  params.chunks_per_worker = static_cast<int>(r.integer("chunks_per_worker", 1, 1, kIntMax));
  params.num_layers = static_cast<int>(r.integer("num_layers", 0, 0, kIntMax));
  params.data_parallel = static_cast<int>(r.integer("data_parallel", 1, 1, kIntMax));
  params.split_backward = r.boolean("split_backward", false);
  params.max_in_flight = static_cast<int>(r.integer("max_in_flight", 0, 0, kIntMax));
  params.v_shape = r.boolean("v_shape", false);
  if (const json* found = r.find("layers_per_chunk"); found != nullptr) {
    if (!found->is_array()) {
      r.fail("layers_per_chunk", "expected an array, got " + std::string(found->type_name()));
    }
    const json& counts = *found;
    for (std::size_t i = 0; i < counts.size(); ++i) {
      if (!counts[i].is_number_integer() || counts[i].get<std::int64_t>() < 1 ||
          counts[i].get<std::int64_t>() > kMaxLayers) {
        r.fail("layers_per_chunk[" + std::to_string(i) + "]", "expected a layer count in [1, " +
                                                                  std::to_string(kMaxLayers) +
                                                                  "], got " + counts[i].dump());
      }
      params.layers_per_chunk.push_back(counts[i].get<int>());
    }
  }
  r.finish();
  return params;
}

Placement placement_from_json(const json& j, const std::string& path) {
  ObjectReader r(j, path);
  for (const char* key : {"num_pipelines", "chunks_per_pipeline", "num_layers", "chunks"}) {
    r.remember(key);
  }
  Placement placement;
  placement.num_pipelines = static_cast<int>(r.integer("num_pipelines", 1, 1, 2, true));
  placement.chunks_per_pipeline =
      static_cast<int>(r.integer("chunks_per_pipeline", 1, 1, kIntMax, true));
  placement.num_layers = static_cast<int>(r.integer("num_layers", 0, 0, kIntMax, true));
  const json& chunks = r.array("chunks");
  placement.chunks.reserve(chunks.size());
  for (std::size_t i = 0; i < chunks.size(); ++i) {
    ObjectReader c(chunks[i], path + ".chunks[" + std::to_string(i) + "]");
    for (const char* key : {"pipeline", "chunk", "worker", "first_layer", "num_layers",
                            "has_embeddings", "has_head"}) {
      c.remember(key);
    }
    ChunkPlacement cp;
    cp.pipeline = static_cast<int>(c.integer("pipeline", 0, 0, 1, true));
    cp.chunk = static_cast<int>(c.integer("chunk", 0, 0, kIntMax, true));
    cp.worker = static_cast<int>(c.integer("worker", 0, 0, kIntMax, true));
    cp.first_layer = static_cast<int>(c.integer("first_layer", 0, 0, kIntMax, true));
    cp.num_layers = static_cast<int>(c.integer("num_layers", 0, 0, kIntMax, true));
    cp.has_embeddings = c.boolean("has_embeddings", false, true);
    cp.has_head = c.boolean("has_head", false, true);
    c.finish();
    placement.chunks.push_back(cp);
  }
  r.finish();
  return placement;
}

}  // namespace

nlohmann::json to_json(const Schedule& schedule) {
  json j = json::object();
  j["format_version"] = kScheduleFormatVersion;
  const ScheduleParams& p = schedule.params;
  j["params"] = {{"kind", to_string(p.kind)},         {"workers", p.workers},
                 {"microbatches", p.microbatches},    {"chunks_per_worker", p.chunks_per_worker},
                 {"num_layers", p.num_layers},        {"data_parallel", p.data_parallel},
                 {"split_backward", p.split_backward}};
  // Written only when set, so files without them read the same in older versions.
  if (p.max_in_flight != 0) j["params"]["max_in_flight"] = p.max_in_flight;
  if (p.v_shape) j["params"]["v_shape"] = true;
  if (!p.layers_per_chunk.empty()) j["params"]["layers_per_chunk"] = p.layers_per_chunk;
  j["num_steps"] = schedule.num_steps;
  if (schedule.kfac_pipelined_refresh) j["kfac_pipelined_refresh"] = true;  // only when set
  json chunks = json::array();
  for (const ChunkPlacement& cp : schedule.placement.chunks) {
    chunks.push_back({{"pipeline", cp.pipeline},
                      {"chunk", cp.chunk},
                      {"worker", cp.worker},
                      {"first_layer", cp.first_layer},
                      {"num_layers", cp.num_layers},
                      {"has_embeddings", cp.has_embeddings},
                      {"has_head", cp.has_head}});
  }
  j["placement"] = {{"num_pipelines", schedule.placement.num_pipelines},
                    {"chunks_per_pipeline", schedule.placement.chunks_per_pipeline},
                    {"num_layers", schedule.placement.num_layers},
                    {"chunks", std::move(chunks)}};
  json streams = json::array();
  for (const auto& stream : schedule.streams) {
    json row = json::array();
    for (const Instruction& in : stream) row.push_back(instruction_to_json(in));
    streams.push_back(std::move(row));
  }
  j["streams"] = std::move(streams);
  return j;
}

Schedule schedule_from_json(const nlohmann::json& json_value, std::string_view source) {
  const std::string root(source);
  ObjectReader r(json_value, root);
  for (const char* key : {"format_version", "params", "num_steps", "kfac_pipelined_refresh",
                          "placement", "streams"}) {
    r.remember(key);
  }
  const auto version = r.integer("format_version", 0, 0, kIntMax, true);
  if (version != kScheduleFormatVersion) {
    r.fail("format_version", "unsupported version " + std::to_string(version) +
                                 " (this build reads version " +
                                 std::to_string(kScheduleFormatVersion) + ")");
  }
  Schedule schedule;
  const json* params = r.find("params");
  if (params == nullptr) r.fail("params", "missing");
  schedule.params = params_from_json(*params, root + ".params");
  schedule.num_steps = static_cast<int>(r.integer("num_steps", 1, 1, 32767));
  schedule.kfac_pipelined_refresh = r.boolean("kfac_pipelined_refresh", false);
  const json* placement = r.find("placement");
  if (placement != nullptr) {
    schedule.placement = placement_from_json(*placement, root + ".placement");
  } else {
    try {
      schedule.placement = make_placement(schedule.params);
    } catch (const std::invalid_argument& error) {
      r.fail("params", error.what());
    }
  }
  const json& streams = r.array("streams");
  schedule.streams.resize(streams.size());
  for (std::size_t w = 0; w < streams.size(); ++w) {
    const std::string path = root + ".streams[" + std::to_string(w) + "]";
    if (!streams[w].is_array()) {
      throw std::invalid_argument(path + ": expected an array of instructions");
    }
    auto& stream = schedule.streams[w];
    stream.reserve(streams[w].size());
    for (std::size_t i = 0; i < streams[w].size(); ++i) {
      stream.push_back(instruction_from_json(streams[w][i], path + "[" + std::to_string(i) + "]"));
    }
  }
  r.finish();
  try {
    validate(schedule);
  } catch (const ValidationError& error) {
    throw ValidationError(root + ": " + error.what(), error.worker, error.position);
  }
  return schedule;
}

Schedule load_schedule_json(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) throw InputError("cannot open schedule file " + path.string());
  json j;
  try {
    j = json_fields::parse_bounded(in, path.string());
  } catch (const json::parse_error& error) {
    throw std::invalid_argument(path.string() + ": not valid JSON: " + error.what());
  }
  return schedule_from_json(j, path.string());
}

void save_schedule_json(const std::filesystem::path& path, const Schedule& schedule) {
  std::ofstream out(path);
  if (!out) throw InputError("cannot write schedule file " + path.string());
  out << to_json(schedule).dump(1) << '\n';
  if (!out) throw InputError("failed writing schedule file " + path.string());
}

}  // namespace pf::sched
