#pragma once
// The transformer families the parallel cost model prices: BERT-style encoders, GPT-style decoders
// (causal attention, learned positions, LayerNorm, GELU MLP, tied or untied LM head) and
// Llama-style decoders (RMSNorm, gated SiLU MLP, grouped-query attention, rotary positions, no
// biases). Read from presets or a Hugging Face config.json (model_type bert, gpt2, llama,
// mistral, qwen2). Per-layer FLOPs and parameters are written out in docs/scale.md.
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "runtime/model/bert_config.h"

namespace pf::sim {

enum class ModelFamily { kBert, kGpt, kLlama };
std::string_view to_string(ModelFamily family);

struct TransformerSpec {
  std::string name = "custom";
  ModelFamily family = ModelFamily::kGpt;
  int vocab_size = 50257;
  int hidden_size = 768;
  int num_layers = 12;
  int num_heads = 12;
  int num_kv_heads = 12;  // grouped-query attention: heads sharing one key/value head
  int intermediate_size = 3072;
  int max_position_embeddings = 1024;
  bool gated_mlp = false;         // Llama: down(silu(gate x) * up x)
  bool rms_norm = false;          // RMSNorm (no bias, no mean) instead of LayerNorm
  bool linear_bias = true;        // Linears carry biases (BERT, GPT; not Llama)
  bool dropout = true;            // hidden and attention dropout (BERT, GPT; not Llama)
  bool causal = true;             // decoder mask; priced as the full S x S products (no skipping)
  bool tied_head = true;          // LM head shares the word embedding
  bool learned_positions = true;  // a position table (BERT, GPT); Llama's rotary has none

  int head_dim() const { return hidden_size / num_heads; }
  int kv_dim() const { return num_kv_heads * head_dim(); }
  // Throws std::invalid_argument naming the field.
  void validate() const;
  friend bool operator==(const TransformerSpec&, const TransformerSpec&) = default;
};

// Presets: the BERT ones (tiny ... large; also "bert-base", "bert-large"), gpt2, gpt2-medium,
// gpt2-large, gpt2-xl, gpt3-125m ... gpt3-175b, the Megatron-LM PTD-P paper's GPT models
// (megatron-1.7b ... megatron-1t), llama-7b, llama-13b, llama2-70b, llama3-8b.
TransformerSpec transformer_preset(std::string_view name);
std::vector<std::string> transformer_preset_names();

TransformerSpec transformer_from_hf_json(const nlohmann::json& json, std::string_view source);
TransformerSpec transformer_from_hf_json_file(const std::filesystem::path& path);
// A preset name or a path to config.json; errors list the presets.
TransformerSpec resolve_transformer(std::string_view preset_or_path);
TransformerSpec from_bert_config(const model::BertConfig& config);

// Parameters (full model, before tensor-parallel sharding).
double transformer_layer_params(const TransformerSpec& s);
double transformer_embedding_params(const TransformerSpec& s);  // word (+ positions, types)
// Final norm, LM head (V x H unless tied to embeddings held on the same chunk), BERT's
// transform and pooler.
double transformer_head_params(const TransformerSpec& s, bool holds_tied_embeddings);
double transformer_total_params(const TransformerSpec& s);

// Forward matrix-product FLOPs per token (t = 1): layer = 2 (H q + 2 H kv + H q) for the
// projections + 4 S H for the attention products + 2 H I (2 or 3 matrices) for the MLP; the
// head 2 H V (BERT: per scored position, with the transform).
double transformer_layer_forward_flops_per_token(const TransformerSpec& s, int seq_len);
// Model FLOPs of one sequence, forward + backward (3x forward), as MFU counts them.
double transformer_model_flops_per_sequence(const TransformerSpec& s, int seq_len,
                                            int scored_positions);

}  // namespace pf::sim
