// The watchdog on the CPU: real operations (flags set by other threads, conditions that never
// become true) with deadlines of ~100 ms.
#include "runtime/comm/watchdog.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace pf::comm {
namespace {

using namespace std::chrono_literals;

// The abort action's calls, as the NCCL communicator's ncclCommAbort would see them.
struct AbortLog {
  std::mutex mutex;
  std::vector<std::string> messages;
  std::atomic<bool> aborted{false};
  Watchdog::AbortAction action() {
    return [this](const std::string& message) {
      std::lock_guard lock(mutex);
      messages.push_back(message);
      aborted = true;
    };
  }
  std::size_t calls() {
    std::lock_guard lock(mutex);
    return messages.size();
  }
};

OperationDescription describe(int rank, int position, std::string instruction,
                              std::string operation) {
  return {rank, position, std::move(instruction), std::move(operation)};
}

Deadline in(std::chrono::milliseconds ms) {
  return Clock::now() + ms;
}

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

TEST(Watchdog, DescriptionNamesRankPositionAndInstruction) {
  EXPECT_EQ(to_string(describe(3, 12, "SA3.c0->w1", "ncclSend of 64 bytes to rank 1")),
            "rank 3, stream position 12 (SA3.c0->w1): ncclSend of 64 bytes to rank 1");
  EXPECT_EQ(to_string(describe(0, -1, "", "ncclAllReduce over {0, 1}")),
            "rank 0: ncclAllReduce over {0, 1}");
}

TEST(Watchdog, WaitReturnsWhenTheOperationCompletes) {
  AbortLog log;
  Watchdog watchdog(log.action());
  std::atomic<bool> done{false};
  const auto id =
      watchdog.watch(describe(0, 1, "F0", "receive"), in(5000ms), [&] { return done.load(); });
  EXPECT_FALSE(watchdog.test(id));
  std::thread completer([&] {
    std::this_thread::sleep_for(20ms);
    done = true;
  });
  const auto start = Clock::now();
  watchdog.wait(id);
  EXPECT_GE(seconds_since(start), 0.015);
  completer.join();
  EXPECT_TRUE(watchdog.test(id));  // no longer watched: completed
  EXPECT_EQ(watchdog.watched(), 0U);
  EXPECT_FALSE(watchdog.failed());
  EXPECT_EQ(log.calls(), 0U);
  EXPECT_NO_THROW(watchdog.check());
}

TEST(Watchdog, AnOperationPastItsDeadlineAbortsAndTheWaiterThrowsNamingIt) {
  AbortLog log;
  Watchdog watchdog(log.action());
  const auto start = Clock::now();
  // A condition that never becomes true: a peer that never posts the matching receive.
  const auto id = watchdog.watch(describe(2, 17, "SA5.c1->w3", "ncclSend of 4096 bytes to rank 3"),
                                 in(100ms), [] { return false; });
  try {
    watchdog.wait(id);
    FAIL() << "wait returned for an operation that never completes";
  } catch (const TimeoutError& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("rank 2, stream position 17 (SA5.c1->w3): ncclSend of 4096 bytes to "
                           "rank 3"),
              std::string::npos)
        << message;
    EXPECT_NE(message.find("deadline"), std::string::npos) << message;
  }
  const double waited = seconds_since(start);
  EXPECT_GE(waited, 0.099);
  EXPECT_LT(waited, 2.0);  // not a hang: the monitor acts within its poll interval
  ASSERT_EQ(log.calls(), 1U);
  EXPECT_EQ(log.messages[0], watchdog.failure_message());
  EXPECT_TRUE(watchdog.failed());
  // Everything afterwards reports the same failure; new operations are refused.
  EXPECT_THROW(watchdog.check(), TimeoutError);
  EXPECT_THROW(watchdog.test(id), TimeoutError);
  EXPECT_THROW(watchdog.watch(describe(2, 18, "", "ncclRecv"), in(1000ms), [] { return true; }),
               TimeoutError);
  EXPECT_EQ(log.calls(), 1U);  // the abort action runs once
}

