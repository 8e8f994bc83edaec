#include "runtime/device/stream_timeline.h"

#include <stdexcept>
#include <string>

namespace pf::device {

void HostTimingMark::record(tensor::Stream& /*stream*/) {
  at_ = std::chrono::steady_clock::now();
  recorded_ = true;
}

double HostTimingMark::seconds_since(const TimingMark& earlier) const {
  const auto& other = dynamic_cast<const HostTimingMark&>(earlier);
  if (!recorded_ || !other.recorded_) {
    throw std::logic_error("HostTimingMark: a mark read before it was recorded");
  }
  return std::chrono::duration<double>(at_ - other.at_).count();
}

StreamTimeline::StreamTimeline(MarkFactory make_mark) : make_mark_(std::move(make_mark)) {
  if (!make_mark_) throw std::invalid_argument("StreamTimeline: no mark factory");
}

void StreamTimeline::set_epoch(tensor::Stream& stream, const std::function<double()>& host_now_s) {
  spans_ = 0;
  used_ = 0;
  closed_.clear();
  if (!epoch_) epoch_ = make_mark_();
  epoch_->record(stream);
  stream.synchronize();
  epoch_host_s_ = host_now_s();
}

TimingMark& StreamTimeline::next_mark() {
  if (used_ == marks_.size()) marks_.push_back(make_mark_());
  return *marks_[used_++];
}

std::size_t StreamTimeline::begin(tensor::Stream& stream) {
  if (!epoch_) throw std::logic_error("StreamTimeline: begin before set_epoch");
  next_mark().record(stream);
  next_mark();  // the span's end, recorded by end()
  closed_.push_back(false);
  return spans_++;
}

void StreamTimeline::check_open(std::size_t id, const char* what) const {
  if (id >= spans_ || closed_[id]) {
    throw std::logic_error(std::string("StreamTimeline: ") + what + " of span " +
                           std::to_string(id) +
                           (id >= spans_ ? ", which was never begun" : ", which is closed"));
  }
}

void StreamTimeline::restart(std::size_t id, tensor::Stream& stream) {
  check_open(id, "restart");
  marks_[2 * id]->record(stream);
}

void StreamTimeline::end(std::size_t id, tensor::Stream& stream) {
  check_open(id, "end");
  marks_[2 * id + 1]->record(stream);
  closed_[id] = true;
}

std::vector<TimedSpan> StreamTimeline::resolve() {
  std::vector<TimedSpan> spans;
  spans.reserve(spans_);
  for (std::size_t id = 0; id < spans_; ++id) {
    if (!closed_[id]) {
      throw std::logic_error("StreamTimeline: span " + std::to_string(id) + " was never closed");
    }
    spans.push_back({epoch_host_s_ + marks_[2 * id]->seconds_since(*epoch_),
                     epoch_host_s_ + marks_[2 * id + 1]->seconds_since(*epoch_)});
  }
  spans_ = 0;
  used_ = 0;
  closed_.clear();
  return spans;
}

}  // namespace pf::device
