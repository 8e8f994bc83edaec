#include "runtime/checkpoint/training_checkpoint.h"

#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <map>
#include <set>
#include <stdexcept>
#include <system_error>
#include <utility>

#include "common/exit_codes.h"
#include "common/input_error.h"
#include "common/json_fields.h"
#include "runtime/checkpoint/durable_file.h"
#include "runtime/checkpoint/xxhash64.h"

namespace pf::ckpt {

namespace {

namespace fs = std::filesystem;

constexpr std::string_view kModelFile = "model.safetensors";
constexpr std::string_view kConfigFile = "config.json";
constexpr std::string_view kOptimizerFile = "optimizer.safetensors";
constexpr std::string_view kKfacFile = "kfac.safetensors";
constexpr std::string_view kStateFile = "state.json";
constexpr std::string_view kScheduleFile = "schedule.json";
constexpr std::string_view kManifestFile = "manifest.json";
// A checkpoint written in parts (several processes): Hugging Face's index of sharded weights.
constexpr std::string_view kModelIndexFile = "model.safetensors.index.json";
// The kinds of part files, as their names begin and as manifest.json's "parts" keys them.
constexpr std::string_view kPartKinds[] = {"model", "optimizer", "kfac"};
constexpr std::string_view kLatestFile = "latest";
constexpr std::string_view kDirPrefix = "step-";
// Leftovers of an interrupted save or prune; the next save removes them.
constexpr std::string_view kTempPrefix = ".tmp-";
constexpr std::string_view kDeletingPrefix = ".deleting-";
constexpr std::string_view kLatestTemp = "latest.tmp";
// Larger small files than these are not ours: refuse them before reading them into memory.
constexpr std::uintmax_t kMaxManifestBytes = 1 << 20;
constexpr std::uintmax_t kMaxLatestBytes = 4096;

// Files every checkpoint has; kfac.safetensors is optional.
constexpr std::string_view kRequiredFiles[] = {kModelFile, kConfigFile, kOptimizerFile, kStateFile,
                                               kScheduleFile};
// Files every checkpoint written in parts has, besides its parts.
constexpr std::string_view kRequiredPartedFiles[] = {kConfigFile, kStateFile, kScheduleFile,
                                                     kModelIndexFile};

// "optimizer-00002-of-00004.safetensors"
std::string part_file_name(std::string_view kind, int index, int count) {
  char digits[32];
  std::snprintf(digits, sizeof(digits), "-%05d-of-%05d", index + 1, count);
  return std::string(kind) + digits + ".safetensors";
}

bool starts_with(std::string_view text, std::string_view prefix) {
  return text.substr(0, prefix.size()) == prefix;
}

// The step of a directory named step-<digits>, or nullopt for any other name.
std::optional<std::int64_t> step_of_dir_name(std::string_view name) {
  if (!starts_with(name, kDirPrefix)) return std::nullopt;
  const auto digits = name.substr(kDirPrefix.size());
  if (digits.empty() || digits.size() > 18) return std::nullopt;
  std::int64_t step = 0;
  const auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), step);
  if (error != std::errc() || end != digits.data() + digits.size()) return std::nullopt;
  return step;
}

std::string describe(const nlohmann::json& value) {
  return value.dump();
}

void validate_for_save(const TrainingCheckpoint& checkpoint, const SaveOptions& options) {
  const auto fail = [](const std::string& what) {
    throw std::invalid_argument("save_training_checkpoint: " + what);
  };
  if (checkpoint.step < 0) fail("step " + std::to_string(checkpoint.step) + " is negative");
  if (checkpoint.weights.empty()) fail("the checkpoint has no weights");
  if (!checkpoint.hf_config.is_object()) {
    fail("hf_config must be a JSON object (config.json), got " +
         std::string(checkpoint.hf_config.type_name()));
  }
  if (!checkpoint.state.is_object()) {
    fail("state must be a JSON object, got " + std::string(checkpoint.state.type_name()));
  }
  if (!checkpoint.identity.is_object()) {
    fail("identity must be a JSON object, got " + std::string(checkpoint.identity.type_name()));
  }
  if (options.keep_last < 1) {
    fail("keep_last is " + std::to_string(options.keep_last) + "; at least 1 is needed");
  }
}

