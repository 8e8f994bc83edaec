// The zero-bubble generators (ZB-H1, ZB-H2 and their memory family, ZB-V) and the V-shaped
// placement: exact streams of small cases written out from the rules in docs/scheduler.md, the
// bubbles of Qi et al. for uniform F = B = W under the unit-time layout, and the peak activation
// memory the paper states.
#include <gtest/gtest.h>

#include <algorithm>

#include "scheduler/compile.h"
#include "scheduler/generators.h"
#include "scheduler/placement.h"
#include "scheduler/unit_timings.h"
#include "scheduler/validate.h"
#include "tests/scheduler/test_util.h"

namespace pf::sched {
namespace {

using testing::labels;
using testing::make;
using testing::microbatch_labels;

std::size_t count(const Schedule& s, OpKind kind) {
  std::size_t n = 0;
  for (const auto& stream : s.streams) {
    n += static_cast<std::size_t>(std::count_if(
        stream.begin(), stream.end(), [&](const Instruction& in) { return in.kind == kind; }));
  }
  return n;
}

struct Span {
  double first_start = 0;
  double last_end = 0;
  double busy = 0;
};

// Per worker: when its first compute starts, its last compute ends, and its compute time, with
// unit durations (forward 1, backward-input 1, backward-weight 1, communication 0).
std::vector<Span> compute_spans(const Schedule& s) {
  const auto timings = unit_timings(s, UnitDurations{});
  std::vector<Span> spans(static_cast<std::size_t>(s.num_workers()));
  for (std::size_t w = 0; w < spans.size(); ++w) {
    bool first = true;
    for (std::size_t i = 0; i < s.streams[w].size(); ++i) {
      if (!is_compute(s.streams[w][i].kind)) continue;
      const auto& t = timings[w][i];
      if (first) spans[w].first_start = t.start_us;
      first = false;
      spans[w].last_end = std::max(spans[w].last_end, t.start_us + t.duration_us);
      spans[w].busy += t.duration_us;
    }
  }
  return spans;
}

double makespan(const std::vector<Span>& spans) {
  double end = 0;
  for (const Span& span : spans) end = std::max(end, span.last_end);
  return end;
}

// Peak number of (chunk, micro-batch) activations a worker holds: +1 at a forward, -1 at the
// backward-weight that releases the stash.
std::vector<int> peak_in_flight(const Schedule& s) {
  std::vector<int> peaks;
  for (const auto& stream : s.streams) {
    int held = 0;
    int peak = 0;
    for (const Instruction& in : stream) {
      if (in.kind == OpKind::kForward) peak = std::max(peak, ++held);
      if (in.kind == OpKind::kBackwardWeight || in.kind == OpKind::kBackward) --held;
    }
    peaks.push_back(peak);
  }
  return peaks;
}

TEST(ZeroBubble, H1ThreeStagesFourMicrobatches) {
  // Worker i: p-1-i warm-up forwards, W deferred while more than i backward-inputs are pending.
  const Schedule s = generate(make(ScheduleKind::kZeroBubbleH1, 3, 4));
  EXPECT_TRUE(s.params.split_backward);
  EXPECT_EQ(microbatch_labels(s.streams[0], 0), "F0 F1 F2 I0 W0 F3 I1 W1 I2 W2 I3 W3");
  EXPECT_EQ(microbatch_labels(s.streams[1], 1), "F0 F1 I0 F2 I1 W0 F3 I2 W1 I3 W2 W3");
  EXPECT_EQ(microbatch_labels(s.streams[2], 2), "F0 I0 F1 I1 F2 I2 W0 F3 I3 W1 W2 W3");
}

TEST(ZeroBubble, H2ThreeStagesFiveMicrobatches) {
  // L = 2p-1 = 5: worker i warms up with 2(p-1-i) forwards and defers 2i weight passes.
  const Schedule s = generate(make(ScheduleKind::kZeroBubbleH2, 3, 5));
  EXPECT_EQ(microbatch_labels(s.streams[0], 0), "F0 F1 F2 F3 F4 I0 W0 I1 W1 I2 W2 I3 W3 I4 W4");
  EXPECT_EQ(microbatch_labels(s.streams[1], 1), "F0 F1 F2 I0 F3 I1 F4 I2 W0 I3 W1 I4 W2 W3 W4");
  EXPECT_EQ(microbatch_labels(s.streams[2], 2), "F0 I0 F1 I1 F2 I2 F3 I3 F4 I4 W0 W1 W2 W3 W4");
}

TEST(ZeroBubble, H2WithFewMicrobatchesDefersNoMoreThanItsSteadyPhase) {
  // m = 4 < 2p-1: worker 1 warms up with 2 forwards and so defers at most m-1-2 = 1 W.
  const Schedule s = generate(make(ScheduleKind::kZeroBubbleH2, 3, 4));
  EXPECT_EQ(microbatch_labels(s.streams[1], 1), "F0 F1 F2 I0 F3 I1 W0 I2 W1 I3 W2 W3");
}

TEST(ZeroBubble, VTwoStagesThreeMicrobatches) {
  // Worker 0 holds chunks 0 and 3, worker 1 chunks 1 and 2 (n = max(m, 2p-1) = 3).
  const Schedule s = generate(make(ScheduleKind::kZeroBubbleV, 2, 3, 2));
  EXPECT_EQ(labels(s.streams[0]),
            "F0.c0 F1.c0 F2.c0 F0.c3 I0.c3 W0.c3 F1.c3 I1.c3 W1.c3 I0.c0 W0.c0 F2.c3 I2.c3 "
            "W2.c3 I1.c0 W1.c0 I2.c0 W2.c0");
  EXPECT_EQ(labels(s.streams[1]),
            "F0.c1 F0.c2 F1.c1 F1.c2 I0.c2 W0.c2 F2.c1 I0.c1 W0.c1 F2.c2 I1.c2 W1.c2 I1.c1 "
            "I2.c2 I2.c1 W1.c1 W2.c2 W2.c1");
}

TEST(ZeroBubble, VLeavesOutMicrobatchesBeyondM) {
  // One micro-batch: the rule runs over n = 3 and keeps only micro-batch 0.
  const Schedule s = generate(make(ScheduleKind::kZeroBubbleV, 2, 1, 2));
  EXPECT_EQ(labels(s.streams[0]), "F0.c0 F0.c3 I0.c3 W0.c3 I0.c0 W0.c0");
  EXPECT_EQ(labels(s.streams[1]), "F0.c1 F0.c2 I0.c2 W0.c2 I0.c1 W0.c1");
}

TEST(ZeroBubble, VShapedPlacement) {
  const Schedule s = generate(make(ScheduleKind::kZeroBubbleV, 4, 8, 2));
  const int expected[8] = {0, 1, 2, 3, 3, 2, 1, 0};
  for (int c = 0; c < 8; ++c) EXPECT_EQ(s.placement.worker_of(0, c), expected[c]) << c;
  EXPECT_TRUE(s.placement.at(0, 0).has_embeddings);
  EXPECT_TRUE(s.placement.at(0, 7).has_head);
  // Three blocks zig-zag: 0 1 | 1 0 | 0 1.
  ScheduleParams custom = make(ScheduleKind::kCustom, 2, 2, 3);
  custom.v_shape = true;
  const Placement zigzag = make_placement(custom);
  const int zig[6] = {0, 1, 1, 0, 0, 1};
  for (int c = 0; c < 6; ++c) EXPECT_EQ(zigzag.worker_of(0, c), zig[c]) << c;
  ScheduleParams chimera = make(ScheduleKind::kChimera, 2, 2);
  chimera.v_shape = true;
  EXPECT_THROW(make_placement(chimera), std::invalid_argument);
}

TEST(ZeroBubble, RefusesImpossibleParameters) {
  auto refused = [](ScheduleParams params, const std::string& part) {
    try {
      generate(params);
      ADD_FAILURE() << "accepted";
    } catch (const std::invalid_argument& error) {
      EXPECT_NE(std::string(error.what()).find(part), std::string::npos) << error.what();
    }
  };
  refused(make(ScheduleKind::kZeroBubbleV, 4, 8, 1), "exactly two chunks per worker");
  refused(make(ScheduleKind::kZeroBubbleH1, 4, 8, 2), "one chunk per worker only");
  ScheduleParams low = make(ScheduleKind::kZeroBubbleH1, 4, 8);
  low.max_in_flight = 3;
  refused(low, "must be in [p, 2p-1] = [4, 7]");
  ScheduleParams high = make(ScheduleKind::kZeroBubbleH2, 4, 8);
  high.max_in_flight = 8;
  refused(high, "must be in [p, 2p-1] = [4, 7]");
  ScheduleParams other = make(ScheduleKind::kOneFOneB, 4, 8);
  other.max_in_flight = 4;
  refused(other, "applies to zbh1 / zbh2 only");
  ScheduleParams v_shaped = make(ScheduleKind::kInterleaved, 4, 8, 2);
  v_shaped.v_shape = true;
  refused(v_shaped, "generated by zbv only");
}

// Every zero-bubble generator over a grid: compute-only and lowered schedules validate, with one
// send per chunk boundary that crosses workers (the V's turn stays on one worker).
TEST(ZeroBubble, EveryGeneratorOverAGridValidates) {
  for (int p : {1, 2, 3, 4, 6, 8}) {
    for (int m : {1, 2, 3, 4, 5, 8, 12, 16}) {
      for (int limit = p; limit <= 2 * p - 1; ++limit) {
        ScheduleParams params = make(ScheduleKind::kZeroBubbleH1, p, m);
        params.max_in_flight = limit;
        SCOPED_TRACE("zbh p=" + std::to_string(p) + " m=" + std::to_string(m) +
                     " L=" + std::to_string(limit));
        const Schedule s = compile(params);
        ASSERT_NO_THROW(validate(s));
        EXPECT_EQ(count(s, OpKind::kBackwardWeight), static_cast<std::size_t>(p * m));
        EXPECT_EQ(count(s, OpKind::kSendActivation), static_cast<std::size_t>((p - 1) * m));
      }
      SCOPED_TRACE("zbv p=" + std::to_string(p) + " m=" + std::to_string(m));
      const Schedule v = compile(make(ScheduleKind::kZeroBubbleV, p, m, 2));
      ASSERT_NO_THROW(validate(v));
      EXPECT_EQ(count(v, OpKind::kForward), static_cast<std::size_t>(2 * p * m));
      EXPECT_EQ(count(v, OpKind::kBackwardInput), static_cast<std::size_t>(2 * p * m));
      EXPECT_EQ(count(v, OpKind::kBackwardWeight), static_cast<std::size_t>(2 * p * m));
      // 2p - 1 boundaries, one of which (p-1 -> p) stays on worker p-1.
      EXPECT_EQ(count(v, OpKind::kSendActivation), static_cast<std::size_t>((2 * p - 2) * m));
      EXPECT_EQ(count(v, OpKind::kSendGradient), static_cast<std::size_t>((2 * p - 2) * m));
    }
  }
}

// Qi et al.: with F = B = W, 1F1B idles (p-1)(F+B+W) per worker, ZB-H1 (p-1)(F+B-W), and ZB-H2
// (p-1)(F+B-2W) = 0 between a worker's first and last instruction. Here F = I = W = 1.
TEST(ZeroBubble, BubblesMatchThePaperForUniformCosts) {
  for (int p : {2, 3, 4, 6, 8}) {
    for (int m : {1, 2, 4, 8, 12, 16, 24}) {
      SCOPED_TRACE("p=" + std::to_string(p) + " m=" + std::to_string(m));
      ScheduleParams one_f_one_b = make(ScheduleKind::kOneFOneB, p, std::max(m, p));
      const auto base = compute_spans(compile(one_f_one_b));
      EXPECT_DOUBLE_EQ(makespan(base), 3.0 * std::max(m, p) + 3.0 * (p - 1));

      const auto h1 = compute_spans(compile(make(ScheduleKind::kZeroBubbleH1, p, m)));
      // Idle per worker: p - 1 once the pipeline fills (m >= p); never worse than 1F1B.
      if (m >= p) {
        EXPECT_DOUBLE_EQ(makespan(h1), 3.0 * m + (p - 1));
      }
      EXPECT_LE(makespan(h1), 3.0 * m + 3.0 * (p - 1));
      for (int w = 0; w < p; ++w) {
        // ZB-H1 starts worker w at w and leaves p-1-w idle waiting for its first gradient.
        const Span& span = h1[static_cast<std::size_t>(w)];
        EXPECT_DOUBLE_EQ(span.first_start, w);
        if (m >= p) {
          EXPECT_DOUBLE_EQ(span.last_end - span.first_start - span.busy, p - 1 - w);
        }
      }
      const auto h2 = compute_spans(compile(make(ScheduleKind::kZeroBubbleH2, p, m)));
      EXPECT_LE(makespan(h2), makespan(h1));  // more memory never hurts
      if (m >= 2 * p - 1) {
        EXPECT_DOUBLE_EQ(makespan(h2), 3.0 * m + (p - 1));
        for (const Span& span : h2) {
          EXPECT_DOUBLE_EQ(span.last_end - span.first_start, span.busy);  // no bubble inside
        }
      }
      // The memory family between them: worker w idles max(0, 2p-1-L-w) inside its step.
      if (m >= 2 * p - 1) {
        for (int limit = p; limit <= 2 * p - 1; ++limit) {
          ScheduleParams params = make(ScheduleKind::kZeroBubbleH1, p, m);
          params.max_in_flight = limit;
          const auto spans = compute_spans(compile(params));
          for (int w = 0; w < p; ++w) {
            const Span& span = spans[static_cast<std::size_t>(w)];
            EXPECT_DOUBLE_EQ(span.last_end - span.first_start - span.busy,
                             std::max(0, 2 * p - 1 - limit - w))
                << "L=" << limit << " w=" << w;
          }
        }
      }
    }
  }
}

// ZB-H2's parallelogram tiles across steps (each worker starts its next step after its own
// optimizer step): k steps take 3mk + p - 1. ZB-H1 keeps idling each step.
TEST(ZeroBubble, H2TilesAcrossSteps) {
  for (int p : {2, 4, 8}) {
    const int m = 2 * p;
    for (int steps : {1, 2, 4}) {
      SCOPED_TRACE("p=" + std::to_string(p) + " steps=" + std::to_string(steps));
      const Schedule h2 =
          lower(repeat_steps(generate(make(ScheduleKind::kZeroBubbleH2, p, m)), steps));
      EXPECT_DOUBLE_EQ(makespan(compute_spans(h2)), 3.0 * m * steps + (p - 1));
      const Schedule h1 =
          lower(repeat_steps(generate(make(ScheduleKind::kZeroBubbleH1, p, m)), steps));
      EXPECT_GT(makespan(compute_spans(h1)), 3.0 * m * steps + (p - 1) - (steps == 1 ? 1 : 0));
    }
  }
}

// ZB-V with F = I = W = 1 per chunk: for m >= 2p-1 only the start offsets remain,
// 6m + p - 1 (ZB-H1 on the same chunk costs would take 6m + 2(p-1), 1F1B 6m + 6(p-1)).
TEST(ZeroBubble, VBubbleForUniformCosts) {
  for (int p : {2, 3, 4, 6, 8}) {
    for (int m : {2 * p - 1, 2 * p, 3 * p, 4 * p}) {
      SCOPED_TRACE("p=" + std::to_string(p) + " m=" + std::to_string(m));
      const auto spans = compute_spans(compile(make(ScheduleKind::kZeroBubbleV, p, m, 2)));
      EXPECT_DOUBLE_EQ(makespan(spans), 6.0 * m + (p - 1));
    }
  }
}

// Peak activation memory (Qi et al., table 2): 1F1B and ZB-H1 hold p micro-batches on the first
// worker (ZB-H1 on every worker), ZB-H2 2p-1, ZB-V p stage-sized micro-batches = 2p chunk-sized.
TEST(ZeroBubble, PeakActivationMemoryMatchesThePaper) {
  for (int p : {2, 3, 4, 8}) {
    const int m = 4 * p;
    SCOPED_TRACE("p=" + std::to_string(p));
    const auto base = peak_in_flight(generate(make(ScheduleKind::kOneFOneB, p, m)));
    EXPECT_EQ(*std::max_element(base.begin(), base.end()), p);
    for (int peak : peak_in_flight(generate(make(ScheduleKind::kZeroBubbleH1, p, m)))) {
      EXPECT_EQ(peak, p);
    }
    for (int peak : peak_in_flight(generate(make(ScheduleKind::kZeroBubbleH2, p, m)))) {
      EXPECT_EQ(peak, 2 * p - 1);
    }
    for (int peak : peak_in_flight(generate(make(ScheduleKind::kZeroBubbleV, p, m, 2)))) {
      EXPECT_LE(peak, 2 * p);
    }
    const auto v = peak_in_flight(generate(make(ScheduleKind::kZeroBubbleV, p, m, 2)));
    EXPECT_EQ(v[0], 2 * p);
  }
}

}  // namespace
}  // namespace pf::sched
