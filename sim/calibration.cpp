#include "sim/calibration.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <fstream>
#include <functional>
#include <optional>
#include <set>
#include <stdexcept>
#include <string_view>

#include "common/json_fields.h"
#include "runtime/model/bert_config.h"
#include "sim/bert_kernels.h"
#include "sim/kfac_kernels.h"

namespace pf::sim {
namespace {

constexpr const char* kOperations =
    "layer_forward, layer_backward, layer_curvature, layer_inversion, layer_precondition, "
    "chunk_forward, chunk_backward, chunk_forward_backward, curvature, precondition, "
    "optimizer_step, gemm, attention, "
    "memory, cholesky_inverse, eigen_inverse";

// The memory class's per-element compute terms, in FitParameter::kElementWork's index order.
constexpr std::array<std::string_view, 4> kElementWorkFields = {
    "element_flop_s", "exponential_s", "error_function_s", "random_number_s"};

template <class Rate>  // ClassRate or const ClassRate
auto& element_work_rate(Rate& memory, int index) {
  switch (index) {
    case 0:
      return memory.element_flop_s;
    case 1:
    case kExpAndErfTogether:  // both hold the value; exponential_s stands for it
      return memory.exponential_s;
    case 2:
      return memory.error_function_s;
    default:
      return memory.random_number_s;
  }
}

class RecordReader {
 public:
  RecordReader(const nlohmann::json& record, std::string where)
      : record_(record), where_(std::move(where)) {}

  double number(const char* field, bool positive = true) const {
    const auto it = record_.find(field);
    if (it == record_.end()) fail(field, "is missing");
    if (!it->is_number()) fail(field, "must be a number, got " + it->dump());
    const double value = it->get<double>();
    if (!std::isfinite(value) || value < 0.0 || (positive && value == 0.0)) {
      fail(field, "= " + it->dump() + " (must be finite and " + (positive ? "> 0" : ">= 0") + ")");
    }
    return value;
  }
  int integer(const char* field, int fallback, int max) const {
    if (!record_.contains(field)) return fallback;
    const double value = number(field);
    if (value != std::floor(value) || value > max) {
      fail(field, "= " + record_.at(field).dump() + " (must be an integer in [1, " +
                      std::to_string(max) + "])");
    }
    return static_cast<int>(value);
  }
  std::string text(const char* field, const char* fallback) const {
    const auto it = record_.find(field);
    if (it == record_.end()) {
      if (fallback == nullptr) fail(field, "is missing");
      return fallback;
    }
    if (!it->is_string()) fail(field, "must be a string, got " + it->dump());
    return it->get<std::string>();
  }
  bool flag(const char* field, bool fallback) const {
    const auto it = record_.find(field);
    if (it == record_.end()) return fallback;
    if (!it->is_boolean()) fail(field, "must be true or false, got " + it->dump());
    return it->get<bool>();
  }
  Precision precision() const {
    const std::string name = text("precision", "fp32");
    try {
      return precision_from_string(name);
    } catch (const std::invalid_argument& e) {
      fail("precision", e.what());
    }
  }
  // "storage_precision": what activations and gradients are stored in, when not the products'
  // precision (pipefisher_train: fp32 with bf16 products).
  std::optional<Precision> storage() const {
    if (!record_.contains("storage_precision")) return std::nullopt;
    const std::string name = text("storage_precision", nullptr);
    try {
      return precision_from_string(name);
    } catch (const std::invalid_argument& e) {
      fail("storage_precision", e.what());
    }
  }
  // "attention": how the run's attention core ran ("batched" when absent, or "fused").
  AttentionAlgorithm attention() const {
    const std::string name = text("attention", "batched");
    try {
      return attention_from_string(name);
    } catch (const std::invalid_argument& e) {
      fail("attention", e.what());
    }
  }
  [[noreturn]] void fail(const std::string& field, const std::string& what) const {
    throw std::invalid_argument(where_ + ".'" + field + "' " + what);
  }
  const std::string& where() const { return where_; }

