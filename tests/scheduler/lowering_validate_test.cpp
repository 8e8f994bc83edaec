// Lowering (exact streams for a small case), the validator on every generator over a grid of
// parameters, and hand-broken schedules rejected with the right message.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <string>

#include "scheduler/compile.h"
#include "scheduler/generators.h"
#include "scheduler/lowering.h"
#include "scheduler/unit_timings.h"
#include "scheduler/validate.h"
#include "tests/scheduler/test_util.h"

namespace pf::sched {
namespace {

using testing::labels;
using testing::make;

std::array<std::size_t, kNumOpKinds> count_kinds(const Schedule& s) {
  std::array<std::size_t, kNumOpKinds> counts{};
  for (const auto& stream : s.streams) {
    for (const Instruction& in : stream) ++counts[static_cast<std::size_t>(in.kind)];
  }
  return counts;
}

std::size_t count(const Schedule& s, OpKind kind) {
  return count_kinds(s)[static_cast<std::size_t>(kind)];
}

TEST(Lowering, OneFOneBTwoStagesExactStreams) {
  const Schedule s = compile(make(ScheduleKind::kOneFOneB, 2, 2));
  EXPECT_EQ(labels(s.streams[0]),
            "F0.c0 SA0.c0->w1 F1.c0 SA1.c0->w1 RG0.c0<-w1 B0.c0 RG1.c0<-w1 B1.c0 OPT");
  EXPECT_EQ(labels(s.streams[1]),
            "RA0.c1<-w0 F0.c1 RA1.c1<-w0 B0.c1 SG0.c1->w0 F1.c1 B1.c1 SG1.c1->w0 OPT");
  // Pair ids in insertion order: SA0 = 0, SA1 = 1, SG0 = 2, SG1 = 3.
  EXPECT_EQ(s.streams[0][1].pair_id, 0);
  EXPECT_EQ(s.streams[1][0].pair_id, 0);
  EXPECT_EQ(s.streams[0][3].pair_id, 1);
  EXPECT_EQ(s.streams[1][4].pair_id, 2);
  EXPECT_EQ(s.streams[0][4].pair_id, 2);
}

TEST(Lowering, BytesReductionsAndOptimizerStep) {
  ScheduleParams params = make(ScheduleKind::kChimera, 4, 4);
  params.data_parallel = 2;
  params.num_layers = 8;
  LoweringOptions options;
  options.activation_bytes = 100;
  options.gradient_bytes = 60;
  options.reduction_bytes_per_layer = 7;
  const Schedule s = compile(params, options);
  EXPECT_EQ(count(s, OpKind::kReduceGradPipelines), 8u);     // 4 stages x 2 replicas
  EXPECT_EQ(count(s, OpKind::kReduceGradDataParallel), 8u);  // every chunk of every worker
  EXPECT_EQ(count(s, OpKind::kOptimizerStep), 4u);
  for (int w = 0; w < 4; ++w) {
    const auto& stream = s.streams[static_cast<std::size_t>(w)];
    EXPECT_EQ(stream.back().kind, OpKind::kOptimizerStep);
    for (const Instruction& in : stream) {
      if (in.kind == OpKind::kSendActivation) {
        EXPECT_EQ(in.bytes, 100);
      }
      if (in.kind == OpKind::kRecvGradient) {
        EXPECT_EQ(in.bytes, 60);
      }
      if (in.kind == OpKind::kReduceGradPipelines) {
        EXPECT_EQ(in.peer, 3 - w);
        EXPECT_EQ(in.bytes, 14);
      }
    }
  }
  // The two reductions of worker 0 (stages 0 and 3, both with worker 3) come in stage order.
  std::vector<int> stages;
  for (const Instruction& in : s.streams[0]) {
    if (in.kind == OpKind::kReduceGradPipelines) stages.push_back(in.chunk);
  }
  EXPECT_EQ(stages, (std::vector<int>{0, 3}));
}

TEST(Lowering, RefusesNonComputeInput) {
  const Schedule lowered = compile(make(ScheduleKind::kGPipe, 2, 2));
  try {
    lower(lowered);
    FAIL();
  } catch (const std::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find("compute-only"), std::string::npos);
  }
}

TEST(Lowering, ReportsACyclicComputeOrder) {
  Schedule s = generate(make(ScheduleKind::kGPipe, 2, 2));
  // Worker 1 wants micro-batch 1 first while worker 0... swap worker 0's forwards after its
  // backwards: worker 0 can never run B0 before worker 1 runs B0, which needs F0 of worker 0.
  std::swap(s.streams[0][0], s.streams[0][2]);  // B0 F1 F0 B1
  try {
    lower(s);
    FAIL();
  } catch (const std::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find("can never finish"), std::string::npos)
        << error.what();
  }
}

