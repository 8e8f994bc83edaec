#include "kfac/layer_state.h"

#include <stdexcept>
#include <string>

#include "common/input_error.h"
#include "kfac/factors.h"
#include "kfac/precondition.h"

namespace pf::kfac {

namespace {

void accumulate(FactorState& factor, std::int64_t dim, const float* x, std::int64_t tokens,
                float scale, int unit_begin, int unit_end, const char* which) {
  if (tokens <= 0) {
    throw std::invalid_argument(std::string("accumulate_") + which +
                                ": a micro-batch needs at least one token, got " +
                                std::to_string(tokens));
  }
  const ItemRange rows = piece_items(tokens, unit_begin, unit_end);
  if (factor.sum.size() == 0) factor.sum = Eigen::MatrixXf::Zero(dim, dim);
  if (rows.size() > 0) add_gram_lower(factor.sum, x + rows.begin * dim, rows.size(), dim, scale);
  if (unit_end == kPieceUnits) ++factor.microbatches;
}

void finalize(FactorState& factor, float running_average, const char* which) {
  if (factor.microbatches == 0) {
    throw std::logic_error(std::string("finalize_") + which +
                           ": no micro-batch was accumulated since the last refresh");
  }
  if (!(running_average >= 0.0F && running_average < 1.0F)) {
    throw std::invalid_argument(std::string("finalize_") + which +
                                ": running_average must lie in [0, 1), got " +
                                std::to_string(running_average));
  }
  Eigen::MatrixXf mean = std::move(factor.sum);
  factor.sum = Eigen::MatrixXf();
  mean *= 1.0F / static_cast<float>(factor.microbatches);
  fill_upper_from_lower(mean);
  if (running_average == 0.0F || factor.refreshes == 0) {
    factor.value = std::move(mean);
  } else {
    factor.value = running_average * factor.value + (1.0F - running_average) * mean;
  }
  factor.microbatches = 0;
  ++factor.refreshes;
}

void invert(FactorState& factor, float damping, InverseMethod method, const char* which) {
  if (factor.refreshes == 0) {
    throw std::logic_error(std::string("invert_") + which + ": the factor was never finalized");
  }
  set_inverse(factor, damped_inverse(factor.value, damping, method), damping);
}

}  // namespace

static_assert(kPieceUnits == sched::kPieceUnits, "kfac/ and the IR cut tasks alike");

void set_inverse(FactorState& factor, InverseResult result, float damping) {
  if (factor.refreshes == 0) {
    throw std::logic_error("set_inverse: the factor was never finalized");
  }
  if (result.inverse.rows() != factor.value.rows() ||
      result.inverse.cols() != factor.value.cols()) {
    throw std::invalid_argument(
        "set_inverse: the inverse is " + std::to_string(result.inverse.rows()) + " x " +
        std::to_string(result.inverse.cols()) + ", the factor " +
        std::to_string(factor.value.rows()) + " x " + std::to_string(factor.value.cols()));
  }
  factor.inverse = std::move(result.inverse);
  factor.damping = damping;
  factor.inverted_refresh = factor.refreshes;
  if (result.fell_back_to_eigen) ++factor.cholesky_fallbacks;
}

KfacLayerState::KfacLayerState(std::int64_t in, std::int64_t out) : d_in(in), d_out(out) {
  if (in <= 0 || out <= 0) {
    throw std::invalid_argument("KfacLayerState: dimensions must be positive, got d_in " +
                                std::to_string(in) + ", d_out " + std::to_string(out));
  }
}

void accumulate_a(KfacLayerState& layer, const float* a, std::int64_t tokens, int unit_begin,
                  int unit_end) {
  accumulate(layer.a, layer.d_in, a, tokens, tokens > 0 ? 1.0F / static_cast<float>(tokens) : 0.0F,
             unit_begin, unit_end, "a");
}

void accumulate_b(KfacLayerState& layer, const float* g, std::int64_t tokens,
                  float output_grad_scale, int unit_begin, int unit_end) {
  if (!(output_grad_scale > 0.0F)) {
    throw std::invalid_argument("accumulate_b: output_grad_scale must be > 0, got " +
                                std::to_string(output_grad_scale));
  }
  accumulate(layer.b, layer.d_out, g, tokens, output_grad_scale, unit_begin, unit_end, "b");
}

std::span<float> sync_piece(FactorState& factor, int unit_begin, int unit_end) {
  check_piece_units(unit_begin, unit_end, "sync_piece");
  if (factor.sum.size() == 0) {
    throw std::logic_error("sync_piece: the factor has no accumulated curvature to sync");
  }
  const std::int64_t d = factor.sum.rows();
  const ItemRange columns = piece_items(d, unit_begin, unit_end);
  return {factor.sum.data() + columns.begin * d, static_cast<std::size_t>(columns.size() * d)};
}

void finalize_a(KfacLayerState& layer, float running_average) {
  finalize(layer.a, running_average, "a");
}
void finalize_b(KfacLayerState& layer, float running_average) {
  finalize(layer.b, running_average, "b");
}

FactorDamping layer_damping(const KfacLayerState& layer, float lambda, bool pi_adjusted) {
  if (layer.a.refreshes == 0 || layer.b.refreshes == 0) {
    throw std::logic_error("layer_damping: both factors must be finalized first");
  }
  return factored_damping(layer.a.value, layer.b.value, lambda, pi_adjusted);
}

void invert_a(KfacLayerState& layer, float damping, InverseMethod method) {
  invert(layer.a, damping, method, "a");
}
void invert_b(KfacLayerState& layer, float damping, InverseMethod method) {
  invert(layer.b, damping, method, "b");
}

void precondition_layer(const KfacLayerState& layer, const float* grad_w, const float* grad_b,
                        float* out_w, float* out_b) {
  if (layer.a.inverse.size() == 0 || layer.b.inverse.size() == 0) {
    throw std::logic_error("precondition_layer: both inverses must be computed first");
  }
  precondition(layer.a.inverse, layer.b.inverse, grad_w, grad_b, layer.d_out, layer.d_in, out_w,
               out_b);
}

std::string_view linear_name(sched::LinearKind kind) {
  switch (kind) {
    case sched::LinearKind::kQuery:
      return "query";
    case sched::LinearKind::kKey:
      return "key";
    case sched::LinearKind::kValue:
      return "value";
    case sched::LinearKind::kAttentionOut:
      return "attention_out";
    case sched::LinearKind::kFfnIn:
      return "ffn_in";
    case sched::LinearKind::kFfnOut:
      return "ffn_out";
  }
  return "unknown";
}

std::string layer_record_prefix(std::string_view prefix, LayerKey key) {
  return std::string(prefix) + ".layer." + std::to_string(key.layer) + "." +
         std::string(linear_name(key.linear));
}

KfacLayerState& KfacState::add_layer(LayerKey key, std::int64_t d_in, std::int64_t d_out) {
  const auto it = layers_.find(key);
  if (it != layers_.end()) {
    if (it->second.d_in != d_in || it->second.d_out != d_out) {
      throw std::invalid_argument("KfacState: " + layer_record_prefix("kfac", key) +
                                  " already exists with other dimensions");
    }
    return it->second;
  }
  return layers_.emplace(key, KfacLayerState(d_in, d_out)).first->second;
}

KfacLayerState& KfacState::at(LayerKey key) {
  const auto it = layers_.find(key);
  if (it == layers_.end()) {
    throw std::out_of_range("KfacState: no layer " + layer_record_prefix("kfac", key));
  }
  return it->second;
}

const KfacLayerState& KfacState::at(LayerKey key) const {
  return const_cast<KfacState&>(*this).at(key);  // NOLINT: same lookup, const result
}

std::vector<ckpt::TensorRecord> KfacState::state_records(std::string_view prefix) const {
  std::vector<ckpt::TensorRecord> records;
  const auto add_matrix = [&](const std::string& name, const Eigen::MatrixXf& matrix) {
    if (matrix.size() == 0) return;
    // Symmetric or lower-triangular square matrices: column-major storage of the lower triangle
    // is the row-major storage of the upper one, so the sum is transposed to stay row-major.
    const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> row_major = matrix;
    records.push_back(ckpt::make_f32_record(
        name, {row_major.rows(), row_major.cols()},
        std::span<const float>(row_major.data(), static_cast<std::size_t>(row_major.size()))));
  };
  for (const auto& [key, layer] : layers_) {
    const auto base = layer_record_prefix(prefix, key);
    add_matrix(base + ".A", layer.a.value);
    add_matrix(base + ".B", layer.b.value);
    add_matrix(base + ".A_inv", layer.a.inverse);
    add_matrix(base + ".B_inv", layer.b.inverse);
    add_matrix(base + ".A_sum", layer.a.sum);
    add_matrix(base + ".B_sum", layer.b.sum);
    const std::int64_t counters[] = {layer.a.microbatches,     layer.a.refreshes,
                                     layer.a.inverted_refresh, layer.a.cholesky_fallbacks,
                                     layer.b.microbatches,     layer.b.refreshes,
                                     layer.b.inverted_refresh, layer.b.cholesky_fallbacks};
    records.push_back(ckpt::make_i64_record(base + ".counters", {2, 4}, counters));
    const float damping[] = {layer.a.damping, layer.b.damping};
    records.push_back(ckpt::make_f32_record(base + ".damping", {2}, damping));
  }
  return records;
}

void KfacState::load_state(const ckpt::SafetensorsFile& file, std::string_view prefix) {
  std::map<LayerKey, KfacLayerState> restored = layers_;
  const std::string source =
      file.source.empty() ? std::string("safetensors") : "safetensors '" + file.source + "'";
  for (auto& [key, layer] : restored) {
    const auto base = layer_record_prefix(prefix, key);
    const std::int64_t counter_shape[] = {2, 4};
    const auto counters = ckpt::read_i64(file, base + ".counters", counter_shape);
    const std::int64_t damping_shape[] = {2};
    const auto damping = ckpt::read_f32(file, base + ".damping", damping_shape);
    for (int index = 0; index < 2; ++index) {
      FactorState& factor = index == 0 ? layer.a : layer.b;
      const std::int64_t dim = index == 0 ? layer.d_in : layer.d_out;
      const std::string letter = index == 0 ? "A" : "B";
      const auto* c = counters.data() + 4 * index;
      for (int k = 0; k < 4; ++k) {
        if (c[k] < 0) {
          throw InputError(source + ": kfac state '" + base + ".counters' has a negative entry");
        }
      }
      const std::int64_t shape[] = {dim, dim};
      // kRequired: the counters say it exists; kAbsent: they say it does not; kOptional: a sum
      // with no whole micro-batch yet exists when the first pieces of a divided curvature task
      // ran before the save and the rest run after it (a checkpoint inside a refresh window).
      enum class Expect { kRequired, kAbsent, kOptional };
      const auto read_matrix = [&](const std::string& suffix, Expect expect) {
        const auto name = base + "." + letter + suffix;
        const bool present = file.tensors.count(name) > 0;
        if (expect == Expect::kAbsent && present) {
          throw InputError(source + ": kfac state '" + name +
                           "' is present but the counters say it should not be");
        }
        if (expect != Expect::kRequired && !present) return Eigen::MatrixXf();
        const auto values = ckpt::read_f32(file, name, shape);
        return Eigen::MatrixXf(
            Eigen::Map<const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>(
                values.data(), dim, dim));
      };
      factor.microbatches = c[0];
      factor.refreshes = c[1];
      factor.inverted_refresh = c[2];
      factor.cholesky_fallbacks = c[3];
      factor.damping = damping[static_cast<std::size_t>(index)];
      const auto expect = [](bool counted) {
        return counted ? Expect::kRequired : Expect::kAbsent;
      };
      factor.value = read_matrix("", expect(factor.refreshes > 0));
      // A replica that never refreshes the factor may hold its inverse, received from the
      // layer's owner (factors sharded across data-parallel replicas, kfac/state_placement.h).
      factor.inverse = read_matrix("_inv", factor.inverted_refresh > 0 ? Expect::kRequired
                                           : factor.refreshes == 0     ? Expect::kOptional
                                                                       : Expect::kAbsent);
      factor.sum =
          read_matrix("_sum", factor.microbatches > 0 ? Expect::kRequired : Expect::kOptional);
    }
  }
  layers_ = std::move(restored);
}

}  // namespace pf::kfac
