#pragma once
// Fitting a device's per-class rates and launch overheads (sim/device.h) to measured durations,
// and the error of a device against them.
//
// Measurements file (times in seconds):
// {"format_version": 1, "description": "...",
//  "defaults": {...fields every record gets unless it sets them...},
//  "measurements": [
//    {"operation": "layer_forward" | "layer_backward" | "layer_curvature" | "layer_inversion" |
//                  "layer_precondition",
//     "model": preset or config.json, "seq_len": 128, "micro_batch_size": 8,
//     "precision": "fp32", "input_requires_grad": true, "separate_grad_accumulation": false,
//     "seconds": 0.0029},
//    {"operation": "gemm", "m": 4096, "n": 1024, "k": 1024, "precision": "fp32", "seconds": ...},
//    {"operation": "attention", "batch": 384, "m": 128, "n": 128, "k": 64, "precision": ...},
//    {"operation": "memory", "bytes": 3.2e7, "seconds": ...,
//     optional: "flops": 4e6, "exponentials": 1e6 (exp, tanh), "error_functions": 1e6 (erf),
//               "random_numbers": 1e6},
//    {"operation": "cholesky_inverse" | "eigen_inverse", "order": 1024, "seconds": ...},
//    {"operation": "chunk_forward" | "chunk_backward" | "chunk_forward_backward", "model": ...,
//     "seq_len", "micro_batch_size", "precision", "layers": 2, "embeddings": true, "head": false,
//     "seconds": ...},
//    {"operation": "curvature", "rows": 1024, "order": 256, "precision": ...},
//    {"operation": "precondition", "d_in": 256, "d_out": 1024, "precision": ...},
//    {"operation": "optimizer_step", "params": 3.3e6, "seconds": ...}]}
// "model" may also be a Hugging Face config object written into the record. Records of a model
// and of "curvature" may give "storage_precision" (what activations and gradients are stored in,
// when not "precision", the products': pipefisher_train's bf16 runs store fp32). Records of a
// model may give "attention": "batched" (the default) or "fused" (the run's --attention: its
// layers are priced with that attention core, sim/attention_kernels.h).
// chunk_* price a pipeline chunk as the analytic cost model does (its layers, the embeddings
// in front, the heads behind); curvature, precondition and optimizer_step one K-FAC factor of a
// micro-batch, one Linear's preconditioning and one optimizer step: the records
// pipefisher_train --calibration-out writes from a run (sim/profile_measurements.h).
// layer_* price one encoder layer (bert_kernels.h): forward; backward (the backward issued right
// after the forward, as a harness that times forward+backward minus forward sees it); and K-FAC
// work of all six Linears for one micro-batch: curvature of their 12 factors, inversion of the
// 12 factors (Cholesky), preconditioning of the 6 gradients (kfac_kernels.h). A record may carry
// "count": kernels of the same shape run back to back in the timed region (default 1), and any
// other fields (kept for --hold-out and the report). Records without an untimed part (all but
// layer_backward and layer_curvature) price each instruction from an empty queue, as the
// simulator does (instruction_seconds): a chunk_backward is not credited with run-ahead.
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "sim/device.h"
#include "sim/kernel_costs.h"