// Every generator over a grid of (p, m, v): compute-only and lowered schedules validate, the
// counts are right, and the unit-time makespan matches the textbook formula where there is one.
TEST(Properties, EveryGeneratorOverAGrid) {
  for (ScheduleKind kind : {ScheduleKind::kGPipe, ScheduleKind::kOneFOneB,
                            ScheduleKind::kInterleaved, ScheduleKind::kChimera}) {
    for (int p : {1, 2, 3, 4, 6, 8}) {
      for (int m : {1, 2, 3, 4, 6, 8, 12, 16}) {
        for (int v : {1, 2, 3}) {
          for (bool split : {false, true}) {
            ScheduleParams params = make(kind, p, m, v);
            params.split_backward = split;
            try {
              check_params(params);
            } catch (const std::invalid_argument&) {
              continue;
            }
            SCOPED_TRACE(std::string(to_string(kind)) + " p=" + std::to_string(p) + " m=" +
                         std::to_string(m) + " v=" + std::to_string(v) + (split ? " split" : ""));
            const Schedule compute_only = generate(params);
            ASSERT_NO_THROW(validate(compute_only));
            const Schedule s = lower(compute_only);
            ASSERT_NO_THROW(validate(s));
            const auto counts = count_kinds(s);
            auto n = [&](OpKind k) { return counts[static_cast<std::size_t>(k)]; };
            const std::size_t pipelines = kind == ScheduleKind::kChimera ? 2 : 1;
            const std::size_t chunks = static_cast<std::size_t>(p * v);
            const std::size_t per_pipeline = static_cast<std::size_t>(m) / pipelines;
            const std::size_t units = pipelines * chunks * per_pipeline;
            EXPECT_EQ(n(OpKind::kForward), units);
            EXPECT_EQ(n(OpKind::kBackward), split ? 0 : units);
            EXPECT_EQ(n(OpKind::kBackwardInput), split ? units : 0);
            EXPECT_EQ(n(OpKind::kBackwardWeight), split ? units : 0);
            // One send per chunk boundary that crosses workers (all of them when p > 1).
            const std::size_t boundaries = p > 1 ? pipelines * (chunks - 1) * per_pipeline : 0;
            EXPECT_EQ(n(OpKind::kSendActivation), boundaries);
            EXPECT_EQ(n(OpKind::kRecvActivation), boundaries);
            EXPECT_EQ(n(OpKind::kSendGradient), boundaries);
            EXPECT_EQ(n(OpKind::kRecvGradient), boundaries);
            EXPECT_EQ(n(OpKind::kOptimizerStep), static_cast<std::size_t>(p));
            EXPECT_EQ(n(OpKind::kReduceGradPipelines), pipelines == 2 ? 2 * chunks : 0);
            // Unit durations: forward 1, backward 2 (1 + 1 when split).
            const auto timings = unit_timings(s, UnitDurations{});
            double makespan = 0;
            for (const auto& row : timings) {
              for (const auto& t : row) makespan = std::max(makespan, t.start_us + t.duration_us);
            }
            if (kind == ScheduleKind::kGPipe || kind == ScheduleKind::kOneFOneB) {
              // (m + p - 1)(t_f + t_b); splitting the backward takes W off the critical path.
              if (split) {
                EXPECT_LE(makespan, 3.0 * (m + p - 1));
              } else {
                EXPECT_DOUBLE_EQ(makespan, 3.0 * (m + p - 1));
              }
            }
            if (kind == ScheduleKind::kChimera && !split && m == p) {
              // PipeFisher's model for one unit (N = D): D t_f + (2D - 2) t_b.
              EXPECT_DOUBLE_EQ(makespan, p * 1.0 + (2.0 * p - 2) * 2.0);
            }
            if (kind == ScheduleKind::kInterleaved && !split) {
              // (m + (p - 1)/v)(t_f + t_b) with t_f = v, t_b = 2v per worker.
              EXPECT_DOUBLE_EQ(makespan, 3.0 * (m * v + p - 1));
            }
          }
        }
      }
    }
  }
}

