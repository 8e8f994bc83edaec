#pragma once
// BERT model dimensions: the presets of REFERENCE.md and Hugging Face config.json files.
// Shared by the runtime (to build the model) and the simulator (to cost it).
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace pf::model {

struct BertConfig {
  // Sane limits on sizes read from files, far above any real BERT (large: 24 layers, width 1024,
  // vocabulary 30522), and low enough that products such as vocab_size * hidden_size and
  // 4 * hidden_size cannot overflow int64 (or int, for the latter).
  static constexpr int kMaxVocabSize = 1 << 24;
  static constexpr int kMaxWidth = 1 << 20;
  static constexpr int kMaxLayers = 1 << 12;
  static constexpr int kMaxPositions = 1 << 20;

  std::string name = "custom";
  int vocab_size = 30522;
  int hidden_size = 768;
  int num_layers = 12;
  int num_heads = 12;
  int intermediate_size = 3072;
  int max_position_embeddings = 512;
  int type_vocab_size = 2;
  float layer_norm_eps = 1e-12F;
  float hidden_dropout = 0.1F;
  float attention_dropout = 0.1F;
  float initializer_range = 0.02F;
  // Hugging Face's word embedding has padding_idx = pad_token_id: that row starts at zero and
  // receives no gradient from the embedding lookup (the tied decoder still updates it).
  int pad_token_id = 0;

  int head_dim() const { return hidden_size / num_heads; }
  // Throws std::invalid_argument naming the field when the sizes are impossible.
  void validate() const;
  friend bool operator==(const BertConfig&, const BertConfig&) = default;
};

// tiny, mini, small, medium, base, large. Throws with the list of known names.
BertConfig bert_preset(std::string_view name);
std::vector<std::string> bert_preset_names();

// Reads a Hugging Face BertConfig (config.json); errors name the file and the field.
BertConfig bert_config_from_hf_json(const std::filesystem::path& path);
BertConfig bert_config_from_hf_json(const nlohmann::json& json, std::string_view source);
nlohmann::json bert_config_to_hf_json(const BertConfig& config);

// A preset name or a path to config.json.
BertConfig resolve_bert_config(std::string_view preset_or_path);

}  // namespace pf::model
