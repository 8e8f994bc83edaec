// Times the runtime's device kernels one class at a time and writes them as a measurements file
// for `pipefisher_sim calibrate` (sim/calibration.h), so that a device's per-class rates and its
// launch overhead can be fitted apart: a training step's records (pipefisher_train
// --calibration-out) are sums over every class and cannot separate them (docs/simulator.md,
// "This project's runtime on an H200"). Everything runs through the interfaces the executor uses
// on a device (kernels/backend_ops.h, device::DeviceRuntime's K-FAC layers, optimizers and timing
// marks), on CUDA (`--device cuda[:N]`) or on the host device runtime over the CPU backend
// (`--device host`, which the test suite runs, so the program's logic is checked without a GPU):
//   - GEMMs of BERT-Large's Linears (forward x W^T, input and weight gradients) at 128 ... 4096
//     tokens, in each product precision asked for (--precision; on CUDA bf16, tf32 and fp32 by
//     default; the K-FAC records run at the first, the precision the runtime is opened with);
//   - the attention's batched products (Q K^T and P V per head) at sequence 128 and 512;
//   - element-wise kernels (GELU, residual add, LayerNorm, masked softmax, dropout) from launch-
//     bound sizes to far past the caches, counted in bytes and per-element work as
//     sim/bert_kernels.cpp counts them;
//   - K-FAC: a factor's curvature (accumulate x^T x), its whole Cholesky inversion chain, one
//     Linear's preconditioning (by rows, all of them), and a LAMB step over a parameter set.
// Each record is the median of --repeats samples; a sample runs the case `count` times back to
// back between two timing marks on the stream (CUDA events on a GPU), `count` chosen so that a
// sample lasts about a millisecond: a launch-bound kernel's record is then its steady issue
// rate, as a pipeline's queue sees it (calibrate prices "count" kernels queued back to back).
// Round-robin as bench_sim_calibrate: every case is set up first; each repeat visits every case
// once, three untimed runs before its sample. Records alternate "shape_set" a and b (calibrate
// --hold-out shape_set=b).
//
//   bench_device_kernels [--device cuda|cuda:N|host] [--precision bf16,tf32,fp32] [--out F.json]
//                        [--repeats 5] [--max-tokens N] [--max-order D] [--smoke]
#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/elementwise_records.h"
#include "bench/warm_up.h"
#include "kernels/backend_ops.h"
#include "kernels/make_ops.h"
#include "kfac/pieces.h"
#include "runtime/device/device_runtime.h"
#include "runtime/device/device_spec.h"
#include "runtime/device/host_device_runtime.h"
#include "runtime/tensor/tensor.h"

namespace {

using namespace pf;
using kernels::ConstMatrixView;
using kernels::GemmPrecision;
using kernels::MatrixView;
using kernels::Transpose;
using nlohmann::json;

struct Settings {
  std::string device = "cuda";
  std::vector<GemmPrecision> precisions;
  std::string out;
  int repeats = 5;
  std::int64_t max_tokens = 0;  // 0: the device's default
  std::int64_t max_order = 0;
  bool smoke = false;
};

// What every case needs: the runtime, one stream, and device arrays that live as long as the
// cases (each case's closure holds its own).
class Bench {
 public:
  Bench(std::shared_ptr<device::DeviceRuntime> runtime, int repeats)
      : runtime_(std::move(runtime)), repeats_(repeats) {
    runtime_->bind_thread();
    stream_ = runtime_->backend().create_stream();
  }

  device::DeviceRuntime& runtime() { return *runtime_; }
  tensor::Stream* stream() { return stream_.get(); }

