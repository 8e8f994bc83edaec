// Times this machine's CPU kernels (the ones the runtime runs) and writes them as a measurements
// file for `pipefisher_sim calibrate` (sim/calibration.h): dense GEMMs of several shapes (the
// Linear layers', their weight gradients', K-FAC's), the attention's batched products,
// element-wise passes (GELU, LayerNorm, residual add) and Cholesky inverses of K-FAC factors.
// Every figure is the median of --repeats timed samples, timed by the process's CPU clock
// (--clock cpu, the default: with one thread it is the kernel's own time, which the other
// programs sharing this machine's cores do not inflate) or the wall clock (--clock wall).
// Round-robin: every case is set up first; each repeat then visits every case once in turn (one
// untimed run to bring its data into the caches, then the timed sample), so that a swing of the
// machine's load hits all shapes alike instead of the few timed while it lasted. Each record
// carries its samples' spread ((75th - 25th percentile) / median), so that noisy records can be
// seen and left out (`calibrate --max-spread`); the file carries the load average before and after
// and this machine's cache levels (/sys/devices/system/cpu/cpu0/cache), for the reader.
// Records alternate between "shape_set": "a" and "b", so that `calibrate --hold-out shape_set=b`
// fits on half the shapes and reports the other half's error.
//
//   bench_sim_calibrate [--out FILE.json] [--threads 1] [--repeats 5] [--max-order 2048]
//                       [--clock cpu|wall] [--sequential]
//   (--sequential: the previous order, each case's samples back to back)
//   bench_sim_calibrate --smoke     (small shapes, for the test suite)
#include <omp.h>
#include <stdlib.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include <Eigen/Dense>
#include <nlohmann/json.hpp>

#include "bench/elementwise_records.h"
#include "bench/warm_up.h"
#include "common/cpu_caches.h"
#include "kernels/cpu/dense_library.h"
#include "kernels/ops.h"
#include "kfac/inverse.h"

