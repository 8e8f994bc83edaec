// Divisible K-FAC tasks in the PipeFisher pass: a task longer than every gap is cut into pieces
// that fill the gaps, the pieces form valid chains (a broken one is refused), survive JSON, are
// priced with their overhead, and the pass never refuses for lack of bubbles.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <tuple>

#include "scheduler/compile.h"
#include "scheduler/pipefisher/pass.h"
#include "scheduler/pipefisher/report_json.h"
#include "scheduler/schedule_json.h"
#include "scheduler/validate.h"
#include "sim/uniform_cost_model.h"

namespace pf::pipefisher {
namespace {

using sched::OpKind;
using sched::ScheduleKind;

sched::Schedule compiled(ScheduleKind kind, int workers, int microbatches, int chunks = 1) {
  sched::ScheduleParams params;
  params.kind = kind;
  params.workers = workers;
  params.microbatches = microbatches;
  params.chunks_per_worker = chunks;
  return sched::compile(params);
}

// Inversions (12 time units) longer than any gap of a pipeline whose forward takes 1 and backward
// 2 (GPipe's largest, at the flush, is (p - 1) * 3 = 9), as BERT-Large's 4096-wide factors are
// against its micro-batch times.
sim::UniformCosts long_inversions(double overhead = 0.001) {
  sim::UniformCosts costs;
  costs.forward_s = 1.0;
  costs.backward_s = 2.0;
  costs.curvature_a_s = 0.02;
  costs.curvature_b_s = 0.02;
  costs.curvature_sync_s = 0.02;
  costs.invert_a_s = 12.0;
  costs.invert_b_s = 12.0;
  costs.precondition_s = 0.05;
  costs.kfac_task_overhead_s = overhead;
  costs.kfac_bytes = 1000.0;
  return costs;
}

KfacOptions two_linears() {
  KfacOptions options;
  options.linears = {sched::LinearKind::kQuery, sched::LinearKind::kFfnIn};
  return options;
}

using TaskKey = std::tuple<int, int, int, int, int, int, int>;  // worker + the task's fields

// Per worker and task: the pieces in stream order must cover [0, kPieceUnits) contiguously.
int check_chains(const sched::Schedule& schedule) {
  int divided = 0;
  for (std::size_t w = 0; w < schedule.streams.size(); ++w) {
    std::map<TaskKey, int> next;
    for (const auto& in : schedule.streams[w]) {
      if (!sched::is_kfac(in.kind)) continue;
      const TaskKey key{static_cast<int>(w),
                        static_cast<int>(in.kind),
                        in.step,
                        in.pipeline,
                        in.microbatch,
                        in.layer,
                        static_cast<int>(in.linear)};
      int& at = next[key];
      if (at == sched::kPieceUnits) at = 0;
      EXPECT_EQ(in.piece_begin, at) << sched::short_label(in) << " on worker " << w;
      at = in.piece_end;
      if (sched::is_piece(in) && in.piece_begin == 0) ++divided;
    }
    for (const auto& [key, at] : next) EXPECT_EQ(at, sched::kPieceUnits);
  }
  return divided;
}

TEST(PipeFisherPieces, InversionLongerThanEveryGapIsCutAndKReachesTheBound) {
  const sim::UniformCostModel costs(long_inversions());
  for (ScheduleKind kind :
       {ScheduleKind::kGPipe, ScheduleKind::kOneFOneB, ScheduleKind::kChimera}) {
    SCOPED_TRACE(std::string(sched::to_string(kind)));
    const auto base = compiled(kind, 4, 8);
    const auto result = run_pipefisher(base, costs, two_linears());
    EXPECT_NO_THROW(sched::validate(result.schedule));
    EXPECT_FALSE(result.report.capped) << result.report.warning;
    EXPECT_TRUE(result.report.warning.empty());
    EXPECT_GT(result.report.divided_tasks, 0);
    EXPECT_GT(result.report.pieces, result.report.divided_tasks);
    EXPECT_GE(result.report.refresh_bound, 1);
    EXPECT_LE(result.report.refresh_steps, result.report.refresh_bound + 1);
    EXPECT_EQ(result.report.spilled_tasks, 0);
    EXPECT_GT(check_chains(result.schedule), 0);
    EXPECT_GT(result.report.idle_filled, 0.0);
    EXPECT_LE(result.report.idle_filled, 1.0);

    // Kept whole, no inversion fits any gap: every one runs after the flush, whatever k.
    KfacOptions whole = two_linears();
    whole.split = false;
    const auto indivisible = run_pipefisher(base, costs, whole);
    EXPECT_NO_THROW(sched::validate(indivisible.schedule));
    EXPECT_EQ(indivisible.report.pieces, 0);
    EXPECT_GT(indivisible.report.spilled_tasks, 0);
    EXPECT_GT(indivisible.report.after_flush_s, 0.0);
    EXPECT_GT(indivisible.report.step_time_overhead, result.report.step_time_overhead);
  }
}

TEST(PipeFisherPieces, BrokenChainIsRefusedWithAClearMessage) {
  const sim::UniformCostModel costs(long_inversions());
  const auto result = run_pipefisher(compiled(ScheduleKind::kOneFOneB, 4, 8), costs, two_linears());
  ASSERT_NO_THROW(sched::validate(result.schedule));
  auto find_piece = [&](auto predicate) {
    for (std::size_t w = 0; w < result.schedule.streams.size(); ++w) {
      const auto& stream = result.schedule.streams[w];
      for (std::size_t x = 0; x < stream.size(); ++x) {
        if (sched::is_piece(stream[x]) && predicate(stream[x])) return std::pair{w, x};
      }
    }
    ADD_FAILURE() << "no such piece";
    return std::pair<std::size_t, std::size_t>{0, 0};
  };
  auto message = [](const sched::Schedule& broken) {
    try {
      sched::validate(broken);
    } catch (const sched::ValidationError& error) {
      return std::string(error.what());
    }
    return std::string("accepted");
  };
  // A middle piece missing: the next one does not continue the chain.
  {
    auto broken = result.schedule;
    const auto [w, x] = find_piece([](const sched::Instruction& in) {
      return in.piece_begin > 0 && in.piece_end < sched::kPieceUnits;
    });
    broken.streams[w].erase(broken.streams[w].begin() + static_cast<std::ptrdiff_t>(x));
    EXPECT_NE(message(broken).find("broken chain of pieces"), std::string::npos) << message(broken);
  }
  // The last piece missing: the task stops short.
  {
    auto broken = result.schedule;
    const auto [w, x] =
        find_piece([](const sched::Instruction& in) { return in.piece_end == sched::kPieceUnits; });
    broken.streams[w].erase(broken.streams[w].begin() + static_cast<std::ptrdiff_t>(x));
    EXPECT_NE(message(broken).find("the rest of the task is missing"), std::string::npos)
        << message(broken);
  }
  // Two pieces swapped.
  {
    auto broken = result.schedule;
    const auto [w, x] = find_piece([](const sched::Instruction& in) {
      return in.piece_begin == 0 && (in.kind == OpKind::kInvertA || in.kind == OpKind::kInvertB);
    });
    auto& stream = broken.streams[w];
    std::size_t second = x + 1;
    while (second < stream.size() &&
           !(stream[second].kind == stream[x].kind && stream[second].layer == stream[x].layer &&
             stream[second].linear == stream[x].linear)) {
      ++second;
    }
    ASSERT_LT(second, stream.size());
    std::swap(stream[x], stream[second]);
    EXPECT_NE(message(broken).find("broken chain of pieces"), std::string::npos) << message(broken);
  }
  // A curvature sync cannot be a piece.
  {
    auto broken = result.schedule;
    for (auto& in : broken.streams[0]) {
      if (in.kind == OpKind::kCurvatureA) {
        in.kind = OpKind::kCurvatureSync;
        in.piece_end = 100;
        break;
      }
    }
    EXPECT_NE(message(broken).find("cannot run in pieces"), std::string::npos) << message(broken);
  }
}

TEST(PipeFisherPieces, PiecesSurviveJson) {
  const sim::UniformCostModel costs(long_inversions());
  const auto result = run_pipefisher(compiled(ScheduleKind::kGPipe, 4, 4), costs, two_linears());
  const auto json = sched::to_json(result.schedule);
  const auto back = sched::schedule_from_json(json, "pieces");
  EXPECT_EQ(back.streams, result.schedule.streams);
  EXPECT_GT(check_chains(back), 0);
  // A piece outside [0, kPieceUnits] or on a sync is refused by the reader.
  auto bad = json;
  for (auto& stream : bad["streams"]) {
    for (auto& in : stream) {
      if (in.contains("piece")) {
        in["piece"] = nlohmann::json::array({5, 5000});
        break;
      }
    }
  }
  EXPECT_THROW(sched::schedule_from_json(bad, "bad"), std::invalid_argument);
}

TEST(PipeFisherPieces, CostModelsPricePiecesWithTheirOverhead) {
  const sim::UniformCostModel costs(long_inversions(0.1));
  const auto schedule = compiled(ScheduleKind::kGPipe, 2, 2);
  sched::Instruction in;
  in.kind = OpKind::kInvertA;
  in.layer = 0;
  EXPECT_DOUBLE_EQ(costs.duration(schedule, 0, in), 12.0);
  in.piece_end = sched::kPieceUnits / 4;
  EXPECT_DOUBLE_EQ(costs.duration(schedule, 0, in), 0.25 * 11.9 + 0.1);
  in.piece_begin = sched::kPieceUnits / 4;
  in.piece_end = sched::kPieceUnits;
  EXPECT_DOUBLE_EQ(costs.duration(schedule, 0, in), 0.75 * 11.9 + 0.1);
  EXPECT_DOUBLE_EQ(costs.kfac_task_overhead_s(), 0.1);
  // Splitting is never free: the pass's report counts the extra overheads.
  const auto result = run_pipefisher(compiled(ScheduleKind::kOneFOneB, 4, 8),
                                     sim::UniformCostModel(long_inversions(0.01)), two_linears());
  EXPECT_GT(result.report.pieces, 0);
}

}  // namespace
}  // namespace pf::pipefisher