 private:
  const nlohmann::json& record_;
  std::string where_;
};

std::string compact(double value) {
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "%g", value);
  return buffer;
}

Workload layer_workload(const nlohmann::json& record, const RecordReader& r) {
  Workload w;
  const auto inline_config = record.find("model");
  if (inline_config != record.end() && inline_config->is_object()) {
    // A Hugging Face config written into the record (pipefisher_train --calibration-out).
    try {
      w.config = model::bert_config_from_hf_json(*inline_config, r.where() + ".'model'");
    } catch (const std::exception& e) {
      r.fail("model", e.what());
    }
    // Named by its shape in the labels (the config's name is the record's position).
    w.config.name = std::to_string(w.config.num_layers) + "x" +
                    std::to_string(w.config.hidden_size) + " V" +
                    std::to_string(w.config.vocab_size);
  } else {
    const std::string model = r.text("model", nullptr);
    try {
      const bool is_file = model.size() > 5 && model.substr(model.size() - 5) == ".json";
      w.config = is_file ? model::bert_config_from_hf_json(model) : model::bert_preset(model);
    } catch (const std::exception& e) {
      r.fail("model", e.what());
    }
  }
  w.seq_len = r.integer("seq_len", 128, 1 << 20);
  w.micro_batch_size = r.integer("micro_batch_size", 0, 1 << 20);
  w.precision = r.precision();
  w.storage_precision = r.storage();
  w.attention = r.attention();
  try {
    w.validate();
  } catch (const std::invalid_argument& e) {
    r.fail("micro_batch_size", e.what());
  }
  return w;
}

void append(Kernels& to, const Kernels& from) {
  to.insert(to.end(), from.begin(), from.end());
}

Measurement parse_record(const nlohmann::json& record, const std::string& where,
                         const DeviceSpec& device) {
  const RecordReader r(record, where);
  Measurement m;
  m.record = record;
  m.operation = r.text("operation", nullptr);
  m.seconds = r.number("seconds");
  const std::string& op = m.operation;
  if (op == "chunk_forward" || op == "chunk_backward" || op == "chunk_forward_backward") {
    // A pipeline chunk as the runtime runs it: `layers` encoder layers, with the embeddings in
    // front and/or the heads behind; the analytic cost model's pieces in its issue order.
    const Workload w = layer_workload(record, r);
    (void)device.peak_flops(w.precision);
    const int layers = record.contains("layers") ? r.integer("layers", 0, 1 << 12) : 0;
    const bool embeddings = r.flag("embeddings", false), head = r.flag("head", false);
    if (layers == 0 && !embeddings && !head) {
      r.fail("layers", "is 0 and the chunk has neither embeddings nor head: nothing to time");
    }
    const PieceKernels layer = encoder_layer_kernels(w);
    const PieceKernels front = embeddings_kernels(w);
    const PieceKernels back = heads_kernels(w);
    Kernels forward;
    if (embeddings) append(forward, front.forward);
    for (int i = 0; i < layers; ++i) append(forward, layer.forward);
    if (head) append(forward, back.forward);
    if (op == "chunk_forward") {
      m.timed = std::move(forward);
    } else {
      // chunk_backward: the backward instruction alone, priced as the simulator prices it (from
      // an empty queue: the run-ahead the runtime's host may have gained during the forward is
      // not credited, docs/simulator.md "One price for an instruction");
      // chunk_forward_backward: both timed (a harness with one pair of events around a forward
      // and its backward), the sum of the two instructions.
      Kernels& to = op == "chunk_backward" ? m.timed : m.backward;
      const auto backward = [&](const PieceKernels& piece) {
        append(to, piece.backward_input);
        append(to, piece.backward_weight);
      };
      if (op == "chunk_forward_backward") m.timed = std::move(forward);
      if (head) backward(back);
      for (int i = 0; i < layers; ++i) backward(layer);
      if (embeddings) backward(front);
      m.timed_backward = op == "chunk_backward";
    }
    m.label = op + " " + w.config.name + " b=" + std::to_string(w.micro_batch_size) + " " +
              std::to_string(layers) + "L" + (embeddings ? "+emb" : "") + (head ? "+head" : "") +
              " " + std::string(to_string(w.precision));
    return m;
  }
  if (op.rfind("layer_", 0) == 0) {
    const Workload w = layer_workload(record, r);
    LayerKernelOptions options;
    options.input_requires_grad = r.flag("input_requires_grad", true);
    options.separate_grad_accumulation = r.flag("separate_grad_accumulation", false);
    m.label = op + " " + w.config.name + " b=" + std::to_string(w.micro_batch_size);
    (void)device.peak_flops(w.precision);  // throws naming the device and precision
    const Precision products = kfac_product_precision(device, w.precision);
    const double T = w.tokens(), e = w.storage_bytes();
    std::vector<LinearDims> linears;
    for (int i = 0; i < sched::kNumLinearKinds; ++i) {
      linears.push_back(linear_dims(w.config, static_cast<sched::LinearKind>(i)));
    }
    const PieceKernels layer = encoder_layer_kernels(w, options);
    if (op == "layer_forward") {
      m.timed = layer.forward;
    } else if (op == "layer_backward") {
      m.before = layer.forward;
      m.timed = layer.backward_input;
      append(m.timed, layer.backward_weight);
      m.timed_backward = true;
    } else if (op == "layer_curvature") {
      // Timed after the micro-batch's forward and backward, which produce what the factors are
      // computed from (PipeFisher's harness times forward + backward + curvature less forward +
      // backward: the curvature's launches queue behind the backward's device work).
      m.before = layer.forward;
      m.before_backward = layer.backward_input;
      append(m.before_backward, layer.backward_weight);
      const bool running_average = r.flag("running_average", true);
      for (const auto& d : linears) {
        append(m.timed, curvature_kernels(products, T, d.in, e, running_average));
        append(m.timed, curvature_kernels(products, T, d.out, e, running_average));
      }
    } else if (op == "layer_inversion") {
      for (const auto& d : linears) {
        append(m.timed, inversion_kernels(d.in));
        append(m.timed, inversion_kernels(d.out));
      }
    } else if (op == "layer_precondition") {
      for (const auto& d : linears) append(m.timed, precondition_kernels(products, d.in, d.out));
    } else {
      r.fail("operation", "= \"" + op + "\" (allowed: " + kOperations + ")");
    }
    return m;
  }
  const int count = r.integer("count", 1, kMaxMeasurementCount);
  if (op == "gemm" || op == "attention") {
    const Precision p = r.precision();
    (void)device.peak_flops(p);
    const double batch = op == "attention" ? r.number("batch") : 1.0;
    const double mm = r.number("m"), n = r.number("n"), k = r.number("k");
    Kernel kernel = gemm_kernel(p, mm, n, k, element_bytes(p), count);
    kernel.flops *= batch;
    kernel.bytes *= batch;
    if (op == "attention") kernel.op_class = OpClass::kAttention;
    m.timed = {kernel};
    m.label = op + " " + (op == "attention" ? compact(batch) + "x" : "") + compact(mm) + "x" +
              compact(n) + "x" + compact(k) + " " + std::string(to_string(p));
  } else if (op == "memory") {
    auto optional = [&](const char* field) {
      return record.contains(field) ? r.number(field, false) : 0.0;
    };
    if (record.contains("special_functions")) {
      r.fail("special_functions",
             "is no longer read: give exp and tanh evaluations as \"exponentials\" and erf "
             "evaluations as \"error_functions\" (they are priced apart)");
    }
    const ElementWork work{.flops = optional("flops"),
                           .exponentials = optional("exponentials"),
                           .error_functions = optional("error_functions"),
                           .random_numbers = optional("random_numbers")};
    m.timed = {elementwise_kernel(r.number("bytes"), work, count)};
    m.label = "memory " + r.text("name", "") + " " + compact(r.number("bytes")) + " B";
  } else if (op == "curvature" || op == "precondition") {
    // One K-FAC factor of one micro-batch (rows x order), or one Linear's preconditioning.
    const Precision p = r.precision();
    (void)device.peak_flops(p);
    const Precision products = kfac_product_precision(device, p);
    if (op == "curvature") {
      const double rows = r.number("rows"), order = r.number("order");
      const double e = element_bytes(r.storage().value_or(p));
      for (int i = 0; i < count; ++i) append(m.timed, curvature_kernels(products, rows, order, e));
      m.label = "curvature " + compact(rows) + "x" + compact(order);
    } else {
      const double d_in = r.number("d_in"), d_out = r.number("d_out");
      for (int i = 0; i < count; ++i) append(m.timed, precondition_kernels(products, d_in, d_out));
      m.label = "precondition " + compact(d_out) + "x" + compact(d_in);
    }
  } else if (op == "optimizer_step") {
    m.timed = {optimizer_step_kernel(r.number("params"), count)};
    m.label = "optimizer_step " + compact(r.number("params")) + " parameters";
  } else if (op == "cholesky_inverse" || op == "eigen_inverse") {
    const double order = r.number("order");
    for (int i = 0; i < count; ++i) {
      append(m.timed, inversion_kernels(order, op == "cholesky_inverse" ? KfacInversion::kCholesky
                                                                        : KfacInversion::kEigen));
    }
    m.label = op + " d=" + compact(order);
  } else {
    r.fail("operation", "= \"" + op + "\" (allowed: " + kOperations + ")");
  }
  return m;
}

std::string as_text(const nlohmann::json& value) {
  if (value.is_string()) return value.get<std::string>();
  if (value.is_number()) return compact(value.get<double>());
  return value.dump();
}

// Range of a positive parameter's logarithm: times in seconds (up to e^5), sizes (1e-4 ... 1e13
// elements or bytes), exponents of the size curve (0.1 ... 10).
std::pair<double, double> log_range(const FitParameter& p) {
  switch (p.kind) {
    case FitParameter::Kind::kHalfEfficiencySize:  // sizes, or bytes for the memory class
    case FitParameter::Kind::kOuterCacheBytes:
      return {std::log(1e-4), std::log(1e13)};
    case FitParameter::Kind::kSizeExponent:
      // Up to 2 for the FLOP classes: a steeper curve is a step that a few sizes cannot place
      // and that extrapolates to absurd times below the smallest measured size (a 2-column
      // classifier product); the caches' cliff may be steeper.
      return {std::log(0.25), std::log(p.index == static_cast<int>(OpClass::kMemory) ? 8.0 : 2.0)};
    case FitParameter::Kind::kCacheSlowdown:  // of slowdown - 1
    case FitParameter::Kind::kOuterCacheSlowdown:
      return {std::log(1e-3), std::log(1e3)};
    case FitParameter::Kind::kRooflineExponent:  // of exponent - 1: from near the sum to the max
      return {std::log(1e-2), std::log(1e2)};
    default:
      return {-40.0, 5.0};
  }
}

// Fitted parameters live in an unconstrained space: efficiencies through a logistic, the rest
// (times, sizes, exponents) through exp.
bool is_curve(const FitParameter& p) {
  return p.kind == FitParameter::Kind::kHalfEfficiencySize ||
         p.kind == FitParameter::Kind::kSizeExponent ||
         p.kind == FitParameter::Kind::kCacheSlowdown ||
         p.kind == FitParameter::Kind::kOuterCacheBytes ||
         p.kind == FitParameter::Kind::kOuterCacheSlowdown ||
         p.kind == FitParameter::Kind::kRooflineExponent;
}

// The slowdown beyond the caches and the roofline exponent are >= 1: each is fitted as
// log(value - 1).
double offset(const FitParameter& p) {
  return p.kind == FitParameter::Kind::kCacheSlowdown ||
                 p.kind == FitParameter::Kind::kOuterCacheSlowdown ||
                 p.kind == FitParameter::Kind::kRooflineExponent
             ? 1.0
             : 0.0;
}

double to_free(const FitParameter& p, double value) {
  if (p.is_efficiency()) {
    const double e = std::clamp(value, 1e-4, 1.0 - 1e-4);
    return std::log(e / (1.0 - e));
  }
  const auto [lo, hi] = log_range(p);
  // A roofline exponent of 0 means the max of the two terms: the top of its range, not the sum.
  if (p.kind == FitParameter::Kind::kRooflineExponent && value == 0.0)
    value = offset(p) + std::exp(hi);
  const double log_value = std::clamp(std::log(std::max(value - offset(p), 1e-300)), lo, hi);
  if (is_curve(p)) {
    // A logistic between the bounds: no flat plateau past a bound, where a clamp would leave a
    // curve parameter without a gradient (its size and exponent trade off against each other).
    const double t = std::clamp((log_value - lo) / (hi - lo), 1e-9, 1.0 - 1e-9);
    return std::log(t / (1.0 - t));
  }
  return log_value;
}

double from_free(const FitParameter& p, double x) {
  if (p.is_efficiency()) return std::clamp(1.0 / (1.0 + std::exp(-x)), 1e-4, 1.0);
  const auto [lo, hi] = log_range(p);
  if (is_curve(p)) return offset(p) + std::exp(lo + (hi - lo) / (1.0 + std::exp(-x)));
  return std::exp(std::clamp(x, lo, hi));
}

// Where a parameter that is not set (0) starts: a microsecond for times; 10 fs per element-wise
// operation and a curve where it barely acts (half efficiency at size
// 0.01, half bandwidth at 100 GB).
double start_value(const FitParameter& p, double value) {
  if (p.is_efficiency() || value > 0.0) return value;
  switch (p.kind) {
    case FitParameter::Kind::kHalfEfficiencySize:  // where the curve barely acts
      return p.index == static_cast<int>(OpClass::kMemory) ? 1e11 : 1e-2;
    case FitParameter::Kind::kElementWork:
      return 1e-14;
    default:
      return 1e-6;
  }
}

double sum_of_squares(const std::vector<double>& values) {
  double sum = 0.0;
  for (double v : values) sum += v * v;
  return sum;
}

// Solves the small dense system a x = b (n x n, row-major) by Gaussian elimination with partial
// pivoting; false when it is singular.
bool solve_dense(std::vector<double> a, std::vector<double>& b) {
  const std::size_t n = b.size();
  for (std::size_t col = 0; col < n; ++col) {
    std::size_t pivot = col;
    for (std::size_t row = col + 1; row < n; ++row) {
      if (std::abs(a[row * n + col]) > std::abs(a[pivot * n + col])) pivot = row;
    }
    if (!(std::abs(a[pivot * n + col]) > 0.0)) return false;
    if (pivot != col) {
      for (std::size_t k = 0; k < n; ++k) std::swap(a[col * n + k], a[pivot * n + k]);
      std::swap(b[col], b[pivot]);
    }
    for (std::size_t row = col + 1; row < n; ++row) {
      const double factor = a[row * n + col] / a[col * n + col];
      for (std::size_t k = col; k < n; ++k) a[row * n + k] -= factor * a[col * n + k];
      b[row] -= factor * b[col];
    }
  }
  for (std::size_t col = n; col-- > 0;) {
    for (std::size_t k = col + 1; k < n; ++k) b[col] -= a[col * n + k] * b[k];
    b[col] /= a[col * n + col];
  }
  return true;
}

// Levenberg-Marquardt on the residual vector `errors(x)` from `x`, with a forward-difference
// Jacobian; returns the best point found within `max_evaluations` residual evaluations.
std::vector<double> levenberg_marquardt(
    std::vector<double> x,
    const std::function<std::vector<double>(const std::vector<double>&)>& errors,
    int max_evaluations) {
  const std::size_t n = x.size();
  std::vector<double> r = errors(x);
  double current = sum_of_squares(r);
  double lambda = 1e-3;
  int evaluations = 1;
  constexpr double kStep = 1e-6;
  while (evaluations + static_cast<int>(n) + 1 < max_evaluations && lambda < 1e12) {
    // Jacobian (m x n) by forward differences in the free parameters.
    const std::size_t m = r.size();
    std::vector<double> jacobian(m * n);
    for (std::size_t j = 0; j < n; ++j) {
      std::vector<double> shifted = x;
      shifted[j] += kStep;
      const std::vector<double> rj = errors(shifted);
      ++evaluations;
      for (std::size_t i = 0; i < m; ++i) jacobian[i * n + j] = (rj[i] - r[i]) / kStep;
    }
    std::vector<double> normal(n * n, 0.0), gradient(n, 0.0);
    for (std::size_t i = 0; i < m; ++i) {
      for (std::size_t j = 0; j < n; ++j) {
        gradient[j] += jacobian[i * n + j] * r[i];
        for (std::size_t k = 0; k < n; ++k) {
          normal[j * n + k] += jacobian[i * n + j] * jacobian[i * n + k];
        }
      }
    }
    bool improved = false;
    while (!improved && lambda < 1e12 && evaluations < max_evaluations) {
      std::vector<double> damped = normal;
      for (std::size_t j = 0; j < n; ++j) damped[j * n + j] += lambda * normal[j * n + j] + 1e-12;
      std::vector<double> step(n);
      for (std::size_t j = 0; j < n; ++j) step[j] = -gradient[j];
      if (!solve_dense(damped, step)) {
        lambda *= 4.0;
        continue;
      }
      std::vector<double> trial = x;
      for (std::size_t j = 0; j < n; ++j) trial[j] += step[j];
      const std::vector<double> rt = errors(trial);
      ++evaluations;
      const double trial_cost = sum_of_squares(rt);
      if (trial_cost < current) {
        const double gain = current - trial_cost;
        x = trial;
        r = rt;
        current = trial_cost;
        lambda = std::max(lambda / 3.0, 1e-12);
        improved = true;
        if (gain < 1e-14 * (1.0 + current)) return x;
      } else {
        lambda *= 4.0;
      }
    }
  }
  return x;
}

}  // namespace

