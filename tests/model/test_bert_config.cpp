// Hugging Face config.json reading: every size range-checked before it is used or narrowed.
#include <gtest/gtest.h>

#include <string>

#include <nlohmann/json.hpp>

#include "runtime/model/bert_config.h"

namespace pf::model {
namespace {

std::string error_of(const nlohmann::json& json) {
  try {
    bert_config_from_hf_json(json, "config.json");
  } catch (const std::invalid_argument& error) {
    return error.what();
  }
  return "accepted";
}

nlohmann::json base_config() {
  return bert_config_to_hf_json(bert_preset("base"));
}

TEST(BertConfigJson, RoundTripOfEveryPreset) {
  for (const auto& name : bert_preset_names()) {
    BertConfig preset = bert_preset(name);
    BertConfig back = bert_config_from_hf_json(bert_config_to_hf_json(preset), "config.json");
    back.name = preset.name;
    EXPECT_EQ(back, preset) << name;
  }
}

// Issue #16 defect 1: the default intermediate_size = 4 * hidden_size overflowed int (UBSan:
// "4 * 600000000") before any validation; now hidden_size is refused first, by name.
TEST(BertConfigJson, PresetsAlsoAnswerToTheirBertPrefixedNames) {
  for (const auto& name : bert_preset_names())
    EXPECT_EQ(bert_preset("bert-" + name), bert_preset(name));
  for (const char* bad : {"bert-", "bert-huge", "bert-bert-base", "Base"}) {
    try {
      (void)bert_preset(bad);
      ADD_FAILURE() << "accepted preset '" << bad << "'";
    } catch (const std::invalid_argument& error) {
      EXPECT_NE(std::string(error.what()).find("unknown BERT preset '" + std::string(bad) + "'"),
                std::string::npos)
          << error.what();
    }
  }
}

TEST(BertConfigJson, HugeHiddenSizeIsRefusedBeforeAnyArithmetic) {
  nlohmann::json j = base_config();
  j["hidden_size"] = 600000000;
  j.erase("intermediate_size");
  EXPECT_EQ(error_of(j),
            "config.json: field 'hidden_size' = 600000000 (allowed: an integer in [1, 1048576])");
}

// Issue #16 defect 2: 4294967297 layers was narrowed to int and silently read as 1 layer.
TEST(BertConfigJson, SixtyFourBitLayerCountIsAnErrorNotOneLayer) {
  nlohmann::json j = base_config();
  j["num_hidden_layers"] = 4294967297;
  EXPECT_EQ(error_of(j),
            "config.json: field 'num_hidden_layers' = 4294967297 (allowed: an integer in [1, "
            "4096])");
  j["num_hidden_layers"] = -4294967295;  // narrows to 1 as well
  EXPECT_NE(error_of(j).find("num_hidden_layers' = -4294967295"), std::string::npos);
}

TEST(BertConfigJson, EverySizeIsBoundedAndTyped) {
  for (const char* field :
       {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
        "intermediate_size", "max_position_embeddings", "type_vocab_size", "pad_token_id"}) {
    nlohmann::json j = base_config();
    j[field] = 1LL << 40;
    EXPECT_NE(error_of(j).find(std::string("field '") + field + "' = 1099511627776 (allowed:"),
              std::string::npos)
        << field << ": " << error_of(j);
    j[field] = 2.5;
    EXPECT_NE(error_of(j).find(std::string("field '") + field + "' = 2.5"), std::string::npos)
        << field;
  }
  nlohmann::json j = base_config();
  j["layer_norm_eps"] = 1e300;  // an infinite float
  EXPECT_EQ(error_of(j), "config.json: field 'layer_norm_eps' = 1e+300 (allowed: a finite number)");
  j = base_config();
  j["pad_token_id"] = nullptr;
  EXPECT_EQ(bert_config_from_hf_json(j, "config.json").pad_token_id, -1);
}

}  // namespace
}  // namespace pf::model