void remove_leftovers(const fs::path& root) {
  for (const auto& entry : fs::directory_iterator(root)) {
    const auto name = entry.path().filename().string();
    if (starts_with(name, kTempPrefix) || starts_with(name, kDeletingPrefix) ||
        name == kLatestTemp) {
      fs::remove_all(entry.path());
    }
  }
}

// Removes a checkpoint directory without ever leaving a half-deleted step-N behind: it is first
// renamed out of the step-* namespace (atomic), then deleted.
void remove_checkpoint_dir(const fs::path& root, const fs::path& dir) {
  const auto doomed = root / (std::string(kDeletingPrefix) + dir.filename().string());
  fs::rename(dir, doomed);
  sync_directory(root);
  fs::remove_all(doomed);
}

// Deletes the temporary directory when a save fails before publishing it.
class TempDirGuard {
 public:
  explicit TempDirGuard(fs::path path) : path_(std::move(path)) {}
  ~TempDirGuard() {
    if (path_.empty()) return;
    std::error_code ignored;
    fs::remove_all(path_, ignored);
  }
  TempDirGuard(const TempDirGuard&) = delete;
  TempDirGuard& operator=(const TempDirGuard&) = delete;
  void release() { path_.clear(); }

 private:
  fs::path path_;
};

void prune(const fs::path& root, std::int64_t saved_step, const SaveOptions& options) {
  std::vector<fs::path> older;
  for (const auto& dir : list_checkpoints(root)) {
    if (*step_of_dir_name(dir.filename().string()) < saved_step) older.push_back(dir);
  }
  // list_checkpoints sorts oldest first; keep the newest keep_last - 1 of the older ones.
  const auto kept_older = static_cast<std::size_t>(options.keep_last - 1);
  const auto removed = older.size() > kept_older ? older.size() - kept_older : 0;
  for (std::size_t i = 0; i < removed; ++i) {
    remove_checkpoint_dir(root, older[i]);
    if (options.after_phase) options.after_phase(SavePhase::kPruned, older[i]);
  }
}

std::vector<std::byte> text_bytes(const std::string& text) {
  const auto* begin = reinterpret_cast<const std::byte*>(text.data());
  return {begin, begin + text.size()};
}

// Writes manifest.json last (a directory with a manifest has every file the manifest
// describes), syncs, renames temp_dir to root/step-N, commits `latest`, prunes.
void publish_checkpoint(const fs::path& root, const fs::path& temp_dir, TempDirGuard& guard,
                        std::int64_t step, const nlohmann::json& files, const nlohmann::json& parts,
                        const SaveOptions& options) {
  const auto phase_done = [&](SavePhase phase, const fs::path& path) {
    if (options.after_phase) options.after_phase(phase, path);
  };
  const auto name = checkpoint_dir_name(step);
  const auto final_dir = root / name;
  nlohmann::json manifest{{"format", kTrainingCheckpointFormat},
                          {"format_version", kTrainingCheckpointFormatVersion},
                          {"step", step},
                          {"files", files}};
  if (!parts.is_null()) manifest["parts"] = parts;
  const auto manifest_path = temp_dir / kManifestFile;
  write_file_synced(manifest_path, manifest.dump(2) + "\n");
  phase_done(SavePhase::kFileWritten, manifest_path);
  sync_directory(temp_dir);
  phase_done(SavePhase::kTempDirSynced, temp_dir);

  if (rename_or_exchange(temp_dir, final_dir)) {
    // Re-saving a step: the old content came back to temp_dir; the guard removes it.
  } else {
    guard.release();
  }
  sync_directory(root);
  phase_done(SavePhase::kRenamed, final_dir);

  const auto latest_temp = root / kLatestTemp;
  write_file_synced(latest_temp, name + "\n");
  phase_done(SavePhase::kLatestTempWritten, latest_temp);
  fs::rename(latest_temp, root / kLatestFile);
  sync_directory(root);
  phase_done(SavePhase::kLatestUpdated, root / kLatestFile);

  prune(root, step, options);
}