std::vector<Measurement> measurements_from_json(const nlohmann::json& json,
                                                const std::string& source,
                                                const DeviceSpec& device) {
  if (!json.is_object()) throw std::invalid_argument(source + ": expected a JSON object");
  const auto version = json.find("format_version");
  if (version == json.end() || !version->is_number_integer() ||
      version->get<long>() != kMeasurementsFormatVersion) {
    throw std::invalid_argument(source + ": field 'format_version' must be " +
                                std::to_string(kMeasurementsFormatVersion) + ", got " +
                                (version == json.end() ? "nothing" : version->dump()));
  }
  nlohmann::json defaults = nlohmann::json::object();
  if (json.contains("defaults")) {
    defaults = json.at("defaults");
    if (!defaults.is_object()) {
      throw std::invalid_argument(source + ": field 'defaults' must be an object");
    }
  }
  const auto records = json.find("measurements");
  if (records == json.end() || !records->is_array() || records->empty()) {
    throw std::invalid_argument(source + ": field 'measurements' must be a non-empty array");
  }
  std::vector<Measurement> out;
  std::int64_t kernels = 0;
  for (std::size_t i = 0; i < records->size(); ++i) {
    const auto& entry = (*records)[i];
    const std::string where = source + ": measurements[" + std::to_string(i) + "]";
    if (!entry.is_object()) throw std::invalid_argument(where + " must be an object");
    nlohmann::json record = defaults;
    for (const auto& [key, value] : entry.items()) record[key] = value;
    out.push_back(parse_record(record, where, device));
    kernels += total_kernels(out.back().before) + total_kernels(out.back().before_backward) +
               total_kernels(out.back().timed) + total_kernels(out.back().backward);
    if (kernels > kMaxMeasurementKernels) {
      throw std::invalid_argument(where + ": the measurements so far describe " +
                                  std::to_string(kernels) + " kernels (allowed: at most " +
                                  std::to_string(kMaxMeasurementKernels) + " in one file)");
    }
  }
  return out;
}

