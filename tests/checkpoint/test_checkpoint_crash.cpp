// A save interrupted at any point, by an exception or by the process being killed, leaves the
// last good checkpoint loadable, and the next save cleans up and succeeds.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <thread>

#include "checkpoint_test_util.h"

namespace pf::ckpt {
namespace {

using testing::entries_of;
using testing::sample_checkpoint;
using testing::ScratchDir;
namespace fs = std::filesystem;

struct InjectedFault : std::runtime_error {
  InjectedFault() : std::runtime_error("injected fault") {}
};

// Calls `on_fault` at the invocation numbered `fault_at` (counting every phase call from 0) and
// records which phase that was.
struct PhaseTrap {
  int fault_at = -1;
  int calls = 0;
  SavePhase hit = SavePhase::kTempDirCreated;

  template <typename OnFault>
  SaveOptions options(OnFault on_fault) {
    SaveOptions options;
    options.after_phase = [this, on_fault](SavePhase phase, const fs::path&) {
      if (calls++ == fault_at) {
        hit = phase;
        on_fault();
      }
    };
    return options;
  }
};

// Two committed checkpoints (10 and 20), then a save of 30 that prunes 10: every phase occurs.
void prepare(const fs::path& root) {
  save_training_checkpoint(root, sample_checkpoint(10));
  save_training_checkpoint(root, sample_checkpoint(20));
}

int count_phase_calls() {
  const ScratchDir root;
  prepare(root.path());
  PhaseTrap trap;
  save_training_checkpoint(root.path(), sample_checkpoint(30), trap.options([] {}));
  return trap.calls;
}

// What must hold after the save of 30 was interrupted right after phase `hit`.
void expect_recoverable(const fs::path& root, SavePhase hit, const std::string& context) {
  SCOPED_TRACE(context + ", interrupted after phase " + std::string(to_string(hit)));
  const bool committed = hit == SavePhase::kLatestUpdated || hit == SavePhase::kPruned;
  const auto loaded = load_latest_checkpoint(root);
  ASSERT_TRUE(loaded.has_value());
  testing::expect_same_checkpoint(*loaded, sample_checkpoint(committed ? 30 : 20));
  // The previous checkpoint is intact whatever happened.
  testing::expect_same_checkpoint(load_training_checkpoint(root / "step-00000020"),
                                  sample_checkpoint(20));
  // The next save succeeds and leaves no debris.
  save_training_checkpoint(root, sample_checkpoint(40));
  const bool renamed = hit != SavePhase::kTempDirCreated && hit != SavePhase::kFileWritten &&
                       hit != SavePhase::kTempDirSynced;
  EXPECT_EQ(entries_of(root),
            (std::vector<std::string>{"latest", renamed ? "step-00000030" : "step-00000020",
                                      "step-00000040"}));
  testing::expect_same_checkpoint(*load_latest_checkpoint(root), sample_checkpoint(40));
}

TEST(CheckpointCrash, PhaseCountCoversEveryPhase) {
  // 1 temp dir + 7 files (6 data + manifest) + synced + renamed + latest temp + latest + 1 prune.
  EXPECT_EQ(count_phase_calls(), 13);
}

TEST(CheckpointCrash, AnExceptionAfterAnyPhaseLeavesTheLastGoodCheckpoint) {
  const int calls = count_phase_calls();
  for (int fault_at = 0; fault_at < calls; ++fault_at) {
    const ScratchDir root;
    prepare(root.path());
    PhaseTrap trap{fault_at};
    EXPECT_THROW(save_training_checkpoint(root.path(), sample_checkpoint(30),
                                          trap.options([] { throw InjectedFault(); })),
                 InjectedFault);
    expect_recoverable(root.path(), trap.hit, "exception at call " + std::to_string(fault_at));
  }
}

// The process dies (SIGKILL: no unwinding, no destructors) right after each phase.
TEST(CheckpointCrash, AProcessKilledAfterAnyPhaseLeavesTheLastGoodCheckpoint) {
  const int calls = count_phase_calls();
  for (int fault_at = 0; fault_at < calls; ++fault_at) {
    const ScratchDir root;
    prepare(root.path());
    // The child reports the phase it died in through a pipe.
    int report[2];
    ASSERT_EQ(::pipe(report), 0);
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      ::close(report[0]);
      PhaseTrap trap{fault_at};
      try {
        save_training_checkpoint(root.path(), sample_checkpoint(30), trap.options([&] {
          const auto phase = static_cast<int>(trap.hit);
          if (::write(report[1], &phase, sizeof(phase)) != sizeof(phase)) {
            ::_exit(4);
          }
          ::kill(::getpid(), SIGKILL);
        }));
      } catch (...) {
        ::_exit(3);
      }
      ::_exit(0);  // not reached when the trap fires
    }
    ::close(report[1]);
    int phase = -1;
    const auto got = ::read(report[0], &phase, sizeof(phase));
    ::close(report[0]);
    int status = 0;
    ASSERT_EQ(::waitpid(child, &status, 0), child);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)
        << "call " << fault_at << ": child status " << status;
    ASSERT_EQ(got, static_cast<ssize_t>(sizeof(phase)));
    expect_recoverable(root.path(), static_cast<SavePhase>(phase),
                       "killed at call " + std::to_string(fault_at));
  }
}

// Kill a process that saves checkpoint after checkpoint at arbitrary moments: whatever `latest`
// names is complete and verifies, and is at least the last save the child reported as done.
TEST(CheckpointCrash, AProcessKilledAtArbitraryMomentsLeavesALoadableCheckpoint) {
  const ScratchDir root;
  for (int round = 0; round < 6; ++round) {
    int report[2];
    ASSERT_EQ(::pipe(report), 0);
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      ::close(report[0]);
      try {
        const auto start = load_latest_checkpoint(root.path());
        for (std::int64_t step = start ? start->step + 1 : 1;; ++step) {
          save_training_checkpoint(root.path(), sample_checkpoint(step));
          if (::write(report[1], &step, sizeof(step)) != sizeof(step)) ::_exit(4);
        }
      } catch (...) {
        ::_exit(3);
      }
    }
    ::close(report[1]);
    // After the first save of this round completes, let the child run on into the middle of
    // later saves (one save takes tens of milliseconds here) and kill it.
    std::int64_t completed = 0;
    ASSERT_EQ(::read(report[0], &completed, sizeof(completed)),
              static_cast<ssize_t>(sizeof(completed)));
    std::this_thread::sleep_for(std::chrono::milliseconds(1 + 13 * round));
    ::kill(child, SIGKILL);
    int status = 0;
    ASSERT_EQ(::waitpid(child, &status, 0), child);
    ::close(report[0]);
    ASSERT_TRUE(WIFSIGNALED(status)) << "the saving child failed by itself, status " << status;
    const auto loaded = load_latest_checkpoint(root.path());
    ASSERT_TRUE(loaded.has_value());
    EXPECT_GE(loaded->step, completed);
    testing::expect_same_checkpoint(*loaded, sample_checkpoint(loaded->step));
  }
}

}  // namespace
}  // namespace pf::ckpt