// --- Loading ------------------------------------------------------------------------------

class CheckpointReader {
 public:
  explicit CheckpointReader(fs::path dir) : dir_(std::move(dir)) {}

  // A checkpoint that cannot be used is bad input (exit status 2), not an internal failure.
  [[noreturn]] void fail(const std::string& what) const {
    throw InputError("checkpoint " + dir_.string() + ": " + what);
  }

  // The size of `name`, a regular file of the checkpoint (or an error naming it).
  std::uintmax_t regular_file_size(std::string_view name) const {
    const auto path = dir_ / name;
    std::error_code error;
    const auto status = fs::status(path, error);
    if (!fs::is_regular_file(status)) {
      fail(std::string(name) + (fs::exists(status) ? " is not a regular file" : " is missing"));
    }
    const auto size = fs::file_size(path, error);
    if (error) fail(std::string(name) + ": cannot read its size: " + error.message());
    return size;
  }

  nlohmann::json read_manifest() const {
    const auto path = dir_ / kManifestFile;
    if (!fs::exists(path)) {
      fail(std::string(kManifestFile) +
           " is missing (an incomplete or foreign directory, not a checkpoint written here)");
    }
    if (const auto size = regular_file_size(kManifestFile); size > kMaxManifestBytes) {
      fail(std::string(kManifestFile) + " has " + std::to_string(size) +
           " bytes (allowed: at most " + std::to_string(kMaxManifestBytes) + ")");
    }
    const auto bytes = read_file_bytes(path);
    auto manifest = parse_json(kManifestFile, bytes);
    if (!manifest.is_object()) fail(std::string(kManifestFile) + " is not a JSON object");
    const auto format = manifest.value("format", nlohmann::json());
    if (format != kTrainingCheckpointFormat) {
      fail(std::string(kManifestFile) + ": format is " + describe(format) + ", expected \"" +
           std::string(kTrainingCheckpointFormat) + "\"");
    }
    const auto version = manifest.value("format_version", nlohmann::json());
    if (!version.is_number_integer() ||
        version.get<std::int64_t>() != kTrainingCheckpointFormatVersion) {
      fail(std::string(kManifestFile) + ": format_version is " + describe(version) +
           "; this program reads version " + std::to_string(kTrainingCheckpointFormatVersion));
    }
    const auto step = manifest.value("step", nlohmann::json());
    if (!step.is_number_integer() || step.get<std::int64_t>() < 0) {
      fail(std::string(kManifestFile) + ": step is " + describe(step) +
           ", not a non-negative integer");
    }
    // A directory renamed by hand may have any name; one named step-N must hold step N.
    const auto dir_step = step_of_dir_name(dir_.filename().string());
    if (dir_step && *dir_step != step.get<std::int64_t>()) {
      fail(std::string(kManifestFile) + ": step is " + describe(step) + " but the directory is " +
           dir_.filename().string());
    }
    const auto files = manifest.value("files", nlohmann::json());
    if (!files.is_object()) fail(std::string(kManifestFile) + ": field 'files' is not an object");
    const bool parted = manifest.contains("parts");
    std::set<std::string> known;
    std::vector<std::string> required;
    if (parted) {
      const auto& parts = manifest["parts"];
      if (!parts.is_object()) fail(std::string(kManifestFile) + ": field 'parts' is not an object");
      for (const auto kind : kPartKinds) {
        const auto list = parts.value(std::string(kind), nlohmann::json::array());
        if (!list.is_array()) {
          fail(std::string(kManifestFile) + ": parts." + std::string(kind) + " is not an array");
        }
        for (const auto& file : list) {
          const std::string text = file.is_string() ? file.get<std::string>() : std::string();
          if (!starts_with(text, std::string(kind) + "-") || text.find('/') != std::string::npos) {
            fail(std::string(kManifestFile) + ": parts." + std::string(kind) + " lists " +
                 file.dump() + ", not a file name " + std::string(kind) +
                 "-<i>-of-<n>.safetensors");
          }
          known.insert(text);
          required.push_back(text);
        }
      }
      if (parts.value("model", nlohmann::json::array()).empty()) {
        fail(std::string(kManifestFile) + ": parts.model lists no file (the weights)");
      }
      for (const auto name : kRequiredPartedFiles) required.emplace_back(name);
    } else {
      for (const auto name : kRequiredFiles) required.emplace_back(name);
      known.emplace(kKfacFile);
    }
    known.insert(required.begin(), required.end());
    for (const auto& [name, entry] : files.items()) {
      if (!known.contains(name)) {
        fail(std::string(kManifestFile) + " lists an unknown file '" + name + "'");
      }
      if (!entry.is_object() || !entry.contains("bytes") || !entry["bytes"].is_number_unsigned() ||
          !entry.contains("xxh64") || !entry["xxh64"].is_string() ||
          entry["xxh64"].get<std::string>().size() != 16) {
        fail(std::string(kManifestFile) + ": entry of '" + name +
             "' is not {\"bytes\": <size>, \"xxh64\": \"<16 hex digits>\"}: " + entry.dump());
      }
    }
    for (const auto& name : required) {
      if (!files.contains(name)) {
        fail(std::string(kManifestFile) + " does not list the required file '" + name + "'");
      }
    }
    return manifest;
  }

