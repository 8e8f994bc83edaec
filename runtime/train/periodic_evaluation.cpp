#include "runtime/train/periodic_evaluation.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <iomanip>
#include <limits>
#include <ostream>
#include <stdexcept>

#include "runtime/executor/batch_source.h"
#include "runtime/train/kfac_statistics.h"

namespace pf::train {

namespace {

// Synthetic evaluation batches come from a stream no training seed reaches (training uses
// seed + 2 for small seeds).
constexpr std::uint64_t kSyntheticEvalSeed = 0x5eed0e7a1ULL;
constexpr std::int64_t kSyntheticEvalBatches = 16;

bool has_kfac_work(const sched::Schedule& schedule) {
  for (const auto& stream : schedule.streams) {
    for (const auto& in : stream) {
      if (sched::is_kfac(in.kind)) return true;
    }
  }
  return false;
}

}  // namespace

template <typename T>
PeriodicEvaluation<T>::PeriodicEvaluation(const TrainOptions& options,
                                          const model::BertConfig& config,
                                          std::int64_t micro_batch_size, std::int64_t seq_len,
                                          std::int64_t max_predictions,
                                          const exec::Executor<T>& executor)
    : options_(options) {
  if (options.eval_data.empty()) return;
  if (dynamic_cast<const exec::ThreadedExecutor<T>*>(&executor) == nullptr) {
    throw std::invalid_argument(
        "--eval-data: evaluation runs in one process (threads); under mpirun drop it and "
        "evaluate a checkpoint instead");
  }
  std::vector<std::shared_ptr<const model::Batch>> batches;
  if (options.eval_data == "synthetic") {
    exec::SyntheticBatches source(config, micro_batch_size, seq_len, max_predictions,
                                  kSyntheticEvalSeed);
    const std::int64_t count =
        options.eval_batches > 0 ? options.eval_batches : kSyntheticEvalBatches;
    for (std::int64_t i = 0; i < count; ++i)
      batches.push_back(source.batch(0, static_cast<int>(i)));
  } else {
    batches = load_eval_batches(options.eval_data, micro_batch_size, options.eval_batches, seq_len);
  }
  // On the training run's device, if it has one.
  evaluator_ = std::make_unique<Evaluator<T>>(config, std::move(batches), executor.setup().device);
}

template <typename T>
std::int64_t PeriodicEvaluation<T>::segment_end(std::int64_t from, std::int64_t last) const {
  if (!evaluator_ || options_.eval_every <= 0) return last;
  const std::int64_t next = (from / options_.eval_every + 1) * options_.eval_every;
  return std::min(next, last);
}

template <typename T>
bool PeriodicEvaluation<T>::at_pause(exec::Executor<T>& any_executor, std::int64_t steps_done,
                                     double train_time_s, bool last,
                                     const std::function<void(const nlohmann::json&)>& write,
                                     std::ostream& out) {
  auto* threaded = dynamic_cast<exec::ThreadedExecutor<T>*>(&any_executor);
  if (threaded == nullptr) return false;  // refused at construction when evaluating
  auto& executor = *threaded;
  if constexpr (std::is_same_v<T, float>) {
    if (has_kfac_work(executor.setup().schedule)) {
      auto record = kfac_statistics(executor);
      record["kind"] = "kfac";
      record["step"] = steps_done;
      record["lambda"] = executor.setup().options.kfac.damping;
      record["refresh_steps"] = executor.setup().schedule.num_steps;
      write(record);
    }
  }
  if (!evaluator_) return false;
  const bool due = last || (options_.eval_every > 0 && steps_done % options_.eval_every == 0);
  if (!due) return false;
  const auto start = std::chrono::steady_clock::now();
  const EvalMetrics metrics = evaluator_->evaluate(executor);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const bool reached = options_.target_loss > 0 && metrics.loss() <= options_.target_loss;
  if (reached && !target_step_) {
    target_step_ = steps_done;
    target_time_s_ = train_time_s;
  }
  write({{"kind", "eval"},
         {"step", steps_done},
         {"train_time_s", train_time_s},
         {"eval_loss", metrics.loss()},
         {"eval_mlm_loss", metrics.mlm_loss()},
         {"eval_mlm_accuracy", metrics.mlm_accuracy()},
         {"eval_nsp_loss", metrics.nsp_loss()},
         {"eval_nsp_accuracy", metrics.nsp_accuracy()},
         {"eval_predictions", metrics.mlm_predictions},
         {"eval_sequences", metrics.sequences},
         {"eval_seconds", seconds}});
  if (!options_.quiet) {
    out << std::fixed << "eval  " << std::setw(5) << steps_done << "  loss " << std::setprecision(4)
        << metrics.loss() << " (mlm " << metrics.mlm_loss() << ", acc " << std::setprecision(3)
        << metrics.mlm_accuracy() << "; nsp " << std::setprecision(4) << metrics.nsp_loss()
        << ", acc " << std::setprecision(3) << metrics.nsp_accuracy() << ") on "
        << static_cast<std::int64_t>(metrics.sequences) << " held-out sequences\n";
  }
  if (reached) {
    out << std::fixed << std::setprecision(4) << "target loss " << options_.target_loss
        << " reached at step " << steps_done << " after " << std::setprecision(1) << train_time_s
        << " s of training\n";
  }
  return reached;
}

void close_pauses(std::vector<exec::InstructionEvent>& events,
                  const std::vector<std::int64_t>& boundaries) {
  for (const std::int64_t boundary : boundaries) {
    double before_end = -std::numeric_limits<double>::infinity();
    double after_start = std::numeric_limits<double>::infinity();
    for (const auto& event : events) {
      if (event.global_step < boundary) {
        before_end = std::max(before_end, event.end_s);
      } else {
        after_start = std::min(after_start, event.start_s);
      }
    }
    const double gap = after_start - before_end;
    if (!(gap > 0) || !std::isfinite(gap)) continue;
    for (auto& event : events) {
      if (event.global_step < boundary) continue;
      event.start_s -= gap;
      event.end_s -= gap;
    }
  }
}

template class PeriodicEvaluation<float>;
template class PeriodicEvaluation<double>;

}  // namespace pf::train