  // A device array of `count` deterministic pseudo-random floats in [-0.5, 0.5): no denormals,
  // no overflow however often a kernel rewrites its output, and x^T x of 2d rows is a well
  // conditioned factor (a periodic pattern would give one of low rank).
  std::shared_ptr<tensor::Tensor> array(std::int64_t count) {
    auto t = std::make_shared<tensor::Tensor>(
        tensor::Tensor::empty(runtime_->backend(), {count}, tensor::DType::kF32));
    std::vector<float> host(static_cast<std::size_t>(count));
    std::uint64_t state = 0x9E3779B97F4A7C15ULL ^ static_cast<std::uint64_t>(count);
    for (float& v : host) {
      state = state * 6364136223846793005ULL + 1442695040888963407ULL;
      v = static_cast<float>(state >> 40) / static_cast<float>(1 << 24) - 0.5F;
    }
    runtime_->backend().copy(t->raw_data(), host.data(), host.size() * sizeof(float),
                             tensor::CopyKind::kHostToDevice, stream_.get());
    stream_->synchronize();
    return t;
  }

  std::unique_ptr<kernels::BackendOps<float>> ops(GemmPrecision precision) {
    return kernels::make_ops<float>(runtime_->backend(), stream_.get(), precision);
  }

  void add(json record, std::function<void()> run) {
    record["shape_set"] = cases_.size() % 2 == 0 ? "a" : "b";
    cases_.push_back({std::move(record), std::move(run), 1, {}, {}, 0.0});
  }

  // Sizes each case's sample, times every case `repeats` times round-robin, and returns the
  // records (seconds: the median sample; count: runs per sample).
  json run() {
    const auto start = runtime_->create_timing_mark();
    const auto stop = runtime_->create_timing_mark();
    for (Case& c : cases_) {  // warm-up: first use (cuBLAS heuristics, scratch); sizes a sample
      c.run();
      c.one_s = sample(*start, *stop, c, 1).device_s;
      c.count = static_cast<int>(std::clamp(1e-3 / std::max(c.one_s, 1e-7), 1.0, 1000.0));
    }
    for (int r = 0; r < repeats_; ++r) {
      for (Case& c : cases_) {
        bench::warm_up(c.one_s, c.run);  // sample() waits for them
        const Sample s = sample(*start, *stop, c, c.count);
        c.device_s.push_back(s.device_s);
        c.host_s.push_back(s.host_s);
      }
    }
    json records = json::array();
    for (Case& c : cases_) {
      json record = c.record;
      const double median = median_of(c.device_s);
      record["count"] = c.count;
      record["seconds"] = median;
      record["spread"] = (quantile(c.device_s, 0.75) - quantile(c.device_s, 0.25)) / median;
      // The host's time to issue the sample (on a GPU, the launches without the wait): where it
      // is as long as the sample, the kernel is launch-bound.
      record["host_seconds"] = median_of(c.host_s);
      std::cerr << record.dump() << "\n";
      records.push_back(std::move(record));
    }
    return records;
  }

 private:
  struct Case {
    json record;
    std::function<void()> run;
    int count;
    std::vector<double> device_s, host_s;
    double one_s = 0.0;
  };
  struct Sample {
    double device_s, host_s;
  };

  Sample sample(device::TimingMark& start, device::TimingMark& stop, Case& c, int count) {
    stream_->synchronize();
    const auto host_start = std::chrono::steady_clock::now();
    start.record(*stream_);
    for (int i = 0; i < count; ++i) c.run();
    stop.record(*stream_);
    const double host_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - host_start).count();
    stream_->synchronize();
    return {stop.seconds_since(start), host_s};
  }
  static double quantile(std::vector<double> v, double q) {
    std::sort(v.begin(), v.end());
    return v[static_cast<std::size_t>(q * static_cast<double>(v.size() - 1) + 0.5)];
  }
  static double median_of(const std::vector<double>& v) { return quantile(v, 0.5); }

  std::shared_ptr<device::DeviceRuntime> runtime_;
  std::unique_ptr<tensor::Stream> stream_;
  int repeats_;
  std::vector<Case> cases_;
};

constexpr std::int64_t kHidden = 1024, kIntermediate = 4096, kHeads = 16, kHeadDim = 64;

std::vector<std::int64_t> token_counts(const Settings& s) {
  if (s.smoke) return {16, 32};
  std::vector<std::int64_t> out;
  for (std::int64_t t : {128, 512, 1024, 2048, 4096}) {
    if (t <= s.max_tokens) out.push_back(t);
  }
  return out;
}

