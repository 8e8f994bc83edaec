// Writes the seed corpus of every fuzz target with the project's own writers, and the crafted
// files of issue #16's defects, under OUT/<target>/ (tests/fuzz/corpus is its committed output):
//   make_fuzz_corpus OUT
// Seeds are small on purpose: libFuzzer mutates them, and the replay test runs them all.
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/exit_codes.h"
#include "kfac/layer_state.h"
#include "runtime/checkpoint/safetensors.h"
#include "runtime/checkpoint/training_checkpoint.h"
#include "runtime/data/loader.h"
#include "runtime/data/shard_format.h"
#include "runtime/data/text_file.h"
#include "runtime/data/vocabulary.h"
#include "runtime/model/bert_config.h"
#include "runtime/optim/state_io.h"
#include "scheduler/compile.h"
#include "scheduler/schedule_json.h"
#include "scheduler/torch_csv.h"
#include "scheduler/unit_timings.h"
#include "sim/device.h"
#include "sim/measured_cost_model.h"
#include "tests/fuzz/fuzz_targets.h"
#include "traces/chrome_trace.h"

namespace {

namespace fs = std::filesystem;
using namespace pf;

class CorpusWriter {
 public:
  explicit CorpusWriter(fs::path root) : root_(std::move(root)) {}

  void bytes(const std::string& target, const std::string& name, std::string_view contents) {
    fs::create_directories(root_ / target);
    std::ofstream out(root_ / target / name, std::ios::binary | std::ios::trunc);
    out.write(contents.data(), static_cast<std::streamsize>(contents.size()));
    if (!out) throw InputError("cannot write " + (root_ / target / name).string());
  }
  void json(const std::string& target, const std::string& name, const nlohmann::json& value) {
    bytes(target, name, value.dump(1) + "\n");
  }
  void bytes(const std::string& target, const std::string& name, std::span<const std::byte> b) {
    bytes(target, name, std::string_view(reinterpret_cast<const char*>(b.data()), b.size()));
  }
  fs::path path(const std::string& target, const std::string& name) const {
    fs::create_directories(root_ / target);
    return root_ / target / name;
  }

