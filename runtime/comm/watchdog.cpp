#include "runtime/comm/watchdog.h"

#include <algorithm>
#include <exception>
#include <stdexcept>
#include <utility>

namespace pf::comm {

std::string to_string(const OperationDescription& description) {
  std::string text = "rank " + std::to_string(description.rank);
  if (description.position >= 0) {
    text += ", stream position " + std::to_string(description.position);
    if (!description.instruction.empty()) text += " (" + description.instruction + ")";
  } else if (!description.instruction.empty()) {
    text += " (" + description.instruction + ")";
  }
  return text + ": " + description.operation;
}

Watchdog::Watchdog(AbortAction abort_action, ErrorProbe error_probe)
    : Watchdog(std::move(abort_action), std::move(error_probe), Options{}) {}

Watchdog::Watchdog(AbortAction abort_action, ErrorProbe error_probe, Options options)
    : abort_action_(std::move(abort_action)),
      error_probe_(std::move(error_probe)),
      options_(options) {
  if (options_.poll_interval <= std::chrono::microseconds(0)) {
    throw std::invalid_argument("Watchdog: poll_interval must be positive, got " +
                                std::to_string(options_.poll_interval.count()) + " us");
  }
  monitor_ = std::thread([this] { monitor(); });
}

Watchdog::~Watchdog() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  monitor_.join();
}

Watchdog::Id Watchdog::watch(OperationDescription description, Deadline deadline,
                             Completion completion) {
  if (!completion) {
    throw std::invalid_argument("Watchdog::watch: " + to_string(description) +
                                ": no completion test given");
  }
  std::lock_guard lock(mutex_);
  if (failure_ != FailureKind::kNone) throw_failure();
  const Id id = next_id_++;
  entries_.emplace(id, Entry{std::move(description), deadline, std::move(completion)});
  return id;
}

void Watchdog::wait(Id id) {
  std::unique_lock lock(mutex_);
  // Short operations finish within microseconds: poll often at first, then back off to the
  // monitor's interval (the monitor also wakes waiters when it sees a completion or failure).
  auto backoff = std::chrono::microseconds(1);
  while (true) {
    if (failure_ != FailureKind::kNone) throw_failure();
    if (!failing_) {
      const auto it = entries_.find(id);
      if (it == entries_.end()) return;
      if (it->second.completion()) {
        entries_.erase(it);
        return;
      }
    }
    // While the abort action runs, aborted operations may report completion: nobody may take
    // that for success, so waiters only wait for the failure to be published.
    changed_.wait_for(lock, backoff);
    backoff = std::min(backoff * 2, options_.poll_interval);
  }
}

bool Watchdog::test(Id id) {
  std::lock_guard lock(mutex_);
  if (failure_ != FailureKind::kNone) throw_failure();
  if (failing_) return false;
  const auto it = entries_.find(id);
  if (it == entries_.end()) return true;
  if (!it->second.completion()) return false;
  entries_.erase(it);
  return true;
}

void Watchdog::forget(Id id) {
  std::lock_guard lock(mutex_);
  entries_.erase(id);
}

void Watchdog::check() const {
  std::lock_guard lock(mutex_);
  if (failure_ != FailureKind::kNone) throw_failure();
}

bool Watchdog::failed() const {
  std::lock_guard lock(mutex_);
  return failure_ != FailureKind::kNone;
}

std::string Watchdog::failure_message() const {
  std::lock_guard lock(mutex_);
  return failure_ != FailureKind::kNone ? failure_message_ : std::string();
}

std::size_t Watchdog::watched() const {
  std::lock_guard lock(mutex_);
  return entries_.size();
}

void Watchdog::abort(const std::string& reason) {
  std::unique_lock lock(mutex_);
  // A failure in progress on the monitor thread wins; wait until it is published so that this
  // call, like every other, returns with the watchdog failed.
  changed_.wait(lock, [this] { return !failing_; });
  if (failure_ != FailureKind::kNone) return;
  fail(lock, FailureKind::kAborted, reason);
}

void Watchdog::time_out(const std::string& message) {
  std::unique_lock lock(mutex_);
  changed_.wait(lock, [this] { return !failing_; });
  if (failure_ != FailureKind::kNone) return;
  fail(lock, FailureKind::kTimeout, message);
}

void Watchdog::monitor() {
  std::unique_lock lock(mutex_);
  while (!stopping_) {
    changed_.wait_for(lock, options_.poll_interval, [this] { return stopping_; });
    if (stopping_) return;
    if (failure_ != FailureKind::kNone || failing_) continue;
    const Deadline now = Clock::now();
    bool completed_any = false;
    for (auto it = entries_.begin(); it != entries_.end();) {
      if (it->second.completion()) {
        it = entries_.erase(it);
        completed_any = true;
        continue;
      }
      if (now > it->second.deadline) {
        const std::string message =
            to_string(it->second.description) +
            ": not complete by its deadline; the watchdog aborted the communicator";
        fail(lock, FailureKind::kTimeout, message);
        break;
      }
      ++it;
    }
    if (completed_any) changed_.notify_all();
    if (failure_ != FailureKind::kNone || !error_probe_) continue;
    // The probe (ncclCommGetAsyncError) runs without the lock: waiters keep polling meanwhile.
    lock.unlock();
    std::string error;
    try {
      error = error_probe_();
    } catch (const std::exception& e) {
      error = std::string("the error probe failed: ") + e.what();
    }
    lock.lock();
    if (!error.empty() && failure_ == FailureKind::kNone && !failing_) {
      std::string pending;
      if (!entries_.empty()) {
        pending = "; pending: " + to_string(entries_.begin()->second.description);
        if (entries_.size() > 1) {
          pending += " and " + std::to_string(entries_.size() - 1) + " more";
        }
      }
      fail(lock, FailureKind::kAborted, error + pending);
    }
  }
}

void Watchdog::fail(std::unique_lock<std::mutex>& lock, FailureKind kind,
                    const std::string& message) {
  failing_ = true;
  std::string published = message;
  lock.unlock();
  if (abort_action_) {
    try {
      abort_action_(message);
    } catch (const std::exception& e) {
      published += " (the abort action failed too: " + std::string(e.what()) + ")";
    }
  }
  lock.lock();
  failure_message_ = std::move(published);
  failure_ = kind;
  failing_ = false;
  entries_.clear();
  changed_.notify_all();
}

void Watchdog::throw_failure() const {
  if (failure_ == FailureKind::kTimeout) throw TimeoutError(failure_message_);
  throw AbortedError(failure_message_);
}

}  // namespace pf::comm
