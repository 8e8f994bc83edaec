#include "sim/transformer_spec.h"

#include <fstream>
#include <stdexcept>

#include <nlohmann/json.hpp>

namespace pf::sim {
namespace {

TransformerSpec gpt(std::string name, int layers, int hidden, int heads, int vocab, int positions) {
  TransformerSpec s;
  s.name = std::move(name);
  s.family = ModelFamily::kGpt;
  s.num_layers = layers;
  s.hidden_size = hidden;
  s.num_heads = heads;
  s.num_kv_heads = heads;
  s.intermediate_size = 4 * hidden;
  s.vocab_size = vocab;
  s.max_position_embeddings = positions;
  return s;
}

TransformerSpec llama(std::string name, int layers, int hidden, int heads, int kv_heads,
                      int intermediate, int vocab, int positions) {
  TransformerSpec s;
  s.name = std::move(name);
  s.family = ModelFamily::kLlama;
  s.num_layers = layers;
  s.hidden_size = hidden;
  s.num_heads = heads;
  s.num_kv_heads = kv_heads;
  s.intermediate_size = intermediate;
  s.vocab_size = vocab;
  s.max_position_embeddings = positions;
  s.gated_mlp = true;
  s.rms_norm = true;
  s.linear_bias = false;
  s.dropout = false;
  s.tied_head = false;
  s.learned_positions = false;
  return s;
}

void require_positive(int value, std::string_view field, std::string_view model) {
  if (value <= 0) {
    throw std::invalid_argument("model '" + std::string(model) + "': " + std::string(field) +
                                " must be positive, got " + std::to_string(value));
  }
}

// json[key] as a positive int, or `fallback` when absent / null (fallback < 0: required).
int int_field(const nlohmann::json& json, const char* key, int fallback, std::string_view source) {
  const auto it = json.find(key);
  if (it == json.end() || it->is_null()) {
    if (fallback < 0) {
      throw std::invalid_argument(std::string(source) + ": field '" + key + "' is missing");
    }
    return fallback;
  }
  if (!it->is_number_integer() || it->get<long long>() <= 0 ||
      it->get<long long>() > 1'000'000'000LL) {
    throw std::invalid_argument(std::string(source) + ": field '" + key +
                                "' must be a positive integer, got " + it->dump());
  }
  return it->get<int>();
}

bool bool_field(const nlohmann::json& json, const char* key, bool fallback,
                std::string_view source) {
  const auto it = json.find(key);
  if (it == json.end() || it->is_null()) return fallback;
  if (!it->is_boolean()) {
    throw std::invalid_argument(std::string(source) + ": field '" + key +
                                "' must be true or false, got " + it->dump());
  }
  return it->get<bool>();
}

}  // namespace

std::string_view to_string(ModelFamily family) {
  switch (family) {
    case ModelFamily::kBert:
      return "bert";
    case ModelFamily::kGpt:
      return "gpt";
    case ModelFamily::kLlama:
      return "llama";
  }
  return "?";
}

void TransformerSpec::validate() const {
  require_positive(vocab_size, "vocab_size", name);
  require_positive(hidden_size, "hidden_size", name);
  require_positive(num_layers, "num_layers", name);
  require_positive(num_heads, "num_heads", name);
  require_positive(num_kv_heads, "num_kv_heads", name);
  require_positive(intermediate_size, "intermediate_size", name);
  require_positive(max_position_embeddings, "max_position_embeddings", name);
  if (hidden_size % num_heads != 0) {
    throw std::invalid_argument("model '" + name + "': hidden_size " + std::to_string(hidden_size) +
                                " is not divisible by num_heads " + std::to_string(num_heads));
  }
  if (num_heads % num_kv_heads != 0) {
    throw std::invalid_argument("model '" + name + "': num_heads " + std::to_string(num_heads) +
                                " is not a multiple of num_kv_heads " +
                                std::to_string(num_kv_heads));
  }
}

TransformerSpec from_bert_config(const model::BertConfig& config) {
  TransformerSpec s;
  s.name = config.name;
  s.family = ModelFamily::kBert;
  s.vocab_size = config.vocab_size;
  s.hidden_size = config.hidden_size;
  s.num_layers = config.num_layers;
  s.num_heads = config.num_heads;
  s.num_kv_heads = config.num_heads;
  s.intermediate_size = config.intermediate_size;
  s.max_position_embeddings = config.max_position_embeddings;
  s.causal = false;
  s.tied_head = true;
  return s;
}

std::vector<std::string> transformer_preset_names() {
  std::vector<std::string> names = model::bert_preset_names();
  for (const char* name : {"bert-base",       "bert-large",      "gpt2",
                           "gpt2-medium",     "gpt2-large",      "gpt2-xl",
                           "gpt3-125m",       "gpt3-350m",       "gpt3-760m",
                           "gpt3-1.3b",       "gpt3-2.7b",       "gpt3-6.7b",
                           "gpt3-13b",        "gpt3-175b",       "megatron-1.7b",
                           "megatron-3.6b",   "megatron-7.5b",   "megatron-18.4b",
                           "megatron-39.1b",  "megatron-76.1b",  "megatron-145.6b",
                           "megatron-310.1b", "megatron-529.6b", "megatron-1t",
                           "llama-7b",        "llama-13b",       "llama2-70b",
                           "llama3-8b"}) {
    names.emplace_back(name);
  }
  return names;
}

TransformerSpec transformer_preset(std::string_view name) {
  for (const std::string& bert : model::bert_preset_names()) {
    if (name == bert || name == "bert-" + bert) return from_bert_config(model::bert_preset(bert));
  }
  // GPT-2 (Radford et al. 2019) and GPT-3 (Brown et al. 2020, Table 2.1; 1.3B with 16 heads of
  // 128 so that heads x head size = hidden): vocabulary 50257.
  if (name == "gpt2") return gpt("gpt2", 12, 768, 12, 50257, 1024);
  if (name == "gpt2-medium") return gpt("gpt2-medium", 24, 1024, 16, 50257, 1024);
  if (name == "gpt2-large") return gpt("gpt2-large", 36, 1280, 20, 50257, 1024);
  if (name == "gpt2-xl") return gpt("gpt2-xl", 48, 1600, 25, 50257, 1024);
  if (name == "gpt3-125m") return gpt("gpt3-125m", 12, 768, 12, 50257, 2048);
  if (name == "gpt3-350m") return gpt("gpt3-350m", 24, 1024, 16, 50257, 2048);
  if (name == "gpt3-760m") return gpt("gpt3-760m", 24, 1536, 16, 50257, 2048);
  if (name == "gpt3-1.3b") return gpt("gpt3-1.3b", 24, 2048, 16, 50257, 2048);
  if (name == "gpt3-2.7b") return gpt("gpt3-2.7b", 32, 2560, 32, 50257, 2048);
  if (name == "gpt3-6.7b") return gpt("gpt3-6.7b", 32, 4096, 32, 50257, 2048);
  if (name == "gpt3-13b") return gpt("gpt3-13b", 40, 5120, 40, 50257, 2048);
  if (name == "gpt3-175b") return gpt("gpt3-175b", 96, 12288, 96, 50257, 2048);
  // The Megatron-LM PTD-P paper's weak-scaling models (vocabulary 51200, sequence 2048).
  if (name == "megatron-1.7b") return gpt("megatron-1.7b", 24, 2304, 24, 51200, 2048);
  if (name == "megatron-3.6b") return gpt("megatron-3.6b", 30, 3072, 32, 51200, 2048);
  if (name == "megatron-7.5b") return gpt("megatron-7.5b", 36, 4096, 32, 51200, 2048);
  if (name == "megatron-18.4b") return gpt("megatron-18.4b", 40, 6144, 48, 51200, 2048);
  if (name == "megatron-39.1b") return gpt("megatron-39.1b", 48, 8192, 64, 51200, 2048);
  if (name == "megatron-76.1b") return gpt("megatron-76.1b", 60, 10240, 80, 51200, 2048);
  if (name == "megatron-145.6b") return gpt("megatron-145.6b", 80, 12288, 96, 51200, 2048);
  if (name == "megatron-310.1b") return gpt("megatron-310.1b", 96, 16384, 128, 51200, 2048);
  if (name == "megatron-529.6b") return gpt("megatron-529.6b", 105, 20480, 128, 51200, 2048);
  if (name == "megatron-1t") return gpt("megatron-1t", 128, 25600, 160, 51200, 2048);
  // Llama (Touvron et al. 2023) and Llama 2 / 3 (grouped-query attention).
  if (name == "llama-7b") return llama("llama-7b", 32, 4096, 32, 32, 11008, 32000, 2048);
  if (name == "llama-13b") return llama("llama-13b", 40, 5120, 40, 40, 13824, 32000, 2048);
  if (name == "llama2-70b") return llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000, 4096);
  if (name == "llama3-8b") return llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192);
  std::string known;
  for (const auto& n : transformer_preset_names()) known += (known.empty() ? "" : ", ") + n;
  throw std::invalid_argument("unknown model '" + std::string(name) + "' (presets: " + known +
                              "; or a Hugging Face config.json)");
}

