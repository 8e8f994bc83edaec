#include "runtime/train/checkpointing.h"

#include <algorithm>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>

#include "kfac/state_placement.h"
#include "runtime/model/bert_chunk.h"
#include "runtime/model/hf_weights.h"
#include "runtime/optim/param_view.h"
#include "scheduler/schedule_json.h"

namespace pf::train {

namespace {

namespace fs = std::filesystem;

constexpr const char* kOptimizerPrefix = "optimizer";
constexpr const char* kKfacPrefix = "kfac";  // layer-keyed, any layout (replica 0, pipeline 0)
// Exact double weights of an fp64 run (model.safetensors holds F32 for transformers).
constexpr const char* kMasterPrefix = "master";

// Whether some instruction of the schedule is of a kind `is_kind` accepts.
bool schedule_has(const sched::Schedule& schedule, bool (*is_kind)(sched::OpKind)) {
  for (const auto& stream : schedule.streams) {
    for (const auto& in : stream) {
      if (is_kind(in.kind)) return true;
    }
  }
  return false;
}
bool schedule_has_kfac_transfers(const sched::Schedule& schedule) {
  return schedule_has(schedule, sched::is_kfac_transfer);
}
bool schedule_has_kfac(const sched::Schedule& schedule) {
  return schedule_has(schedule, sched::is_kfac);
}

// Per rank and pipeline, the exact K-FAC state of the checkpoint's own schedule.
std::string exact_kfac_prefix(int rank, int pipeline) {
  return std::string(kKfacPrefix) + ".rank" + std::to_string(rank) + ".pipeline" +
         std::to_string(pipeline);
}
std::string progress_prefix(int rank) {
  return std::string(kKfacPrefix) + ".rank" + std::to_string(rank) + ".progress";
}

std::string layout_string(const nlohmann::json& schedule) {
  if (!schedule.is_object() || !schedule.contains("params")) return "an unknown layout";
  const auto& p = schedule["params"];
  std::string text = p.value("kind", std::string("?")) + " on " +
                     std::to_string(p.value("workers", 0)) + " worker(s)";
  if (p.value("chunks_per_worker", 1) > 1) {
    text += " x " + std::to_string(p.value("chunks_per_worker", 1)) + " chunks";
  }
  return text + ", refresh every " + std::to_string(schedule.value("num_steps", 1)) + " step(s)";
}

// The word embeddings and the head's tied copy share one optimizer state (identical gradients
// and updates): a layout whose head is on its own chunk finds the copy's state under the
// embeddings' name when the checkpoint came from a layout with one chunk.
void alias_tied_records(ckpt::SafetensorsFile& file, const std::string& prefix) {
  const auto [word, decoder] = model::tied_parameter_names();
  const std::string from = prefix + "." + word + ".";
  const std::string to = prefix + "." + decoder + ".";
  std::vector<ckpt::TensorRecord> aliases;
  for (const auto& [name, record] : file.tensors) {
    if (name.rfind(from, 0) != 0) continue;
    auto alias = record;
    alias.name = to + name.substr(from.size());
    if (file.tensors.count(alias.name) == 0) aliases.push_back(std::move(alias));
  }
  for (auto& alias : aliases) file.tensors.emplace(alias.name, std::move(alias));
}

template <typename T>
std::vector<optim::BasicParamView<T>> parameter_views(exec::Worker<T>& worker) {
  std::vector<optim::BasicParamView<T>> views;
  for (auto* chunk : worker.chunks()) {
    for (auto& p : chunk->parameters()) {
      views.push_back({p.name, p.value, p.grad, static_cast<std::size_t>(p.size), p.shape,
                       p.is_bias_or_layernorm});
    }
  }
  return views;
}

// Records merged from several workers: the first of a name wins (Chimera's second pipeline and
// the head's tied copy hold the same values as the first).
void merge_records(std::map<std::string, ckpt::TensorRecord>& merged,
                   std::vector<ckpt::TensorRecord> records) {
  for (auto& record : records) merged.try_emplace(record.name, std::move(record));
}

std::vector<ckpt::TensorRecord> values_of(std::map<std::string, ckpt::TensorRecord> merged) {
  std::vector<ckpt::TensorRecord> records;
  records.reserve(merged.size());
  for (auto& [name, record] : merged) records.push_back(std::move(record));
  return records;
}

}  // namespace

nlohmann::json run_identity(const TrainOptions& o, const model::BertConfig& config,
                            std::int64_t seq_len, std::int64_t max_predictions, int microbatches,
                            int data_parallel, const std::vector<std::string>& shard_files) {
  nlohmann::json shards = nlohmann::json::array();
  for (const auto& file : shard_files) shards.push_back(fs::path(file).filename().string());
  const auto lr = learning_rate_schedule(o);
  nlohmann::json optimizer = {{"kind", o.optimizer},
                              {"lr", lr.base_lr},
                              {"lr_decay_steps", lr.total_steps},
                              {"warmup_fraction", lr.warmup_fraction},
                              {"weight_decay", o.weight_decay}};
  if (o.optimizer == "sgd") optimizer["momentum"] = o.momentum;
  nlohmann::json kfac = {{"enabled", o.kfac.enabled}};
  if (o.kfac.enabled) {
    kfac["damping"] = o.kfac_damping;
    kfac["curvature"] = o.kfac.curvature;
    kfac["linears"] = o.kfac.linears;
    kfac["layers"] = o.kfac.layers;
  }
  return {{"model", model::bert_config_to_hf_json(config)},
          {"data", {{"kind", o.data == "synthetic" ? "synthetic" : "shards"}, {"shards", shards}}},
          {"seq_len", seq_len},
          {"max_predictions", max_predictions},
          {"micro_batch_size", o.micro_batch_size},
          {"microbatches", microbatches},
          {"data_parallel", data_parallel},
          {"global_batch",
           static_cast<std::int64_t>(o.micro_batch_size) * microbatches * data_parallel},
          {"seed", o.seed},
          {"precision", o.precision},
          {"optimizer", optimizer},
          {"kfac", kfac}};
}

ckpt::TrainingCheckpoint load_resume_checkpoint(const fs::path& directory,
                                                const nlohmann::json& identity) {
  std::optional<ckpt::TrainingCheckpoint> checkpoint;
  try {
    checkpoint = ckpt::load_latest_checkpoint(directory);
  } catch (const std::exception& error) {
    throw std::invalid_argument("--resume: " + std::string(error.what()));
  }
  if (!checkpoint) {
    throw std::invalid_argument("--resume: no checkpoint in " + directory.string() +
                                " (no 'latest' file): drop --resume to start a new run");
  }
  try {
    ckpt::check_resume_compatible(identity, *checkpoint);
  } catch (const std::exception& error) {
    throw std::invalid_argument("--resume: " + std::string(error.what()) + " (identity in " +
                                (checkpoint->directory / "state.json").string() + ")");
  }
  return std::move(*checkpoint);
}

bool same_layout(const ckpt::TrainingCheckpoint& checkpoint, const sched::Schedule& base) {
  if (!checkpoint.schedule.is_object()) return false;
  const auto json = sched::to_json(base);
  for (const char* key : {"params", "placement"}) {
    if (!checkpoint.schedule.contains(key) || checkpoint.schedule[key] != json[key]) return false;
  }
  return true;
}

kfac::StatePlacement checkpoint_kfac_placement(const ckpt::TrainingCheckpoint& checkpoint) {
  const auto text =
      checkpoint.state.value("/kfac/placement"_json_pointer, std::string("replicate"));
  try {
    return kfac::parse_kfac_sharding(text).placement;
  } catch (const std::exception& error) {
    throw std::invalid_argument("--resume: " + (checkpoint.directory / "state.json").string() +
                                ": kfac.placement: " + error.what());
  }
}

// A pipelined refresh whose work runs on into the next window: at a window boundary part of
// the refresh is still to come (a curvature sync of the replicas' unsynced sums, the rest of a
// chain of inversion pieces, or whole inversions of sums not yet finalized), which only the
// schedule that saved it runs. Another schedule's first window skips the work of a refresh
// before its windows, so the sums would stay unfinalized (its next window's start then failed,
// "the factor sums of two earlier refreshes are both unfinalized"; without a pipelined refresh
// they would have been added to its own refresh's sums): the saved schedule finishes that work
// first (finish_saved_refresh).
bool runs_on_across_windows(const sched::Schedule& schedule) {
  if (!schedule.kfac_pipelined_refresh) return false;
  for (const auto& stream : schedule.streams) {
    for (const auto& in : stream) {
      if (sched::is_wrapped(in) && !sched::is_kfac_transfer(in.kind)) return true;
    }
  }
  return false;
}

namespace {
// state.json's kfac.<name>, or null where the checkpoint has none.
const nlohmann::json* kfac_state_field(const ckpt::TrainingCheckpoint& checkpoint,
                                       const char* name) {
  const auto kfac = checkpoint.state.find("kfac");
  if (kfac == checkpoint.state.end() || !kfac->is_object()) return nullptr;
  const auto field = kfac->find(name);
  return field == kfac->end() ? nullptr : &*field;
}

// state.json's kfac.window_origin (0 for checkpoints saved before it existed), checked.
std::int64_t checkpoint_window_origin(const ckpt::TrainingCheckpoint& checkpoint) {
  const auto* origin = kfac_state_field(checkpoint, "window_origin");
  if (origin == nullptr) return 0;  // saved before windows could start elsewhere
  if (!origin->is_number_integer() || origin->get<std::int64_t>() < 0 ||
      origin->get<std::int64_t>() > checkpoint.step) {
    throw std::invalid_argument("--resume: " + (checkpoint.directory / "state.json").string() +
                                ": kfac.window_origin should be a step from 0 to the "
                                "checkpoint's step " +
                                std::to_string(checkpoint.step) + ", it is " + origin->dump());
  }
  return origin->get<std::int64_t>();
}
}  // namespace

std::int64_t checkpoint_warmup_end(const ckpt::TrainingCheckpoint& checkpoint) {
  const auto* end = kfac_state_field(checkpoint, "warmup_end");
  if (end == nullptr) return 0;
  if (!end->is_number_integer() || end->get<std::int64_t>() < 1) {
    throw std::invalid_argument("--resume: " + (checkpoint.directory / "state.json").string() +
                                ": kfac.warmup_end should be a step >= 1, it is " + end->dump());
  }
  return end->get<std::int64_t>();
}

std::int64_t check_kfac_resumable(const ckpt::TrainingCheckpoint& checkpoint,
                                  const sched::Schedule& schedule,
                                  const kfac::StatePlacement& placement) {
  const std::int64_t saved_origin = checkpoint_window_origin(checkpoint);
  const auto saved = checkpoint_kfac_placement(checkpoint);
  // The checkpoint's own schedule and placement: the refresh in progress resumes as it was.
  if (checkpoint.schedule == sched::to_json(schedule) && saved == placement) return saved_origin;
  if (!schedule_has_kfac(schedule)) return checkpoint.step;
  bool saved_runs_on = false;
  if (checkpoint.step > 0) {
    std::optional<sched::Schedule> saved_schedule;
    try {
      saved_schedule = sched::schedule_from_json(checkpoint.schedule,
                                                 (checkpoint.directory / "schedule.json").string());
    } catch (const std::exception&) {
      // not a schedule this build reads: the checks below decide
    }
    saved_runs_on = saved_schedule && runs_on_across_windows(*saved_schedule);
    // Its refresh's work in the next window is finished on the saved schedule first
    // (finish_saved_refresh), but not with its offload copies around it.
    if (saved_runs_on && schedule_has_kfac_transfers(*saved_schedule)) {
      throw std::invalid_argument(
          "--resume: checkpoint " + checkpoint.directory.string() + " (" +
          layout_string(checkpoint.schedule) +
          ") runs a pipelined K-FAC refresh whose curvature syncs or inversions run on into the "
          "next refresh window, with K-FAC state offloaded to host memory: it resumes only on "
          "the schedule that saved it (the same flags, and its schedule.json), or from step 0");
    }
  }
  // This run's schedule starts its own windows at the checkpoint's step. At the end of one of
  // the checkpoint's windows the K-FAC state is whole (sharded state on the replicas that own
  // each Linear: restore_checkpoint gathers it); inside one the refresh in progress is dropped
  // (drops_refresh_in_progress). A pipelined refresh's work of the previous refresh in the
  // window precedes the window's first preconditioning of its Linear (sched::validate), so it
  // is done after the window's first step; sums still set aside for it say otherwise.
  const bool previous_refresh_pending =
      std::any_of(checkpoint.kfac.begin(), checkpoint.kfac.end(),
                  [](const auto& record) { return record.name.ends_with(".prev_counts"); });
  if (!inside_refresh_window(checkpoint) || !saved_runs_on || !previous_refresh_pending) {
    return checkpoint.step;
  }
  throw std::invalid_argument(
      "--resume: checkpoint " + checkpoint.directory.string() + " is at step " +
      std::to_string(checkpoint.step) + ", inside a K-FAC refresh window of its schedule (" +
      layout_string(checkpoint.schedule) + ", windows from step " + std::to_string(saved_origin) +
      "), whose pipelined refresh runs work of the previous refresh in this window, which this "
      "run's (" +
      layout_string(sched::to_json(schedule)) +
      ") does not continue. Resume with the checkpoint's layout and flags, or from a checkpoint "
      "at the end of one of its refresh windows (--checkpoint-every a multiple of its refresh "
      "interval)");
}

bool inside_refresh_window(const ckpt::TrainingCheckpoint& checkpoint) {
  const std::int64_t k = checkpoint.state.value("/kfac/refresh_steps"_json_pointer, 1);
  return k > 1 && (checkpoint.step - checkpoint_window_origin(checkpoint)) % k != 0;
}

namespace {
// The checkpoint's K-FAC state goes to a schedule or placement other than its own (on its own,
// the refresh in progress resumes as it was).
bool moves_kfac_state(const ckpt::TrainingCheckpoint& checkpoint, const sched::Schedule& schedule,
                      const kfac::StatePlacement& placement) {
  return !checkpoint.kfac.empty() && schedule_has_kfac(schedule) &&
         !(checkpoint.schedule == sched::to_json(schedule) &&
           checkpoint_kfac_placement(checkpoint) == placement);
}
}  // namespace

bool drops_refresh_in_progress(const ckpt::TrainingCheckpoint& checkpoint,
                               const sched::Schedule& schedule,
                               const kfac::StatePlacement& placement) {
  return moves_kfac_state(checkpoint, schedule, placement) && inside_refresh_window(checkpoint);
}

bool needs_refresh_finished(const ckpt::TrainingCheckpoint& checkpoint,
                            const sched::Schedule& schedule,
                            const kfac::StatePlacement& placement) {
  if (!moves_kfac_state(checkpoint, schedule, placement)) return false;
  if (checkpoint.step <= checkpoint_window_origin(checkpoint)) return false;  // no refresh yet
  if (inside_refresh_window(checkpoint)) return false;  // refused (check_kfac_resumable)
  try {
    return runs_on_across_windows(sched::schedule_from_json(
        checkpoint.schedule, (checkpoint.directory / "schedule.json").string()));
  } catch (const std::exception&) {
    return false;
  }
}

std::vector<data::LoaderPosition> checkpoint_loader_positions(
    const ckpt::TrainingCheckpoint& checkpoint, int replicas) {
  const auto& json = checkpoint.state.value("loader_positions", nlohmann::json());
  const fs::path state_file = checkpoint.directory / "state.json";
  if (!json.is_array() || json.size() != static_cast<std::size_t>(replicas)) {
    throw std::invalid_argument("--resume: " + state_file.string() +
                                ": loader_positions should hold one position per data-parallel "
                                "replica (" +
                                std::to_string(replicas) + "), it holds " +
                                (json.is_array() ? std::to_string(json.size()) : "none"));
  }
  std::vector<data::LoaderPosition> positions;
  for (const auto& position : json) {
    try {
      positions.push_back(data::LoaderPosition::from_json(position));
    } catch (const std::exception& error) {
      throw std::invalid_argument("--resume: " + state_file.string() +
                                  ": loader_positions: " + error.what());
    }
  }
  return positions;
}

namespace {

// The records of one rank: weights and optimizer state from replica 0's workers (the other
// replicas hold copies), its K-FAC state (exact per rank and pipeline, with the refresh in
// progress; layer-keyed from replica 0's pipeline 0). Merged over the ranks in rank order, the
// first record of a name kept, they are the whole checkpoint. `copies`: instead the copies of
// the weights and optimizer state the rank holds, of every replica and pipeline (no K-FAC
// records), for a process whose ranks hold no replica 0 or pipeline 0 of some layers.
template <typename T>
ckpt::CheckpointPart collect_part(exec::Worker<T>& worker, const sched::Schedule& schedule,
                                  bool copies = false) {
  const int rank = worker.rank();
  const int workers = schedule.num_workers();
  ckpt::CheckpointPart part;
  if (rank < workers || copies) {
    // This rank's chunks of pipeline 0 (with the copies: of every pipeline, each chunk once).
    std::vector<model::BertChunk<T>*> model_chunks;
    std::vector<bool> taken(static_cast<std::size_t>(schedule.placement.chunks_per_pipeline));
    for (int p = 0; p < (copies ? schedule.placement.num_pipelines : 1); ++p) {
      for (int c = 0; c < schedule.placement.chunks_per_pipeline; ++c) {
        if (schedule.placement.worker_of(p, c) != worker.worker() || taken[c]) continue;
        taken[c] = true;
        auto* chunk = worker.chunk(p, c);
        if (chunk == nullptr) throw std::logic_error("checkpoint: chunk " + std::to_string(c));
        model_chunks.push_back(chunk);
      }
    }
    if (!model_chunks.empty()) part.weights = model::hf_weight_records<T>(model_chunks);
    std::map<std::string, ckpt::TensorRecord> optimizer;
    merge_records(optimizer, worker.optimizer().state_records(kOptimizerPrefix));
    if constexpr (!std::is_same_v<T, float>) {
      for (auto* chunk : model_chunks) {
        for (const auto& p : chunk->parameters()) {
          merge_records(optimizer,
                        {ckpt::make_f64_record(
                            std::string(kMasterPrefix) + "." + p.name, p.shape,
                            std::span<const double>(p.value, static_cast<std::size_t>(p.size)))});
        }
      }
    }
    part.optimizer = values_of(std::move(optimizer));
  }
  if (schedule_has_kfac(schedule) && !copies) {
    std::map<std::string, ckpt::TensorRecord> kfac;
    for (int p = 0; p < schedule.placement.num_pipelines; ++p) {
      const auto state = worker.kfac_state_with_offloaded(p);
      if (state.layers().empty()) continue;
      if (rank < workers && p == 0) merge_records(kfac, state.state_records(kKfacPrefix));
      merge_records(kfac, state.state_records(exact_kfac_prefix(rank, p)));
    }
    merge_records(kfac, worker.kfac_progress_records(progress_prefix(rank)));
    part.kfac = values_of(std::move(kfac));
  }
  return part;
}

// Everything but the records: step, config, identity, schedule and state.json's state.
template <typename T>
ckpt::TrainingCheckpoint shared_checkpoint_fields(const exec::RunSetup<T>& setup, std::int64_t step,
                                                  const nlohmann::json& identity,
                                                  const nlohmann::json& loader_positions) {
  const auto& schedule = setup.schedule;
  ckpt::TrainingCheckpoint checkpoint;
  checkpoint.step = step;
  checkpoint.hf_config = model::bert_config_to_hf_json(setup.config);
  checkpoint.identity = identity;
  checkpoint.schedule = sched::to_json(schedule);
  checkpoint.state = {{"step", step},
                      {"loader_positions", loader_positions},
                      {"seeds",
                       {{"init", setup.options.init_seed},
                        {"dropout", setup.options.dropout_seed},
                        {"data", identity.value("seed", std::uint64_t{0})}}},
                      {"kfac",
                       {{"refresh_steps", schedule.num_steps},
                        {"window_origin", setup.options.window_origin},
                        {"round_phase", (step - setup.options.window_origin) % schedule.num_steps},
                        {"placement", kfac::to_string(setup.options.kfac.placement)}}},
                      {"layout", layout_string(checkpoint.schedule)}};
  if (setup.options.kfac_warmup_end > 0) {
    checkpoint.state["kfac"]["warmup_end"] = setup.options.kfac_warmup_end;
  }
  return checkpoint;
}

// The collective save of a run on several processes (MPI), each holding its own ranks: rank 0
// opens the temporary directory, every process writes its part, rank 0 commits the manifest
// once all have succeeded. Every step ends in a collective with the run's deadline, and every
// process learns the outcome: a failure anywhere throws the same error on all.
template <typename T>
fs::path save_collectively(exec::Executor<T>& executor, std::int64_t step,
                           const nlohmann::json& identity, exec::ShardBatches* shards,
                           const fs::path& root, const ckpt::SaveOptions& save_options) {
  const auto& setup = executor.setup();
  const auto& schedule = setup.schedule;
  const bool is_root = executor.is_root();
  const auto fail_everywhere = [](const std::string& outcome) {
    if (outcome.rfind("error: ", 0) == 0) {
      throw std::runtime_error("checkpoint at " + outcome.substr(7));
    }
  };
  // 1. The temporary directory, named by rank 0.
  std::string opened;
  if (is_root) {
    try {
      opened = "ok: " + ckpt::begin_partial_save(root, step).string();
    } catch (const std::exception& error) {
      opened = "error: step " + std::to_string(step) + ": rank 0: " + error.what();
    }
  }
  opened = executor.broadcast_from_root(opened);
  fail_everywhere(opened);
  const fs::path temp_dir = opened.substr(4);

  // 2. Every process its part (and its replica's loader position).
  nlohmann::json mine = nlohmann::json::array();
  for (auto* worker : executor.local_workers()) {
    const int rank = worker->rank();
    try {
      auto answer = ckpt::write_checkpoint_part(temp_dir, rank, executor.num_ranks(),
                                                collect_part(*worker, schedule));
      if (shards != nullptr && worker->worker() == 0) {
        answer["loader_position"] = shards->position_after(step - 1, worker->replica()).to_json();
      }
      mine.push_back(std::move(answer));
    } catch (const std::exception& error) {
      mine.push_back({{"error", "rank " + std::to_string(rank) + ": " + error.what()}});
    }
  }
  const auto gathered = executor.gather_to_root(mine.dump());

  // 3. Rank 0 commits when every part is there.
  std::string outcome;
  if (is_root) {
    try {
      std::vector<nlohmann::json> parts;
      std::map<int, nlohmann::json> positions;  // by replica
      std::string errors;
      for (const auto& text : gathered) {
        nlohmann::json answers = nlohmann::json::parse(text);
        for (nlohmann::json& answer : answers) {
          if (answer.contains("error")) {
            errors += (errors.empty() ? "" : "; ") + answer["error"].get<std::string>();
            continue;
          }
          if (answer.contains("loader_position")) {
            const int rank = answer["index"].get<int>();
            positions[rank / schedule.num_workers()] = answer["loader_position"];
          }
          parts.push_back(std::move(answer));
        }
      }
      if (!errors.empty()) throw std::runtime_error(errors);
      nlohmann::json loader_positions = nullptr;
      if (shards != nullptr) {
        loader_positions = nlohmann::json::array();
        for (auto& [replica, position] : positions) loader_positions.push_back(position);
      }
      outcome = "ok: " + ckpt::commit_partial_save(
                             root, temp_dir,
                             shared_checkpoint_fields(setup, step, identity, loader_positions),
                             parts, save_options)
                             .string();
    } catch (const std::exception& error) {
      ckpt::discard_partial_save(temp_dir);
      outcome = "error: step " + std::to_string(step) + " (" + root.string() + "): " + error.what();
    }
  }
  outcome = executor.broadcast_from_root(outcome);
  fail_everywhere(outcome);
  return outcome.substr(4);
}

// The records of this process's workers merged into `checkpoint` (collect_part): the whole
// checkpoint's first (all of them under threads), then, `with_copies`, the copies its ranks
// hold of the records other processes' ranks would give.
template <typename T>
void merge_worker_records(exec::Executor<T>& executor, bool with_copies,
                          ckpt::TrainingCheckpoint& checkpoint) {
  std::map<std::string, ckpt::TensorRecord> weights, optimizer, kfac;
  for (const bool copies : {false, true}) {
    if (copies && !with_copies) break;
    for (auto* worker : executor.local_workers()) {
      auto part = collect_part(*worker, executor.setup().schedule, copies);
      merge_records(weights, std::move(part.weights));
      merge_records(optimizer, std::move(part.optimizer));
      merge_records(kfac, std::move(part.kfac));
    }
  }
  checkpoint.weights = values_of(std::move(weights));
  checkpoint.optimizer = values_of(std::move(optimizer));
  checkpoint.kfac = values_of(std::move(kfac));
}
}  // namespace

template <typename T>
ckpt::TrainingCheckpoint collect_checkpoint(exec::ThreadedExecutor<T>& executor, std::int64_t step,
                                            const nlohmann::json& identity,
                                            exec::ShardBatches* shards) {
  const auto& setup = executor.setup();
  if (executor.pending_messages() != 0) {
    throw std::logic_error("checkpoint at step " + std::to_string(step) + ": " +
                           std::to_string(executor.pending_messages()) +
                           " message(s) in flight between workers");
  }
  nlohmann::json positions = nullptr;
  if (shards != nullptr) {
    positions = nlohmann::json::array();
    for (const auto& position : shards->positions_after(step - 1)) {
      positions.push_back(position.to_json());
    }
  }
  auto checkpoint = shared_checkpoint_fields(setup, step, identity, positions);
  merge_worker_records(executor, false, checkpoint);
  return checkpoint;
}

template <typename T>
ckpt::TrainingCheckpoint collect_local_checkpoint(exec::Executor<T>& executor, std::int64_t step,
                                                  const nlohmann::json& identity) {
  const auto& setup = executor.setup();
  auto* threaded = dynamic_cast<exec::ThreadedExecutor<T>*>(&executor);
  if (threaded != nullptr && threaded->pending_messages() != 0) {
    throw std::logic_error("state at step " + std::to_string(step) + ": " +
                           std::to_string(threaded->pending_messages()) +
                           " message(s) in flight between workers");
  }
  auto checkpoint = shared_checkpoint_fields(setup, step, identity, nullptr);
  // Under threads every rank is here and the first pass is the whole checkpoint; a process of
  // an MPI run takes the copies its ranks hold too.
  merge_worker_records(executor, threaded == nullptr, checkpoint);
  return checkpoint;
}

namespace {
// A record of a rank's exact K-FAC state, "kfac.rank<r>.pipeline<p>.layer.<i>.<linear>.<field>",
// cut into its parts; nullopt for any other name.
struct ExactKfacName {
  int rank = 0;
  std::string prefix;  // "kfac.rank<r>.pipeline<p>."
  std::string linear;  // "layer.<i>.<linear>"
};
std::optional<ExactKfacName> parse_exact_kfac_name(const std::string& name) {
  const std::string rank_prefix = std::string(kKfacPrefix) + ".rank";
  if (name.rfind(rank_prefix, 0) != 0) return std::nullopt;
  std::size_t at = rank_prefix.size();
  const auto number = [&]() -> std::optional<int> {
    const std::size_t begin = at;
    while (at < name.size() && at - begin < 9 && name[at] >= '0' && name[at] <= '9') ++at;
    if (at == begin) return std::nullopt;
    return std::stoi(name.substr(begin, at - begin));
  };
  const auto literal = [&](std::string_view text) {
    if (name.compare(at, text.size(), text) != 0) return false;
    at += text.size();
    return true;
  };
  ExactKfacName parsed;
  const auto rank = number();
  if (!rank || !literal(".pipeline") || !number() || !literal(".")) return std::nullopt;
  parsed.rank = *rank;
  parsed.prefix = name.substr(0, at);
  const std::size_t linear_begin = at;
  if (!literal("layer.") || !number() || !literal(".")) return std::nullopt;
  const auto field = name.find('.', at);  // after the Linear's name, the field's
  if (field == std::string::npos || field == at || name.find('.', field + 1) != std::string::npos)
    return std::nullopt;
  parsed.linear = name.substr(linear_begin, field - linear_begin);
  return parsed;
}

// K-FAC state sharded across the replicas, moving to another layout or placement
// (check_kfac_resumable): the layer-keyed records are replica 0's, which lack
// the factors and inverses of the Linears other replicas own. Each Linear's layer-keyed records
// are replaced by those of a rank that holds its factors (the owner's group, which inverts, so
// it holds the inverses too), else of one that holds its inverses; the first such rank, since
// every holder's copies are the same bits (the sums are all-reduced in one order, inverted
// alike and broadcast). Before the first refresh no rank holds either: replica 0's stay.
ckpt::SafetensorsFile with_owners_kfac_records(ckpt::SafetensorsFile file) {
  struct Candidate {
    int score = -1;  // 2: holds the factors, 1: the inverses only, 0: neither
    int rank = 0;
    std::string prefix;  // "kfac.rank<r>.pipeline<p>."
  };
  std::map<std::string, Candidate> best;  // by "layer.<i>.<linear>"
  for (const auto& [name, record] : file.tensors) {
    const auto parsed = parse_exact_kfac_name(name);
    if (!parsed) continue;
    const auto holds = [&](const char* what) {
      return file.tensors.count(parsed->prefix + parsed->linear + "." + what) > 0;
    };
    const int score = holds("A") ? 2 : holds("A_inv") ? 1 : 0;
    auto& candidate = best[parsed->linear];
    if (score > candidate.score || (score == candidate.score && parsed->rank < candidate.rank)) {
      candidate = {score, parsed->rank, parsed->prefix};
    }
  }
  for (const auto& [linear, candidate] : best) {
    if (candidate.score == 0) continue;
    const std::string keyed = std::string(kKfacPrefix) + "." + linear + ".";
    std::erase_if(file.tensors,
                  [&](const auto& entry) { return entry.first.rfind(keyed, 0) == 0; });
    std::vector<ckpt::TensorRecord> copies;
    const std::string from = candidate.prefix + linear + ".";
    for (const auto& [name, record] : file.tensors) {
      if (name.rfind(from, 0) != 0) continue;
      auto copy = record;
      copy.name = keyed + name.substr(from.size());
      copies.push_back(std::move(copy));
    }
    for (auto& copy : copies) file.tensors.emplace(copy.name, std::move(copy));
  }
  return file;
}

// A refresh in progress dropped (drops_refresh_in_progress): no factor sums, and none counted
// (the micro-batches column of each Linear's counters, KfacState::state_records).
ckpt::SafetensorsFile without_factor_sums(ckpt::SafetensorsFile file) {
  std::erase_if(file.tensors, [](const auto& entry) {
    return entry.first.ends_with(".A_sum") || entry.first.ends_with(".B_sum");
  });
  for (auto& [name, record] : file.tensors) {
    if (!name.ends_with(".counters") || record.shape != std::vector<std::int64_t>{2, 4}) continue;
    auto counters = ckpt::read_i64(file, name, record.shape);
    counters[0] = counters[4] = 0;  // rows A and B: micro-batches accumulated
    record = ckpt::make_i64_record(name, record.shape, counters);
  }
  return file;
}

// restore_checkpoint and restore_local_checkpoint: the K-FAC state from each rank's exact
// records (`exact_kfac`; else the layer-keyed ones, with each Linear's from its owners where
// `owners`: state sharded across the replicas), with its refresh in progress (`progress`) or
// without its factor sums (`drop_sums`).
template <typename T>
void restore_records(exec::Executor<T>& executor, const ckpt::TrainingCheckpoint& checkpoint,
                     bool exact_kfac, bool progress, bool owners = false, bool drop_sums = false) {
  const auto& schedule = executor.setup().schedule;
  const auto where = [&](const char* file) {
    // A checkpoint in parts names the kind of part files.
    if (fs::exists(checkpoint.directory / file) || checkpoint.directory.empty()) {
      return (checkpoint.directory / file).string();
    }
    const std::string kind(file, std::string_view(file).find('.'));
    return (checkpoint.directory / (kind + "-*.safetensors")).string();
  };
  const auto weights = ckpt::to_safetensors_file(checkpoint.weights);
  auto optimizer = ckpt::to_safetensors_file(checkpoint.optimizer);
  alias_tied_records(optimizer, kOptimizerPrefix);
  alias_tied_records(optimizer, kMasterPrefix);
  const bool kfac_on = schedule_has_kfac(schedule);
  ckpt::SafetensorsFile kfac;
  if (kfac_on) kfac = ckpt::to_safetensors_file(checkpoint.kfac);
  if (kfac_on && owners && !exact_kfac) kfac = with_owners_kfac_records(std::move(kfac));
  if (kfac_on && drop_sums) kfac = without_factor_sums(std::move(kfac));

  for (auto* worker_pointer : executor.local_workers()) {
    auto& worker = *worker_pointer;
    const int rank = worker.rank();
    try {
      for (auto* chunk : worker.chunks()) model::load_hf_weights(weights, *chunk);
    } catch (const std::exception& error) {
      throw std::runtime_error(where("model.safetensors") + ": " + error.what());
    }
    const auto views = parameter_views(worker);
    try {
      if constexpr (!std::is_same_v<T, float>) {
        for (const auto& view : views) {
          const auto exact =
              ckpt::read_f64(optimizer, std::string(kMasterPrefix) + "." + view.name, view.shape);
          std::copy(exact.begin(), exact.end(), view.value);
        }
      }
      worker.optimizer().load_state(optimizer, views, kOptimizerPrefix);
    } catch (const std::exception& error) {
      throw std::runtime_error(where("optimizer.safetensors") + ": " + error.what());
    }
    if (!kfac_on) continue;
    try {
      for (int p = 0; p < schedule.placement.num_pipelines; ++p) {
        worker.load_kfac_state(p, kfac, exact_kfac ? exact_kfac_prefix(rank, p) : kKfacPrefix);
      }
      if (progress) worker.load_kfac_progress(kfac, progress_prefix(rank));
    } catch (const std::exception& error) {
      throw std::runtime_error(where("kfac.safetensors") + ": " + error.what());
    }
  }
}
}  // namespace

template <typename T>
void restore_checkpoint(exec::Executor<T>& executor, const ckpt::TrainingCheckpoint& checkpoint) {
  const auto& setup = executor.setup();
  const auto& placement = setup.options.kfac.placement;
  const auto saved = checkpoint_kfac_placement(checkpoint);
  const bool same_schedule =
      checkpoint.schedule == sched::to_json(setup.schedule) && saved == placement;
  // Sharded K-FAC state on another schedule of the same layout and placement (at the end of a
  // refresh window, check_kfac_resumable): each rank holds the same Linears, and its own records
  // have them. Otherwise the layer-keyed records, on any layout and placement: replica 0's where
  // the state was replicated, each Linear's owners' where it was sharded (each rank then keeps
  // what its placement holds, Worker::load_kfac_state).
  const bool same_shards = !(placement == kfac::StatePlacement{}) && saved == placement &&
                           same_layout(checkpoint, setup.schedule);
  // Inside one of the checkpoint's refresh windows another schedule drops the refresh in
  // progress (drops_refresh_in_progress).
  restore_records(executor, checkpoint, same_schedule || same_shards, same_schedule,
                  !(saved == kfac::StatePlacement{}),
                  !same_schedule && inside_refresh_window(checkpoint));
}

template <typename T>
void restore_local_checkpoint(exec::Executor<T>& executor,
                              const ckpt::TrainingCheckpoint& checkpoint) {
  restore_records(executor, checkpoint, true, false);
}

template <typename T>
fs::path save_checkpoint(exec::Executor<T>& executor, std::int64_t step,
                         const nlohmann::json& identity, exec::ShardBatches* shards,
                         const fs::path& root, const ckpt::SaveOptions& save_options) {
  auto* threaded = dynamic_cast<exec::ThreadedExecutor<T>*>(&executor);
  if (threaded == nullptr) {  // one process per rank (MPI), even with one process
    return save_collectively(executor, step, identity, shards, root, save_options);
  }
  return ckpt::save_training_checkpoint(root, collect_checkpoint(*threaded, step, identity, shards),
                                        save_options);
}

template <typename T>
ckpt::TrainingCheckpoint finish_saved_refresh(
    const ckpt::TrainingCheckpoint& checkpoint, exec::RunSetup<T> setup,
    const nlohmann::json& identity,
    const std::function<std::unique_ptr<exec::Executor<T>>(exec::RunSetup<T>)>& make_executor) {
  setup.schedule = sched::schedule_from_json(checkpoint.schedule,
                                             (checkpoint.directory / "schedule.json").string());
  setup.options.kfac.placement = checkpoint_kfac_placement(checkpoint);
  setup.options.window_origin = checkpoint_window_origin(checkpoint);
  setup.options.kfac_warmup_end = checkpoint_warmup_end(checkpoint);
  setup.options.record_events = false;
  auto executor = make_executor(std::move(setup));
  restore_checkpoint(*executor, checkpoint);  // its own schedule: with the refresh in progress
  executor->finish_refresh(checkpoint.step);
  auto* threaded = dynamic_cast<exec::ThreadedExecutor<T>*>(executor.get());
  if (threaded != nullptr) {  // every rank in this process
    auto finished = collect_checkpoint(*threaded, checkpoint.step, identity, nullptr);
    finished.directory = checkpoint.directory;
    return finished;
  }
  // MPI: each process holds its ranks only, and another layout may need any rank's state:
  // a checkpoint on disk beside the run's (every process reads it whole), then removed.
  const fs::path root = checkpoint.directory.parent_path() / ".refresh-finished";
  std::error_code ignored;
  // One a failed resume left (rank 0 alone writes before the others, save_collectively).
  if (executor->is_root()) fs::remove_all(root, ignored);
  (void)save_collectively(*executor, checkpoint.step, identity, nullptr, root, {});
  std::string loaded = "ok";
  ckpt::TrainingCheckpoint finished;
  try {
    finished = load_resume_checkpoint(root, identity);
    finished.directory = checkpoint.directory;
  } catch (const std::exception& error) {
    loaded = std::string("error: ") + error.what();
  }
  // Every process has read it (or failed) before rank 0 removes it.
  std::string errors;
  for (const auto& outcome : executor->gather_to_root(loaded)) {
    if (outcome != "ok") errors += (errors.empty() ? "" : "; ") + outcome;
  }
  errors = executor->broadcast_from_root(errors);
  if (executor->is_root()) fs::remove_all(root, ignored);
  if (!errors.empty()) {
    throw std::runtime_error("--resume: finishing the K-FAC refresh of " +
                             checkpoint.directory.string() + ": " + errors);
  }
  return finished;
}

template <typename T>
fs::path run_with_checkpoints(exec::Executor<T>& executor, const TrainOptions& o,
                              std::int64_t first_step, const nlohmann::json& identity,
                              exec::ShardBatches* shards,
                              const std::function<void(const exec::StepResult&)>& on_step,
                              const ckpt::SaveOptions& save_options, const RunPauses& pauses,
                              bool save_at_end) {
  fs::path last_saved;
  std::int64_t step = first_step;
  while (step < o.steps) {
    std::int64_t next = o.steps;
    if (!o.checkpoint_dir.empty() && o.checkpoint_every > 0) {
      next = std::min(o.steps, (step / o.checkpoint_every + 1) * o.checkpoint_every);
    }
    const std::int64_t checkpoint_step = next;
    if (pauses.segment_end) next = std::min(next, pauses.segment_end(step));
    executor.run(step, next, on_step);
    step = next;
    const bool stop = pauses.after_segment && pauses.after_segment(step);
    const bool due = step == checkpoint_step && (save_at_end || step < o.steps);
    if (!o.checkpoint_dir.empty() && (due || stop)) {
      last_saved =
          save_checkpoint(executor, step, identity, shards, o.checkpoint_dir, save_options);
    }
    if (stop) break;
  }
  return last_saved;
}

template fs::path run_with_checkpoints<float>(exec::Executor<float>&, const TrainOptions&,
                                              std::int64_t, const nlohmann::json&,
                                              exec::ShardBatches*,
                                              const std::function<void(const exec::StepResult&)>&,
                                              const ckpt::SaveOptions&, const RunPauses&, bool);
template fs::path run_with_checkpoints<double>(exec::Executor<double>&, const TrainOptions&,
                                               std::int64_t, const nlohmann::json&,
                                               exec::ShardBatches*,
                                               const std::function<void(const exec::StepResult&)>&,
                                               const ckpt::SaveOptions&, const RunPauses&, bool);
template ckpt::TrainingCheckpoint collect_checkpoint<float>(exec::ThreadedExecutor<float>&,
                                                            std::int64_t, const nlohmann::json&,
                                                            exec::ShardBatches*);
template ckpt::TrainingCheckpoint collect_checkpoint<double>(exec::ThreadedExecutor<double>&,
                                                             std::int64_t, const nlohmann::json&,
                                                             exec::ShardBatches*);
template ckpt::TrainingCheckpoint collect_local_checkpoint<float>(exec::Executor<float>&,
                                                                  std::int64_t,
                                                                  const nlohmann::json&);
template ckpt::TrainingCheckpoint collect_local_checkpoint<double>(exec::Executor<double>&,
                                                                   std::int64_t,
                                                                   const nlohmann::json&);
template void restore_checkpoint<float>(exec::Executor<float>&, const ckpt::TrainingCheckpoint&);
template void restore_local_checkpoint<float>(exec::Executor<float>&,
                                              const ckpt::TrainingCheckpoint&);
template void restore_local_checkpoint<double>(exec::Executor<double>&,
                                               const ckpt::TrainingCheckpoint&);
template void restore_checkpoint<double>(exec::Executor<double>&, const ckpt::TrainingCheckpoint&);
template ckpt::TrainingCheckpoint finish_saved_refresh<float>(
    const ckpt::TrainingCheckpoint&, exec::RunSetup<float>, const nlohmann::json&,
    const std::function<std::unique_ptr<exec::Executor<float>>(exec::RunSetup<float>)>&);
template ckpt::TrainingCheckpoint finish_saved_refresh<double>(
    const ckpt::TrainingCheckpoint&, exec::RunSetup<double>, const nlohmann::json&,
    const std::function<std::unique_ptr<exec::Executor<double>>(exec::RunSetup<double>)>&);
template fs::path save_checkpoint<float>(exec::Executor<float>&, std::int64_t,
                                         const nlohmann::json&, exec::ShardBatches*,
                                         const fs::path&, const ckpt::SaveOptions&);
template fs::path save_checkpoint<double>(exec::Executor<double>&, std::int64_t,
                                          const nlohmann::json&, exec::ShardBatches*,
                                          const fs::path&, const ckpt::SaveOptions&);

}  // namespace pf::train