  // The file's bytes after checking them against the manifest entry.
  std::vector<std::byte> read_verified(std::string_view name, const nlohmann::json& entry) const {
    const auto path = dir_ / name;
    const auto expected_bytes = entry["bytes"].get<std::uint64_t>();
    if (!fs::exists(path)) {
      fail(std::string(name) + " is missing (the manifest lists " + std::to_string(expected_bytes) +
           " bytes)");
    }
    // Compare sizes before reading, so that a wrong multi-gigabyte file is never read whole.
    if (const auto size = regular_file_size(name); size != expected_bytes) {
      fail(std::string(name) + " has " + std::to_string(size) + " bytes but the manifest says " +
           std::to_string(expected_bytes) +
           (size < expected_bytes ? " (truncated)" : " (extra bytes)"));
    }
    const auto bytes = read_file_bytes(path);
    if (bytes.size() != expected_bytes) {
      fail(std::string(name) + " has " + std::to_string(bytes.size()) +
           " bytes but the manifest says " + std::to_string(expected_bytes) +
           (bytes.size() < expected_bytes ? " (truncated)" : " (extra bytes)"));
    }
    const auto actual = to_hex64(xxhash64(bytes));
    const auto expected = entry["xxh64"].get<std::string>();
    if (actual != expected) {
      fail(std::string(name) + " is corrupt: its XXH64 checksum is " + actual +
           " but the manifest says " + expected);
    }
    return bytes;
  }

  nlohmann::json parse_json(std::string_view name, const std::vector<std::byte>& bytes) const {
    const std::string_view text(reinterpret_cast<const char*>(bytes.data()), bytes.size());
    try {
      return json_fields::parse_bounded(text, (dir_ / name).string());
    } catch (const nlohmann::json::exception& error) {
      fail(std::string(name) + " is not valid JSON: " + error.what());
    }
  }

  std::vector<TensorRecord> parse_records(std::string_view name,
                                          const std::vector<std::byte>& bytes) const {
    SafetensorsFile file;
    try {
      file = parse_safetensors(bytes, (dir_ / name).string());
    } catch (const std::exception& error) {
      fail(std::string(name) + ": " + error.what());
    }
    std::vector<TensorRecord> records;
    records.reserve(file.tensors.size());
    for (auto& [tensor_name, record] : file.tensors) records.push_back(std::move(record));
    return records;
  }

 private:
  fs::path dir_;
};

// Dotted key -> value for every leaf (non-object) of a JSON object.
void flatten(const nlohmann::json& value, const std::string& prefix,
             std::map<std::string, nlohmann::json>& out) {
  if (value.is_object() && (prefix.empty() || !value.empty())) {
    for (const auto& [key, child] : value.items()) {
      flatten(child, prefix.empty() ? key : prefix + "." + key, out);
    }
    return;
  }
  out[prefix] = value;
}

}  // namespace

