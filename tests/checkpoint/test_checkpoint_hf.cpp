// A training checkpoint's model.safetensors and config.json are the Hugging Face layout: the
// tensors under their global names, loadable into a model split another way.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "checkpoint_test_util.h"
#include "runtime/model/bert_chunk.h"
#include "runtime/model/bert_config.h"
#include "runtime/model/hf_weights.h"
#include "runtime/tensor/cpu_backend.h"

namespace pf::ckpt {
namespace {

using testing::ScratchDir;

model::BertConfig small_config() {
  model::BertConfig config;
  config.name = "checkpoint-test";
  config.vocab_size = 31;
  config.hidden_size = 8;
  config.num_layers = 4;
  config.num_heads = 2;
  config.intermediate_size = 16;
  config.max_position_embeddings = 12;
  return config;
}

TEST(CheckpointHfLayout, ModelFileHasHuggingFaceNamesAndLoadsIntoAnotherSplit) {
  const ScratchDir root;
  const auto config = small_config();
  tensor::CpuBackend backend;
  // Saved from a 2-stage layout ...
  auto saved_chunks = model::make_chunks<float>(config, {{0, 2, true, false}, {2, 2, false, true}},
                                                backend, /*seed=*/42);
  std::vector<model::BertChunk<float>*> saved_views;
  for (auto& chunk : saved_chunks) saved_views.push_back(chunk.get());
  auto checkpoint = testing::sample_checkpoint(12);
  checkpoint.weights = model::hf_weight_records<float>(saved_views);
  checkpoint.hf_config = model::bert_config_to_hf_json(config);
  const auto dir = save_training_checkpoint(root.path(), checkpoint);

  // ... the file is a plain Hugging Face checkpoint ...
  const auto file = load_safetensors(dir / "model.safetensors");
  EXPECT_EQ(file.metadata.at("format"), "pt");
  EXPECT_EQ(file.tensors.size(), checkpoint.weights.size());
  for (const auto& name :
       {"bert.embeddings.word_embeddings.weight",
        "bert.encoder.layer.3.attention.self.query.weight", "bert.pooler.dense.weight",
        "cls.predictions.decoder.weight", "cls.seq_relationship.bias"}) {
    EXPECT_TRUE(file.tensors.contains(name)) << name;
  }
  auto reread = model::bert_config_from_hf_json(dir / "config.json");
  reread.name = config.name;
  EXPECT_EQ(reread, config);

  // ... and resumes into a 4-stage layout with identical values.
  const auto loaded = load_latest_checkpoint(root.path());
  ASSERT_TRUE(loaded.has_value());
  const auto weights = to_safetensors_file(loaded->weights);
  std::vector<model::ChunkSpec> four_stages{
      {0, 1, true, false}, {1, 1, false, false}, {2, 1, false, false}, {3, 1, false, true}};
  auto resumed = model::make_chunks<float>(config, four_stages, backend, /*seed=*/7);
  int compared = 0;
  for (auto& chunk : resumed) {
    model::load_hf_weights(weights, *chunk);
    for (const auto& p : chunk->parameters()) {
      bool found = false;
      for (auto& source : saved_chunks) {
        const auto original = source->parameter(p.name);
        if (!original) continue;
        found = true;
        for (std::int64_t i = 0; i < p.size; ++i)
          ASSERT_EQ(p.value[i], original->value[i]) << p.name;
        ++compared;
      }
      EXPECT_TRUE(found) << p.name;
    }
  }
  EXPECT_GT(compared, 20);
}

}  // namespace
}  // namespace pf::ckpt