std::vector<Measurement> measurements_from_json_file(const std::filesystem::path& path,
                                                     const DeviceSpec& device) {
  std::ifstream in(path);
  if (!in) throw std::invalid_argument("cannot open measurements file " + path.string());
  nlohmann::json json;
  try {
    json = json_fields::parse_bounded(in, path.string());
  } catch (const nlohmann::json::exception& e) {
    throw std::invalid_argument(path.string() + ": not valid JSON: " + e.what());
  }
  return measurements_from_json(json, path.string(), device);
}

double predict(const DeviceSpec& device, const Measurement& m) {
  if (m.before.empty() && m.before_backward.empty()) {
    // One instruction (or a forward and its backward), each as the simulator prices it.
    double seconds = instruction_seconds(device, price(device, m.timed), m.timed_backward);
    if (!m.backward.empty())
      seconds += instruction_seconds(device, price(device, m.backward), true);
    return seconds;
  }
  // A harness's difference of two timed runs (layer_backward, layer_curvature): the timed kernels
  // queued behind the untimed ones.
  const PricedKernels before = price(device, m.before);
  const PricedKernels before_backward = price(device, m.before_backward);
  const PricedKernels timed = price(device, m.timed);
  const PricedKernels backward = price(device, m.backward);
  const double launch = m.timed_backward ? device.backward_launch_s() : device.launch_overhead_s;
  const std::array<QueuedPart, 4> parts = {
      QueuedPart{&before, 1, device.launch_overhead_s},
      QueuedPart{&before_backward, 1, device.backward_launch_s()}, QueuedPart{&timed, 1, launch},
      QueuedPart{&backward, 1, device.backward_launch_s()}};
  return queued_seconds(parts, device.launch_overhead_s) -
         queued_seconds(std::span<const QueuedPart>(parts.data(), 2), device.launch_overhead_s);
}