void time_gemms(Bench& bench, const Settings& s) {
  // (m, n, k): c[m x n] = a[m x k] b[n x k]^T, as a Linear's forward. BERT-Large's Linears at
  // each token count T (QKV 1024 -> 3072, output 1024 -> 1024, FFN 1024 -> 4096 -> 1024), their
  // weight gradients (k = T), and a few square products for the size curve's small end.
  const std::int64_t h = s.smoke ? 32 : kHidden, i = s.smoke ? 64 : kIntermediate;
  std::vector<std::array<std::int64_t, 3>> shapes;
  if (!s.smoke) shapes = {{64, 64, 64}, {256, 256, 256}, {512, 512, 512}};
  for (std::int64_t t : token_counts(s)) {
    shapes.push_back({t, 3 * h, h});
    shapes.push_back({t, h, h});
    shapes.push_back({t, i, h});
    shapes.push_back({t, h, i});
    shapes.push_back({h, h, t});
    shapes.push_back({i, h, t});
  }
  for (GemmPrecision precision : s.precisions) {
    std::shared_ptr<kernels::BackendOps<float>> ops = bench.ops(precision);
    for (const auto& [m, n, k] : shapes) {
      auto a = bench.array(m * k), b = bench.array(n * k), c = bench.array(m * n);
      bench.add({{"operation", "gemm"},
                 {"m", m},
                 {"n", n},
                 {"k", k},
                 {"precision", kernels::to_string(precision)}},
                [ops, a, b, c, m, n, k] {
                  ops->gemm({a->data<float>(), m, k}, Transpose::kNo, {b->data<float>(), n, k},
                            Transpose::kYes, {c->data<float>(), m, n});
                });
    }
  }
}

void time_attention(Bench& bench, const Settings& s) {
  // Per (sequence, head): scores = Q K^T ([S x D] [D x S]) and context = P V ([S x S] [S x D]),
  // batch = sequences x heads, as the batched attention runs them.
  std::vector<std::array<std::int64_t, 2>> shapes;  // (sequences, S)
  if (s.smoke) {
    shapes = {{2, 16}};
  } else {
    for (std::int64_t b : {1, 4, 8, 32}) {
      if (b * 128 <= s.max_tokens) shapes.push_back({b, 128});
    }
    for (std::int64_t b : {1, 4}) {
      if (b * 512 <= s.max_tokens) shapes.push_back({b, 512});
    }
  }
  const std::int64_t heads = s.smoke ? 2 : kHeads, d = s.smoke ? 8 : kHeadDim;
  for (GemmPrecision precision : s.precisions) {
    std::shared_ptr<kernels::BackendOps<float>> ops = bench.ops(precision);
    for (const auto& [sequences, seq] : shapes) {
      const std::int64_t batch = sequences * heads;
      auto q = bench.array(batch * seq * d), k = bench.array(batch * seq * d),
           p = bench.array(batch * seq * seq), c = bench.array(batch * seq * d);
      const std::string p_name(kernels::to_string(precision));
      bench.add({{"operation", "attention"},
                 {"name", "scores"},
                 {"batch", batch},
                 {"m", seq},
                 {"n", seq},
                 {"k", d},
                 {"precision", p_name}},
                [ops, q, k, p, batch, seq, d] {
                  ops->batched_gemm(batch, {q->data<float>(), seq, d}, seq * d, Transpose::kNo,
                                    {k->data<float>(), seq, d}, seq * d, Transpose::kYes,
                                    {p->data<float>(), seq, seq}, seq * seq);
                });
      bench.add({{"operation", "attention"},
                 {"name", "context"},
                 {"batch", batch},
                 {"m", seq},
                 {"n", d},
                 {"k", seq},
                 {"precision", p_name}},
                [ops, p, k, c, batch, seq, d] {
                  ops->batched_gemm(batch, {p->data<float>(), seq, seq}, seq * seq, Transpose::kNo,
                                    {k->data<float>(), seq, d}, seq * d, Transpose::kNo,
                                    {c->data<float>(), seq, d}, seq * d);
                });
    }
  }
}