SafetensorsFile to_safetensors_file(std::vector<TensorRecord> records) {
  SafetensorsFile file;
  for (auto& record : records) {
    auto name = record.name;
    if (!file.tensors.emplace(name, std::move(record)).second) {
      throw std::invalid_argument("to_safetensors_file: duplicate tensor name '" + name + "'");
    }
  }
  return file;
}

std::string checkpoint_dir_name(std::int64_t step) {
  char digits[32];
  std::snprintf(digits, sizeof(digits), "%08lld", static_cast<long long>(step));
  return std::string(kDirPrefix) + digits;
}

std::string_view to_string(SavePhase phase) {
  switch (phase) {
    case SavePhase::kTempDirCreated:
      return "temp-dir-created";
    case SavePhase::kFileWritten:
      return "file-written";
    case SavePhase::kTempDirSynced:
      return "temp-dir-synced";
    case SavePhase::kRenamed:
      return "renamed";
    case SavePhase::kLatestTempWritten:
      return "latest-temp-written";
    case SavePhase::kLatestUpdated:
      return "latest-updated";
    case SavePhase::kPruned:
      return "pruned";
  }
  return "?";
}

fs::path save_training_checkpoint(const fs::path& root, const TrainingCheckpoint& checkpoint,
                                  int keep_last) {
  SaveOptions options;
  options.keep_last = keep_last;
  return save_training_checkpoint(root, checkpoint, options);
}

fs::path save_training_checkpoint(const fs::path& root, const TrainingCheckpoint& checkpoint,
                                  const SaveOptions& options) {
  validate_for_save(checkpoint, options);
  const auto phase_done = [&](SavePhase phase, const fs::path& path) {
    if (options.after_phase) options.after_phase(phase, path);
  };
  fs::create_directories(root);
  remove_leftovers(root);

  const auto name = checkpoint_dir_name(checkpoint.step);
  const auto final_dir = root / name;
  const auto temp_dir = root / (std::string(kTempPrefix) + name + "-" + std::to_string(::getpid()));
  fs::create_directory(temp_dir);
  TempDirGuard guard(temp_dir);
  phase_done(SavePhase::kTempDirCreated, temp_dir);

  nlohmann::json files = nlohmann::json::object();
  // Serialized one at a time so that only one file's bytes are in memory besides the state.
  const auto write = [&](std::string_view file_name, const std::vector<std::byte>& bytes) {
    const auto path = temp_dir / file_name;
    write_file_synced(path, bytes);
    files[std::string(file_name)] = {{"bytes", bytes.size()}, {"xxh64", to_hex64(xxhash64(bytes))}};
    phase_done(SavePhase::kFileWritten, path);
  };
  // transformers refuses safetensors files without format=pt.
  const std::map<std::string, std::string> pt_metadata{{"format", "pt"}};
  write(kModelFile, serialize_safetensors(checkpoint.weights, pt_metadata));
  write(kConfigFile, text_bytes(checkpoint.hf_config.dump(2) + "\n"));
  write(kOptimizerFile, serialize_safetensors(checkpoint.optimizer, pt_metadata));
  if (!checkpoint.kfac.empty())
    write(kKfacFile, serialize_safetensors(checkpoint.kfac, pt_metadata));
  const nlohmann::json state{
      {"step", checkpoint.step}, {"identity", checkpoint.identity}, {"state", checkpoint.state}};
  write(kStateFile, text_bytes(state.dump(2) + "\n"));
  write(kScheduleFile, text_bytes(checkpoint.schedule.dump(2) + "\n"));

  publish_checkpoint(root, temp_dir, guard, checkpoint.step, files, nullptr, options);
  return final_dir;
}

fs::path begin_partial_save(const fs::path& root, std::int64_t step) {
  if (step < 0) {
    throw std::invalid_argument("begin_partial_save: step " + std::to_string(step) +
                                " is negative");
  }
  fs::create_directories(root);
  remove_leftovers(root);
  const auto temp_dir = root / (std::string(kTempPrefix) + checkpoint_dir_name(step) + "-" +
                                std::to_string(::getpid()));
  fs::create_directory(temp_dir);
  return temp_dir;
}