void hold_out(std::vector<Measurement>& measurements, const std::string& rule) {
  const auto equals = rule.find('=');
  if (equals == std::string::npos || equals == 0) {
    throw std::invalid_argument("--hold-out '" + rule +
                                "': expected FIELD=VALUE (e.g. model=base)");
  }
  const std::string key = rule.substr(0, equals), value = rule.substr(equals + 1);
  for (auto& m : measurements) {
    const auto it = m.record.find(key);
    if (it != m.record.end() && as_text(*it) == value) m.held_out = true;
  }
}

std::vector<Residual> residuals(const DeviceSpec& device,
                                const std::vector<Measurement>& measurements) {
  std::vector<Residual> out;
  for (const auto& m : measurements) {
    const double predicted = predict(device, m);
    out.push_back(
        {m.label, m.operation, m.seconds, predicted, predicted / m.seconds - 1.0, m.held_out});
  }
  return out;
}

std::string FitParameter::name() const {
  switch (kind) {
    case Kind::kEfficiency:
      return "classes." + std::string(to_string(static_cast<OpClass>(index))) + ".efficiency";
    case Kind::kLatency:
      return "classes." + std::string(to_string(static_cast<OpClass>(index))) + ".latency_s";
    case Kind::kGemmPrecisionEfficiency:
      return "classes.gemm.by_precision." + std::string(to_string(static_cast<Precision>(index)));
    case Kind::kLaunch:
      return "launch_overhead_s";
    case Kind::kBackwardLaunch:
      return "backward_launch_overhead_s";
    case Kind::kCurvatureHost:
      return "curvature_host_overhead_s";
    case Kind::kHalfEfficiencySize:
      return "classes." + std::string(to_string(static_cast<OpClass>(index))) +
             ".half_efficiency_size";
    case Kind::kSizeExponent:
      return "classes." + std::string(to_string(static_cast<OpClass>(index))) + ".size_exponent";
    case Kind::kCacheSlowdown:
      return "classes.memory.beyond_cache_slowdown";
    case Kind::kOuterCacheBytes:
      return "classes.memory.outer_cache_bytes";
    case Kind::kOuterCacheSlowdown:
      return "classes.memory.beyond_outer_cache_slowdown";
    case Kind::kRooflineExponent:
      return "classes.memory.roofline_exponent";
    case Kind::kElementWork:
      if (index == kExpAndErfTogether) return "classes.memory.exponential_s=error_function_s";
      return "classes.memory." + std::string(kElementWorkFields[static_cast<std::size_t>(index)]);
  }
  return "";
}

double FitParameter::get(const DeviceSpec& device) const {
  switch (kind) {
    case Kind::kEfficiency:
      return device.efficiency(static_cast<OpClass>(index));
    case Kind::kLatency:
      return device.latency_s(static_cast<OpClass>(index));
    case Kind::kGemmPrecisionEfficiency:
      return device.gemm_efficiency(static_cast<Precision>(index));
    case Kind::kLaunch:
      return device.launch_overhead_s;
    case Kind::kBackwardLaunch:
      return device.backward_launch_s();
    case Kind::kCurvatureHost:
      return device.curvature_host_overhead_s;
    case Kind::kHalfEfficiencySize:
      return device.classes[static_cast<std::size_t>(index)].half_efficiency_size;
    case Kind::kSizeExponent:
      return device.classes[static_cast<std::size_t>(index)].size_exponent;
    case Kind::kCacheSlowdown:
      return device.classes[static_cast<std::size_t>(OpClass::kMemory)].beyond_cache_slowdown;
    case Kind::kOuterCacheBytes:
      return device.classes[static_cast<std::size_t>(OpClass::kMemory)].outer_cache_bytes;
    case Kind::kOuterCacheSlowdown:
      return device.classes[static_cast<std::size_t>(OpClass::kMemory)].beyond_outer_cache_slowdown;
    case Kind::kRooflineExponent:
      return device.classes[static_cast<std::size_t>(OpClass::kMemory)].roofline_exponent;
    case Kind::kElementWork:
      return element_work_rate(device.classes[static_cast<std::size_t>(OpClass::kMemory)], index);
  }
  return 0.0;
}

void FitParameter::set(DeviceSpec& device, double value) const {
  const auto i = static_cast<std::size_t>(index);
  switch (kind) {
    case Kind::kEfficiency:
      device.classes[i].efficiency = value;
      break;
    case Kind::kLatency:
      device.classes[i].latency_s = value;
      break;
    case Kind::kGemmPrecisionEfficiency:
      device.gemm_efficiency_by_precision[i] = value;
      break;
    case Kind::kLaunch:
      device.launch_overhead_s = value;
      break;
    case Kind::kBackwardLaunch:
      device.backward_launch_overhead_s = value;
      break;
    case Kind::kCurvatureHost:
      device.curvature_host_overhead_s = value;
      break;
    case Kind::kHalfEfficiencySize:
      device.classes[i].half_efficiency_size = value;
      break;
    case Kind::kSizeExponent:
      device.classes[i].size_exponent = value;
      break;
    case Kind::kCacheSlowdown:
      device.classes[static_cast<std::size_t>(OpClass::kMemory)].beyond_cache_slowdown = value;
      break;
    case Kind::kOuterCacheBytes:
      device.classes[static_cast<std::size_t>(OpClass::kMemory)].outer_cache_bytes = value;
      break;
    case Kind::kOuterCacheSlowdown:
      device.classes[static_cast<std::size_t>(OpClass::kMemory)].beyond_outer_cache_slowdown =
          value;
      break;
    case Kind::kRooflineExponent:
      device.classes[static_cast<std::size_t>(OpClass::kMemory)].roofline_exponent = value;
      break;
    case Kind::kElementWork: {
      ClassRate& memory = device.classes[static_cast<std::size_t>(OpClass::kMemory)];
      if (index == kExpAndErfTogether) {
        memory.exponential_s = memory.error_function_s = value;
      } else {
        element_work_rate(memory, index) = value;
      }
      break;
    }
  }
}

