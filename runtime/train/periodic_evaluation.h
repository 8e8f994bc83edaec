#pragma once
// pipefisher_train's pauses: the run is executed in segments ending at the evaluation steps
// (--eval-every) and the last step; at each pause every worker is idle, so the held-out set is
// evaluated on a copy of the weights, the K-FAC statistics are read, and the run stops early once
// the held-out loss reaches --target-loss. Splitting the run does not change what it computes
// (the executor resumes a k-step round where it stopped); the pauses are left out of the
// measured step times.
#include <cstdint>
#include <functional>
#include <iosfwd>
#include <memory>
#include <optional>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/executor/executor.h"
#include "runtime/train/evaluation.h"
#include "runtime/train/train_options.h"

namespace pf::train {

template <typename T>
class PeriodicEvaluation {
 public:
  // Loads the evaluation set when --eval-data is given (throws std::invalid_argument for a bad
  // one, or when the executor runs in several processes: the evaluation copies the whole model
  // out of the workers, which only the threaded executor holds in one process).
  // max_predictions: masked slots per sequence of the training data (synthetic sets).
  PeriodicEvaluation(const TrainOptions& options, const model::BertConfig& config,
                     std::int64_t micro_batch_size, std::int64_t seq_len,
                     std::int64_t max_predictions, const exec::Executor<T>& executor);

  // The end of the segment that starts at step `from` (exclusive end, at most `last`).
  std::int64_t segment_end(std::int64_t from, std::int64_t last) const;

  // After `steps_done` steps (train_time_s: their summed step times). Evaluates when an
  // evaluation is due, writes {"kind": "eval", ...} and {"kind": "kfac", ...} records through
  // `write`, prints a line, and returns true when the target loss is reached.
  // K-FAC statistics need the threaded executor too (none are written otherwise).
  bool at_pause(exec::Executor<T>& executor, std::int64_t steps_done, double train_time_s,
                bool last, const std::function<void(const nlohmann::json&)>& write,
                std::ostream& out);

  // The step at which the target was reached, if it was.
  std::optional<std::int64_t> target_step() const { return target_step_; }
  std::optional<double> target_time_s() const { return target_time_s_; }

 private:
  const TrainOptions& options_;
  std::unique_ptr<Evaluator<T>> evaluator_;
  std::optional<std::int64_t> target_step_;
  std::optional<double> target_time_s_;
};

// Removes the pauses between segments from a run's events: every event of a step >= boundary
// (and everything after it) moves earlier by the idle gap between the segments, so the measured
// summary and trace show the training alone. boundaries: the first step of each later segment.
void close_pauses(std::vector<exec::InstructionEvent>& events,
                  const std::vector<std::int64_t>& boundaries);

extern template class PeriodicEvaluation<float>;
extern template class PeriodicEvaluation<double>;

}  // namespace pf::train