TransformerSpec transformer_from_hf_json(const nlohmann::json& json, std::string_view source) {
  if (!json.is_object()) {
    throw std::invalid_argument(std::string(source) + ": a config.json must be a JSON object");
  }
  const auto type_it = json.find("model_type");
  const std::string type =
      type_it != json.end() && type_it->is_string() ? type_it->get<std::string>() : "bert";
  TransformerSpec s;
  s.name = std::filesystem::path(std::string(source)).parent_path().filename().string();
  if (s.name.empty()) s.name = std::filesystem::path(std::string(source)).stem().string();
  if (type == "bert") {
    const std::string name = s.name;
    s = from_bert_config(model::bert_config_from_hf_json(json, source));
    s.name = name;
  } else if (type == "gpt2") {
    s.family = ModelFamily::kGpt;
    s.hidden_size = int_field(json, "n_embd", -1, source);
    s.num_layers = int_field(json, "n_layer", -1, source);
    s.num_heads = int_field(json, "n_head", -1, source);
    s.num_kv_heads = s.num_heads;
    s.intermediate_size = int_field(json, "n_inner", 4 * s.hidden_size, source);
    s.vocab_size = int_field(json, "vocab_size", -1, source);
    s.max_position_embeddings = int_field(json, "n_positions", 1024, source);
    s.tied_head = bool_field(json, "tie_word_embeddings", true, source);
  } else if (type == "llama" || type == "mistral" || type == "qwen2") {
    s = llama(s.name, 1, 1, 1, 1, 1, 1, 1);
    s.hidden_size = int_field(json, "hidden_size", -1, source);
    s.num_layers = int_field(json, "num_hidden_layers", -1, source);
    s.num_heads = int_field(json, "num_attention_heads", -1, source);
    s.num_kv_heads = int_field(json, "num_key_value_heads", s.num_heads, source);
    s.intermediate_size = int_field(json, "intermediate_size", -1, source);
    s.vocab_size = int_field(json, "vocab_size", -1, source);
    s.max_position_embeddings = int_field(json, "max_position_embeddings", 2048, source);
    s.tied_head = bool_field(json, "tie_word_embeddings", false, source);
    s.linear_bias = type == "qwen2";  // Qwen2 has biases on Q, K, V (priced on all: close)
  } else {
    throw std::invalid_argument(std::string(source) + ": model_type '" + type +
                                "' is not supported (bert, gpt2, llama, mistral, qwen2)");
  }
  try {
    s.validate();
  } catch (const std::invalid_argument& error) {
    throw std::invalid_argument(std::string(source) + ": " + error.what());
  }
  return s;
}