TEST(Watchdog, AnotherOperationsTimeoutReleasesAWaiterWithALongDeadline) {
  AbortLog log;
  Watchdog watchdog(log.action());
  const auto patient = watchdog.watch(describe(1, 4, "B2", "ncclRecv from rank 0"), in(60000ms),
                                      [] { return false; });
  watchdog.watch(describe(1, 3, "RG2", "ncclAllReduce over {0, 1}"), in(100ms),
                 [] { return false; });
  const auto start = Clock::now();
  try {
    watchdog.wait(patient);
    FAIL() << "the waiter was not released";
  } catch (const TimeoutError& error) {
    EXPECT_NE(std::string(error.what()).find("stream position 3 (RG2): ncclAllReduce"),
              std::string::npos)
        << error.what();
  }
  EXPECT_LT(seconds_since(start), 2.0);
  EXPECT_EQ(log.calls(), 1U);
}

TEST(Watchdog, TheAbortActionRunsBeforeWaitersAreReleased) {
  // ncclCommAbort makes stuck kernels return: here the abort action is what "completes" the
  // operation. The waiter must still throw (an aborted transfer is not a success), and only
  // after the abort action has finished.
  std::atomic<bool> aborted{false};
  std::atomic<bool> abort_finished{false};
  Watchdog watchdog([&](const std::string&) {
    aborted = true;
    std::this_thread::sleep_for(30ms);  // a slow abort
    abort_finished = true;
  });
  const auto id =
      watchdog.watch(describe(0, 9, "SG1", "ncclRecv"), in(100ms), [&] { return aborted.load(); });
  EXPECT_THROW(watchdog.wait(id), TimeoutError);
  EXPECT_TRUE(abort_finished.load());
}

TEST(Watchdog, AnAsynchronousErrorAbortsAndNamesThePendingOperation) {
  AbortLog log;
  std::atomic<bool> broken{false};
  Watchdog watchdog(log.action(), [&]() -> std::string {
    return broken ? "rank 0: ncclCommGetAsyncError: unhandled system error" : "";
  });
  const auto id = watchdog.watch(describe(0, 5, "SA1.c0->w1", "ncclSend to rank 1"), in(60000ms),
                                 [] { return false; });
  std::thread breaker([&] {
    std::this_thread::sleep_for(20ms);
    broken = true;
  });
  const auto start = Clock::now();
  try {
    watchdog.wait(id);
    FAIL() << "the asynchronous error did not reach the waiter";
  } catch (const AbortedError& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("unhandled system error"), std::string::npos) << message;
    EXPECT_NE(message.find("pending: rank 0, stream position 5 (SA1.c0->w1)"), std::string::npos)
        << message;
  }
  breaker.join();
  EXPECT_LT(seconds_since(start), 2.0);
  EXPECT_EQ(log.calls(), 1U);
}

TEST(Watchdog, AnAsynchronousErrorWithNothingPendingStillFailsTheTransport) {
  AbortLog log;
  Watchdog watchdog(log.action(), [] { return std::string("remote process exited"); });
  const auto start = Clock::now();
  while (!watchdog.failed() && seconds_since(start) < 2.0) std::this_thread::sleep_for(1ms);
  EXPECT_THROW(watchdog.check(), AbortedError);
  EXPECT_EQ(watchdog.failure_message(), "remote process exited");
  EXPECT_EQ(log.calls(), 1U);
}

TEST(Watchdog, OperationsNobodyWaitsOnAreRetiredWhenTheyComplete) {
  AbortLog log;
  Watchdog watchdog(log.action(), {}, Watchdog::Options{std::chrono::microseconds(500)});
  std::atomic<bool> done{false};
  for (int i = 0; i < 5; ++i) {
    watchdog.watch(describe(0, i, "", "ncclAllReduce"), in(5000ms), [&] { return done.load(); });
  }
  EXPECT_EQ(watchdog.watched(), 5U);
  done = true;
  const auto start = Clock::now();
  while (watchdog.watched() > 0 && seconds_since(start) < 2.0) std::this_thread::sleep_for(1ms);
  EXPECT_EQ(watchdog.watched(), 0U);
  EXPECT_FALSE(watchdog.failed());
}

