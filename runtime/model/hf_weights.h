#pragma once
// Weights in safetensors files with Hugging Face BertForPreTraining tensor names (Linear
// weights [out, in]), so that a checkpoint written here opens in transformers and a Hugging Face
// checkpoint loads here. The chunks may live on any device: their parameters are read and written
// through the chunk's backend (downloaded from / uploaded to a GPU on the chunk's stream).
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "runtime/checkpoint/safetensors.h"
#include "runtime/model/bert_chunk.h"

namespace pf::model {

// Loads every parameter of `chunk` from `file` (F32, F16, BF16 or F64 data, converted). The
// head chunk's decoder copy comes from "cls.predictions.decoder.weight" or, when the file has
// none (transformers drops tied tensors), from the word embeddings. Throws std::runtime_error
// naming the tensor that is missing, mis-shaped or of an unsupported dtype, or a decoder weight
// that differs from the word embeddings. Older spellings are accepted when the Hugging Face name
// is absent: "LayerNorm.gamma"/"LayerNorm.beta" and names without the "bert." prefix (a bare
// BertModel file). Tensors of other chunks and buffers such as
// "bert.embeddings.position_ids" are ignored.
template <typename T>
void load_hf_weights(const ckpt::SafetensorsFile& file, BertChunk<T>& chunk);

// F32 records of all parameters of all chunks under their Hugging Face names, plus the tied
// copies transformers' state_dict also has ("cls.predictions.decoder.weight",
// "cls.predictions.decoder.bias"). The two tied copies of split models must be equal.
template <typename T>
std::vector<ckpt::TensorRecord> hf_weight_records(std::span<BertChunk<T>* const> chunks);

// Writes the safetensors file (metadata {"format": "pt"}, which transformers requires) and,
// when config_json is not empty, the Hugging Face config.json beside it.
template <typename T>
void save_hf_weights(const std::filesystem::path& path, std::span<BertChunk<T>* const> chunks,
                     const std::filesystem::path& config_json = {});

}  // namespace pf::model
