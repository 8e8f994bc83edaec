#include "sim/profile_measurements.h"

#include <stdexcept>
#include <string>

#include "scheduler/instruction.h"
#include "sim/bert_costs.h"

namespace pf::sim {

nlohmann::json measurements_from_profile(const Profile& profile, const sched::Schedule& schedule,
                                         const ProfileWorkload& workload,
                                         const nlohmann::json& tags) {
  if (!tags.is_object())
    throw std::invalid_argument("measurements_from_profile: tags not an object");
  const auto& c = workload.config;
  nlohmann::json base = tags;
  base["model"] = model::bert_config_to_hf_json(c);
  base["seq_len"] = workload.seq_len;
  base["micro_batch_size"] = workload.micro_batch_size;
  base["precision"] = std::string(to_string(workload.precision));
  if (element_bytes(workload.storage_precision) != element_bytes(workload.precision)) {
    base["storage_precision"] = std::string(to_string(workload.storage_precision));
  }
  if (workload.attention != AttentionAlgorithm::kBatched) {
    base["attention"] = std::string(to_string(workload.attention));
  }
  nlohmann::json records = nlohmann::json::array();
  const auto add = [&](const std::string& operation, double seconds, nlohmann::json fields) {
    if (!(seconds > 0.0)) return;
    nlohmann::json record = base;
    record.update(fields);
    record["operation"] = operation;
    record["seconds"] = seconds;
    records.push_back(std::move(record));
  };

  const auto& placement = schedule.placement;
  for (const auto& entry : profile.chunks) {
    const sched::ChunkPlacement* placed = nullptr;
    for (const auto& candidate : placement.chunks) {
      if (candidate.chunk == entry.chunk &&
          (entry.pipeline < 0 || candidate.pipeline == entry.pipeline)) {
        placed = &candidate;
        break;
      }
    }
    if (placed == nullptr) {
      throw std::invalid_argument("measured profile: chunk " + std::to_string(entry.chunk) +
                                  " of pipeline " + std::to_string(entry.pipeline) +
                                  " is not in the schedule's placement");
    }
    const nlohmann::json chunk = {{"layers", placed->num_layers},
                                  {"embeddings", placed->has_embeddings},
                                  {"head", placed->has_head},
                                  {"chunk", entry.chunk}};
    add("chunk_forward", entry.forward_s, chunk);
    add("chunk_backward", entry.backward_s, chunk);
  }

  const double tokens = static_cast<double>(workload.seq_len) * workload.micro_batch_size;
  for (const auto& entry : profile.kfac) {
    if (!entry.linear.has_value()) continue;  // a fallback for every Linear: no one shape
    const LinearDims d = linear_dims(c, *entry.linear);
    const nlohmann::json where = {{"layer", entry.layer},
                                  {"linear", std::string(sched::to_string(*entry.linear))}};
    auto with = [&](nlohmann::json fields) {
      fields.update(where);
      return fields;
    };
    add("curvature", entry.curvature_a_s, with({{"rows", tokens}, {"order", d.in}}));
    add("curvature", entry.curvature_b_s, with({{"rows", tokens}, {"order", d.out}}));
    add("cholesky_inverse", entry.invert_a_s, with({{"order", d.in}}));
    add("cholesky_inverse", entry.invert_b_s, with({{"order", d.out}}));
    add("precondition", entry.precondition_s, with({{"d_in", d.in}, {"d_out", d.out}}));
  }

  // The profile's optimizer step is one figure for every worker: priced at the mean worker's
  // parameters.
  std::vector<double> per_worker;
  for (const auto& placed : placement.chunks) {
    if (placed.worker >= static_cast<int>(per_worker.size())) per_worker.resize(placed.worker + 1);
    double params = placed.num_layers * encoder_layer_params(c);
    if (placed.has_embeddings) params += embeddings_params(c);
    if (placed.has_head) params += heads_params(c, placed.has_embeddings);
    per_worker[static_cast<std::size_t>(placed.worker)] += params;
  }
  if (!per_worker.empty()) {
    double total = 0.0;
    for (double params : per_worker) total += params;
    add("optimizer_step", profile.optimizer_step_s,
        {{"params", total / static_cast<double>(per_worker.size())}});
  }
  return {{"format_version", 1},
          {"description", profile.description},
          {"measurements", std::move(records)}};
}

}  // namespace pf::sim