TransformerSpec transformer_from_hf_json_file(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) throw std::invalid_argument(path.string() + ": cannot open the file");
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(in);
  } catch (const nlohmann::json::parse_error& error) {
    throw std::invalid_argument(path.string() + ": not valid JSON (" + error.what() + ")");
  }
  return transformer_from_hf_json(json, path.string());
}

TransformerSpec resolve_transformer(std::string_view preset_or_path) {
  const std::string text(preset_or_path);
  if (text.size() > 5 && text.substr(text.size() - 5) == ".json") {
    return transformer_from_hf_json_file(text);
  }
  return transformer_preset(text);
}

double transformer_layer_params(const TransformerSpec& s) {
  const double H = s.hidden_size, I = s.intermediate_size, kv = s.kv_dim();
  const double bias = s.linear_bias ? 1.0 : 0.0;
  const double attention = H * (H + 2.0 * kv) + H * H + bias * (H + 2.0 * kv + H);
  const double mlp_matrices = s.gated_mlp ? 3.0 : 2.0;
  const double mlp = mlp_matrices * H * I + bias * ((mlp_matrices - 1.0) * I + H);
  const double norms = (s.rms_norm ? 1.0 : 2.0) * 2.0 * H;
  return attention + mlp + norms;
}

double transformer_embedding_params(const TransformerSpec& s) {
  const double H = s.hidden_size;
  double rows = s.vocab_size;
  if (s.learned_positions) rows += s.max_position_embeddings;
  if (s.family == ModelFamily::kBert) rows += 2.0;                     // token types
  const double norm = s.family == ModelFamily::kBert ? 2.0 * H : 0.0;  // embedding LayerNorm
  return rows * H + norm;
}

double transformer_head_params(const TransformerSpec& s, bool holds_tied_embeddings) {
  const double H = s.hidden_size, V = s.vocab_size;
  double params = 0.0;
  if (s.family == ModelFamily::kBert) {
    // Pooler, NSP, MLM transform + LayerNorm, decoder bias.
    params = (H * H + H) + (2.0 * H + 2.0) + (H * H + H) + 2.0 * H + V;
  } else {
    params = (s.rms_norm ? 1.0 : 2.0) * H;  // final norm
  }
  if (!(s.tied_head && holds_tied_embeddings)) params += V * H;
  return params;
}

double transformer_total_params(const TransformerSpec& s) {
  return s.num_layers * transformer_layer_params(s) + transformer_embedding_params(s) +
         transformer_head_params(s, true);
}

double transformer_layer_forward_flops_per_token(const TransformerSpec& s, int seq_len) {
  const double H = s.hidden_size, I = s.intermediate_size, kv = s.kv_dim(), S = seq_len;
  const double projections = 2.0 * H * (H + 2.0 * kv) + 2.0 * H * H;
  const double attention = 4.0 * S * H;
  const double mlp = (s.gated_mlp ? 3.0 : 2.0) * 2.0 * H * I;
  return projections + attention + mlp;
}

double transformer_model_flops_per_sequence(const TransformerSpec& s, int seq_len,
                                            int scored_positions) {
  const double H = s.hidden_size, V = s.vocab_size, S = seq_len;
  const double layers = s.num_layers * S * transformer_layer_forward_flops_per_token(s, seq_len);
  double head = 0.0;
  if (s.family == ModelFamily::kBert) {
    head = scored_positions * (2.0 * H * H + 2.0 * H * V) + 2.0 * H * H + 4.0 * H;
  } else {
    head = S * 2.0 * H * V;
  }
  return 3.0 * (layers + head);
}

}  // namespace pf::sim
