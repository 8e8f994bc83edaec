// Data-parallel gradient buckets (ExecutorOptions::dp_bucket_bytes): all-reduces started inside
// each chunk's last backward as its layers finish train to exactly the parameters of the
// whole-chunk all-reduce after it, on every schedule; they show in the events inside that
// backward; a replica that never joins ends the run at the deadline naming the bucket.
#include <cstring>
#include <ostream>
#include <thread>

#include <gtest/gtest.h>

#include "runtime/comm/in_process.h"
#include "runtime/executor/executor.h"
#include "runtime/executor/measured.h"
#include "runtime/optim/lamb.h"
#include "scheduler/compile.h"
#include "scheduler/pipefisher/pass.h"
#include "sim/uniform_cost_model.h"
#include "tests/executor/kfac_test_schedule.h"
#include "traces/chrome_trace.h"

namespace pf::exec {
namespace {

using sched::OpKind;
using sched::ScheduleKind;

model::BertConfig bucket_test_config() {
  model::BertConfig config;
  config.name = "test";
  config.vocab_size = 29;
  config.hidden_size = 8;
  config.num_layers = 4;
  config.num_heads = 2;
  config.intermediate_size = 12;
  config.max_position_embeddings = 10;
  config.type_vocab_size = 2;
  config.hidden_dropout = 0.1F;
  config.attention_dropout = 0.1F;
  return config;
}

struct BucketCase {
  ScheduleKind kind;
  int chunks_per_worker;
  bool split_backward;
  int kfac_refresh;  // -1: no K-FAC
};

std::string name_of(const BucketCase& c) {
  return std::string(sched::to_string(c.kind)) + "_v" + std::to_string(c.chunks_per_worker) +
         (c.split_backward ? "_split" : "") +
         (c.kfac_refresh >= 0 ? "_kfac" + std::to_string(c.kfac_refresh) : "");
}
void PrintTo(const BucketCase& c, std::ostream* os) {
  *os << name_of(c);
}

// Two pipeline workers, two data-parallel replicas.
sched::Schedule schedule_of(const BucketCase& c) {
  sched::ScheduleParams params;
  params.kind = c.kind;
  params.workers = 2;
  params.microbatches = 4;
  params.chunks_per_worker = c.chunks_per_worker;
  params.num_layers = 4;
  params.data_parallel = 2;
  params.split_backward = c.split_backward;
  auto schedule = sched::compile(params);
  if (c.kfac_refresh < 0) return schedule;
  return testing::with_kfac_in_bubbles(schedule, c.kfac_refresh);
}

RunSetup<float> make_setup(const sched::Schedule& schedule, BatchSource& batches,
                           std::int64_t bucket_bytes) {
  RunSetup<float> setup;
  setup.config = bucket_test_config();
  setup.schedule = schedule;
  setup.options.init_seed = 7;
  setup.options.dropout_seed = 11;
  setup.options.wait_timeout = std::chrono::seconds(60);
  setup.options.kfac.damping = 1e-2F;
  setup.options.record_events = true;
  setup.options.dp_bucket_bytes = bucket_bytes;
  setup.make_optimizer = [] {
    return std::make_unique<optim::BasicLamb<float>>(optim::LambOptions{.max_grad_norm = 0.5});
  };
  setup.learning_rate = [](std::int64_t step) { return 1e-2 * (1.0 + 0.5 * double(step)); };
  setup.batches = &batches;
  return setup;
}

struct Outcome {
  std::vector<std::vector<float>> parameters;  // every rank's chunks' values, in order
  std::vector<double> losses, grad_norms;
  std::vector<InstructionEvent> events;
};

Outcome train(const sched::Schedule& schedule, std::int64_t bucket_bytes) {
  SyntheticBatches batches(bucket_test_config(), 2, 6, 2, 13);
  ThreadedExecutor<float> executor(make_setup(schedule, batches, bucket_bytes));
  Outcome outcome;
  const std::int64_t steps = schedule.num_steps > 1 ? 2 * schedule.num_steps : 3;
  executor.run(0, steps, [&](const StepResult& r) {
    outcome.losses.push_back(r.loss());
    outcome.grad_norms.push_back(r.grad_norm);
  });
  for (int r = 0; r < executor.num_ranks(); ++r) {
    for (auto* chunk : executor.worker(r).chunks()) {
      const auto values = chunk->flat_values();
      outcome.parameters.emplace_back(values.begin(), values.end());
    }
  }
  outcome.events = executor.take_events();
  return outcome;
}

class DpBuckets : public ::testing::TestWithParam<BucketCase> {};

TEST_P(DpBuckets, BitIdenticalToTheWholeChunkReductionAndStartedInsideTheLastBackward) {
  const auto schedule = schedule_of(GetParam());
  const Outcome whole = train(schedule, 0);
  for (const auto& e : whole.events) EXPECT_EQ(e.bucket, -1);
  int reductions = 0;
  for (const auto& e : whole.events)
    reductions += e.instruction.kind == OpKind::kReduceGradDataParallel;
  ASSERT_GT(reductions, 0);
  // 1 byte: every finished range of the model alone; 600 bytes: adjacent ranges merged.
  for (const std::int64_t bucket_bytes : {std::int64_t{1}, std::int64_t{600}}) {
    SCOPED_TRACE("bucket bytes " + std::to_string(bucket_bytes));
    const Outcome bucketed = train(schedule, bucket_bytes);
    ASSERT_EQ(bucketed.parameters.size(), whole.parameters.size());
    for (std::size_t i = 0; i < whole.parameters.size(); ++i) {
      ASSERT_EQ(bucketed.parameters[i].size(), whole.parameters[i].size());
      EXPECT_EQ(std::memcmp(bucketed.parameters[i].data(), whole.parameters[i].data(),
                            whole.parameters[i].size() * sizeof(float)),
                0)
          << "chunk " << i << " differs";
    }
    EXPECT_EQ(bucketed.losses, whole.losses);
    EXPECT_EQ(bucketed.grad_norms, whole.grad_norms);
    // More buckets than reductions (the chunks were cut), each begun while its chunk's
    // backward (or backward-weight) on that rank was still running.
    int buckets = 0;
    for (const auto& b : bucketed.events) {
      if (b.bucket < 0) continue;
      ++buckets;
      EXPECT_EQ(b.instruction.kind, OpKind::kReduceGradDataParallel);
      EXPECT_EQ(b.lane, Lane::kCommunication);
      EXPECT_GT(b.bytes, 0);
      bool inside = false;
      for (const auto& e : bucketed.events) {
        const auto& in = e.instruction;
        inside |= e.rank == b.rank && e.bucket < 0 && e.global_step == b.global_step &&
                  (in.kind == OpKind::kBackward || in.kind == OpKind::kBackwardWeight) &&
                  in.pipeline == b.instruction.pipeline && in.chunk == b.instruction.chunk &&
                  e.start_s <= b.start_s && b.start_s <= e.end_s;
      }
      EXPECT_TRUE(inside) << "rank " << b.rank << " step " << b.global_step << " chunk "
                          << b.instruction.chunk << " bucket " << b.bucket;
    }
    EXPECT_GT(buckets, reductions);
    // The trace shows them on the collective lane.
    const auto trace = measured_trace(schedule, bucketed.events);
    int traced = 0;
    for (const auto& event : trace["traceEvents"]) {
      if (event.value("cat", "") == "dp_bucket") {
        ++traced;
        EXPECT_EQ(event["tid"], static_cast<int>(traces::Lane::kCollective));
      }
    }
    EXPECT_EQ(traced, buckets);
  }
}

INSTANTIATE_TEST_SUITE_P(Schedules, DpBuckets,
                         ::testing::Values(BucketCase{ScheduleKind::kOneFOneB, 1, false, -1},
                                           BucketCase{ScheduleKind::kGPipe, 1, false, -1},
                                           BucketCase{ScheduleKind::kInterleaved, 2, false, -1},
                                           BucketCase{ScheduleKind::kInterleaved, 2, true, -1},
                                           BucketCase{ScheduleKind::kZeroBubbleH1, 1, true, -1},
                                           BucketCase{ScheduleKind::kChimera, 1, false, -1},
                                           BucketCase{ScheduleKind::kOneFOneB, 1, false, 2}),
                         [](const ::testing::TestParamInfo<BucketCase>& case_info) {
                           return name_of(case_info.param);
                         });

// Replica 1 never runs: replica 0's DP reductions end at the deadline naming the bucket.
TEST(DpBuckets, AReplicaThatNeverJoinsEndsTheRunAtTheDeadlineNamingTheBucket) {
  const auto schedule = schedule_of({ScheduleKind::kOneFOneB, 1, false, -1});
  SyntheticBatches batches(bucket_test_config(), 2, 6, 2, 13);
  auto setup = make_setup(schedule, batches, 1);
  setup.options.wait_timeout = std::chrono::milliseconds(200);
  comm::InProcessWorld world(4);
  Worker<float> first(setup, world.rank(0));
  Worker<float> last(setup, world.rank(1));
  std::string errors[2];
  const auto start = comm::Clock::now();
  std::thread other([&] {
    try {
      last.run(0, 1, {});
    } catch (const WorkerError& error) {
      errors[1] = error.what();
    }
  });
  try {
    first.run(0, 1, {});
  } catch (const WorkerError& error) {
    errors[0] = error.what();
  }
  other.join();
  EXPECT_LT(comm::Clock::now() - start, std::chrono::seconds(10));
  for (int r = 0; r < 2; ++r) {
    const std::string& message = errors[r];
    SCOPED_TRACE(message);
    EXPECT_NE(message.find("rank " + std::to_string(r) + ")"), std::string::npos);
    EXPECT_NE(message.find(", RD"), std::string::npos);  // the DP reduction
    EXPECT_NE(message.find("data-parallel gradient bucket 0 of "), std::string::npos);
    EXPECT_NE(message.find("over {" + std::to_string(r) + ", " + std::to_string(r + 2) +
                           "}: ranks " + std::to_string(r + 2) + " did not join"),
              std::string::npos);
  }
}

}  // namespace
}  // namespace pf::exec
