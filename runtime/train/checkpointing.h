#pragma once
// pipefisher_train's checkpoints (runtime/checkpoint does the files): what a run saves — weights
// under their Hugging Face names, optimizer state keyed by global parameter names, K-FAC state
// keyed by layer (and, for the same schedule, the refresh in progress), loader positions per
// data-parallel replica, seeds, step and schedule — and how a run resumes from one, on the same
// pipeline layout (bit-identical on CPU) or on another one. Rules: docs/checkpoints.md.
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "kfac/state_placement.h"
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

// Whether a K-FAC state can move to `schedule` with `placement`, and the step at which the
// resumed run's refresh windows start (ExecutorOptions::window_origin): the checkpoint's own
// schedule and placement continue it as it was, its refresh in progress restored (its windows
// keep their origin, state.json's kfac.window_origin); another schedule or placement starts its
// own windows at the checkpoint's step. At the end of one of the checkpoint's windows the state
// moves whole (sharded state gathered from the replicas that own each Linear); inside one, the
// refresh in progress (its curvature so far, defined by the old schedule's tasks) is dropped
// (drops_refresh_in_progress) and the inverses held serve until this run's first refresh.
// A pipelined refresh whose curvature syncs or inversions (whole or pieces) run on into the
// next window is not whole at a window's end: needs_refresh_finished says so, and
// finish_saved_refresh finishes it on the checkpoint's schedule first (inside one of its
// windows that work is done: it precedes the window's first preconditioning). Throws
// std::invalid_argument saying how to resume otherwise: such a checkpoint whose records still
// hold sums set aside for that work, or, after step 0, with K-FAC state offloaded to host
// memory; a malformed window_origin is named.
std::int64_t check_kfac_resumable(const ckpt::TrainingCheckpoint& checkpoint,
                                  const sched::Schedule& schedule,
                                  const kfac::StatePlacement& placement);

// Whether the checkpoint is inside one of its K-FAC refresh windows (not at the end of one).
bool inside_refresh_window(const ckpt::TrainingCheckpoint& checkpoint);

// Whether a resume on `schedule` with `placement` (check_kfac_resumable passed) drops the
// checkpoint's refresh in progress: another schedule or placement, inside one of its windows.
// restore_checkpoint then loads no factor sums (each Linear's values and newest inverses only).
bool drops_refresh_in_progress(const ckpt::TrainingCheckpoint& checkpoint,
                               const sched::Schedule& schedule,
                               const kfac::StatePlacement& placement);

// Whether the checkpoint, resumed on `schedule` with `placement` (check_kfac_resumable passed),
// holds a refresh whose work its own schedule places in the next window (a pipelined refresh
// runs on across windows), still to come at its step: not on the checkpoint's own schedule and
// placement (the refresh in progress resumes as it was), nor at its first window's start.
bool needs_refresh_finished(const ckpt::TrainingCheckpoint& checkpoint,
                            const sched::Schedule& schedule, const kfac::StatePlacement& placement);

// The checkpoint with that work done: an executor of the checkpoint's schedule and placement
// (make_executor of `setup` with them, its windows' origin and warm-up end) restores it, runs
// the wrapped K-FAC tasks of the window starting at its step (Executor::finish_refresh) and
// gives its state, whole, in memory (under MPI through a checkpoint on disk beside the
// checkpoint's, removed once every process has read it). Its schedule is the checkpoint's, its
// K-FAC state that of a window's end: restore_checkpoint moves it to this run's schedule. The
// executor is gone on return. Throws what restoring and running throw.
template <typename T>
ckpt::TrainingCheckpoint finish_saved_refresh(
    const ckpt::TrainingCheckpoint& checkpoint, exec::RunSetup<T> setup,
    const nlohmann::json& identity,
    const std::function<std::unique_ptr<exec::Executor<T>>(exec::RunSetup<T>)>& make_executor);

// The step at which the K-FAC warm-up the checkpoint was saved in ends (state.json's
// kfac.warmup_end, ExecutorOptions::kfac_warmup_end); 0 for a checkpoint saved outside one.
// Throws std::invalid_argument naming the file for a malformed value.
std::int64_t checkpoint_warmup_end(const ckpt::TrainingCheckpoint& checkpoint);

// The K-FAC state placement the checkpoint was saved with (state.json's kfac.placement;
// "replicate" for checkpoints without one). Throws std::invalid_argument for an unknown one.
kfac::StatePlacement checkpoint_kfac_placement(const ckpt::TrainingCheckpoint& checkpoint);

// The loader positions per data-parallel replica (empty for synthetic data).
std::vector<data::LoaderPosition> checkpoint_loader_positions(
    const ckpt::TrainingCheckpoint& checkpoint, int replicas);

// The executor's state after `step` steps (its threads idle, between two run() calls).
template <typename T>
ckpt::TrainingCheckpoint collect_checkpoint(exec::ThreadedExecutor<T>& executor, std::int64_t step,
                                            const nlohmann::json& identity,
                                            exec::ShardBatches* shards);

// What this process's workers hold after `step` steps, in a checkpoint held in memory, for
// restore_local_checkpoint into another executor of this process with the same layout (a
// K-FAC warm-up's end: another K-FAC schedule). Under threads it is collect_checkpoint's
// records; under MPI a process holds only its ranks, so it also takes the copies they hold of
// the weights and optimizer state that replica 0's pipeline 0 would give (data-parallel
// replicas and Chimera's pipelines hold them bit for bit alike; each rank's exact K-FAC records
// are there in either case, which restore_local_checkpoint reads). No loader positions (the
// batches continue in the same source).
template <typename T>
ckpt::TrainingCheckpoint collect_local_checkpoint(exec::Executor<T>& executor, std::int64_t step,
                                                  const nlohmann::json& identity);