TEST(Properties, MultiStepSchedulesLowerAndValidate) {
  for (ScheduleKind kind : {ScheduleKind::kGPipe, ScheduleKind::kOneFOneB,
                            ScheduleKind::kInterleaved, ScheduleKind::kChimera}) {
    for (int p : {2, 4}) {
      ScheduleParams params = make(kind, p, 2 * p, kind == ScheduleKind::kInterleaved ? 2 : 1);
      params.data_parallel = 2;
      SCOPED_TRACE(std::string(to_string(kind)) + " p=" + std::to_string(p));
      const Schedule s = lower(repeat_steps(generate(params), 3));
      ASSERT_NO_THROW(validate(s));
      EXPECT_EQ(s.num_steps, 3);
      EXPECT_EQ(count(s, OpKind::kOptimizerStep), static_cast<std::size_t>(3 * p));
      // Each worker's optimizer step of step s comes before any compute of step s + 1.
      for (const auto& stream : s.streams) {
        int steps_done = 0;
        for (const Instruction& in : stream) {
          if (in.kind == OpKind::kOptimizerStep) {
            EXPECT_EQ(in.step, steps_done);
            ++steps_done;
          }
          if (is_compute(in.kind)) {
            EXPECT_EQ(in.step, steps_done);
          }
        }
        EXPECT_EQ(steps_done, 3);
      }
    }
  }
  EXPECT_THROW(repeat_steps(compile(make(ScheduleKind::kGPipe, 2, 2)), 2), std::invalid_argument);
}

// ---------------------------------------------------------------------------------------------
// Hand-broken schedules.

std::string validation_message(const Schedule& s) {
  try {
    validate(s);
  } catch (const ValidationError& error) {
    return error.what();
  }
  return "accepted";
}

void expect_message(const Schedule& s, const std::string& fragment) {
  const std::string message = validation_message(s);
  EXPECT_NE(message.find(fragment), std::string::npos) << message;
}

Schedule small_1f1b() {
  return compile(make(ScheduleKind::kOneFOneB, 2, 2));
}

TEST(Validator, MissingBackward) {
  Schedule s = compile(make(ScheduleKind::kOneFOneB, 4, 4));
  auto& stream = s.streams[2];
  const auto it = std::find_if(stream.begin(), stream.end(), [](const Instruction& in) {
    return in.kind == OpKind::kBackward && in.microbatch == 3;
  });
  ASSERT_NE(it, stream.end());
  stream.erase(it);
  expect_message(s, "missing backward of step 0, pipeline 0, chunk 2, micro-batch 3");
  expect_message(s, "worker 2");
}

TEST(Validator, FailureNamesWorkerPositionInstructionAndDrawsTheGrid) {
  Schedule s = small_1f1b();
  std::swap(s.streams[0][1], s.streams[0][2]);  // SA0 moved after F1: fine; now swap F0/SA0
  std::swap(s.streams[0][0], s.streams[0][2]);  // SA0 F1 F0 ...
  try {
    validate(s);
    FAIL();
  } catch (const ValidationError& error) {
    EXPECT_EQ(error.worker, 0);
    EXPECT_EQ(error.position, 0);
    const std::string message = error.what();
    EXPECT_NE(message.find("worker 0 position 0 (SA0.c0->w1)"), std::string::npos) << message;
    EXPECT_NE(message.find("activation sent before it is computed"), std::string::npos) << message;
    EXPECT_NE(message.find("[SA0.c0->w1]"), std::string::npos) << message;  // the grid
    EXPECT_NE(message.find("w1    |"), std::string::npos) << message;
  }
}

