#pragma once
// Training checkpoints: everything a run needs to resume (weights under their Hugging Face global
// names, optimizer and K-FAC state, loader positions, RNG, step, schedule) in one directory per
// step, written so that a crash at any moment leaves the last good checkpoint loadable, and
// verified on load so that a corrupt, truncated or foreign checkpoint is refused with a message
// naming the file and what differs. Layout and protocol: docs/checkpoints.md.
#include <cstdint>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/checkpoint/safetensors.h"

namespace pf::ckpt {

inline constexpr int kTrainingCheckpointFormatVersion = 1;
// The "format" field of manifest.json.
inline constexpr std::string_view kTrainingCheckpointFormat = "pipefisher-training-checkpoint";

struct TrainingCheckpoint {
  std::int64_t step = 0;                // optimizer steps completed (>= 0)
  std::vector<TensorRecord> weights;    // model::hf_weight_records: Hugging Face names, not empty
  nlohmann::json hf_config;             // model::bert_config_to_hf_json: written as config.json
  std::vector<TensorRecord> optimizer;  // Optimizer::state_records (may be empty)
  std::vector<TensorRecord> kfac;       // KfacState::state_records; empty = no kfac.safetensors
  // Small things the caller defines: loader positions per replica, RNG state, learning-rate
  // schedule, the K-FAC refresh phase...
  nlohmann::json state = nlohmann::json::object();
  nlohmann::json schedule;  // the schedule being run (null allowed)
  // What must match for a run to resume from this checkpoint (check_resume_compatible).
  nlohmann::json identity = nlohmann::json::object();
  std::filesystem::path directory;  // where load_* read it from; ignored by save
};

// The records as the SafetensorsFile that load_hf_weights, Optimizer::load_state and
// KfacState::load_state take. Throws std::invalid_argument on a duplicate name.
SafetensorsFile to_safetensors_file(std::vector<TensorRecord> records);

// "step-00000100": zero-padded so that directory listings sort by step.
std::string checkpoint_dir_name(std::int64_t step);

// The points between the phases of a save, in order (test-only fault injection).
enum class SavePhase {
  kTempDirCreated,     // root/.tmp-step-N-<pid>/ exists, empty
  kFileWritten,        // one file written and synced (once per file; manifest.json last)
  kTempDirSynced,      // every file written, the temporary directory synced
  kRenamed,            // root/step-N/ in place and root synced; latest still names the previous
  kLatestTempWritten,  // root/latest.tmp written and synced, not yet renamed
  kLatestUpdated,      // root/latest names step-N (the commit point), root synced
  kPruned,             // one older checkpoint removed (once per removal)
};
std::string_view to_string(SavePhase phase);

struct SaveOptions {
  int keep_last = 2;  // checkpoints kept after a save, the new one included (>= 1)
  // Called after each phase with the path it concerns; a test makes it throw or kill the process.
  std::function<void(SavePhase, const std::filesystem::path&)> after_phase;
};

// Writes root/step-<N>/ (a temporary directory, every file synced, renamed into place), then
// points root/latest at it (temporary file, sync, rename: the commit point), then removes
// checkpoints with smaller steps beyond keep_last (never ones with larger steps, which another
// run may own). Saving a step that exists replaces it atomically. Returns root/step-<N>.
// One writer per root. Throws std::invalid_argument for a checkpoint that cannot be written
// (negative step, no weights, hf_config or state or identity not an object, keep_last < 1) and
// std::system_error / std::runtime_error naming the path on an I/O failure; whatever fails, the
// previous checkpoint stays loadable.
std::filesystem::path save_training_checkpoint(const std::filesystem::path& root,
                                               const TrainingCheckpoint& checkpoint,
                                               int keep_last = 2);
std::filesystem::path save_training_checkpoint(const std::filesystem::path& root,
                                               const TrainingCheckpoint& checkpoint,
                                               const SaveOptions& options);

// --- One checkpoint written by several processes (MPI) -----------------------------------------
// Each process writes its own part into one temporary directory; one process (the committer)
// then writes the shared files and the manifest, which lists every part with its size and
// checksum, and publishes the directory exactly as save_training_checkpoint does (rename, then
// `latest`: the commit point). The caller orders the phases with collectives: begin on the
// committer, then write_checkpoint_part everywhere, then commit (or discard) on the committer.
// A crash before the commit leaves the previous checkpoint as the latest; the next save removes
// the temporary directory. load_training_checkpoint reads such a checkpoint into the same
// TrainingCheckpoint value as a single-process one (parts merged in order, the first record of a
// name kept), so either kind resumes under threads or MPI.

// One process's records. Written as "<kind>-<index+1>-of-<count>.safetensors" (5 digits each;
// kind model, optimizer, kfac), a file only for a kind with records.
struct CheckpointPart {
  std::vector<TensorRecord> weights;
  std::vector<TensorRecord> optimizer;
  std::vector<TensorRecord> kfac;
};

// The committer: removes leftovers of interrupted saves in `root` (created if needed) and creates
// the empty temporary directory root/.tmp-step-<N>-<pid>, which it returns.
std::filesystem::path begin_partial_save(const std::filesystem::path& root, std::int64_t step);

// Any process: writes and syncs its part's files into `temp_dir`. Returns what the commit needs:
// {"index": i, "files": {name: {"bytes": n, "xxh64": "..."}}, "model": [file], "optimizer":
// [file], "kfac": [file], "weights": [tensor names]} (a kind's array empty when it has no file).
// Throws std::invalid_argument for index outside [0, count), std::system_error on I/O failure.
nlohmann::json write_checkpoint_part(const std::filesystem::path& temp_dir, int index, int count,
                                     const CheckpointPart& part);

// The committer, once every part is written: config.json, state.json, schedule.json,
// model.safetensors.index.json (Hugging Face's index of sharded weights) and manifest.json last,
// then publishes root/step-<N> and commits `latest`, then prunes (SaveOptions). `shared`'s
// weights, optimizer and kfac are not used (they are in the parts). parts: write_checkpoint_part's
// answers, any order. Throws std::invalid_argument for parts that do not fit (no weights, a file
// named twice, an index twice); on any failure the temporary directory is removed and `latest`
// is untouched.
std::filesystem::path commit_partial_save(const std::filesystem::path& root,
                                          const std::filesystem::path& temp_dir,
                                          const TrainingCheckpoint& shared,
                                          const std::vector<nlohmann::json>& parts,
                                          const SaveOptions& options = {});

// The committer, when a part failed: removes the temporary directory (never throws).
void discard_partial_save(const std::filesystem::path& temp_dir);

// Reads and verifies one checkpoint directory: manifest.json (format, version, step), then every
// file it lists (present, size, XXH64 checksum, parses). Throws pf::InputError (a
// std::runtime_error: bad input, exit status 2) "checkpoint <dir>: <file> <what differs>";
// std::system_error when the file system fails.
TrainingCheckpoint load_training_checkpoint(const std::filesystem::path& step_dir);

// The checkpoint root/latest names; std::nullopt when root or root/latest does not exist (no save
// ever completed there). A `latest` naming a missing or broken checkpoint is an error, not a
// silent fall-back to an older one: the message lists the checkpoints present and how to resume
// from one of them.
std::optional<TrainingCheckpoint> load_latest_checkpoint(const std::filesystem::path& root);

// The checkpoint directories (root/step-<digits>) sorted by step, oldest first; not verified.
std::vector<std::filesystem::path> list_checkpoints(const std::filesystem::path& root);

// Compares the run's identity with the checkpoint's key by key (nested objects as dotted keys)
// and throws pf::InputError (a std::runtime_error) listing every difference, e.g. "checkpoint
// step-00000100 does not match this run: hidden_size is 256 in the checkpoint, 512 in this run".
void check_resume_compatible(const nlohmann::json& expected_identity,
                             const TrainingCheckpoint& checkpoint);

}  // namespace pf::ckpt