nlohmann::json write_checkpoint_part(const fs::path& temp_dir, int index, int count,
                                     const CheckpointPart& part) {
  if (count < 1 || index < 0 || index >= count) {
    throw std::invalid_argument("write_checkpoint_part: part " + std::to_string(index) + " of " +
                                std::to_string(count));
  }
  nlohmann::json answer{
      {"index", index}, {"files", nlohmann::json::object()}, {"weights", nlohmann::json::array()}};
  const std::map<std::string, std::string> pt_metadata{{"format", "pt"}};
  const std::pair<std::string_view, const std::vector<TensorRecord>*> kinds[] = {
      {kPartKinds[0], &part.weights},
      {kPartKinds[1], &part.optimizer},
      {kPartKinds[2], &part.kfac}};
  for (const auto& [kind, records] : kinds) {
    answer[std::string(kind)] = nlohmann::json::array();
    if (records->empty()) continue;
    const auto name = part_file_name(kind, index, count);
    const auto bytes = serialize_safetensors(*records, pt_metadata);
    write_file_synced(temp_dir / name, bytes);
    answer["files"][name] = {{"bytes", bytes.size()}, {"xxh64", to_hex64(xxhash64(bytes))}};
    answer[std::string(kind)].push_back(name);
  }
  for (const auto& record : part.weights) answer["weights"].push_back(record.name);
  return answer;
}

fs::path commit_partial_save(const fs::path& root, const fs::path& temp_dir,
                             const TrainingCheckpoint& shared,
                             const std::vector<nlohmann::json>& parts, const SaveOptions& options) {
  TempDirGuard guard(temp_dir);
  // The shared fields as save_training_checkpoint checks them (the weights are in the parts).
  auto check = shared;
  check.weights = {TensorRecord{}};
  validate_for_save(check, options);

  // Parts in index order, so that the manifest (and a load) merges them by rank.
  std::vector<const nlohmann::json*> ordered(parts.size(), nullptr);
  for (const auto& part : parts) {
    const auto index = part.value("index", -1);
    if (index < 0 || static_cast<std::size_t>(index) >= parts.size() ||
        ordered[static_cast<std::size_t>(index)] != nullptr) {
      throw std::invalid_argument("commit_partial_save: part index " + std::to_string(index) +
                                  " out of range or given twice (" + std::to_string(parts.size()) +
                                  " parts)");
    }
    ordered[static_cast<std::size_t>(index)] = &part;
  }
  nlohmann::json files = nlohmann::json::object();
  nlohmann::json manifest_parts = nlohmann::json::object();
  nlohmann::json weight_map = nlohmann::json::object();
  std::uint64_t total_bytes = 0;
  for (const auto kind : kPartKinds) manifest_parts[std::string(kind)] = nlohmann::json::array();
  for (const auto* part : ordered) {
    for (const auto& [name, entry] : part->at("files").items()) {
      if (files.contains(name)) {
        throw std::invalid_argument("commit_partial_save: two parts wrote " + name);
      }
      files[name] = entry;
    }
    for (const auto kind : kPartKinds) {
      for (const auto& name : part->at(std::string(kind))) {
        manifest_parts[std::string(kind)].push_back(name);
      }
    }
    const auto& model = part->at("model");
    if (model.empty()) continue;
    total_bytes += files[model[0].get<std::string>()]["bytes"].get<std::uint64_t>();
    for (const auto& tensor : part->at("weights")) {
      // The first part with a tensor holds it (as a load merges them).
      if (!weight_map.contains(tensor.get<std::string>()))
        weight_map[tensor.get<std::string>()] = model[0];
    }
  }
  if (manifest_parts["model"].empty()) {
    throw std::invalid_argument("commit_partial_save: no part holds weights");
  }
  const auto write = [&](std::string_view file_name, const std::string& text) {
    const auto path = temp_dir / file_name;
    const auto bytes = text_bytes(text);
    write_file_synced(path, bytes);
    files[std::string(file_name)] = {{"bytes", bytes.size()}, {"xxh64", to_hex64(xxhash64(bytes))}};
    if (options.after_phase) options.after_phase(SavePhase::kFileWritten, path);
  };
  write(kConfigFile, shared.hf_config.dump(2) + "\n");
  const nlohmann::json state{
      {"step", shared.step}, {"identity", shared.identity}, {"state", shared.state}};
  write(kStateFile, state.dump(2) + "\n");
  write(kScheduleFile, shared.schedule.dump(2) + "\n");
  const nlohmann::json index{{"metadata", {{"total_size", total_bytes}}},
                             {"weight_map", weight_map}};
  write(kModelIndexFile, index.dump(2) + "\n");
  publish_checkpoint(root, temp_dir, guard, shared.step, files, manifest_parts, options);
  return root / checkpoint_dir_name(shared.step);
}

