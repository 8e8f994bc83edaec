#include "runtime/model/hf_weights.h"

#include <algorithm>
#include <fstream>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "common/input_error.h"

namespace pf::model {
namespace {

constexpr const char* kDecoderBias = "cls.predictions.decoder.bias";

// Other spellings of a tensor found in published checkpoints: LayerNorm gamma/beta (converted
// from TensorFlow) and a bare BertModel without the "bert." prefix.
std::vector<std::string> alternative_names(const std::string& name) {
  std::vector<std::string> names;
  auto replace_suffix = [&](const std::string& from, const std::string& to) {
    if (name.size() >= from.size() &&
        name.compare(name.size() - from.size(), from.size(), from) == 0) {
      names.push_back(name.substr(0, name.size() - from.size()) + to);
    }
  };
  replace_suffix("LayerNorm.weight", "LayerNorm.gamma");
  replace_suffix("LayerNorm.bias", "LayerNorm.beta");
  const std::string prefix = "bert.";
  if (name.rfind(prefix, 0) == 0) names.push_back(name.substr(prefix.size()));
  return names;
}

// A parameter's values on the host: read through the chunk's backend, so that a device's
// parameters are downloaded (after the work issued on the chunk's stream so far).
template <typename T>
std::vector<T> host_values(BertChunk<T>& chunk, const ParameterView<T>& p) {
  std::vector<T> host(static_cast<std::size_t>(p.size));
  chunk.backend().copy(host.data(), p.value, host.size() * sizeof(T),
                       tensor::CopyKind::kDeviceToHost, chunk.stream());
  chunk.ops().synchronize();
  return host;
}

}  // namespace

template <typename T>
void load_hf_weights(const ckpt::SafetensorsFile& file, BertChunk<T>& chunk) {
  const auto [word_name, decoder_name] = tied_parameter_names();
  for (auto& p : chunk.parameters()) {
    std::string source = p.name;
    if (p.name == decoder_name && !file.tensors.contains(decoder_name)) source = word_name;
    if (!file.tensors.contains(source)) {
      for (const auto& alternative : alternative_names(source)) {
        if (file.tensors.contains(alternative)) {
          source = alternative;
          break;
        }
      }
    }
    const auto values = ckpt::read_as_f32(file, source, p.shape);
    std::vector<T> host(values.size());
    std::transform(values.begin(), values.end(), host.begin(),
                   [](float v) { return static_cast<T>(v); });
    // Through the backend: uploaded on the chunk's stream when the parameters are on a device.
    chunk.backend().copy(p.value, host.data(), host.size() * sizeof(T),
                         tensor::CopyKind::kHostToDevice, chunk.stream());
    chunk.ops().synchronize();  // `host` is freed
  }
  // A file with both tied names must agree, or one of them would be silently dropped.
  if (file.tensors.contains(decoder_name) && file.tensors.contains(word_name)) {
    if (auto word = chunk.parameter(word_name)) {
      const auto decoder = ckpt::read_as_f32(file, decoder_name, word->shape);
      const auto loaded = host_values(chunk, *word);
      for (std::int64_t i = 0; i < word->size; ++i) {
        const auto index = static_cast<std::size_t>(i);
        if (static_cast<float>(loaded[index]) != decoder[index]) {
          throw InputError("safetensors '" + file.source + "': tensor '" +
                           std::string(decoder_name) + "' differs from '" + std::string(word_name) +
                           "' at element " + std::to_string(i) +
                           ": the decoder is tied to the word embeddings");
        }
      }
    }
  }
}

template <typename T>
std::vector<ckpt::TensorRecord> hf_weight_records(std::span<BertChunk<T>* const> chunks) {
  const auto [word_name, decoder_name] = tied_parameter_names();
  std::map<std::string, ckpt::TensorRecord> records;
  for (auto* chunk : chunks) {
    for (const auto& p : chunk->parameters()) {
      const auto host = host_values(*chunk, p);
      std::vector<float> values(host.size());
      std::transform(host.begin(), host.end(), values.begin(),
                     [](T v) { return static_cast<float>(v); });
      if (records.contains(p.name)) {
        throw std::invalid_argument("hf weights: parameter '" + p.name + "' is in two chunks");
      }
      records.emplace(p.name, ckpt::make_f32_record(p.name, p.shape, values));
    }
  }
  if (records.contains(word_name) && !records.contains(decoder_name) &&
      records.contains("cls.predictions.bias")) {
    auto copy = records.at(word_name);
    copy.name = decoder_name;
    records.emplace(decoder_name, std::move(copy));
  }
  if (records.contains(word_name) && records.contains(decoder_name) &&
      records.at(word_name).data != records.at(decoder_name).data) {
    throw std::invalid_argument("hf weights: the tied copies '" + word_name + "' and '" +
                                decoder_name + "' differ");
  }
  if (records.contains("cls.predictions.bias")) {
    auto copy = records.at("cls.predictions.bias");
    copy.name = kDecoderBias;
    records.emplace(kDecoderBias, std::move(copy));
  }
  std::vector<ckpt::TensorRecord> result;
  result.reserve(records.size());
  for (auto& [name, record] : records) result.push_back(std::move(record));
  return result;
}

template <typename T>
void save_hf_weights(const std::filesystem::path& path, std::span<BertChunk<T>* const> chunks,
                     const std::filesystem::path& config_json) {
  if (chunks.empty()) throw std::invalid_argument("save_hf_weights: no chunks");
  ckpt::save_safetensors(path, hf_weight_records(chunks), {{"format", "pt"}});
  if (!config_json.empty()) {
    std::ofstream out(config_json);
    if (!out) throw InputError("cannot write '" + config_json.string() + "'");
    out << bert_config_to_hf_json(chunks.front()->config()).dump(2) << "\n";
    if (!out) throw InputError("error writing '" + config_json.string() + "'");
  }
}

template void load_hf_weights<float>(const ckpt::SafetensorsFile&, BertChunk<float>&);
template void load_hf_weights<double>(const ckpt::SafetensorsFile&, BertChunk<double>&);
template std::vector<ckpt::TensorRecord> hf_weight_records<float>(
    std::span<BertChunk<float>* const>);
template std::vector<ckpt::TensorRecord> hf_weight_records<double>(
    std::span<BertChunk<double>* const>);
template void save_hf_weights<float>(const std::filesystem::path&,
                                     std::span<BertChunk<float>* const>,
                                     const std::filesystem::path&);
template void save_hf_weights<double>(const std::filesystem::path&,
                                      std::span<BertChunk<double>* const>,
                                      const std::filesystem::path&);

}  // namespace pf::model
