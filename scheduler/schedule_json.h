#pragma once
// JSON form of a whole schedule (parameters, placement, streams), with a format version.
//
// {"format_version": 1,
//  "params": {"kind": "1f1b", "workers": 4, "microbatches": 8, "chunks_per_worker": 1,
//             "num_layers": 0, "data_parallel": 1, "split_backward": false},
//  "num_steps": 1,
//  "placement": {"num_pipelines": 1, "chunks_per_pipeline": 4, "num_layers": 4,
//                "chunks": [{"pipeline": 0, "chunk": 0, "worker": 0, "first_layer": 0,
//                            "num_layers": 1, "has_embeddings": true, "has_head": false}, ...]},
//  "streams": [[{"kind": "forward", "chunk": 0, "microbatch": 0}, ...], ...]}
//
// Instruction fields equal to their defaults are omitted (pipeline 0, step 0, chunk -1,
// microbatch -1, peer -1, pair_id -1, bytes 0, layer -1, linear "query"); the placement may be
// omitted on input, it is then derived from params.
#include <filesystem>
#include <string_view>

#include <nlohmann/json.hpp>

#include "scheduler/schedule.h"

namespace pf::sched {

inline constexpr int kScheduleFormatVersion = 1;

nlohmann::json to_json(const Schedule& schedule);

// Parses and validates (validate()); errors name `source` and the offending field, e.g.
// "plan.json: streams[2][5].kind: unknown kind 'fwd' (allowed: forward, backward, ...)".
Schedule schedule_from_json(const nlohmann::json& json, std::string_view source);

Schedule load_schedule_json(const std::filesystem::path& path);
void save_schedule_json(const std::filesystem::path& path, const Schedule& schedule);

}  // namespace pf::sched