namespace {

using namespace pf;
using kernels::ConstMatrixView;
using kernels::MatrixView;
using kernels::Transpose;

struct Settings {
  std::string out;
  int threads = 1;
  int repeats = 5;
  int max_order = 2048;
  bool smoke = false;
  bool cpu_clock = true;
  bool sequential = false;
};

double now_seconds(bool cpu_clock) {
  if (!cpu_clock) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

// A sample runs the kernel enough times back to back to take about a millisecond (small kernels
// would otherwise be timed at the clock's and the scheduler's granularity) and reports the time
// per run.
int runs_per_sample(double one_run_seconds) {
  return static_cast<int>(std::clamp(1e-3 / std::max(one_run_seconds, 1e-7), 1.0, 1000.0));
}

double sample_seconds(bool cpu_clock, int inner, const std::function<void()>& run) {
  const double start = now_seconds(cpu_clock);
  for (int i = 0; i < inner; ++i) run();
  return (now_seconds(cpu_clock) - start) / inner;
}

std::vector<float> filled(std::int64_t n, float value = 0.01f) {
  std::vector<float> v(static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = value * static_cast<float>(i % 97) - 0.4f;
  return v;
}
using Buffer = std::shared_ptr<std::vector<float>>;
Buffer buffer(std::int64_t n, float value = 0.01f) {
  return std::make_shared<std::vector<float>>(filled(n, value));
}

// The cases are set up first (each owns its buffers) and timed afterwards, round-robin or one
// after another.
class Recorder {
 public:
  Recorder(int repeats, bool cpu_clock, bool sequential)
      : repeats_(repeats), cpu_clock_(cpu_clock), sequential_(sequential) {}
  // The shape set alternates with the case's position unless the caller names it.
  void add(nlohmann::json record, std::function<void()> run, const char* shape_set = nullptr) {
    record["shape_set"] = shape_set != nullptr ? shape_set : cases_.size() % 2 == 0 ? "a" : "b";
    cases_.push_back({std::move(record), std::move(run), 1, 0.0, {}});
  }
  void run() {
    for (Case& c : cases_) {  // warm-up: first-touch pages, caches; sizes the samples
      const double start = now_seconds(cpu_clock_);
      c.run();
      c.one_run = now_seconds(cpu_clock_) - start;
      c.inner = runs_per_sample(c.one_run);
    }
    if (sequential_) {
      for (Case& c : cases_) {
        for (int r = 0; r < repeats_; ++r)
          c.samples.push_back(sample_seconds(cpu_clock_, c.inner, c.run));
      }
    } else {
      for (int r = 0; r < repeats_; ++r) {
        for (Case& c : cases_) {
          bench::warm_up(c.one_run, c.run);
          c.samples.push_back(sample_seconds(cpu_clock_, c.inner, c.run));
        }
      }
    }
    for (Case& c : cases_) {
      std::vector<double> t = c.samples;
      std::sort(t.begin(), t.end());
      const auto at = [&](double q) {
        return t[static_cast<std::size_t>(q * static_cast<double>(t.size() - 1) + 0.5)];
      };
      c.record["seconds"] = t[t.size() / 2];
      c.record["spread"] = (at(0.75) - at(0.25)) / t[t.size() / 2];
      std::cerr << c.record.dump() << "\n";
      records_.push_back(c.record);
    }
  }
  const nlohmann::json& records() const { return records_; }

 private:
  struct Case {
    nlohmann::json record;
    std::function<void()> run;
    int inner;
    double one_run;
    std::vector<double> samples;
  };
  int repeats_;
  bool cpu_clock_;
  bool sequential_;
  std::vector<Case> cases_;
  nlohmann::json records_ = nlohmann::json::array();
};

// This machine's data and unified caches, innermost first, from sysfs (empty where it has none).
nlohmann::json cache_levels() {
  nlohmann::json levels = nlohmann::json::array();
  for (const CacheLevel& cache : cpu_data_caches()) {
    levels.push_back({{"level", cache.level}, {"bytes", cache.bytes}});
  }
  return levels;
}

double load_average() {
  double load[1] = {0.0};
  return getloadavg(load, 1) == 1 ? load[0] : -1.0;
}

void time_gemms(Recorder& rec, bool smoke) {
  // (m, n, k): c[m x n] = a[m x k] b[k x n]. BERT-mini (T = 1024 tokens, H = 256, I = 1024) and
  // BERT-base-sized Linears, their weight gradients (k = T), the MLM decoder, K-FAC products.
  // Small and skinny products (the pooler's 8 rows, the MLM decoder's 160 scored positions and
  // its weight gradient) trace the efficiency curve in the smallest dimension.
  std::vector<std::array<std::int64_t, 3>> shapes = {
      {8, 256, 256},     {64, 64, 64},     {96, 96, 96},       {128, 128, 128},   {256, 256, 256},
      {1024, 256, 256},  {256, 256, 1024}, {1024, 1024, 256},  {1024, 256, 1024}, {1024, 768, 256},
      {256, 1024, 1024}, {512, 512, 512},  {160, 8192, 256},   {160, 256, 8192},  {8192, 256, 160},
      {2048, 768, 768},  {768, 768, 2048}, {1024, 1024, 1024}, {2048, 2048, 512}, {4096, 64, 256}};
  if (smoke) shapes = {{32, 32, 32}, {64, 48, 80}};
  for (const auto& [m, n, k] : shapes) {
    auto a = buffer(m * k), b = buffer(k * n), c = buffer(m * n);
    rec.add({{"operation", "gemm"}, {"m", m}, {"n", n}, {"k", k}, {"precision", "fp32"}},
            [a, b, c, m, n, k] {
              kernels::gemm<float>(ConstMatrixView<float>{a->data(), m, k}, Transpose::kNo,
                                   ConstMatrixView<float>{b->data(), k, n}, Transpose::kNo,
                                   MatrixView<float>{c->data(), m, n});
            });
  }
}

void time_attention(Recorder& rec, bool smoke) {
  // Q K^T per (sequence, head): batch = b x heads products of [S x D] [D x S]. Head widths 16
  // to 128 and sequences 64 to 512 in both shape sets (records alternate a, b), so that the
  // fit sees the class's size curve (a product's smallest dimension) and the held-out shapes
  // test it: a narrow head's short inner products run well below a wide one's rate.
  std::vector<std::array<std::int64_t, 3>> shapes = {
      {32, 128, 64},  {64, 128, 32},  {128, 128, 64}, {32, 256, 64}, {128, 128, 16},
      {32, 128, 128}, {16, 256, 128}, {16, 512, 32},  {128, 64, 32}, {8, 512, 64}};
  if (smoke) shapes = {{4, 16, 8}};
  for (const auto& [batch, s, d] : shapes) {
    auto q = buffer(batch * s * d), k = buffer(batch * s * d), c = buffer(batch * s * s);
    rec.add({{"operation", "attention"},
             {"batch", batch},
             {"m", s},
             {"n", s},
             {"k", d},
             {"precision", "fp32"}},
            [q, k, c, batch, s, d] {
              kernels::batched_gemm<float>(batch, ConstMatrixView<float>{q->data(), s, d}, s * d,
                                           Transpose::kNo, ConstMatrixView<float>{k->data(), s, d},
                                           s * d, Transpose::kYes,
                                           MatrixView<float>{c->data(), s, s}, s * s);
            });
  }
}

// The five element-wise kinds at `rows` x 256. `sets` names each kind's shape set in the order
// gelu, add, layernorm, softmax, dropout; empty: alternate with the case's position.
void time_memory_kinds(Recorder& rec, std::int64_t r, const std::vector<const char*>& sets = {}) {
  const auto set = [&](std::size_t kind) { return sets.empty() ? nullptr : sets[kind]; };
  const std::int64_t cols = 256;
  const double n = static_cast<double>(r * cols);
  auto x = buffer(r * cols), y = buffer(r * cols), z = buffer(r * cols);
  const ConstMatrixView<float> cx{x->data(), r, cols}, cy{y->data(), r, cols};
  const MatrixView<float> out{z->data(), r, cols};
  // Bytes moved and per-element arithmetic as the simulator counts them
  // (bench/elementwise_records.h). Five kinds per size, so that each kind lands in both shape
  // sets.
  const auto record = [n](const char* name) { return bench::elementwise_record(name, n); };
  rec.add(
      record("gelu"), [x, z, cx, out] { kernels::gelu_forward<float>(cx, out); }, set(0));
  rec.add(
      record("add"), [x, y, z, cx, cy, out] { kernels::add<float>(cx, cy, out); }, set(1));
  auto gamma = buffer(cols, 0.0f), beta = buffer(cols, 0.0f), mean = buffer(r), rstd = buffer(r);
  rec.add(
      record("layernorm"),
      [x, z, cx, out, gamma, beta, mean, rstd] {
        kernels::layernorm_forward<float>(cx, gamma->data(), beta->data(), 1e-12f, out,
                                          mean->data(), rstd->data());
      },
      set(2));
  rec.add(
      record("softmax"), [z, out] { kernels::masked_softmax_forward<float>(out, 0.125f, nullptr); },
      set(3));
  rec.add(
      record("dropout"), [x, z, cx, out] { kernels::dropout_forward<float>(cx, out, 0.1f, 42); },
      set(4));
}

void time_memory(Recorder& rec, bool smoke) {
  std::vector<std::int64_t> rows = {256, 1024, 4096, 16384};
  if (smoke) rows = {16};
  for (std::int64_t r : rows) time_memory_kinds(rec, r);
}

// The five kinds once more past the caches (32768 rows: 33.5 MB a tensor), in the sets opposite
// to those of 16384 rows: there GELU, LayerNorm and dropout are held out and the add and softmax
// fitted, so without this the fit sees no kernel whose arithmetic and memory traffic are both
// comparable beyond the caches, where the roofline exponent is decided (it fitted the in-place
// softmax alone and missed LayerNorm at 33.5 MB by 19%). After the bandwidth adds, so that the
// records before keep their shape sets.
void time_memory_beyond_cache(Recorder& rec, bool smoke) {
  time_memory_kinds(rec, smoke ? 32 : 32768, {"a", "b", "a", "b", "a"});
}

// The residual add at more working sets (192 KiB ... 96 MiB, several between 6 and 24 MiB, where
// this machine's bandwidth falls out of its shared L3): the element-wise bandwidth through the
// cache levels, in both shape sets. After the inverses, so that the records before keep their
// shape sets.
// Then more of them, in named shape sets so that each set has adds inside the L2, between the
// two cliffs and past the last-level cache, where the memory class's two cliffs
// (half_efficiency_size, outer_cache_bytes) are placed: with one in-L2 add in the fitted set the
// fit drew the first cliff through it and missed the held-out ones by 30%.
void time_bandwidth(Recorder& rec, bool smoke) {
  std::vector<std::pair<std::int64_t, const char*>> rows = {
      {64, nullptr},   {128, nullptr},  {512, nullptr},  {2048, nullptr},  {3072, nullptr},
      {5120, nullptr}, {6144, nullptr}, {8192, nullptr}, {32768, nullptr}, {32, "a"},
      {96, "b"},       {192, "a"},      {384, "b"},      {768, "a"},       {1536, "b"},
      {12288, "a"},    {24576, "b"}};
  if (smoke) rows = {{8, nullptr}};
  const std::int64_t cols = 256;
  for (const auto& [r, shape_set] : rows) {
    const double n = static_cast<double>(r * cols);
    auto x = buffer(r * cols), y = buffer(r * cols), z = buffer(r * cols);
    const ConstMatrixView<float> cx{x->data(), r, cols}, cy{y->data(), r, cols};
    const MatrixView<float> out{z->data(), r, cols};
    rec.add(
        {{"operation", "memory"}, {"name", "add"}, {"bytes", 12.0 * n}, {"flops", n}},
        [x, y, z, cx, cy, out] { kernels::add<float>(cx, cy, out); }, shape_set);
  }
}

void time_inverses(Recorder& rec, int max_order, bool smoke) {
  std::vector<int> orders = {128, 256, 384, 512, 640, 768, 896, 1024, 1280, 1536, 2048, 3072, 4096};
  if (smoke) orders = {16, 32};
  for (int d : orders) {
    if (d > max_order) continue;
    // A K-FAC-like factor: a^T a / rows of random activations, positive definite.
    const Eigen::MatrixXf a = Eigen::MatrixXf::Random(2 * d, d);
    auto factor =
        std::make_shared<const Eigen::MatrixXf>((a.transpose() * a) / static_cast<float>(2 * d));
    rec.add({{"operation", "cholesky_inverse"}, {"order", d}}, [factor] {
      const auto result = kfac::damped_inverse(*factor, 1e-3f, kfac::InverseMethod::kCholesky);
      if (result.fell_back_to_eigen) throw std::runtime_error("Cholesky fell back to eigen");
    });
  }
}

int usage(const char* what) {
  std::fprintf(stderr,
               "bench_sim_calibrate: %s\nusage: bench_sim_calibrate [--out FILE.json] "
               "[--threads N] [--repeats N] [--max-order D] [--clock cpu|wall] [--sequential] "
               "[--smoke]\n",
               what);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> const char* { return i + 1 < argc ? argv[++i] : nullptr; };
    auto positive = [&](int& field) {
      const char* v = value();
      const int parsed = v != nullptr ? std::atoi(v) : 0;
      if (parsed <= 0) return false;
      field = parsed;
      return true;
    };
    if (arg == "--smoke") {
      s.smoke = true;
    } else if (arg == "--sequential") {
      s.sequential = true;
    } else if (arg == "--out") {
      const char* v = value();
      if (v == nullptr) return usage("--out needs a file name");
      s.out = v;
    } else if (arg == "--threads") {
      if (!positive(s.threads)) return usage("--threads needs a positive integer");
    } else if (arg == "--repeats") {
      if (!positive(s.repeats)) return usage("--repeats needs a positive integer");
    } else if (arg == "--max-order") {
      if (!positive(s.max_order)) return usage("--max-order needs a positive integer");
    } else if (arg == "--clock") {
      const char* v = value();
      if (v == nullptr || (std::strcmp(v, "cpu") != 0 && std::strcmp(v, "wall") != 0)) {
        return usage("--clock needs cpu or wall");
      }
      s.cpu_clock = std::strcmp(v, "cpu") == 0;
    } else {
      return usage(("unknown argument '" + arg + "'").c_str());
    }
  }
  if (s.smoke) s.repeats = 1;
  omp_set_num_threads(s.threads);
  Eigen::setNbThreads(s.threads);
  if (s.cpu_clock && s.threads != 1) return usage("--clock cpu needs --threads 1");
  Recorder rec(s.repeats, s.cpu_clock, s.sequential);
  const double load_before = load_average();
  std::string dense_library;
  try {
    dense_library = pf::kernels::cpu::dense_library().summary;
    time_gemms(rec, s.smoke);
    time_attention(rec, s.smoke);
    time_memory(rec, s.smoke);
    time_inverses(rec, s.max_order, s.smoke);
    time_bandwidth(rec, s.smoke);
    time_memory_beyond_cache(rec, s.smoke);
    rec.run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_sim_calibrate: %s\n", e.what());
    return 1;
  }
  const nlohmann::json out = {
      {"format_version", 1},
      {"description", "This machine's CPU kernels (kernels/ops.h, kfac/inverse.h), fp32, " +
                          std::to_string(s.threads) + " thread(s), median of " +
                          std::to_string(s.repeats) + " samples after a warm-up (" +
                          (s.sequential ? "one case after another"
                                        : "round-robin, " + std::to_string(bench::kWarmUpRuns) +
                                              " untimed runs before each sample") +
                          "), " + (s.cpu_clock ? "process CPU time" : "wall time") +
                          "; written by bench_sim_calibrate."},
      {"load_average", {{"before", load_before}, {"after", load_average()}}},
      {"caches", cache_levels()},
      {"dense_library", dense_library},
      {"defaults", {{"precision", "fp32"}}},
      {"measurements", rec.records()}};
  if (s.out.empty()) {
    std::cout << out.dump(1) << "\n";
  } else {
    std::ofstream file(s.out);
    file << out.dump(1) << "\n";
    if (!file) return usage(("cannot write " + s.out).c_str());
    std::printf("wrote %zu measurements to %s\n", rec.records().size(), s.out.c_str());
  }
  return 0;
}