// The five element-wise kinds at rows x 1024, with the bytes and per-element work the simulator
// counts for them (bench/elementwise_records.h).
void time_elementwise(Bench& bench, const Settings& s) {
  const std::int64_t cols = s.smoke ? 32 : kHidden;
  std::vector<std::int64_t> rows = {8, 128, 1024, 4096, 16384, 65536};
  if (s.smoke) rows = {4, 16};
  std::shared_ptr<kernels::BackendOps<float>> ops = bench.ops(GemmPrecision::kFp32);
  for (std::int64_t r : rows) {
    if (!s.smoke && r > 16 * s.max_tokens) continue;
    const double n = static_cast<double>(r * cols);
    auto x = bench.array(r * cols), y = bench.array(r * cols), z = bench.array(r * cols);
    auto gamma = bench.array(cols), beta = bench.array(cols), mean = bench.array(r),
         rstd = bench.array(r);
    const ConstMatrixView<float> cx{x->data<float>(), r, cols}, cy{y->data<float>(), r, cols};
    const MatrixView<float> out{z->data<float>(), r, cols};
    const auto record = [n, r, cols](const char* name) {
      json entry = bench::elementwise_record(name, n);
      entry["rows"] = r;
      entry["cols"] = cols;
      return entry;
    };
    bench.add(record("gelu"), [ops, x, z, cx, out] { ops->gelu_forward(cx, out); });
    bench.add(record("add"), [ops, x, y, z, cx, cy, out] { ops->add(cx, cy, out); });
    bench.add(record("layernorm"), [ops, x, z, cx, out, gamma, beta, mean, rstd] {
      ops->layernorm_forward(cx, gamma->data<float>(), beta->data<float>(), 1e-12F, out,
                             mean->data<float>(), rstd->data<float>());
    });
    bench.add(record("softmax"),
              [ops, z, out] { ops->masked_softmax_forward(out, 0.125F, nullptr); });
    bench.add(record("dropout"), [ops, x, z, cx, out] { ops->dropout_forward(cx, out, 0.1F, 42); });
  }
}