TEST(Validator, SwappedSendPairIds) {
  Schedule s = small_1f1b();
  std::swap(s.streams[0][1].pair_id, s.streams[0][3].pair_id);  // SA0 <-> SA1 ids
  expect_message(s, "(RA0.c1<-w0) has pair id 0, the send has 1");
}

TEST(Validator, SendToTheWrongPeer) {
  Schedule s = compile(make(ScheduleKind::kOneFOneB, 4, 4));
  s.streams[0][1].peer = 2;  // SA0 of chunk 0 must go to worker 1
  expect_message(s, "lives on worker 1, but the peer is 2");
}

TEST(Validator, MismatchedBytes) {
  Schedule s = small_1f1b();
  s.streams[0][1].bytes = 5;
  expect_message(s, "sends 5 bytes but its receive");
}

TEST(Validator, DuplicatePairId) {
  Schedule s = small_1f1b();
  // Re-label the whole gradient pair 2 as pair 0, already used by the first activation pair.
  for (auto& stream : s.streams) {
    for (Instruction& in : stream) {
      if (in.pair_id == 2) in.pair_id = 0;
    }
  }
  expect_message(s, "pair id 0 is used by more than one");
}

TEST(Validator, CyclicWaitIsADeadlock) {
  Schedule s = small_1f1b();
  // Worker 1: RA0 F0 B0 SG0 RA1 F1 B1 SG1 OPT. Worker 0 sends activation 1 before it waits for
  // gradient 0, worker 1 sends gradient 0 before it receives activation 1: a cycle.
  auto& w1 = s.streams[1];
  const std::vector<Instruction> original = w1;
  w1 = {original[0], original[1], original[3], original[4], original[2],
        original[5], original[6], original[7], original[8]};
  ASSERT_EQ(labels(w1), "RA0.c1<-w0 F0.c1 B0.c1 SG0.c1->w0 RA1.c1<-w0 F1.c1 B1.c1 SG1.c1->w0 OPT");
  const std::string message = validation_message(s);
  EXPECT_NE(message.find("deadlock under blocking send/receive semantics"), std::string::npos)
      << message;
  EXPECT_NE(message.find("worker 0 at position 3 (SA1.c0->w1) waits for worker 1 at position 3 "
                         "(SG0.c1->w0) waits for worker 0 (cycle)"),
            std::string::npos)
      << message;
}

TEST(Validator, ComputeOnlyCycleIsReported) {
  Schedule s = generate(make(ScheduleKind::kGPipe, 2, 2));
  // Worker 0: B0 before... make worker 1 run F1 before F0 and worker 0 run B0 before F1.
  s.streams[0] = {s.streams[0][0], s.streams[0][2], s.streams[0][1], s.streams[0][3]};
  std::swap(s.streams[1][0], s.streams[1][1]);  // w1: F1 F0 B0 B1
  expect_message(s, "cyclic wait");
}

TEST(Validator, WrongWorkerAndRanges) {
  Schedule s = generate(make(ScheduleKind::kGPipe, 2, 2));
  s.streams[0][0].chunk = 1;
  expect_message(s, "chunk 1 of pipeline 0 lives on worker 1, not here");
  s = generate(make(ScheduleKind::kGPipe, 2, 2));
  s.streams[0][0].microbatch = 7;
  expect_message(s, "micro-batch 7 outside [0, 2)");
  s = generate(make(ScheduleKind::kGPipe, 2, 2));
  s.streams[0].push_back(s.streams[0][0]);
  expect_message(s, "second forward");
  s = generate(make(ScheduleKind::kGPipe, 2, 2));
  s.streams.pop_back();
  expect_message(s, "1 streams but its parameters say 2 workers");
}

TEST(Validator, BackwardInputAndWeightOrder) {
  ScheduleParams params = make(ScheduleKind::kOneFOneB, 2, 2);
  params.split_backward = true;
  Schedule s = generate(params);
  // Worker 1: F0 I0 W0 F1 I1 W1 -> F0 W0 I0 ...
  std::swap(s.streams[1][1], s.streams[1][2]);
  expect_message(s, "backward-weight before its backward-input");
  s = generate(params);
  s.streams[1].erase(s.streams[1].begin() + 2);  // drop W0
  expect_message(s, "missing backward-weight");
}