std::vector<FitParameter> parameters_of(const std::vector<Measurement>& measurements,
                                        bool outer_cache) {
  std::array<bool, kNumOpClasses> classes{};
  std::array<bool, 4> precisions{};
  std::array<std::set<double>, kNumOpClasses> sizes;
  bool backward = false, any = false, curvature = false;
  std::array<bool, kElementWorkFields.size()> element_work{};  // in kElementWorkFields' order
  // exp and erf can be told apart only when some record times one without the other (a whole
  // layer always does both, in the same proportion): otherwise one value prices both.
  bool exp_apart_from_erf = false;
  // The orders of each fitted record's factorizations (and eigendecompositions): a class's
  // latency per panel and its rate can be told apart only by records of different orders (every
  // layer_inversion record of one model inverts the same 12 factors: one equation for two
  // unknowns).
  std::array<std::set<std::vector<double>>, kNumOpClasses> order_sets;
  for (const auto& m : measurements) {
    if (m.held_out) continue;
    for (const OpClass c : {OpClass::kFactorization, OpClass::kEigendecomposition}) {
      std::vector<double> orders;
      for (const Kernel& k : m.timed) {
        if (k.op_class == c) orders.insert(orders.end(), static_cast<std::size_t>(k.count), k.size);
      }
      std::sort(orders.begin(), orders.end());
      if (!orders.empty()) order_sets[static_cast<std::size_t>(c)].insert(orders);
    }
  }
  for (const auto& m : measurements) {
    if (m.held_out) continue;
    any = true;
    // A backward launch overhead of its own only where a record times backward work alone: in a
    // record that times a forward and its backward together (chunk_forward_backward) the two
    // launch overheads only act as their sum, as exp and erf do in a whole layer.
    backward = backward || m.timed_backward;
    double exps = 0.0, erfs = 0.0;
    for (const auto* list : {&m.timed, &m.backward}) {
      for (const Kernel& k : *list) {
        exps += k.exponentials;
        erfs += k.error_functions;
      }
    }
    exp_apart_from_erf = exp_apart_from_erf || ((exps > 0.0) != (erfs > 0.0));
    for (const Kernel& k : m.timed) curvature = curvature || k.curvature_host;
    for (const auto* list : {&m.before, &m.before_backward, &m.timed, &m.backward}) {
      for (const Kernel& k : *list) {
        classes[static_cast<std::size_t>(k.op_class)] = true;
        // The memory class's curve is in the bytes (caches).
        const double size = k.op_class == OpClass::kMemory ? k.bytes : k.size;
        if (size > 0.0) sizes[static_cast<std::size_t>(k.op_class)].insert(size);
        if (k.op_class == OpClass::kMemory) {
          element_work[0] = element_work[0] || k.flops > 0.0;
          element_work[1] = element_work[1] || k.exponentials > 0.0;
          element_work[2] = element_work[2] || k.error_functions > 0.0;
          element_work[3] = element_work[3] || k.random_numbers > 0.0;
        }
        if (k.op_class == OpClass::kGemm) precisions[static_cast<std::size_t>(k.precision)] = true;
      }
    }
  }
  using Kind = FitParameter::Kind;
  std::vector<FitParameter> out;
  if (!any) return out;
  for (int c = 0; c < kNumOpClasses; ++c) {
    if (!classes[static_cast<std::size_t>(c)]) continue;
    // No record times a triangular solve apart from its factorization: it keeps the fp32
    // product rate it inherits, and the factorization's parameters absorb the rest.
    if (c == static_cast<int>(OpClass::kTriangularSolve)) continue;
    if (c == static_cast<int>(OpClass::kGemm)) {
      for (int p = 0; p < 4; ++p) {
        if (precisions[static_cast<std::size_t>(p)]) {
          out.push_back({Kind::kGemmPrecisionEfficiency, p});
        }
      }
    } else if ((c != static_cast<int>(OpClass::kFactorization) &&
                c != static_cast<int>(OpClass::kEigendecomposition)) ||
               order_sets[static_cast<std::size_t>(c)].size() >= 2) {
      // A factorization timed at one set of orders only fits its latency: its rate stays at
      // the start device's (the datasheet prior), not wherever the optimizer leaves it.
      out.push_back({Kind::kEfficiency, c});
    }
    out.push_back({Kind::kLatency, c});
    if (static_cast<int>(sizes[static_cast<std::size_t>(c)].size()) >= kMinSizesForCurve) {
      out.push_back({Kind::kHalfEfficiencySize, c});
      out.push_back({Kind::kSizeExponent, c});
      if (c == static_cast<int>(OpClass::kMemory)) out.push_back({Kind::kCacheSlowdown, c});
    }
    if (c == static_cast<int>(OpClass::kMemory) && outer_cache &&
        static_cast<int>(sizes[static_cast<std::size_t>(c)].size()) >= kMinSizesForOuterCache) {
      out.push_back({Kind::kOuterCacheBytes, c});
      out.push_back({Kind::kOuterCacheSlowdown, c});
    }
  }
  if (!exp_apart_from_erf && element_work[1] && element_work[2]) {
    element_work[1] = element_work[2] = false;
    out.push_back({Kind::kElementWork, kExpAndErfTogether});
  }
  for (int w = 0; w < static_cast<int>(element_work.size()); ++w) {
    if (element_work[static_cast<std::size_t>(w)]) out.push_back({Kind::kElementWork, w});
  }
  // How compute and bandwidth overlap shows only where both act: element-wise work priced, and
  // sizes enough for the cache curve (the kernels past the caches, where the two are close).
  const auto memory = static_cast<std::size_t>(OpClass::kMemory);
  if (static_cast<int>(sizes[memory].size()) >= kMinSizesForCurve &&
      std::any_of(element_work.begin(), element_work.end(), [](bool w) { return w; })) {
    out.push_back({Kind::kRooflineExponent, static_cast<int>(memory)});
  }
  out.push_back({Kind::kLaunch, 0});
  if (backward) out.push_back({Kind::kBackwardLaunch, 0});
  if (curvature) out.push_back({Kind::kCurvatureHost, 0});
  return out;
}