// K-FAC on the device's layers, as the executor runs them: the curvature of one factor of one
// micro-batch (rows x order), one whole Cholesky inversion chain, one Linear's preconditioning
// (every row of its gradient), and a LAMB step. `precision`: the runtime's (K-FAC products
// follow it as the simulator's kfac_product_precision says).
void time_kfac(Bench& bench, const Settings& s, GemmPrecision precision) {
  auto& runtime = bench.runtime();
  const std::string p_name(kernels::to_string(precision));
  const std::int64_t h = s.smoke ? 16 : kHidden, i = s.smoke ? 48 : kIntermediate;
  // Curvature: factor A of a 1024 -> 4096 Linear (order 1024) and its B (order 4096).
  for (std::int64_t rows : token_counts(s)) {
    auto layer = std::shared_ptr<device::DeviceKfacLayer>(
        runtime.make_kfac_layer(bench.stream(), h, i, "bench curvature"));
    auto a = bench.array(rows * h), g = bench.array(rows * i);
    for (const bool is_a : {true, false}) {
      const std::int64_t order = is_a ? h : i;
      const auto x = is_a ? a : g;
      bench.add(
          {{"operation", "curvature"}, {"rows", rows}, {"order", order}, {"precision", p_name}},
          [layer, x, rows, order, is_a] {
            layer->accumulate(is_a, {x->data<float>(), rows, order}, 1.0F, 0, kfac::kPieceUnits);
          });
    }
  }
  // A positive definite factor for each order: the curvature of 2d rows.
  const auto factor_layer = [&](std::int64_t d_in, std::int64_t d_out) {
    auto layer = std::shared_ptr<device::DeviceKfacLayer>(
        runtime.make_kfac_layer(bench.stream(), d_in, d_out, "bench inverse"));
    const auto a = bench.array(2 * d_in * d_in), g = bench.array(2 * d_out * d_out);
    layer->accumulate(true, {a->data<float>(), 2 * d_in, d_in}, 1.0F, 0, kfac::kPieceUnits);
    layer->accumulate(false, {g->data<float>(), 2 * d_out, d_out}, 1.0F, 0, kfac::kPieceUnits);
    layer->finalize(true, 0.0F);
    layer->finalize(false, 0.0F);
    bench.stream()->synchronize();
    return layer;
  };
  std::vector<std::int64_t> orders = {256, 512, 1024, 2048, 3072, 4096};
  if (s.smoke) orders = {16, 48};
  for (std::int64_t d : orders) {
    if (d > s.max_order) continue;
    auto layer = factor_layer(d, 8);
    bench.add({{"operation", "cholesky_inverse"}, {"order", d}}, [layer] {
      layer->begin_inverse_chain(true, 1e-3F);
      layer->run_inverse_chain(true, 0, kfac::kPieceUnits);
    });
  }
  // Preconditioning: the attention output (1024 -> 1024), FFN in (1024 -> 4096) and out.
  std::vector<std::array<std::int64_t, 2>> linears = {{h, h}, {h, i}, {i, h}};
  for (const auto& [d_in, d_out] : linears) {
    if (std::max(d_in, d_out) > s.max_order) continue;
    auto layer = factor_layer(d_in, d_out);
    layer->invert(true, 1e-3F, kfac::InverseMethod::kCholesky);
    layer->invert(false, 1e-3F, kfac::InverseMethod::kCholesky);
    auto grad_w = bench.array(d_out * d_in), grad_b = bench.array(d_out),
         out_w = bench.array(d_out * d_in), out_b = bench.array(d_out);
    bench.add(
        {{"operation", "precondition"}, {"d_in", d_in}, {"d_out", d_out}, {"precision", p_name}},
        [layer, grad_w, grad_b, out_w, out_b] {
          layer->precondition_rows(false, false, grad_w->data<float>(), grad_b->data<float>(), 0,
                                   kfac::kPieceUnits, out_w->data<float>(), out_b->data<float>());
        });
  }
  // LAMB over a parameter set of `params` floats in 1024 x 1024 matrices (a BERT-Large layer:
  // 12.6 M), its gradient norm given as the executor gives it (all-reduced apart).
  std::vector<std::int64_t> param_counts = {1 << 20, 12 << 20};
  if (s.smoke) param_counts = {4096};
  for (std::int64_t params : param_counts) {
    const std::int64_t matrix = std::min<std::int64_t>(params, 1 << 20);
    auto optimizer = std::shared_ptr<optim::Optimizer>(
        runtime.make_optimizer(device::OptimizerChoice{}, bench.stream()));
    std::vector<std::shared_ptr<tensor::Tensor>> held;
    auto views = std::make_shared<std::vector<optim::ParamView>>();
    for (std::int64_t done = 0; done < params; done += matrix) {
      held.push_back(bench.array(matrix));
      held.push_back(bench.array(matrix));
      views->push_back({"w" + std::to_string(views->size()),
                        held[held.size() - 2]->data<float>(),
                        held.back()->data<float>(),
                        static_cast<std::size_t>(matrix),
                        {matrix},
                        false});
    }
    bench.add({{"operation", "optimizer_step"}, {"params", params}},
              [optimizer, views, held] { optimizer->step(*views, 1e-4F, 1.0); });
  }
}

std::vector<GemmPrecision> parse_precisions(const std::string& list) {
  std::vector<GemmPrecision> out;
  std::stringstream in(list);
  std::string item;
  while (std::getline(in, item, ',')) out.push_back(kernels::parse_gemm_precision(item));
  if (out.empty()) throw std::invalid_argument("--precision: give at least one precision");
  return out;
}