 private:
  fs::path root_;
};

data::Vocabulary seed_vocabulary() {
  return data::Vocabulary::from_tokens({"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", "the",
                                        "cat", "sat", "dog", "ran", "##s", "é", "中"},
                                       "seed vocabulary");
}

sched::ScheduleParams params(sched::ScheduleKind kind, int workers, int microbatches,
                             int chunks = 1) {
  sched::ScheduleParams p;
  p.kind = kind;
  p.workers = workers;
  p.microbatches = microbatches;
  p.chunks_per_worker = chunks;
  return p;
}

void write_checkpoints(CorpusWriter& out) {
  const float f32[] = {1.0F, -2.5F, 3.25F, 0.0F, 1e-3F, 7.0F};
  const std::int64_t i64[] = {1, -2, 1LL << 40};
  auto half = ckpt::make_f32_record("half", {2}, std::span<const float>(f32, 2));
  half.dtype = ckpt::DType::kF16;
  half.data.resize(4);  // 1.0 and -2.5 as IEEE half
  const std::uint16_t half_bits[] = {0x3C00, 0xC100};
  std::memcpy(half.data.data(), half_bits, 4);
  out.bytes("safetensors", "mixed.safetensors",
            ckpt::serialize_safetensors({ckpt::make_f32_record("w", {2, 3}, f32),
                                         ckpt::make_i64_record("step", {3}, i64), half},
                                        {{"format", "pt"}}));
  out.bytes("safetensors", "empty.safetensors", ckpt::serialize_safetensors({}, {}));

  kfac::KfacState state;
  auto& query = state.add_layer({0, sched::LinearKind::kQuery}, 4, 3);
  query.a.value = Eigen::MatrixXf::Identity(4, 4);
  query.a.refreshes = 1;
  query.b.sum = Eigen::MatrixXf::Constant(3, 3, 0.5F);
  query.b.microbatches = 2;
  state.add_layer({1, sched::LinearKind::kFfnOut}, 2, 5);
  std::vector<ckpt::TensorRecord> records = state.state_records("kfac");
  optim::AdamMomentsMap<float> moments;
  moments["w"] = {std::vector<float>(6, 0.1F), std::vector<float>(6, 0.01F), {2, 3}};
  for (auto& record : optim::adam_moment_records("adam", 3, moments)) records.push_back(record);
  out.bytes("checkpoint_state", "kfac-and-adam.safetensors",
            ckpt::serialize_safetensors(records, {}));

  // A training checkpoint's manifest.json and state.json, as save_training_checkpoint writes
  // them for the checkpoint the checkpoint_* harnesses load.
  const fs::path scratch = out.path("checkpoint_manifest", ".scratch");
  const fs::path step_dir =
      ckpt::save_training_checkpoint(scratch, fuzz::sample_training_checkpoint());
  const std::string manifest = data::read_text_file((step_dir / "manifest.json").string());
  const std::string state_json = data::read_text_file((step_dir / "state.json").string());
  fs::remove_all(scratch);
  out.bytes("checkpoint_manifest", "manifest.json", manifest);
  out.bytes("checkpoint_state_json", "state.json", state_json);
  // Deep nesting: a stack overflow wherever a document is copied, compared or quoted, unless the
  // parser refuses it (json_fields::parse_bounded).
  const std::string deep = std::string(1000, '[') + std::string(1000, ']');
  out.bytes("checkpoint_state_json", "identity-nested-1000-deep.json",
            R"({"step": 3, "state": {}, "identity": {"model": )" + deep + "}}\n");
}

void write_data(CorpusWriter& out) {
  const data::Vocabulary vocab = seed_vocabulary();
  vocab.save(out.path("vocab", "vocab.txt").string());
  out.bytes("tokenizer", "mixed.txt", "The cats SAT, on the mat!  Été 中文 dog's ran...\n");
  out.bytes("tokenizer", "controls.txt", std::string("tab\there\r\nnul\0byte \xc3\xa9", 22));
  out.bytes("corpus", "paragraphs.txt",
            "The cat sat. The dog ran!\nIt was fine.\n\nA second document. It ends here.\n");
  out.bytes("corpus", "page.rst",
            "Title\n=====\n\nSome *text* with ``code`` and a :ref:`link <x>`.\n\n"
            ".. note::\n\n   A note. Another sentence.\n\n* item one\n* item two\n");

  data::ShardInfo info;
  info.vocab_hash = vocab.hash();
  info.vocab_size = static_cast<std::uint32_t>(vocab.size());
  info.max_seq_length = 12;
  info.max_predictions = 2;
  data::TrainingInstance instance;
  instance.tokens = {2, 6, 7, 4, 3, 9, 10, 3};  // [CLS] the cat [MASK] [SEP] dog ran [SEP]
  instance.segment_a_length = 5;
  instance.masked_positions = {3};
  instance.masked_labels = {8};
  data::TrainingInstance second = instance;
  second.is_random_next = true;
  data::write_shard(out.path("shard", "two-records.pfshard").string(), info, {instance, second});

  // Defect 5: a 64-byte shard (640-byte records, so 2^58 of them "fit" modulo 2^64).
  info.max_seq_length = 128;
  info.max_predictions = 20;
  const fs::path wrap = out.path("shard", "defect5-instances-2pow58.pfshard");
  data::write_shard(wrap.string(), info, {});
  std::string header = data::read_text_file(wrap.string());
  const std::uint64_t instances = std::uint64_t{1} << 58;
  std::memcpy(header.data() + 40, &instances, 8);
  const std::uint64_t checksum = data::fnv1a64(std::string_view(header.data(), 56));
  std::memcpy(header.data() + 56, &checksum, 8);
  out.bytes("shard", wrap.filename().string(), header);

  data::LoaderPosition position;
  position.epoch = 2;
  position.batches_in_epoch = 5;
  position.seed = 12345;
  position.replica_count = 2;
  position.micro_batch_size = 8;
  position.num_instances = 100;
  out.json("loader_position", "position.json", position.to_json());
}

void write_model_and_simulator(CorpusWriter& out) {
  out.json("hf_config", "tiny.json", model::bert_config_to_hf_json(model::bert_preset("tiny")));
  nlohmann::json config = model::bert_config_to_hf_json(model::bert_preset("base"));
  config.erase("intermediate_size");
  config["hidden_size"] = 600000000;  // defect 1
  out.json("hf_config", "defect1-hidden-size-600000000.json", config);
  config = model::bert_config_to_hf_json(model::bert_preset("base"));
  config["num_hidden_layers"] = 4294967297;  // defect 2
  out.json("hf_config", "defect2-layers-4294967297.json", config);

  out.json("device", "h100.json", sim::device_to_json(sim::device_preset("h100")));
  out.json("device", "v100.json", sim::device_to_json(sim::device_preset("v100")));
  nlohmann::json device = sim::device_to_json(sim::device_preset("a100"));
  device["name"] = 42;
  out.json("device", "name-not-a-string.json", device);
  // Found by reading: 2 million '[' as peak_flops overflowed the stack when the error message
  // quoted the value (exit 139). 1000 levels are enough to meet the nesting limit.
  out.bytes("device", "peak-flops-nested-1000-deep.json",
            R"({"name": "deep", "peak_flops": )" + std::string(1000, '[') + std::string(1000, ']') +
                "}\n");

  // Calibration measurements (pipefisher_sim calibrate): one record of every operation.
  out.json("measurements", "every-operation.json",
           {{"format_version", 1},
            {"defaults", {{"model", "base"}, {"seq_len", 128}, {"precision", "fp32"}}},
            {"measurements",
             {{{"operation", "layer_forward"}, {"micro_batch_size", 8}, {"seconds", 0.004}},
              {{"operation", "layer_backward"}, {"micro_batch_size", 8}, {"seconds", 0.008}},
              {{"operation", "layer_curvature"}, {"micro_batch_size", 8}, {"seconds", 0.002}},
              {{"operation", "layer_inversion"}, {"micro_batch_size", 8}, {"seconds", 0.02}},
              {{"operation", "layer_precondition"}, {"micro_batch_size", 8}, {"seconds", 0.001}},
              {{"operation", "gemm"}, {"m", 1024}, {"n", 1024}, {"k", 1024}, {"seconds", 1e-4}},
              {{"operation", "attention"},
               {"batch", 96},
               {"m", 128},
               {"n", 128},
               {"k", 64},
               {"seconds", 5e-5}},
              {{"operation", "memory"}, {"bytes", 1e8}, {"count", 2}, {"seconds", 1e-4}},
              {{"operation", "cholesky_inverse"}, {"order", 1024}, {"seconds", 2e-3}},
              {{"operation", "eigen_inverse"}, {"order", 256}, {"count", 3}, {"seconds", 9e-3}}}}});

  sim::Profile profile;
  profile.description = "seed";
  for (int chunk = 0; chunk < 2; ++chunk) {
    sim::ChunkProfile c;
    c.chunk = chunk;
    c.forward_s = 1e-3;
    c.backward_s = 2e-3;
    c.activation_bytes = 1e6;
    profile.chunks.push_back(c);
  }
  profile.chunks[1].pipeline = 0;
  profile.communication = {1e10, 1e-6, 1e6};
  profile.reduction = {5e9, 2e-6, 0.0};
  sim::KfacProfile k;
  k.curvature_a_s = k.curvature_b_s = k.invert_a_s = k.invert_b_s = k.precondition_s = 1e-4;
  profile.kfac.push_back(k);
  k.layer = 1;
  k.linear = sched::LinearKind::kFfnIn;
  profile.kfac.push_back(k);
  out.json("profile", "two-chunks.json", sim::profile_to_json(profile));
  // Workers that shared processors on two machines (two replicas' ranks).
  profile.shared_processor_capacity = 0.75;
  profile.shared_processor_replicas = 2;
  profile.shared_processor_machines = {0, 1, 0, 1};
  out.json("profile", "shared-two-machines.json", sim::profile_to_json(profile));
  // Defect 4: about 200 bytes asking for a 2^30 x 2^30 table.
  out.bytes("profile", "defect4-index-1073741824.json",
            R"({"format_version": 1, "chunks": [{"pipeline": 1073741824, "chunk": 1073741824,)"
            R"( "forward_s": 1, "backward_s": 2}], "communication": {"bandwidth": 1e9,)"
            R"( "latency_s": 0, "message_bytes": 0}})"
            "\n");
}

void write_schedules(CorpusWriter& out) {
  using sched::ScheduleKind;
  sched::ScheduleParams gpipe = params(ScheduleKind::kGPipe, 2, 2);
  gpipe.num_layers = 2;
  const sched::Schedule small = sched::compile(gpipe);
  out.json("schedule_json", "gpipe-2x2.json", sched::to_json(small));
  sched::ScheduleParams interleaved = params(ScheduleKind::kInterleaved, 2, 4, 2);
  interleaved.split_backward = true;
  out.json("schedule_json", "interleaved-split.json", sched::to_json(sched::compile(interleaved)));
  sched::ScheduleParams chimera = params(ScheduleKind::kChimera, 2, 2);
  chimera.data_parallel = 2;
  out.json("schedule_json", "chimera-dp2.json", sched::to_json(sched::compile(chimera)));
  // Defect 3: a chunk at first_layer INT_MAX, so first_layer + num_layers overflows.
  nlohmann::json overflow = sched::to_json(small);
  overflow["placement"]["chunks"][1]["first_layer"] = 2147483647;
  overflow["placement"]["chunks"][1]["num_layers"] = 1;
  out.json("schedule_json", "defect3-first-layer-2147483647.json", overflow);

  const sched::Schedule one_f_one_b = sched::compile(params(ScheduleKind::kOneFOneB, 3, 4));
  out.bytes("torch_csv", "1f1b-comm.csv", sched::to_torch_csv(one_f_one_b, true));
  out.bytes("torch_csv", "1f1b-compute.csv", sched::to_torch_csv(one_f_one_b, false));
  sched::ScheduleParams zero_bubble = params(ScheduleKind::kOneFOneB, 2, 2);
  zero_bubble.split_backward = true;
  out.bytes("torch_csv", "split-backward.csv",
            sched::to_torch_csv(sched::compile(zero_bubble), false));
  // Zero-bubble schedules: I and W actions, V-shaped placement, both CSV forms and our JSON.
  const sched::Schedule zbh1 = sched::compile(params(ScheduleKind::kZeroBubbleH1, 2, 4));
  const sched::Schedule zbh2 = sched::compile(params(ScheduleKind::kZeroBubbleH2, 2, 4));
  const sched::Schedule zbv = sched::compile(params(ScheduleKind::kZeroBubbleV, 2, 4, 2));
  out.bytes("torch_csv", "zbh1-comm.csv", sched::to_torch_csv(zbh1, true));
  out.bytes("torch_csv", "zbh2-compute.csv", sched::to_torch_csv(zbh2, false));
  out.bytes("torch_csv", "zbv-comm.csv", sched::to_torch_csv(zbv, true));
  out.bytes("torch_csv", "zbv-compute.csv", sched::to_torch_csv(zbv, false));
  out.json("schedule_json", "zbh2-2x4.json", sched::to_json(zbh2));
  out.json("schedule_json", "zbv-2x4.json", sched::to_json(zbv));

  const nlohmann::json trace = traces::make_chrome_trace(small, sched::unit_timings(small));
  out.json("chrome_trace", "gpipe-2x2.json", trace);
  out.json("chrome_trace", "bare-array.json",
           nlohmann::json::array({{{"ph", "X"},
                                   {"name", "F0"},
                                   {"pid", 0},
                                   {"tid", 1},
                                   {"ts", 0.5},
                                   {"dur", 2},
                                   {"args", {{"k", 1}}}},
                                  {{"ph", "M"}, {"name", "process_name"}}}));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: make_fuzz_corpus OUT_DIR\n";
    return pf::kExitBadInput;
  }
  try {
    CorpusWriter out{fs::path(argv[1])};
    write_checkpoints(out);
    write_data(out);
    write_model_and_simulator(out);
    write_schedules(out);
  } catch (const std::exception& error) {
    std::cerr << "make_fuzz_corpus: error: " << error.what() << '\n';
    return pf::exit_code_for(error);
  }
  return pf::kExitSuccess;
}
