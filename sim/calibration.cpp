#include "sim/calibration.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <stdexcept>

#include "common/json_fields.h"
#include "runtime/model/bert_config.h"
#include "sim/bert_kernels.h"
#include "sim/kfac_kernels.h"

namespace pf::sim {
namespace {

constexpr const char* kOperations =
    "layer_forward, layer_backward, layer_curvature, layer_inversion, layer_precondition, gemm, "
    "attention, memory, cholesky_inverse, eigen_inverse";

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

Workload layer_workload(const RecordReader& r) {
  Workload w;
  const std::string model = r.text("model", nullptr);
  try {
    const bool is_file = model.size() > 5 && model.substr(model.size() - 5) == ".json";
    w.config = is_file ? model::bert_config_from_hf_json(model) : model::bert_preset(model);
  } catch (const std::exception& e) {
    r.fail("model", e.what());
  }
  w.seq_len = r.integer("seq_len", 128, 1 << 20);
  w.micro_batch_size = r.integer("micro_batch_size", 0, 1 << 20);
  w.precision = r.precision();
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
  if (op.rfind("layer_", 0) == 0) {
    const Workload w = layer_workload(r);
    LayerKernelOptions options;
    options.input_requires_grad = r.flag("input_requires_grad", true);
    options.separate_grad_accumulation = r.flag("separate_grad_accumulation", false);
    m.label = op + " " + w.config.name + " b=" + std::to_string(w.micro_batch_size);
    (void)device.peak_flops(w.precision);  // throws naming the device and precision
    const Precision products = kfac_product_precision(device, w.precision);
    const double T = w.tokens(), e = element_bytes(w.precision);
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
      for (const auto& d : linears) {
        append(m.timed, curvature_kernels(products, T, d.in, e));
        append(m.timed, curvature_kernels(products, T, d.out, e));
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
    m.timed = {memory_kernel(r.number("bytes"), count)};
    m.label = "memory " + r.text("name", "") + " " + compact(r.number("bytes")) + " B";
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

// Fitted parameters live in an unconstrained space: efficiencies through a logistic, times
// through exp (seconds).
double to_free(const FitParameter& p, double value) {
  if (p.kind == FitParameter::Kind::kEfficiency ||
      p.kind == FitParameter::Kind::kGemmPrecisionEfficiency) {
    const double e = std::clamp(value, 1e-4, 1.0 - 1e-4);
    return std::log(e / (1.0 - e));
  }
  return std::log(std::max(value, 1e-8));
}

double from_free(const FitParameter& p, double x) {
  if (p.kind == FitParameter::Kind::kEfficiency ||
      p.kind == FitParameter::Kind::kGemmPrecisionEfficiency) {
    return std::clamp(1.0 / (1.0 + std::exp(-x)), 1e-4, 1.0);
  }
  return std::exp(std::clamp(x, -40.0, 5.0));
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
    kernels += total_kernels(out.back().before) + total_kernels(out.back().timed);
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
  const PricedKernels before = price(device, m.before);
  const PricedKernels timed = price(device, m.timed);
  const double launch = m.timed_backward ? device.backward_launch_s() : device.launch_overhead_s;
  const std::array<QueuedPart, 2> parts = {QueuedPart{&before, 1, device.launch_overhead_s},
                                           QueuedPart{&timed, 1, launch}};
  return queued_seconds(parts, device.launch_overhead_s) -
         queued_seconds(before, device.launch_overhead_s);
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
  }
}

std::vector<FitParameter> parameters_of(const std::vector<Measurement>& measurements) {
  std::array<bool, kNumOpClasses> classes{};
  std::array<bool, 4> precisions{};
  bool backward = false, any = false;
  for (const auto& m : measurements) {
    if (m.held_out) continue;
    any = true;
    backward = backward || m.timed_backward;
    for (const auto* list : {&m.before, &m.timed}) {
      for (const Kernel& k : *list) {
        classes[static_cast<std::size_t>(k.op_class)] = true;
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
    } else {
      out.push_back({Kind::kEfficiency, c});
    }
    out.push_back({Kind::kLatency, c});
  }
  out.push_back({Kind::kLaunch, 0});
  if (backward) out.push_back({Kind::kBackwardLaunch, 0});
  return out;
}

FitResult fit_device(const DeviceSpec& start, const std::vector<Measurement>& measurements,
                     const FitOptions& options) {
  FitResult result;
  result.parameters = parameters_of(measurements);
  if (result.parameters.empty()) {
    throw std::invalid_argument("calibrate: no measurement left to fit (all held out)");
  }
  const auto& params = result.parameters;
  const std::size_t n = params.size();
  std::vector<const Measurement*> fitted;
  for (const auto& m : measurements) {
    if (!m.held_out) fitted.push_back(&m);
  }
  auto device_at = [&](const std::vector<double>& x) {
    DeviceSpec d = start;
    for (std::size_t i = 0; i < n; ++i) params[i].set(d, from_free(params[i], x[i]));
    return d;
  };
  auto cost = [&](const std::vector<double>& x) {
    ++result.evaluations;
    const DeviceSpec d = device_at(x);
    double sum = 0.0;
    for (const Measurement* m : fitted) {
      const double predicted = std::max(predict(d, *m), 1e-15);
      const double r = std::log(predicted / m->seconds);
      sum += r * r;
    }
    return sum;
  };
  std::vector<double> best(n);
  for (std::size_t i = 0; i < n; ++i) {
    double value = params[i].get(start);
    // A latency that starts at 0 would start at exp(-inf): start it at a microsecond.
    if (params[i].kind != FitParameter::Kind::kEfficiency &&
        params[i].kind != FitParameter::Kind::kGemmPrecisionEfficiency && value <= 0.0) {
      value = 1e-6;
    }
    best[i] = to_free(params[i], value);
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
  result.device = device_at(best);
  result.rms_log_error = std::sqrt(best_cost / static_cast<double>(fitted.size()));
  return result;
}

}  // namespace pf::sim