int usage(const std::string& what) {
  std::fprintf(stderr,
               "bench_device_kernels: %s\nusage: bench_device_kernels [--device cuda|cuda:N|host] "
               "[--precision bf16,tf32,fp32] [--out FILE.json] [--repeats N] [--max-tokens N] "
               "[--max-order D] [--smoke]\n",
               what.c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  std::string precisions;
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string arg = argv[i];
      const auto value = [&]() -> std::string {
        if (i + 1 >= argc) throw std::invalid_argument(arg + " needs a value");
        return argv[++i];
      };
      const auto positive = [&]() {
        const std::string v = value();
        const long long parsed = std::atoll(v.c_str());
        if (parsed <= 0)
          throw std::invalid_argument(arg + " needs a positive integer, not '" + v + "'");
        return static_cast<std::int64_t>(parsed);
      };
      if (arg == "--smoke") {
        s.smoke = true;
      } else if (arg == "--device") {
        s.device = value();
      } else if (arg == "--precision") {
        precisions = value();
      } else if (arg == "--out") {
        s.out = value();
      } else if (arg == "--repeats") {
        s.repeats = static_cast<int>(std::min<std::int64_t>(positive(), 1000));
      } else if (arg == "--max-tokens") {
        s.max_tokens = positive();
      } else if (arg == "--max-order") {
        s.max_order = positive();
      } else {
        return usage("unknown argument '" + arg + "'");
      }
    }
  } catch (const std::invalid_argument& e) {
    return usage(e.what());
  }
  const bool host = s.device == "host";
  std::shared_ptr<device::DeviceRuntime> runtime;
  try {
    s.precisions =
        parse_precisions(precisions.empty() ? (host ? "fp32" : "bf16,tf32,fp32") : precisions);
    if (host) {
      for (GemmPrecision p : s.precisions) {
        if (p != GemmPrecision::kFp32) {
          return usage("--device host computes in fp32 only, not " +
                       std::string(kernels::to_string(p)));
        }
      }
      runtime = std::make_shared<device::HostDeviceRuntime>();
    } else {
      const tensor::Device where = device::parse_device(s.device);
      if (where.kind != tensor::DeviceKind::kCuda) {
        return usage("--device: cuda, cuda:N or host, not '" + s.device + "'");
      }
      runtime = device::open_device_runtime(where, s.precisions.front());
    }
  } catch (const device::DeviceUnavailableError& e) {
    // A build or machine without a GPU: nothing to time (the test suite runs --device host).
    std::printf("bench_device_kernels: skipped: %s\n", e.what());
    return 0;
  } catch (const std::invalid_argument& e) {
    return usage(e.what());
  }
  if (s.max_tokens == 0) s.max_tokens = host ? 1024 : 4096;
  if (s.max_order == 0) s.max_order = host ? 2048 : 4096;
  if (s.smoke) s.repeats = 1;
  json records;
  try {
    Bench bench(runtime, s.repeats);
    time_gemms(bench, s);
    time_attention(bench, s);
    time_elementwise(bench, s);
    time_kfac(bench, s, s.precisions.front());
    records = bench.run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_device_kernels: %s\n", e.what());
    return 1;
  }
  const json out = {
      {"format_version", 1},
      {"description", "The runtime's device kernels on " +
                          (host ? std::string("the host device runtime (CPU backend)")
                                : tensor::to_string(runtime->device())) +
                          ", one class at a time, median of " + std::to_string(s.repeats) +
                          " samples of `count` back-to-back runs between timing marks; written "
                          "by bench_device_kernels."},
      {"device", host ? std::string("host") : tensor::to_string(runtime->device())},
      {"defaults", {{"precision", "fp32"}}},
      {"measurements", records}};
  if (s.out.empty()) {
    std::cout << out.dump(1) << "\n";
    return 0;
  }
  std::ofstream file(s.out);
  file << out.dump(1) << "\n";
  if (!file) {
    std::fprintf(stderr, "bench_device_kernels: cannot write %s\n", s.out.c_str());
    return 1;
  }
  std::printf("wrote %zu measurements to %s\n", records.size(), s.out.c_str());
  return 0;
}
