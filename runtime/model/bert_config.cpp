#include "runtime/model/bert_config.h"

#include <cmath>
#include <fstream>
#include <limits>
#include <optional>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "common/json_fields.h"

namespace pf::model {
namespace {

BertConfig make(std::string name, int layers, int hidden, int heads) {
  BertConfig config;
  config.name = std::move(name);
  config.num_layers = layers;
  config.hidden_size = hidden;
  config.num_heads = heads;
  config.intermediate_size = 4 * hidden;
  return config;
}

void require_in_range(int value, std::string_view field, int hi) {
  if (value <= 0 || value > hi) {
    throw std::invalid_argument("BERT config: " + std::string(field) + " = " +
                                std::to_string(value) + " (allowed: an integer in [1, " +
                                std::to_string(hi) + "])");
  }
}

}  // namespace

void BertConfig::validate() const {
  require_in_range(vocab_size, "vocab_size", kMaxVocabSize);
  require_in_range(hidden_size, "hidden_size", kMaxWidth);
  require_in_range(num_layers, "num_hidden_layers", kMaxLayers);
  require_in_range(num_heads, "num_attention_heads", kMaxWidth);
  require_in_range(intermediate_size, "intermediate_size", 4 * kMaxWidth);
  require_in_range(max_position_embeddings, "max_position_embeddings", kMaxPositions);
  require_in_range(type_vocab_size, "type_vocab_size", kMaxVocabSize);
  if (hidden_size % num_heads != 0) {
    throw std::invalid_argument("BERT config: hidden_size " + std::to_string(hidden_size) +
                                " is not divisible by num_attention_heads " +
                                std::to_string(num_heads));
  }
  if (pad_token_id < -1 || pad_token_id >= vocab_size) {
    throw std::invalid_argument("BERT config: pad_token_id " + std::to_string(pad_token_id) +
                                " is outside the vocabulary (or -1 for none)");
  }
  if (!(layer_norm_eps > 0.0F)) {
    throw std::invalid_argument("BERT config: layer_norm_eps must be positive");
  }
  if (!(hidden_dropout >= 0.0F && hidden_dropout < 1.0F) ||
      !(attention_dropout >= 0.0F && attention_dropout < 1.0F)) {
    throw std::invalid_argument("BERT config: dropout probabilities must lie in [0, 1)");
  }
}

std::vector<std::string> bert_preset_names() {
  return {"tiny", "mini", "small", "medium", "base", "large"};
}

BertConfig bert_preset(std::string_view name) {
  if (name == "tiny") return make("tiny", 2, 128, 2);
  if (name == "mini") return make("mini", 4, 256, 4);
  if (name == "small") return make("small", 4, 512, 8);
  if (name == "medium") return make("medium", 8, 512, 8);
  if (name == "base") return make("base", 12, 768, 12);
  if (name == "large") return make("large", 24, 1024, 16);
  // "bert-base" as the configuration search and Hugging Face's model names spell it.
  constexpr std::string_view kPrefix = "bert-";
  if (name.starts_with(kPrefix) && name.size() > kPrefix.size()) {
    const auto bare = name.substr(kPrefix.size());
    for (const auto& preset : bert_preset_names()) {
      if (bare == preset) return bert_preset(bare);
    }
  }
  std::string known;
  for (const auto& preset : bert_preset_names()) known += (known.empty() ? "" : ", ") + preset;
  throw std::invalid_argument("unknown BERT preset '" + std::string(name) + "' (known: " + known +
                              ", each also with a bert- prefix, or a path to a Hugging Face "
                              "config.json)");
}

BertConfig bert_config_from_hf_json(const nlohmann::json& json, std::string_view source) {
  auto fail = [&](const std::string& what) {
    throw std::invalid_argument(std::string(source) + ": " + what);
  };
  if (!json.is_object()) fail("expected a JSON object");
  BertConfig config;
  config.name = std::string(source);
  // Every size is range-checked as a 64-bit value before it is narrowed to int, so that
  // 4294967297 layers is an error rather than 1 layer, and the products the model computes from
  // these sizes (vocab_size * hidden_size, 4 * hidden_size) stay far from int64 overflow.
  auto read_int = [&](const char* field, int& out, bool required, int lo, int hi) {
    const std::optional<int> fallback = required ? std::nullopt : std::optional<int>(out);
    out = json_fields::integer_field<int>(json, field, source, lo, hi, fallback);
  };
  auto read_float = [&](const char* field, float& out) {
    auto it = json.find(field);
    if (it == json.end()) return;
    // 1e300 would become an infinite float: only values a float holds finitely are accepted.
    if (!it->is_number() || !std::isfinite(it->get<double>()) ||
        std::abs(it->get<double>()) > std::numeric_limits<float>::max()) {
      json_fields::fail(source, field, *it, "a finite number");
    }
    out = it->get<float>();
  };
  read_int("vocab_size", config.vocab_size, false, 1, BertConfig::kMaxVocabSize);
  read_int("hidden_size", config.hidden_size, true, 1, BertConfig::kMaxWidth);
  read_int("num_hidden_layers", config.num_layers, true, 1, BertConfig::kMaxLayers);
  read_int("num_attention_heads", config.num_heads, true, 1, BertConfig::kMaxWidth);
  // Hugging Face's default; hidden_size <= kMaxWidth keeps 4 * hidden_size within int.
  config.intermediate_size = 4 * config.hidden_size;
  read_int("intermediate_size", config.intermediate_size, false, 1, 4 * BertConfig::kMaxWidth);
  read_int("max_position_embeddings", config.max_position_embeddings, false, 1,
           BertConfig::kMaxPositions);
  read_int("type_vocab_size", config.type_vocab_size, false, 1, BertConfig::kMaxVocabSize);
  if (auto it = json.find("pad_token_id"); it != json.end() && it->is_null()) {
    config.pad_token_id = -1;  // no padding row
  } else {
    read_int("pad_token_id", config.pad_token_id, false, -1, BertConfig::kMaxVocabSize - 1);
  }
  read_float("layer_norm_eps", config.layer_norm_eps);
  read_float("hidden_dropout_prob", config.hidden_dropout);
  read_float("attention_probs_dropout_prob", config.attention_dropout);
  read_float("initializer_range", config.initializer_range);
  if (auto it = json.find("hidden_act"); it != json.end() && *it != "gelu") {
    fail("hidden_act '" + it->dump() + "' is not supported (only \"gelu\", the erf form)");
  }
  try {
    config.validate();
  } catch (const std::invalid_argument& error) {
    fail(error.what());
  }
  return config;
}

BertConfig bert_config_from_hf_json(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) throw std::invalid_argument("cannot open model config '" + path.string() + "'");
  nlohmann::json json;
  try {
    json = json_fields::parse_bounded(in, path.string());
  } catch (const nlohmann::json::parse_error& error) {
    throw std::invalid_argument(path.string() + ": not valid JSON: " + error.what());
  }
  return bert_config_from_hf_json(json, path.string());
}

