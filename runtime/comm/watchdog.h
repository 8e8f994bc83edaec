#pragma once
// A watchdog for operations that run outside the host thread (NCCL kernels on a CUDA stream):
// nothing in the transport itself gives up, so without it a missing peer hangs the job forever.
//
// Each operation is registered with a description (rank, stream position, instruction, what it
// does), a deadline and a non-blocking completion test (for NCCL: cudaEventQuery on an event
// recorded after the operation). A monitor thread polls every registered operation and an
// optional asynchronous-error probe (ncclCommGetAsyncError). The first time an operation passes
// its deadline, or the probe reports an error, the watchdog
//   1. records one failure message naming the rank, the stream position and the instruction,
//   2. calls the abort action once, on the monitor thread (ncclCommAbort: the stuck kernels
//      return, so streams and the host stop waiting on them),
//   3. releases every waiter: each wait, test and check from then on throws the failure
//      (TimeoutError for a passed deadline, AbortedError for an asynchronous error or abort()).
// The transport is unusable after that; the executor turns the exception into a worker error
// and the MPI launch ends every rank.
//
// No global state: each communicator owns its Watchdog; the destructor stops and joins the
// monitor thread (operations still registered are dropped, the abort action is not called).
// Thread-safe: any thread may watch, wait and test.
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>

#include "runtime/comm/communicator.h"

namespace pf::comm {

// What an operation is, for the failure message.
struct OperationDescription {
  int rank = -1;
  int position = -1;        // in the worker's instruction stream; -1: outside one
  std::string instruction;  // the instruction being executed ("" outside one)
  std::string operation;    // "ncclSend of 4096 bytes to rank 1 (pair 7)"
};
// "rank 0, stream position 12 (SA3.c0->w1): ncclSend of 4096 bytes to rank 1 (pair 7)"
std::string to_string(const OperationDescription& description);

class Watchdog {
 public:
  using Id = std::uint64_t;
  // Runs once, on the monitor thread (or in abort()'s caller), with the failure message, before
  // any waiter is released. Must not call back into the watchdog.
  using AbortAction = std::function<void(const std::string& message)>;
  // Polled on the monitor thread: an error text when the transport reports an asynchronous
  // error, else an empty string.
  using ErrorProbe = std::function<std::string()>;
  // Whether the operation has completed. Non-blocking and callable from any thread (the
  // monitor polls it, and so does a thread waiting on the operation).
  using Completion = std::function<bool()>;

  struct Options {
    // How often the monitor looks at deadlines, completions and the error probe.
    std::chrono::microseconds poll_interval = std::chrono::milliseconds(1);
  };

  explicit Watchdog(AbortAction abort_action, ErrorProbe error_probe = {});
  Watchdog(AbortAction abort_action, ErrorProbe error_probe, Options options);
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // Registers an operation; it stays watched until it completes (whether or not anyone waits
  // on it) or is forgotten. Throws the failure when the watchdog has already failed (the
  // operation must not be issued on an aborted transport) and std::invalid_argument for an
  // empty completion test.
  Id watch(OperationDescription description, Deadline deadline, Completion completion);
  // Blocks until the operation completes, or throws the failure (this operation's or another's:
  // the transport is gone either way). An id that is not watched (completed and already
  // reported, or never issued) returns at once.
  void wait(Id id);
  // Non-blocking: true once the operation has completed; throws the failure.
  bool test(Id id);
  // Stops watching an operation (its owner no longer cares, e.g. the job is shutting down).
  void forget(Id id);

  // Throws the failure, if any.
  void check() const;
  bool failed() const;
  std::string failure_message() const;  // empty before a failure
  // Operations registered and not yet seen complete.
  std::size_t watched() const;

  // Fails the watchdog now (AbortedError with `reason`), running the abort action, unless it
  // has failed already.
  void abort(const std::string& reason);
  // The same for a deadline the caller saw pass itself (TimeoutError with `message`), e.g. a
  // host-side call of the transport that stayed in progress.
  void time_out(const std::string& message);

 private:
  enum class FailureKind : std::uint8_t { kNone, kTimeout, kAborted };
  struct Entry {
    OperationDescription description;
    Deadline deadline;
    Completion completion;
  };

  void monitor();
  // Records the failure (first one wins) and runs the abort action outside the lock; returns
  // with `lock` held again.
  void fail(std::unique_lock<std::mutex>& lock, FailureKind kind, const std::string& message);
  [[noreturn]] void throw_failure() const;  // mutex_ held by the caller

  AbortAction abort_action_;
  ErrorProbe error_probe_;
  Options options_;

  mutable std::mutex mutex_;
  std::condition_variable changed_;  // an operation completed, a failure, or stopping
  std::map<Id, Entry> entries_;
  Id next_id_ = 1;
  FailureKind failure_ = FailureKind::kNone;
  bool failing_ = false;  // the abort action is running
  std::string failure_message_;
  bool stopping_ = false;
  std::thread monitor_;  // started last in the constructor
};

}  // namespace pf::comm