// Restores weights, optimizer state and K-FAC state into a fresh executor's workers of this
// process (every rank's under threads, its own under MPI; each process reads the whole
// checkpoint). K-FAC state on another schedule or placement comes from the layer-keyed records
// (each Linear's from the ranks that held it, where the checkpoint's state was sharded); each
// rank keeps what this run's placement gives it. Throws std::runtime_error naming the record that
// is missing or mis-shaped.
template <typename T>
void restore_checkpoint(exec::Executor<T>& executor, const ckpt::TrainingCheckpoint& checkpoint);

// restore_checkpoint of collect_local_checkpoint's records into an executor of the same layout
// and K-FAC placement on another schedule, at a refresh window's end of both: each rank's K-FAC
// state from its own exact records (sharded state too: the placement fixes which rank holds
// what), without the refresh in progress (there is none at a window's end).
template <typename T>
void restore_local_checkpoint(exec::Executor<T>& executor,
                              const ckpt::TrainingCheckpoint& checkpoint);

// Saves the executor's state after `step` steps into `root` and returns the checkpoint's
// directory. Threads: one process writes one checkpoint (save_training_checkpoint). Several
// processes (MPI; collective, every process calls it): each writes its ranks' part, rank 0 the
// manifest and the commit, once every part is written (ckpt::commit_partial_save); a failure on
// any process throws the same std::runtime_error on all, and `latest` is untouched.
template <typename T>
std::filesystem::path save_checkpoint(exec::Executor<T>& executor, std::int64_t step,
                                      const nlohmann::json& identity, exec::ShardBatches* shards,
                                      const std::filesystem::path& root,
                                      const ckpt::SaveOptions& save_options = {});

// Runs steps [first_step, options.steps) and, with --checkpoint-dir, saves after every
// --checkpoint-every-th step and after the last (the executor runs in segments between saves,
// which executes the same instructions in the same order as one run). Returns the last
// checkpoint written (empty path if none).
// pauses: further segment ends (held-out evaluation, periodic_evaluation.h): segment_end(from)
// is where the segment starting at `from` ends at the latest, after_segment(step) runs after
// each segment and returns true to stop the run there (early stop; a checkpoint is then saved
// at that step). save_at_end false: no checkpoint at options.steps unless the run stops there
// (a K-FAC warm-up's end, where the main schedule's executor saves instead).
struct RunPauses {
  std::function<std::int64_t(std::int64_t)> segment_end;
  std::function<bool(std::int64_t)> after_segment;
};
template <typename T>
std::filesystem::path run_with_checkpoints(
    exec::Executor<T>& executor, const TrainOptions& options, std::int64_t first_step,
    const nlohmann::json& identity, exec::ShardBatches* shards,
    const std::function<void(const exec::StepResult&)>& on_step,
    const ckpt::SaveOptions& save_options = {}, const RunPauses& pauses = {},
    bool save_at_end = true);

extern template ckpt::TrainingCheckpoint collect_checkpoint<float>(exec::ThreadedExecutor<float>&,
                                                                   std::int64_t,
                                                                   const nlohmann::json&,
                                                                   exec::ShardBatches*);
extern template ckpt::TrainingCheckpoint collect_checkpoint<double>(exec::ThreadedExecutor<double>&,
                                                                    std::int64_t,
                                                                    const nlohmann::json&,
                                                                    exec::ShardBatches*);
extern template ckpt::TrainingCheckpoint collect_local_checkpoint<float>(exec::Executor<float>&,
                                                                         std::int64_t,
                                                                         const nlohmann::json&);
extern template ckpt::TrainingCheckpoint collect_local_checkpoint<double>(exec::Executor<double>&,
                                                                          std::int64_t,
                                                                          const nlohmann::json&);
extern template void restore_checkpoint<float>(exec::Executor<float>&,
                                               const ckpt::TrainingCheckpoint&);
extern template void restore_local_checkpoint<float>(exec::Executor<float>&,
                                                     const ckpt::TrainingCheckpoint&);
extern template void restore_local_checkpoint<double>(exec::Executor<double>&,
                                                      const ckpt::TrainingCheckpoint&);
extern template void restore_checkpoint<double>(exec::Executor<double>&,
                                                const ckpt::TrainingCheckpoint&);
extern template std::filesystem::path save_checkpoint<float>(exec::Executor<float>&, std::int64_t,
                                                             const nlohmann::json&,
                                                             exec::ShardBatches*,
                                                             const std::filesystem::path&,
                                                             const ckpt::SaveOptions&);
extern template std::filesystem::path save_checkpoint<double>(exec::Executor<double>&, std::int64_t,
                                                              const nlohmann::json&,
                                                              exec::ShardBatches*,
                                                              const std::filesystem::path&,
                                                              const ckpt::SaveOptions&);
extern template std::filesystem::path run_with_checkpoints<float>(
    exec::Executor<float>&, const TrainOptions&, std::int64_t, const nlohmann::json&,
    exec::ShardBatches*, const std::function<void(const exec::StepResult&)>&,
    const ckpt::SaveOptions&, const RunPauses&, bool);
extern template std::filesystem::path run_with_checkpoints<double>(
    exec::Executor<double>&, const TrainOptions&, std::int64_t, const nlohmann::json&,
    exec::ShardBatches*, const std::function<void(const exec::StepResult&)>&,
    const ckpt::SaveOptions&, const RunPauses&, bool);

}  // namespace pf::train
