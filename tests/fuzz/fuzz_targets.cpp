#include "tests/fuzz/fuzz_targets.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/input_error.h"
#include "common/json_fields.h"
#include "kfac/layer_state.h"
#include "runtime/checkpoint/safetensors.h"
#include "runtime/checkpoint/training_checkpoint.h"
#include "runtime/checkpoint/xxhash64.h"
#include "runtime/data/bert_tokenizer.h"
#include "runtime/data/loader.h"
#include "runtime/data/pretraining_instances.h"
#include "runtime/data/rst_corpus.h"
#include "runtime/data/sentence_splitter.h"
#include "runtime/data/shard_format.h"
#include "runtime/data/unicode_text.h"
#include "runtime/data/vocabulary.h"
#include "runtime/model/bert_config.h"
#include "runtime/optim/state_io.h"
#include "scheduler/schedule_json.h"
#include "scheduler/torch_csv.h"
#include "sim/calibration.h"
#include "sim/device.h"
#include "sim/measured_cost_model.h"
#include "traces/chrome_trace.h"

namespace pf::fuzz {
namespace {

std::string_view as_text(std::span<const std::uint8_t> input) {
  return {reinterpret_cast<const char*>(input.data()), input.size()};
}

// The input as a file the readers open by path, without touching the disk: an anonymous memory
// file seen through /proc/self/fd (opening that path gives a fresh offset, like a real file).
class MemoryFile {
 public:
  explicit MemoryFile(std::span<const std::uint8_t> bytes)
      : fd_(::memfd_create("pf-fuzz-input", MFD_CLOEXEC)) {
    if (fd_ < 0) throw std::system_error(errno, std::generic_category(), "memfd_create");
    std::size_t written = 0;
    while (written < bytes.size()) {
      const auto n = ::write(fd_, bytes.data() + written, bytes.size() - written);
      if (n < 0) {
        if (errno == EINTR) continue;
        const int saved = errno;
        ::close(fd_);
        throw std::system_error(saved, std::generic_category(), "writing the memory file");
      }
      written += static_cast<std::size_t>(n);
    }
    path_ = "/proc/self/fd/" + std::to_string(fd_);
  }
  ~MemoryFile() { ::close(fd_); }
  MemoryFile(const MemoryFile&) = delete;
  MemoryFile& operator=(const MemoryFile&) = delete;
  const std::string& path() const { return path_; }