namespace {

struct StageResult {
  DeviceSpec device;
  double cost = 0.0;  // sum of squared log errors
};

// Fits `params` of `start` to the `fitted` records: Nelder-Mead, then Levenberg-Marquardt.
StageResult fit_stage(const DeviceSpec& start, const std::vector<FitParameter>& params,
                      const std::vector<const Measurement*>& fitted, const FitOptions& options,
                      int& evaluations) {
  struct {
    int evaluations = 0;
  } result;
  const std::size_t n = params.size();
  auto device_at = [&](const std::vector<double>& x) {
    DeviceSpec d = start;
    for (std::size_t i = 0; i < n; ++i) params[i].set(d, from_free(params[i], x[i]));
    return d;
  };
  auto log_errors = [&](const std::vector<double>& x) {
    ++result.evaluations;
    const DeviceSpec d = device_at(x);
    std::vector<double> errors;
    errors.reserve(fitted.size());
    for (const Measurement* m : fitted) {
      errors.push_back(std::log(std::max(predict(d, *m), 1e-15) / m->seconds));
    }
    return errors;
  };
  auto cost = [&](const std::vector<double>& x) { return sum_of_squares(log_errors(x)); };
  std::vector<double> best(n);
  for (std::size_t i = 0; i < n; ++i) {
    // A time or size that starts at 0 would start at exp(-inf).
    best[i] = to_free(params[i], start_value(params[i], params[i].get(start)));
  }
  double best_cost = cost(best);
  // Nelder-Mead (reflection 1, expansion 2, contraction 1/2, shrink 1/2), restarted from the
  // best point with a fresh simplex: a collapsed simplex restarts instead of stalling.
  for (int restart = 0; restart < options.restarts; ++restart) {
    std::vector<std::vector<double>> simplex(n + 1, best);
    std::vector<double> values(n + 1, best_cost);
    for (std::size_t i = 0; i < n; ++i) {
      simplex[i + 1][i] += 1.0;
      values[i + 1] = cost(simplex[i + 1]);
    }
    const int budget = options.max_evaluations / options.restarts;
    for (int iteration = 0; iteration < budget; ++iteration) {
      // Best, worst and second-worst vertices.
      std::size_t lo = 0, hi = 0;
      for (std::size_t v = 1; v <= n; ++v) {
        if (values[v] < values[lo]) lo = v;
        if (values[v] > values[hi]) hi = v;
      }
      std::size_t second = lo;
      for (std::size_t v = 0; v <= n; ++v) {
        if (v != hi && values[v] > values[second]) second = v;
      }
      if (values[hi] - values[lo] < 1e-12 * (1.0 + values[lo])) break;
      std::vector<double> centroid(n, 0.0);
      for (std::size_t v = 0; v <= n; ++v) {
        if (v == hi) continue;
        for (std::size_t i = 0; i < n; ++i) centroid[i] += simplex[v][i] / static_cast<double>(n);
      }
      auto along = [&](double t) {
        std::vector<double> x(n);
        for (std::size_t i = 0; i < n; ++i) x[i] = centroid[i] + t * (simplex[hi][i] - centroid[i]);
        return x;
      };
      const auto reflected = along(-1.0);
      const double fr = cost(reflected);
      if (fr < values[lo]) {
        const auto expanded = along(-2.0);
        const double fe = cost(expanded);
        if (fe < fr) {
          simplex[hi] = expanded;
          values[hi] = fe;
        } else {
          simplex[hi] = reflected;
          values[hi] = fr;
        }
      } else if (fr < values[second]) {
        simplex[hi] = reflected;
        values[hi] = fr;
      } else {
        const auto contracted = fr < values[hi] ? along(-0.5) : along(0.5);
        const double fc = cost(contracted);
        if (fc < std::min(fr, values[hi])) {
          simplex[hi] = contracted;
          values[hi] = fc;
        } else {
          for (std::size_t v = 0; v <= n; ++v) {
            if (v == lo) continue;
            for (std::size_t i = 0; i < n; ++i) {
              simplex[v][i] = simplex[lo][i] + 0.5 * (simplex[v][i] - simplex[lo][i]);
            }
            values[v] = cost(simplex[v]);
          }
        }
      }
    }
    const auto it = std::min_element(values.begin(), values.end());
    if (*it < best_cost) {
      best_cost = *it;
      best = simplex[static_cast<std::size_t>(it - values.begin())];
    }
  }
  // Nelder-Mead finds the basin; Levenberg-Marquardt then converges in it (with the shape terms
  // there are up to ~20 parameters, where the simplex alone stalls short of the minimum).
  best = levenberg_marquardt(best, log_errors, options.max_evaluations);
  best_cost = cost(best);
  evaluations += result.evaluations;
  return {device_at(best), best_cost};
}

bool is_shape_term(const FitParameter& p) {
  return is_curve(p) || p.kind == FitParameter::Kind::kElementWork;
}

}  // namespace

