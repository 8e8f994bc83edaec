#pragma once
// pipefisher_train's checkpoints (runtime/checkpoint does the files): what a run saves — weights
// under their Hugging Face names, optimizer state keyed by global parameter names, K-FAC state
// keyed by layer (and, for the same schedule, the refresh in progress), loader positions per
// data-parallel replica, seeds, step and schedule — and how a run resumes from one, on the same
// pipeline layout (bit-identical on CPU) or on another one. Rules: docs/checkpoints.md.
#include <cstdint>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "runtime/checkpoint/training_checkpoint.h"
#include "runtime/data/loader.h"
#include "runtime/executor/executor.h"
#include "runtime/executor/shard_batches.h"
#include "runtime/model/bert_config.h"
#include "runtime/train/train_options.h"
#include "scheduler/schedule.h"

namespace pf::train {

// What a run shares with every checkpoint it may resume from: the model, the data (kind, shard
// names, sequence length), the global batch (micro-batches x micro-batch size x data-parallel,
// and each factor, since the loaders' positions count micro-batches of that size), the seed,
// the precision, the optimizer with its learning-rate schedule, and K-FAC's settings. Not the
// pipeline layout (schedule kind, stages, chunks), the K-FAC refresh interval or the threads.
nlohmann::json run_identity(const TrainOptions& options, const model::BertConfig& config,
                            std::int64_t seq_len, std::int64_t max_predictions, int microbatches,
                            int data_parallel, const std::vector<std::string>& shard_files);

// The latest checkpoint of `directory`, verified, and checked against `identity`. Throws
// std::invalid_argument naming the checkpoint and what differs (or that there is none).
ckpt::TrainingCheckpoint load_resume_checkpoint(const std::filesystem::path& directory,
                                                const nlohmann::json& identity);

// True when the checkpoint's schedule has the same layout (parameters and placement) as
// `base`: a K-FAC run then reuses the checkpoint's k-step schedule instead of running the
// PipeFisher pass again (whose timing-dependent placement would change the arithmetic's order).
bool same_layout(const ckpt::TrainingCheckpoint& checkpoint, const sched::Schedule& base);

// Whether a K-FAC state can move to `schedule`: always for the checkpoint's own schedule (the
// refresh in progress is restored); for another schedule only at a refresh boundary of both
// (the step a multiple of both refresh intervals), since a refresh in progress is defined by the
// old schedule's curvature tasks. Throws std::invalid_argument saying how to resume otherwise.
void check_kfac_resumable(const ckpt::TrainingCheckpoint& checkpoint,
                          const sched::Schedule& schedule);

// The loader positions per data-parallel replica (empty for synthetic data).
std::vector<data::LoaderPosition> checkpoint_loader_positions(
    const ckpt::TrainingCheckpoint& checkpoint, int replicas);

// The executor's state after `step` steps (its threads idle, between two run() calls).
template <typename T>
ckpt::TrainingCheckpoint collect_checkpoint(exec::ThreadedExecutor<T>& executor, std::int64_t step,
                                            const nlohmann::json& identity,
                                            exec::ShardBatches* shards);

// Restores weights (every replica of every chunk), optimizer state and K-FAC state into a fresh
// executor. Throws std::runtime_error naming the record that is missing or mis-shaped.
template <typename T>
void restore_checkpoint(exec::ThreadedExecutor<T>& executor,
                        const ckpt::TrainingCheckpoint& checkpoint);
// The same through the trainer's interface: only the threaded runtime holds every rank's state
// (under MPI, run_training refuses checkpoints before any work); throws std::logic_error else.
template <typename T>
void restore_checkpoint(exec::Executor<T>& executor, const ckpt::TrainingCheckpoint& checkpoint) {
  auto* threaded = dynamic_cast<exec::ThreadedExecutor<T>*>(&executor);
  if (threaded == nullptr) throw std::logic_error("checkpoints need the threaded executor");
  restore_checkpoint(*threaded, checkpoint);
}

// Runs steps [first_step, options.steps) and, with --checkpoint-dir, saves after every
// --checkpoint-every-th step and after the last (the executor runs in segments between saves,
// which executes the same instructions in the same order as one run). Returns the last
// checkpoint written (empty path if none).
// pauses: further segment ends (held-out evaluation, periodic_evaluation.h): segment_end(from)
// is where the segment starting at `from` ends at the latest, after_segment(step) runs after
// each segment and returns true to stop the run there (early stop; a checkpoint is then saved
// at that step).
struct RunPauses {
  std::function<std::int64_t(std::int64_t)> segment_end;
  std::function<bool(std::int64_t)> after_segment;
};
template <typename T>
std::filesystem::path run_with_checkpoints(
    exec::Executor<T>& executor, const TrainOptions& options, std::int64_t first_step,
    const nlohmann::json& identity, exec::ShardBatches* shards,
    const std::function<void(const exec::StepResult&)>& on_step,
    const ckpt::SaveOptions& save_options = {}, const RunPauses& pauses = {});

extern template ckpt::TrainingCheckpoint collect_checkpoint<float>(exec::ThreadedExecutor<float>&,
                                                                   std::int64_t,
                                                                   const nlohmann::json&,
                                                                   exec::ShardBatches*);
extern template ckpt::TrainingCheckpoint collect_checkpoint<double>(exec::ThreadedExecutor<double>&,
                                                                    std::int64_t,
                                                                    const nlohmann::json&,
                                                                    exec::ShardBatches*);
extern template void restore_checkpoint<float>(exec::ThreadedExecutor<float>&,
                                               const ckpt::TrainingCheckpoint&);
extern template void restore_checkpoint<double>(exec::ThreadedExecutor<double>&,
                                                const ckpt::TrainingCheckpoint&);
extern template std::filesystem::path run_with_checkpoints<float>(
    exec::Executor<float>&, const TrainOptions&, std::int64_t, const nlohmann::json&,
    exec::ShardBatches*, const std::function<void(const exec::StepResult&)>&,
    const ckpt::SaveOptions&, const RunPauses&);
extern template std::filesystem::path run_with_checkpoints<double>(
    exec::Executor<double>&, const TrainOptions&, std::int64_t, const nlohmann::json&,
    exec::ShardBatches*, const std::function<void(const exec::StepResult&)>&,
    const ckpt::SaveOptions&, const RunPauses&);

}  // namespace pf::train