void discard_partial_save(const fs::path& temp_dir) {
  std::error_code ignored;
  fs::remove_all(temp_dir, ignored);
}

TrainingCheckpoint load_training_checkpoint(const fs::path& step_dir) {
  const CheckpointReader reader(step_dir);
  if (!fs::is_directory(step_dir)) {
    reader.fail(fs::exists(step_dir) ? "not a directory" : "does not exist");
  }
  const auto manifest = reader.read_manifest();
  const auto& files = manifest["files"];

  TrainingCheckpoint checkpoint;
  checkpoint.directory = step_dir;
  checkpoint.step = manifest["step"].get<std::int64_t>();
  const auto records_of = [&](std::string_view name) {
    return reader.parse_records(name, reader.read_verified(name, files[std::string(name)]));
  };
  if (manifest.contains("parts")) {
    // Parts merged in order; the first record of a name wins (replicated state, such as every
    // rank's optimizer step counter, is in several parts).
    const auto merged = [&](std::string_view kind) {
      std::vector<TensorRecord> records;
      std::set<std::string> names;
      for (const auto& file : manifest["parts"].value(std::string(kind), nlohmann::json::array())) {
        for (auto& record : records_of(file.get<std::string>())) {
          if (names.insert(record.name).second) records.push_back(std::move(record));
        }
      }
      return records;
    };
    checkpoint.weights = merged("model");
    checkpoint.optimizer = merged("optimizer");
    checkpoint.kfac = merged("kfac");
    // The index is for transformers; verified (size, checksum, JSON) like every listed file.
    (void)reader.parse_json(kModelIndexFile,
                            reader.read_verified(kModelIndexFile, files[kModelIndexFile]));
    if (checkpoint.weights.empty()) reader.fail("the model parts hold no tensors");
  } else {
    checkpoint.weights = records_of(kModelFile);
    if (checkpoint.weights.empty()) reader.fail(std::string(kModelFile) + " holds no tensors");
    checkpoint.optimizer = records_of(kOptimizerFile);
    if (files.contains(kKfacFile)) checkpoint.kfac = records_of(kKfacFile);
  }
  checkpoint.hf_config =
      reader.parse_json(kConfigFile, reader.read_verified(kConfigFile, files[kConfigFile]));
  if (!checkpoint.hf_config.is_object()) {
    reader.fail(std::string(kConfigFile) + " is not a JSON object");
  }
  auto state = reader.parse_json(kStateFile, reader.read_verified(kStateFile, files[kStateFile]));
  if (!state.is_object() || !state.contains("step") || !state.contains("identity") ||
      !state.contains("state") || !state["identity"].is_object() || !state["state"].is_object()) {
    reader.fail(std::string(kStateFile) +
                " is not {\"step\": N, \"identity\": {...}, \"state\": {...}}");
  }
  if (state["step"] != manifest["step"]) {
    reader.fail(std::string(kStateFile) + ": step is " + describe(state["step"]) +
                " but the manifest says " + describe(manifest["step"]));
  }
  checkpoint.identity = std::move(state["identity"]);
  checkpoint.state = std::move(state["state"]);
  checkpoint.schedule =
      reader.parse_json(kScheduleFile, reader.read_verified(kScheduleFile, files[kScheduleFile]));
  return checkpoint;
}