// ---------------------------------------------------------------------------------------------
// K-FAC kinds.

Instruction kfac(OpKind kind, int layer, int chunk, int microbatch = -1) {
  Instruction in;
  in.kind = kind;
  in.layer = layer;
  in.chunk = chunk;
  in.microbatch = microbatch;
  in.linear = LinearKind::kFfnIn;
  return in;
}

// GPipe p=2 m=2 lowered, worker 1 (chunk 1 = layer 1):
// RA0 F0 RA1 F1 B0 SG0 B1 SG1 OPT. Each insert goes before the original instruction at
// `position`; inserts at the same position keep their listed order (list them ascending).
Schedule gpipe_with_kfac(const std::vector<std::pair<std::size_t, Instruction>>& inserts) {
  Schedule s = compile(make(ScheduleKind::kGPipe, 2, 2));
  auto& stream = s.streams[1];
  std::size_t offset = 0;
  for (const auto& [position, in] : inserts) {
    stream.insert(stream.begin() + static_cast<std::ptrdiff_t>(position + offset), in);
    ++offset;
  }
  return s;
}

TEST(Validator, KfacInOrderIsAccepted) {
  ASSERT_EQ(labels(compile(make(ScheduleKind::kGPipe, 2, 2)).streams[1]),
            "RA0.c1<-w0 F0.c1 RA1.c1<-w0 F1.c1 B0.c1 SG0.c1->w0 B1.c1 SG1.c1->w0 OPT");
  const Schedule s = gpipe_with_kfac({
      {2, kfac(OpKind::kCurvatureA, 1, 1, 0)},
      {4, kfac(OpKind::kCurvatureA, 1, 1, 1)},
      {5, kfac(OpKind::kCurvatureB, 1, 1, 0)},
      {7, kfac(OpKind::kCurvatureB, 1, 1, 1)},
      {8, kfac(OpKind::kCurvatureSync, 1, -1)},
      {8, kfac(OpKind::kInvertA, 1, -1)},
      {8, kfac(OpKind::kInvertB, 1, -1)},
      {8, kfac(OpKind::kPrecondition, 1, -1)},
  });
  EXPECT_EQ(validation_message(s), "accepted");
}

TEST(Validator, KfacOrderViolations) {
  expect_message(gpipe_with_kfac({{1, kfac(OpKind::kCurvatureA, 1, 1, 0)}}),
                 "curvature A before its forward");
  expect_message(gpipe_with_kfac({{4, kfac(OpKind::kCurvatureB, 1, 1, 0)}}),
                 "curvature B before its backward");
  expect_message(gpipe_with_kfac({{2, kfac(OpKind::kCurvatureSync, 1, -1)},
                                  {2, kfac(OpKind::kCurvatureA, 1, 1, 0)}}),
                 "curvature sync of layer 1 ffn_in before its curvature");
  expect_message(gpipe_with_kfac(
                     {{6, kfac(OpKind::kInvertB, 1, -1)}, {7, kfac(OpKind::kCurvatureB, 1, 1, 1)}}),
                 "inversion B of layer 1 ffn_in before the curvature");
  expect_message(gpipe_with_kfac({{6, kfac(OpKind::kPrecondition, 1, -1)}}),
                 "precondition of layer 1 ffn_in before the last backward");
  expect_message(gpipe_with_kfac({{9, kfac(OpKind::kPrecondition, 1, -1)}}),
                 "after its step's optimizer step");
  expect_message(gpipe_with_kfac({{8, kfac(OpKind::kInvertA, 0, -1)}}),
                 "layer 0 does not live on this worker (it lives in pipeline 0 chunk 0 on "
                 "worker 0)");
  expect_message(gpipe_with_kfac({{8, kfac(OpKind::kInvertA, 5, -1)}}), "layer 5 outside [0, 2)");
}

}  // namespace
}  // namespace pf::sched
