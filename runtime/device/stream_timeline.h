#pragma once
// Instruction times measured on the device, not on the host: a start and an end mark recorded
// in stream order around each instruction, read only after the step's synchronization (so the
// host never stalls per instruction), converted to the executor's host clock through an epoch
// mark pinned to a host time when the stream was idle. Device-neutral: CUDA events with timing
// on a GPU, HostTimingMark (host clock at record) for the CPU backend, whose work is done when
// the call returns.
#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <vector>

#include "runtime/device/device_runtime.h"

namespace pf::device {

class HostTimingMark final : public TimingMark {
 public:
  void record(tensor::Stream& stream) override;
  double seconds_since(const TimingMark& earlier) const override;

 private:
  std::chrono::steady_clock::time_point at_{};
  bool recorded_ = false;
};

struct TimedSpan {
  double start_s = 0.0;
  double end_s = 0.0;
};

class StreamTimeline {
 public:
  using MarkFactory = std::function<std::unique_ptr<TimingMark>()>;
  explicit StreamTimeline(MarkFactory make_mark);

  // Records the epoch on `stream`, waits for the stream, and pins the epoch to `host_now_s()`
  // (seconds on the caller's clock, read once the stream is idle). Drops unresolved spans (a
  // run that stopped mid-step starts over).
  void set_epoch(tensor::Stream& stream, const std::function<double()>& host_now_s);
  // Opens a span with a mark on `stream`; returns its id (begin order from 0 since the last
  // resolve). Throws std::logic_error before set_epoch.
  std::size_t begin(tensor::Stream& stream);
  // Moves span `id`'s start to now in `stream` (e.g. after the stream waited for its input, so
  // that the span holds the work, not the wait). Throws std::logic_error for an unknown or
  // closed span.
  void restart(std::size_t id, tensor::Stream& stream);
  // Closes span `id` with a mark on `stream` (the same or another stream). Throws
  // std::logic_error for an unknown or closed span.
  void end(std::size_t id, tensor::Stream& stream);
  std::size_t open_spans() const { return spans_; }
  // Once every stream that holds a mark has been synchronized: the spans in begin order, on the
  // host clock; then starts over (marks are reused). Throws std::logic_error when a span was
  // never closed.
  std::vector<TimedSpan> resolve();

 private:
  TimingMark& next_mark();
  void check_open(std::size_t id, const char* what) const;

  MarkFactory make_mark_;
  std::unique_ptr<TimingMark> epoch_;
  double epoch_host_s_ = 0.0;
  std::vector<std::unique_ptr<TimingMark>> marks_;  // start and end of each span, in pairs
  std::vector<bool> closed_;
  std::size_t used_ = 0;
  std::size_t spans_ = 0;
};

}  // namespace pf::device