std::optional<TrainingCheckpoint> load_latest_checkpoint(const fs::path& root) {
  const auto latest_path = root / kLatestFile;
  if (!fs::exists(latest_path)) return std::nullopt;
  if (!fs::is_regular_file(latest_path) || fs::file_size(latest_path) > kMaxLatestBytes) {
    throw InputError("checkpoint root " + root.string() + ": " + latest_path.string() +
                     " is not a small regular file naming a checkpoint step-<N>");
  }
  const auto bytes = read_file_bytes(latest_path);
  std::string name(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  while (!name.empty() && (name.back() == '\n' || name.back() == '\r' || name.back() == ' ')) {
    name.pop_back();
  }
  const auto others = [&](std::string_view except) {
    std::string text;
    for (const auto& dir : list_checkpoints(root)) {
      const auto other = dir.filename().string();
      if (other == except) continue;
      text += (text.empty() ? "" : ", ") + other;
    }
    return text.empty() ? std::string("none") : text;
  };
  const auto how_to_pick = [&](std::string_view except) {
    return ". Other checkpoints in " + root.string() + ": " + others(except) +
           ". To resume from one of them, write its name into " + latest_path.string() +
           " (it is verified when loaded)";
  };
  if (!step_of_dir_name(name)) {
    throw InputError("checkpoint root " + root.string() + ": " + latest_path.string() + " holds '" +
                     name + "', not a checkpoint name step-<N>" + how_to_pick(""));
  }
  try {
    return load_training_checkpoint(root / name);
  } catch (const std::exception& error) {
    // Keep the kind: a corrupt checkpoint stays bad input, a failing disk an internal failure.
    const std::string what =
        "checkpoint root " + root.string() + ": the latest checkpoint, " + name +
        ", cannot be loaded (not falling back to an older one): " + error.what() +
        how_to_pick(name);
    if (is_input_error(error)) throw InputError(what);
    throw std::runtime_error(what);
  }
}

std::vector<fs::path> list_checkpoints(const fs::path& root) {
  std::vector<std::pair<std::int64_t, fs::path>> found;
  std::error_code error;
  for (const auto& entry : fs::directory_iterator(root, error)) {
    const auto step = step_of_dir_name(entry.path().filename().string());
    if (step && entry.is_directory()) found.emplace_back(*step, entry.path());
  }
  std::sort(found.begin(), found.end());
  std::vector<fs::path> dirs;
  dirs.reserve(found.size());
  for (auto& [step, dir] : found) dirs.push_back(std::move(dir));
  return dirs;
}

void check_resume_compatible(const nlohmann::json& expected_identity,
                             const TrainingCheckpoint& checkpoint) {
  std::map<std::string, nlohmann::json> expected;
  std::map<std::string, nlohmann::json> actual;
  flatten(expected_identity, "", expected);
  flatten(checkpoint.identity, "", actual);
  std::set<std::string> keys;
  for (const auto& [key, value] : expected) keys.insert(key);
  for (const auto& [key, value] : actual) keys.insert(key);
  std::string differences;
  for (const auto& key : keys) {
    const auto in_checkpoint = actual.find(key);
    const auto in_run = expected.find(key);
    const auto show = [](const auto& it, const auto& map) {
      return it == map.end() ? std::string("absent") : describe(it->second);
    };
    if (in_checkpoint != actual.end() && in_run != expected.end() &&
        in_checkpoint->second == in_run->second) {
      continue;
    }
    differences += (differences.empty() ? "" : "; ") + (key.empty() ? "identity" : key) + " is " +
                   show(in_checkpoint, actual) + " in the checkpoint, " + show(in_run, expected) +
                   " in this run";
  }
  if (differences.empty()) return;
  const auto name = checkpoint.directory.empty() ? checkpoint_dir_name(checkpoint.step)
                                                 : checkpoint.directory.string();
  throw InputError("checkpoint " + name + " does not match this run: " + differences);
}

}  // namespace pf::ckpt