 private:
  int fd_;
  std::string path_;
};

data::Vocabulary fixed_vocabulary() {
  std::vector<std::string> tokens = {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", ",",
                                     "the",   "cat",   "sat",   "on",    "mat",    "a", "dog",
                                     "ran",   "##s",   "##ed",  "##ing", "é",      "中"};
  return data::Vocabulary::from_tokens(tokens, "fuzz vocabulary");
}

// --- binary and text files of the data pipeline and checkpoints --------------------------------

void run_safetensors(std::span<const std::uint8_t> input, const std::string& path) {
  const ckpt::SafetensorsFile file = ckpt::load_safetensors(path);
  // The in-memory parser must agree with the file reader.
  const ckpt::SafetensorsFile again =
      ckpt::parse_safetensors(std::as_bytes(std::span(input)), path);
  if (again.tensors.size() != file.tensors.size() || again.metadata != file.metadata) {
    throw std::logic_error("finding: parse_safetensors and load_safetensors disagree on " + path);
  }
  for (const auto& [name, record] : file.tensors) {
    if (record.dtype == ckpt::DType::kF32 || record.dtype == ckpt::DType::kF16 ||
        record.dtype == ckpt::DType::kBF16 || record.dtype == ckpt::DType::kF64) {
      (void)ckpt::read_as_f32(file, name, record.shape);
    } else if (record.dtype == ckpt::DType::kI64 || record.dtype == ckpt::DType::kI32) {
      (void)ckpt::read_i64(file, name, record.shape);
    }
  }
}

// Optimizer and K-FAC state restored from a checkpoint file (the seeds are such files).
void run_checkpoint_state(std::span<const std::uint8_t>, const std::string& path) {
  const ckpt::SafetensorsFile file = ckpt::load_safetensors(path);
  kfac::KfacState kfac;
  kfac.add_layer({0, sched::LinearKind::kQuery}, 4, 3);
  kfac.add_layer({1, sched::LinearKind::kFfnOut}, 2, 5);
  kfac.load_state(file, "kfac");
  std::vector<float> values(6), grads(6);
  std::vector<optim::ParamView> params{{"w", values.data(), grads.data(), 6, {2, 3}, false}};
  std::int64_t steps = 0;
  (void)optim::read_adam_moments(file, std::span<const optim::ParamView>(params), "adam", steps);
}

// The header carries a checksum of itself, which a fuzzer cannot keep right: recompute it so that
// mutated header fields reach the checks behind it.
void fix_shard_header_checksum(std::vector<std::uint8_t>& bytes) {
  if (bytes.size() < data::ShardInfo::kHeaderBytes) return;
  const std::uint64_t checksum =
      data::fnv1a64(std::string_view(reinterpret_cast<const char*>(bytes.data()), 56));
  std::memcpy(bytes.data() + 56, &checksum, sizeof(checksum));
}

void run_shard(std::span<const std::uint8_t>, const std::string& path) {
  // The records' checksum is not verified, so that mutated records reach the record decoder.
  data::ShardReader reader(path, std::nullopt, /*verify_checksum=*/false);
  data::TrainingInstance instance;
  for (std::size_t i = 0; i < std::min<std::size_t>(reader.size(), 64); ++i) {
    reader.read(i, instance);
  }
}

void run_vocab(std::span<const std::uint8_t>, const std::string& path) {
  const data::Vocabulary vocab = data::Vocabulary::load(path);
  const data::BertTokenizer tokenizer(vocab);
  (void)tokenizer.encode("The cat sat on the mat, running é 中文!");
}

void run_tokenizer(std::span<const std::uint8_t> input, const std::string&) {
  static const data::Vocabulary vocab = fixed_vocabulary();
  const std::string_view raw = as_text(input);
  std::string text;
  data::drop_invalid_utf8(raw, text);  // as the programs do with --skip-invalid-utf8
  for (const bool lower_case : {true, false}) {
    const data::BertTokenizer tokenizer(vocab, {.lower_case = lower_case, .max_word_chars = 20});
    for (const data::TokenId id : tokenizer.encode(text)) {
      if (id < 0 || static_cast<std::size_t>(id) >= vocab.size()) {
        throw std::logic_error("finding: tokenizer produced id " + std::to_string(id));
      }
    }
  }
}

void run_corpus(std::span<const std::uint8_t> input, const std::string& path) {
  static const data::Vocabulary vocab = fixed_vocabulary();
  const std::string_view text = as_text(input);
  const data::BertTokenizer tokenizer(vocab);
  data::CorpusReader reader(tokenizer, /*skip_invalid_utf8=*/true);
  reader.add_text(text, path);
  if (data::find_invalid_utf8(text) == std::string_view::npos) {
    std::string out;
    data::RstStats stats;
    data::rst_to_corpus(text, out, stats);
    reader.add_text(out, path);
    reader.add_text(data::paragraphs_to_sentences(text), path);
  }
  const data::TokenizedCorpus corpus = reader.finish();
  if (corpus.num_documents() == 0) return;
  data::InstanceOptions options;
  options.max_seq_length = 24;
  options.max_predictions_per_seq = 4;
  options.dupe_factor = 1;
  (void)data::create_instances(corpus, vocab, options);
}

// --- JSON and CSV files of the model, the simulator and the scheduler ---------------------------

void run_hf_config(std::span<const std::uint8_t>, const std::string& path) {
  const model::BertConfig config = model::bert_config_from_hf_json(path);
  config.validate();
}

void run_device(std::span<const std::uint8_t>, const std::string& path) {
  const sim::DeviceSpec device = sim::device_from_json_file(path);
  for (const auto precision : {sim::Precision::kFp32, sim::Precision::kTf32, sim::Precision::kBf16,
                               sim::Precision::kFp16}) {
    try {
      (void)device.peak_flops(precision);
    } catch (const std::invalid_argument&) {  // a precision the device lacks: documented
    }
  }
}

void run_profile(std::span<const std::uint8_t>, const std::string& path) {
  const sim::MeasuredCostModel model(sim::profile_from_json_file(path), path);
  const sched::Schedule none;
  for (const sim::ChunkProfile& chunk : model.profile().chunks) {
    (void)model.activation_bytes(none, std::max(chunk.pipeline, 0), chunk.chunk);
  }
  // Every schedule starts with pipeline 0's chunk 0: a profile without it fits none.
  (void)model.activation_bytes(none, 0, 0);
  for (const sim::KfacProfile& kfac : model.profile().kfac) {
    (void)model.kfac_bytes(none, std::max(kfac.layer, 0),
                           kfac.linear.value_or(sched::LinearKind::kQuery));
  }
}

void run_torch_csv(std::span<const std::uint8_t>, const std::string& path) {
  const sched::Schedule schedule = sched::load_torch_csv(path);
  // What was accepted must survive our own format.
  (void)sched::schedule_from_json(sched::to_json(schedule), path + " (re-read)");
}

void run_schedule_json(std::span<const std::uint8_t>, const std::string& path) {
  const sched::Schedule schedule = sched::load_schedule_json(path);
  (void)sched::schedule_from_json(sched::to_json(schedule), path + " (re-read)");
}

void run_chrome_trace(std::span<const std::uint8_t>, const std::string& path) {
  (void)traces::read_chrome_trace(path);
}

void run_loader_position(std::span<const std::uint8_t> input, const std::string&) {
  nlohmann::json json;
  try {
    // As the checkpoint loader reads state.json (training_checkpoint.cpp): bounded nesting, and
    // a number beyond a double an error (a bare nlohmann::json::parse let it escape).
    json = json_fields::parse_bounded(as_text(input), "loader position");
  } catch (const nlohmann::json::parse_error& error) {
    throw std::invalid_argument(std::string("loader position: not valid JSON: ") + error.what());
  }
  const data::LoaderPosition position = data::LoaderPosition::from_json(json);
  if (!(data::LoaderPosition::from_json(position.to_json()) == position)) {
    throw std::logic_error("finding: loader position does not round-trip");
  }
}

// --- training checkpoints (a directory: manifest.json, state.json and the files they list) -----

void write_file(const std::filesystem::path& path, std::span<const std::uint8_t> bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("cannot write " + path.string());
}

std::vector<std::uint8_t> file_bytes(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// sample_training_checkpoint() saved once per process in a temporary directory (removed at exit);
// each run overwrites the file it fuzzes and restores the other.
class CheckpointScratch {
 public:
  CheckpointScratch() {
    std::string pattern = (std::filesystem::temp_directory_path() / "pf-fuzz-ckpt-XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) {
      throw std::system_error(errno, std::generic_category(), "mkdtemp " + pattern);
    }
    root_ = pattern;
    step_dir_ = ckpt::save_training_checkpoint(root_, sample_training_checkpoint());
    manifest_ = file_bytes(step_dir_ / "manifest.json");
    state_ = file_bytes(step_dir_ / "state.json");
  }
  ~CheckpointScratch() {
    std::error_code ignored;
    std::filesystem::remove_all(root_, ignored);
  }
  CheckpointScratch(const CheckpointScratch&) = delete;
  CheckpointScratch& operator=(const CheckpointScratch&) = delete;

  const std::filesystem::path& step_dir() const { return step_dir_; }
  const std::vector<std::uint8_t>& manifest() const { return manifest_; }
  const std::vector<std::uint8_t>& state() const { return state_; }

 private:
  std::filesystem::path root_;
  std::filesystem::path step_dir_;
  std::vector<std::uint8_t> manifest_;
  std::vector<std::uint8_t> state_;
};

CheckpointScratch& checkpoint_scratch() {
  static CheckpointScratch scratch;
  return scratch;
}

// Loads the scratch checkpoint and checks it against the run that wrote it, as a resume does.
void load_scratch_checkpoint() {
  const auto checkpoint = ckpt::load_training_checkpoint(checkpoint_scratch().step_dir());
  ckpt::check_resume_compatible(sample_training_checkpoint().identity, checkpoint);
  if (checkpoint.state.contains("loader")) {
    (void)data::LoaderPosition::from_json(checkpoint.state["loader"]);
  }
}

void run_checkpoint_manifest(std::span<const std::uint8_t> input, const std::string&) {
  auto& scratch = checkpoint_scratch();
  write_file(scratch.step_dir() / "state.json", scratch.state());
  write_file(scratch.step_dir() / "manifest.json", input);
  load_scratch_checkpoint();
}

// The input is state.json; the manifest is rewritten to list it with its true size and checksum
// (a fuzzer cannot keep an XXH64 right), so mutations reach the parsing behind the check.
void run_checkpoint_state_json(std::span<const std::uint8_t> input, const std::string&) {
  auto& scratch = checkpoint_scratch();
  nlohmann::json manifest = nlohmann::json::parse(scratch.manifest());
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(input.data()),
                                         input.size());
  manifest["files"]["state.json"] = {{"bytes", input.size()},
                                     {"xxh64", ckpt::to_hex64(ckpt::xxhash64(bytes))}};
  const std::string text = manifest.dump(2);
  write_file(scratch.step_dir() / "state.json", input);
  write_file(scratch.step_dir() / "manifest.json",
             {reinterpret_cast<const std::uint8_t*>(text.data()), text.size()});
  load_scratch_checkpoint();
}

// --- the simulator's calibration measurements (pipefisher_sim calibrate --measurements) --------

void run_measurements(std::span<const std::uint8_t>, const std::string& path) {
  static const sim::DeviceSpec device = sim::device_preset("h100");
  const auto measurements = sim::measurements_from_json_file(path, device);
  for (const auto& measurement : measurements) (void)sim::predict(device, measurement);
}

constexpr Target kTargets[] = {
    {"safetensors", nullptr, run_safetensors, true},
    {"checkpoint_state", nullptr, run_checkpoint_state, true},
    {"shard", fix_shard_header_checksum, run_shard, true},
    {"vocab", nullptr, run_vocab, true},
    {"tokenizer", nullptr, run_tokenizer, false},
    {"corpus", nullptr, run_corpus, true},
    {"hf_config", nullptr, run_hf_config, true},
    {"device", nullptr, run_device, true},
    {"profile", nullptr, run_profile, true},
    {"torch_csv", nullptr, run_torch_csv, true},
    {"schedule_json", nullptr, run_schedule_json, true},
    {"chrome_trace", nullptr, run_chrome_trace, true},
    {"loader_position", nullptr, run_loader_position, false},
    {"checkpoint_manifest", nullptr, run_checkpoint_manifest, false},
    {"checkpoint_state_json", nullptr, run_checkpoint_state_json, false},
    {"measurements", nullptr, run_measurements, true},
};

}  // namespace

ckpt::TrainingCheckpoint sample_training_checkpoint() {
  ckpt::TrainingCheckpoint checkpoint;
  checkpoint.step = 3;
  const std::vector<float> weights = {0.5F, -1.0F, 2.0F, 0.25F, 1.5F, -0.75F};
  checkpoint.weights = {ckpt::make_f32_record("encoder.weight", {2, 3}, weights)};
  checkpoint.hf_config = {{"model_type", "bert"}, {"hidden_size", 8}, {"num_hidden_layers", 1}};
  const std::vector<std::int64_t> steps = {3};
  checkpoint.optimizer = {ckpt::make_i64_record("adamw.step", {1}, steps)};
  data::LoaderPosition loader;
  loader.epoch = 1;
  loader.batches_in_epoch = 5;
  loader.seed = 42;
  loader.micro_batch_size = 4;
  loader.num_instances = 64;
  checkpoint.state = {{"loader", loader.to_json()}, {"learning_rate", {{"step", 3}}}};
  checkpoint.schedule = {{"kind", "1f1b"}};
  checkpoint.identity = {{"model", {{"hidden_size", 8}, {"layers", 1}}}, {"schedule", "1f1b"}};
  return checkpoint;
}

std::span<const Target> targets() {
  return kTargets;
}

const Target& target_named(std::string_view name) {
  std::string known;
  for (const Target& target : kTargets) {
    if (target.name == name) return target;
    known += (known.empty() ? "" : ", ") + std::string(target.name);
  }
  throw std::invalid_argument("unknown fuzz target '" + std::string(name) + "' (known: " + known +
                              ")");
}

std::optional<std::string> run_target(const Target& target, std::span<const std::uint8_t> input) {
  std::vector<std::uint8_t> bytes(input.begin(), input.end());
  if (target.prepare != nullptr) target.prepare(bytes);
  const MemoryFile file(bytes);
  std::string message;
  try {
    target.run(bytes, file.path());
    return std::nullopt;
  } catch (const std::invalid_argument& error) {
    message = error.what();
  } catch (const InputError& error) {
    message = error.what();
  }
  if (target.names_file && message.find(file.path()) == std::string::npos) {
    throw std::logic_error("finding: the " + std::string(target.name) +
                           " reader's error does not name the file: " + message);
  }
  return message;
}

}  // namespace pf::fuzz