FitResult fit_device(const DeviceSpec& start, const std::vector<Measurement>& measurements,
                     const FitOptions& options) {
  FitResult result;
  const bool outer_cache =
      start.classes[static_cast<std::size_t>(OpClass::kMemory)].outer_cache_bytes > 0.0;
  result.parameters = parameters_of(measurements, outer_cache);
  if (result.parameters.empty()) {
    throw std::invalid_argument("calibrate: no measurement left to fit (all held out)");
  }
  for (const std::string& rule : options.keep) {
    const bool prefix = !rule.empty() && rule.back() == '*';
    const std::string stem = prefix ? rule.substr(0, rule.size() - 1) : rule;
    const auto matches = [&](const FitParameter& p) {
      const std::string name = p.name();
      return prefix ? name.rfind(stem, 0) == 0 : name == stem;
    };
    const auto kept = std::stable_partition(result.parameters.begin(), result.parameters.end(),
                                            [&](const FitParameter& p) { return !matches(p); });
    if (kept == result.parameters.end()) result.unmatched_keep.push_back(rule);
    result.kept.insert(result.kept.end(), kept, result.parameters.end());
    result.parameters.erase(kept, result.parameters.end());
  }
  if (result.parameters.empty()) {
    throw std::invalid_argument("calibrate: every parameter is kept: nothing to fit");
  }
  std::vector<const Measurement*> fitted;
  for (const auto& m : measurements) {
    if (!m.held_out) fitted.push_back(&m);
  }
  // Two stages: the flat model first (efficiencies, latencies, launches), then everything from
  // there with the shape terms starting where they barely act. The second stage starts at the
  // first one's optimum, so the shape terms can only lower the error, and extra, weakly
  // determined parameters do not send the fit into a worse local minimum.
  std::vector<FitParameter> flat;
  for (const auto& p : result.parameters) {
    if (!is_shape_term(p)) flat.push_back(p);
  }
  // The flat stage runs from the start device and from a neutral point (every fitted
  // efficiency 0.5, every fitted time 10 us): with a few dozen records the flat model has
  // several minima (a per-product latency against a launch floor, a rate against a latency),
  // and the start device's values can lie in the basin of a worse one. The full stage then runs
  // from each of the two flat optima.
  DeviceSpec neutral = start;
  for (const auto& p : flat) p.set(neutral, p.is_efficiency() ? 0.5 : 1e-5);
  std::vector<StageResult> flats;
  for (const DeviceSpec& from : {start, neutral}) {
    flats.push_back(fit_stage(from, flat, fitted, options, result.evaluations));
  }
  StageResult best = flats[0].cost <= flats[1].cost ? flats[0] : flats[1];
  const auto overlap = std::find_if(
      result.parameters.begin(), result.parameters.end(),
      [](const FitParameter& p) { return p.kind == FitParameter::Kind::kRooflineExponent; });
  std::vector<FitParameter> shapes;  // every parameter but the roofline exponent
  for (auto p = result.parameters.begin(); p != result.parameters.end(); ++p) {
    if (p != overlap) shapes.push_back(*p);
  }
  if (flat.size() < shapes.size()) {
    // The shape terms sit behind a max() and a saturating curve: where they barely act their
    // gradient is ~0, so the second stage also starts from where they clearly act: each curve
    // halving its class at the smallest size (FLOP classes) or the largest bytes (memory) the
    // records have, each element-wise term pricing an operation like 8 bytes of bandwidth.
    std::array<double, kNumOpClasses> smallest{}, largest{};
    for (const Measurement* m : fitted) {
      for (const auto* list : {&m->timed, &m->backward}) {
        for (const Kernel& k : *list) {
          const auto c = static_cast<std::size_t>(k.op_class);
          const double size = k.op_class == OpClass::kMemory ? k.bytes : k.size;
          if (size <= 0.0) continue;
          smallest[c] = smallest[c] > 0.0 ? std::min(smallest[c], size) : size;
          largest[c] = std::max(largest[c], size);
        }
      }
    }
    // The memory class's own parameters (no roofline exponent: it comes last) and the records
    // that time nothing else.
    std::vector<FitParameter> memory_shapes;
    for (const auto& p : shapes) {
      const bool memory_class =
          (p.kind == FitParameter::Kind::kEfficiency || p.kind == FitParameter::Kind::kLatency ||
           p.kind == FitParameter::Kind::kHalfEfficiencySize ||
           p.kind == FitParameter::Kind::kSizeExponent) &&
          p.index == static_cast<int>(OpClass::kMemory);
      if (memory_class || p.kind == FitParameter::Kind::kCacheSlowdown ||
          p.kind == FitParameter::Kind::kOuterCacheBytes ||
          p.kind == FitParameter::Kind::kOuterCacheSlowdown ||
          p.kind == FitParameter::Kind::kElementWork) {
        memory_shapes.push_back(p);
      }
    }
    std::vector<const Measurement*> memory_records;
    for (const Measurement* m : fitted) {
      bool only_memory = true;
      for (const auto* list : {&m->before, &m->before_backward, &m->timed, &m->backward}) {
        for (const Kernel& k : *list) only_memory = only_memory && k.op_class == OpClass::kMemory;
      }
      if (only_memory) memory_records.push_back(m);
    }
    for (const StageResult& flat_optimum : flats) {
      DeviceSpec acting = flat_optimum.device;
      for (const auto& p : result.parameters) {
        if (p.kind == FitParameter::Kind::kHalfEfficiencySize) {
          const auto c = static_cast<std::size_t>(p.index);
          // With two cliffs the first one starts where the start device puts it (this-cpu:
          // its L2), the outer one stays at the start's (its last-level cache).
          const double placed = start.classes[c].half_efficiency_size;
          p.set(acting, p.index != static_cast<int>(OpClass::kMemory) ? smallest[c]
                        : outer_cache && placed > 0.0                 ? placed
                                                      : std::sqrt(smallest[c] * largest[c]));
        } else if (p.kind == FitParameter::Kind::kCacheSlowdown ||
                   p.kind == FitParameter::Kind::kOuterCacheSlowdown) {
          p.set(acting, 2.0);
        } else if (p.kind == FitParameter::Kind::kElementWork) {
          p.set(acting, 8.0 / (acting.memory_bandwidth * acting.efficiency(OpClass::kMemory)));
        }
      }
      std::vector<DeviceSpec> froms = {flat_optimum.device, acting};
      if (outer_cache && !memory_records.empty() && !memory_shapes.empty()) {
        // Two cliffs give the memory class local optima of its own (one smooth curve through
        // both, with the other cliff run off past every record), which the joint fit of every
        // class reached from this-cpu. So also from the memory class fitted alone first, on the
        // records that time only element-wise kernels.
        froms.push_back(
            fit_stage(acting, memory_shapes, memory_records, options, result.evaluations).device);
      }
      for (const DeviceSpec& from : froms) {
        const StageResult full = fit_stage(from, shapes, fitted, options, result.evaluations);
        if (full.cost < best.cost) best = full;
      }
    }
  }
  if (overlap != result.parameters.end()) {
    // The roofline exponent last: it only bends kernels whose two terms are close, so it is
    // told apart only once the cache curve and the element-wise rates are in place (fitted
    // together from the start, the curve ran off to its bound and the exponent took its role).
    // From the optimum without it (the max of the two terms), and from a clear overlap.
    const StageResult without = best;
    for (const double exponent : {0.0, 2.0}) {
      DeviceSpec from = without.device;
      overlap->set(from, exponent);
      const StageResult full =
          fit_stage(from, result.parameters, fitted, options, result.evaluations);
      if (full.cost < best.cost) best = full;
    }
  }
  result.device = best.device;
  // The two cache cliffs multiply, so the fit may return them in either order: the first is the
  // inner one.
  ClassRate& memory = result.device.classes[static_cast<std::size_t>(OpClass::kMemory)];
  if (memory.outer_cache_bytes > 0.0 && memory.outer_cache_bytes < memory.half_efficiency_size) {
    std::swap(memory.outer_cache_bytes, memory.half_efficiency_size);
    std::swap(memory.beyond_outer_cache_slowdown, memory.beyond_cache_slowdown);
  }
  result.rms_log_error = std::sqrt(best.cost / static_cast<double>(fitted.size()));
  return result;
}

}  // namespace pf::sim