TEST(Watchdog, ACompletedOperationIsNotFailedByItsLaterDeadline) {
  AbortLog log;
  Watchdog watchdog(log.action());
  watchdog.watch(describe(0, 0, "", "short"), in(50ms), [] { return true; });
  std::this_thread::sleep_for(150ms);
  EXPECT_FALSE(watchdog.failed());
  EXPECT_EQ(log.calls(), 0U);
}

TEST(Watchdog, ForgottenOperationsDoNotTimeOut) {
  AbortLog log;
  Watchdog watchdog(log.action());
  const auto id = watchdog.watch(describe(0, 0, "", "abandoned"), in(50ms), [] { return false; });
  watchdog.forget(id);
  std::this_thread::sleep_for(150ms);
  EXPECT_FALSE(watchdog.failed());
  EXPECT_EQ(watchdog.watched(), 0U);
  EXPECT_NO_THROW(watchdog.wait(id));  // no longer watched
}

TEST(Watchdog, ExplicitAbortReleasesWaitersWithTheReason) {
  AbortLog log;
  Watchdog watchdog(log.action());
  const auto id =
      watchdog.watch(describe(1, 2, "F1", "ncclRecv"), in(60000ms), [] { return false; });
  std::thread aborter([&] {
    std::this_thread::sleep_for(20ms);
    watchdog.abort("rank 0 failed: bad batch");
  });
  try {
    watchdog.wait(id);
    FAIL() << "abort() did not release the waiter";
  } catch (const AbortedError& error) {
    EXPECT_EQ(std::string(error.what()), "rank 0 failed: bad batch");
  }
  aborter.join();
  watchdog.abort("a second reason");  // no effect: the first failure stands
  EXPECT_EQ(watchdog.failure_message(), "rank 0 failed: bad batch");
  EXPECT_EQ(log.calls(), 1U);
}

TEST(Watchdog, AFailingAbortActionIsReportedInTheMessage) {
  Watchdog watchdog([](const std::string&) { throw std::runtime_error("ncclCommAbort failed"); });
  const auto id = watchdog.watch(describe(0, 1, "", "ncclSend"), in(100ms), [] { return false; });
  try {
    watchdog.wait(id);
    FAIL();
  } catch (const TimeoutError& error) {
    EXPECT_NE(std::string(error.what()).find("the abort action failed too: ncclCommAbort failed"),
              std::string::npos)
        << error.what();
  }
}

TEST(Watchdog, DestructionWithPendingOperationsJoinsWithoutAborting) {
  AbortLog log;
  const auto start = Clock::now();
  {
    Watchdog watchdog(log.action());
    watchdog.watch(describe(0, 0, "", "never"), in(60000ms), [] { return false; });
  }
  EXPECT_LT(seconds_since(start), 1.0);
  EXPECT_EQ(log.calls(), 0U);
}

TEST(Watchdog, ManyThreadsWatchAndWaitConcurrently) {
  AbortLog log;
  Watchdog watchdog(log.action());
  std::vector<std::thread> threads;
  std::atomic<int> completed{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 50; ++i) {
        auto done = std::make_shared<std::atomic<bool>>(false);
        const auto id =
            watchdog.watch(describe(t, i, "", "op"), in(5000ms), [done] { return done->load(); });
        std::thread setter([done] { *done = true; });
        watchdog.wait(id);
        setter.join();
        ++completed;
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(completed.load(), 200);
  EXPECT_FALSE(watchdog.failed());
  EXPECT_EQ(log.calls(), 0U);
}

TEST(Watchdog, RefusesAnEmptyCompletionTestAndABadPollInterval) {
  AbortLog log;
  Watchdog watchdog(log.action());
  EXPECT_THROW(watchdog.watch(describe(0, 0, "", "op"), in(100ms), {}), std::invalid_argument);
  EXPECT_THROW(Watchdog(log.action(), {}, Watchdog::Options{std::chrono::microseconds(0)}),
               std::invalid_argument);
}

}  // namespace
}  // namespace pf::comm