namespace pf::sim {

inline constexpr int kMeasurementsFormatVersion = 1;
// Limits of a measurements file, checked before the kernels are built: "count" of one record, and
// the kernels of the whole file (a few hundred bytes could otherwise ask for gigabytes).
inline constexpr int kMaxMeasurementCount = 1 << 16;
inline constexpr std::int64_t kMaxMeasurementKernels = std::int64_t{1} << 22;

// What to predict for one record: the `timed` kernels issued after `before` (untimed: the forward
// ahead of a layer_backward record's backward, as a harness that times forward + backward less
// forward sees it); timed_backward: the timed kernels are dispatched as backward work
// (DeviceSpec::backward_launch_overhead_s). A record without `before` is one or two of a
// worker's instructions, each priced as the simulator prices it (instruction_seconds,
// sim/kernel_costs.h): a chunk_backward record is the backward from an empty queue, not the time
// it adds behind its forward.
struct Measurement {
  std::string label;      // e.g. "layer_forward large b=8"
  std::string operation;  // the record's "operation"
  double seconds = 0.0;
  nlohmann::json record;  // after defaults
  Kernels before;
  Kernels before_backward;  // untimed backward work after `before` (layer_curvature)
  Kernels timed;
  bool timed_backward = false;
  // Timed too, after `timed`: the backward instruction of a chunk_forward_backward record (a
  // forward and its backward between one pair of events), priced as its own instruction.
  Kernels backward;
  bool held_out = false;
};

// Throws std::invalid_argument naming `source`, the record index, the field and the value.
// `device` fixes the precision of K-FAC products (tf32 where it has tensor cores and the run is
// not fp32) and must have every record's precision.
std::vector<Measurement> measurements_from_json(const nlohmann::json& json,
                                                const std::string& source,
                                                const DeviceSpec& device);
std::vector<Measurement> measurements_from_json_file(const std::filesystem::path& path,
                                                     const DeviceSpec& device);

// Predicted seconds of a record on a device.
double predict(const DeviceSpec& device, const Measurement& measurement);

// Marks records whose field `key` equals `value` (numbers and strings compared as text) held out
// of the fit. `rule` is "key=value"; throws when malformed.
void hold_out(std::vector<Measurement>& measurements, const std::string& rule);

struct Residual {
  std::string label;
  std::string operation;
  double measured_s = 0.0;
  double predicted_s = 0.0;
  double relative_error = 0.0;  // predicted / measured - 1
  bool held_out = false;
};
std::vector<Residual> residuals(const DeviceSpec& device,
                                const std::vector<Measurement>& measurements);

// One fitted quantity of the device.
inline constexpr int kExpAndErfTogether = 4;  // FitParameter::kElementWork's tied index

struct FitParameter {
  enum class Kind {
    kEfficiency,
    kLatency,
    kGemmPrecisionEfficiency,
    kLaunch,
    kBackwardLaunch,
    kCurvatureHost,       // DeviceSpec::curvature_host_overhead_s
    kHalfEfficiencySize,  // ClassRate::half_efficiency_size of class `index`
    kSizeExponent,        // ClassRate::size_exponent of class `index`
    kCacheSlowdown,       // the memory class's beyond_cache_slowdown
    kOuterCacheBytes,     // the memory class's outer_cache_bytes
    kOuterCacheSlowdown,  // the memory class's beyond_outer_cache_slowdown
    kRooflineExponent,    // the memory class's roofline_exponent
    kElementWork          // the memory class's element_flop_s (index 0), exponential_s (1),
                          // error_function_s (2), random_number_s (3), or exponential_s and
                          // error_function_s as one value (kExpAndErfTogether)
  };
  Kind kind = Kind::kLaunch;
  int index = 0;  // OpClass or Precision
  std::string name() const;
  // A class's or a precision's efficiency (a fraction of a peak, at most 1).
  bool is_efficiency() const {
    return kind == Kind::kEfficiency || kind == Kind::kGemmPrecisionEfficiency;
  }
  double get(const DeviceSpec& device) const;
  void set(DeviceSpec& device, double value) const;
};

struct FitOptions {
  int max_evaluations = 20000;
  int restarts = 3;
  // Parameters (FitParameter::name(); a trailing '*' matches every name with that prefix) kept at
  // the start device's value instead of fitted: with few records a class's latency and
  // efficiency, or a curve, trade against each other, and the fit has no ground to split them.
  // A rule that matches no parameter the records fit is listed in FitResult::unmatched_keep.
  std::vector<std::string> keep;
};

struct FitResult {
  DeviceSpec device;
  std::vector<FitParameter> parameters;     // what was fitted
  std::vector<FitParameter> kept;           // what the records would fit but FitOptions::keep kept
  std::vector<std::string> unmatched_keep;  // keep rules that matched none of them
  double rms_log_error = 0.0;               // over the fitted records
  int evaluations = 0;
};

// The parameters the fitted records depend on: the efficiency and latency of every class their
// kernels use (per precision for gemm; not triangular_solve, which no record times apart from its
// factorization: it keeps the fp32 gemm rate), the launch overhead, and the backward launch
// overhead when a record times backward work alone (not chunk_forward_backward, where only the
// two overheads' sum acts; without such a record backward work keeps the launch overhead), and
// the curvature host overhead when a record times K-FAC curvature. A factorization's (or
// eigendecomposition's) efficiency only when the fitted records time it at two or more
// different sets of orders: from one set (every layer_inversion record of one model) its latency
// per panel and its rate are one equation, so the rate stays at the start device's. A
// class's efficiency curve in the kernel size
// (half_efficiency_size, size_exponent) is fitted when its kernels in the fitted records have at
// least kMinSizesForCurve distinct sizes (fewer cannot tell a curve from the flat efficiency),
// and each of the memory class's per-element compute terms (element_flop_s, exponential_s,
// error_function_s, random_number_s) when a fitted element-wise kernel does that work;
// exponential_s and error_function_s as one value unless some record times exp work without
// erf work or the reverse (layer records always do both: they cannot tell the two apart).
// With `outer_cache` (a start device that places the memory class's second cliff,
// outer_cache_bytes > 0) also that cliff's bytes and slowdown, when the fitted element-wise
// kernels have at least kMinSizesForOuterCache distinct sizes.
inline constexpr int kMinSizesForCurve = 4;
inline constexpr int kMinSizesForOuterCache = 6;
std::vector<FitParameter> parameters_of(const std::vector<Measurement>& measurements,
                                        bool outer_cache = false);

// Minimizes the sum over records not held out of log(predicted / measured)^2 over
// `parameters_of` (efficiencies in (0, 1], times >= 0), starting from `start`, by Nelder-Mead
// with restarts, leaving `options.keep` at the start's values. Throws std::invalid_argument when
// no record or no parameter is left to fit.
FitResult fit_device(const DeviceSpec& start, const std::vector<Measurement>& measurements,
                     const FitOptions& options = {});

}  // namespace pf::sim