nlohmann::json bert_config_to_hf_json(const BertConfig& config) {
  return {{"architectures", {"BertForPreTraining"}},
          {"model_type", "bert"},
          {"vocab_size", config.vocab_size},
          {"hidden_size", config.hidden_size},
          {"num_hidden_layers", config.num_layers},
          {"num_attention_heads", config.num_heads},
          {"intermediate_size", config.intermediate_size},
          {"max_position_embeddings", config.max_position_embeddings},
          {"type_vocab_size", config.type_vocab_size},
          {"layer_norm_eps", config.layer_norm_eps},
          {"hidden_dropout_prob", config.hidden_dropout},
          {"attention_probs_dropout_prob", config.attention_dropout},
          {"initializer_range", config.initializer_range},
          {"hidden_act", "gelu"},
          {"pad_token_id", config.pad_token_id < 0 ? nlohmann::json(nullptr)
                                                   : nlohmann::json(config.pad_token_id)}};
}

BertConfig resolve_bert_config(std::string_view preset_or_path) {
  for (const auto& preset : bert_preset_names()) {
    if (preset == preset_or_path) return bert_preset(preset_or_path);
  }
  std::filesystem::path path(preset_or_path);
  if (std::filesystem::exists(path)) return bert_config_from_hf_json(path);
  return bert_preset(preset_or_path);  // throws with the list of presets
}

}  // namespace pf::model
