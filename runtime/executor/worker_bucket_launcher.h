#pragma once
// Worker<T>::Impl::BucketLauncher (private to runtime/executor): starts a chunk's data-parallel
// gradient buckets during its last backward.
#include <algorithm>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "runtime/executor/worker_impl.h"

namespace pf::exec {

// Gathers the finished ranges the model reports during a chunk's last backward into buckets
// of up to dp_bucket_bytes (adjacent ranges only, so a bucket is one span of the flat
// gradients) and starts each bucket's all-reduce as soon as it is full or the next range
// does not fit. Every replica's model reports the same ranges, so every member of the
// data-parallel group starts the same buckets in the same order.
template <typename T>
class Worker<T>::Impl::BucketLauncher final : public model::GradientsReady {
 public:
  BucketLauncher(Impl& impl, ChunkStepKey key, std::span<T> grads, std::int64_t global_step,
                 int reduction_position, int backward_position)
      : impl_(&impl),
        key_(key),
        grads_(grads),
        global_step_(global_step),
        reduction_position_(reduction_position),
        backward_position_(backward_position),
        cap_elements_(std::max<std::int64_t>(
            1, impl.setup.options.dp_bucket_bytes / static_cast<std::int64_t>(sizeof(T)))) {
    if (impl.dp_buckets.contains(key)) {
      throw std::runtime_error("data-parallel buckets of this chunk are already in flight");
    }
    impl.dp_buckets[key];  // the chunk has buckets from now on, even if none is started yet
  }

  void on_gradients_ready(std::int64_t begin, std::int64_t end) override {
    if (begin < 0 || end > static_cast<std::int64_t>(grads_.size()) || begin > end) {
      throw std::logic_error("model reported gradients [" + std::to_string(begin) + ", " +
                             std::to_string(end) + ") outside its " +
                             std::to_string(grads_.size()) + " gradients");
    }
    impl_->poll_dp_buckets();
    if (pending_begin_ < pending_end_ &&
        (end != pending_begin_ || pending_end_ - begin > cap_elements_)) {
      flush();
    }
    if (pending_begin_ == pending_end_) pending_end_ = end;
    pending_begin_ = begin;
    if (pending_end_ - pending_begin_ >= cap_elements_) flush();
  }

  // After the backward: the last bucket, and any gradients the model did not report.
  void finish() {
    flush();
    std::sort(started_.begin(), started_.end());
    std::int64_t covered = 0;
    std::vector<std::pair<std::int64_t, std::int64_t>> gaps;
    for (const auto& [begin, end] : started_) {
      if (begin > covered) gaps.emplace_back(covered, begin);
      covered = std::max(covered, end);
    }
    const auto total = static_cast<std::int64_t>(grads_.size());
    if (covered < total) gaps.emplace_back(covered, total);
    // Descending, as the model reports: every replica starts them in the same order.
    for (auto it = gaps.rbegin(); it != gaps.rend(); ++it) start(it->first, it->second);
  }

 private:
  void flush() {
    if (pending_begin_ < pending_end_) start(pending_begin_, pending_end_);
    pending_begin_ = pending_end_ = 0;
  }
  void start(std::int64_t begin, std::int64_t end) {
    started_.emplace_back(begin, end);
    DpBucket bucket;
    bucket.begin = begin;
    bucket.end = end;
    bucket.issued_s = impl_->now_s();
    bucket.global_step = global_step_;
    bucket.reduction_position = reduction_position_;
    const auto slice =
        grads_.subspan(static_cast<std::size_t>(begin), static_cast<std::size_t>(end - begin));
    const auto group = impl_->data_parallel_group(impl_->self);
    auto& buckets = impl_->dp_buckets[key_];
    if (impl_->device_comm != nullptr) {
      start_on_device(slice, group, buckets.size());
      bucket.done = true;  // enqueued: the reduction orders the compute stream after it
    } else {
      bucket.request = impl_->comm.iall_reduce_sum(slice, group, impl_->deadline());
    }
    buckets.push_back(std::move(bucket));
  }
  // On the device communicator's stream, after the compute stream's work so far (this
  // range's weight gradients); the host does not wait. The watchdog names the bucket.
  void start_on_device(std::span<T> slice, const std::vector<int>& group, std::size_t index) {
    if constexpr (std::is_same_v<T, float>) {
      auto& device_comm = *impl_->device_comm;
      const auto produced = impl_->backend().create_event();
      produced->record(*impl_->compute_stream);
      device_comm.wait_on_device(*produced);
      const auto& reduction = (*impl_->stream)[static_cast<std::size_t>(reduction_position_)];
      const auto& backward = (*impl_->stream)[static_cast<std::size_t>(backward_position_)];
      device_comm.set_activity(reduction_position_,
                               sched::short_label(reduction) + " bucket " + std::to_string(index));
      device_comm.all_reduce_sum_async(slice, group, impl_->deadline());
      device_comm.set_activity(backward_position_, sched::short_label(backward));
    } else {
      (void)slice;
      (void)group;
      (void)index;
      throw std::logic_error("device runs are float");
    }
  }

  Impl* impl_;
  ChunkStepKey key_;
  std::span<T> grads_;
  std::int64_t global_step_;
  int reduction_position_;
  int backward_position_;
  std::int64_t cap_elements_;
  std::int64_t pending_begin_ = 0, pending_end_ = 0;  // gathered, not started
  std::vector<std::pair<std::int64_t, std::int64_t>> started_;
};

}  // namespace pf::exec
