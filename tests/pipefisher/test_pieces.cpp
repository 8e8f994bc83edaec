// Divisible K-FAC tasks in the PipeFisher pass: a task longer than every gap is cut into pieces
// that fill the gaps, the pieces form valid chains (a broken one is refused), survive JSON, are
// priced with their overhead, and the pass never refuses for lack of bubbles.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "runtime/model/bert_config.h"
#include "scheduler/compile.h"
#include "scheduler/pipefisher/kfac_command.h"
#include "scheduler/pipefisher/pass.h"
#include "scheduler/pipefisher/report_json.h"
#include "scheduler/schedule_json.h"
#include "scheduler/validate.h"
#include "sim/analytic_cost_model.h"
#include "sim/simulator.h"
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

TEST(PipeFisherPieces, UsableBoundCountsOnlyGapsThatHoldAPieceEachPayingTheOverhead) {
  // GPipe, 4 workers, 8 micro-batches, forward 1, backward 2: each worker idles 9 per steady
  // step, in one gap (workers 0 and 3: 9) or two (worker 1: 6 and 3, worker 2: 3 and 6). Per
  // refresh each worker has two Linears' curvature (0.64 in all) and four inversions of 12:
  // 48.64 * 1.05 (margin) / 9 = 5.7, the work/bubble bound 6.
  const auto base = compiled(ScheduleKind::kGPipe, 4, 8);
  // Splitting free (no per-task overhead): every gap holds a piece and loses nothing to it, and
  // the bound in usable gaps is the work/bubble bound.
  const auto free =
      run_pipefisher(base, sim::UniformCostModel(long_inversions(0.0)), two_linears());
  EXPECT_EQ(free.report.refresh_bound, 6);
  EXPECT_EQ(free.report.usable_bound, 6);
  // An overhead of 0.6 in each task: each gap does at most its length less 0.63 (with the
  // margin) of the tasks' work beyond their own overhead (4 * 11.4 * 1.05 = 47.9): workers 1 and
  // 2 have 9 - 2 * 0.63 = 7.74 a step for it, 6.2 steps. (An inversion of 12 is two pieces at
  // least, no piece being longer than the longest gap, 9: 51.1 + 4 * 0.63 over 9 is 6 steps.)
  // The bound in usable gaps is 7, and k with it.
  const auto costly =
      run_pipefisher(base, sim::UniformCostModel(long_inversions(0.6)), two_linears());
  EXPECT_EQ(costly.report.refresh_bound, 6);
  EXPECT_EQ(costly.report.usable_bound, 7);
  EXPECT_GE(costly.report.refresh_steps, costly.report.usable_bound);
  EXPECT_EQ(to_json(costly.report).at("usable_bound"), costly.report.usable_bound);
  EXPECT_NE(format_kfac_report(costly.report)
                .find("in usable gaps " + std::to_string(costly.report.usable_bound) + ")"),
            std::string::npos)
      << format_kfac_report(costly.report);
  // Curvature of 3 per micro-batch and no piece under 5 overheads (3): no piece of any task fits
  // a gap of 3 with the margin, so workers 1 and 2 have only their gap of 6 a step for
  // 32 * 3 + 4 * 12 = 144 (* 1.05) of work, and in it each inversion is three pieces at least
  // (11.4 of work in pieces of at most 6 / 1.05 - 0.6 = 5.1), two overheads more each:
  // (144 + 8 * 0.6) * 1.05 / 6 = 26.04, 27 steps, against the work/bubble bound's
  // 151.2 / 9 = 17.
  sim::UniformCosts long_curvature = long_inversions(0.6);
  long_curvature.curvature_a_s = long_curvature.curvature_b_s = 3.0;
  KfacOptions five = two_linears();
  five.min_piece_overheads = 5.0;
  const auto short_gaps = run_pipefisher(base, sim::UniformCostModel(long_curvature), five);
  EXPECT_EQ(short_gaps.report.refresh_bound, 17);
  EXPECT_EQ(short_gaps.report.usable_bound, 27);
  EXPECT_GE(short_gaps.report.refresh_steps, short_gaps.report.usable_bound);
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
  // An inverse broadcast cannot be a piece.
  {
    auto broken = result.schedule;
    for (auto& in : broken.streams[0]) {
      if (in.kind == OpKind::kCurvatureA) {
        in.kind = OpKind::kBroadcastInverses;
        in.piece_end = 100;
        break;
      }
    }
    EXPECT_NE(message(broken).find("cannot run in pieces"), std::string::npos) << message(broken);
  }
}

// Chimera's curvature sync (an all-reduce between the two replicas of a stage) longer than every
// common gap: cut into row-range pieces that both replicas run at the same time, in the same
// order; the inversions follow the last piece.
sim::UniformCosts long_syncs() {
  sim::UniformCosts costs = long_inversions();
  costs.invert_a_s = costs.invert_b_s = 0.5;
  costs.curvature_sync_s = 8.0;
  return costs;
}

// Per worker, its sync instructions with `peer` in stream order: (step, layer, linear, piece).
std::vector<std::tuple<int, int, int, int, int>> syncs_with(const sched::Schedule& schedule,
                                                            int worker, int peer) {
  std::vector<std::tuple<int, int, int, int, int>> out;
  for (const auto& in : schedule.streams[static_cast<std::size_t>(worker)]) {
    if (in.kind == OpKind::kCurvatureSync && in.peer == peer) {
      out.emplace_back(in.step, in.layer, static_cast<int>(in.linear), in.piece_begin,
                       in.piece_end);
    }
  }
  return out;
}

TEST(PipeFisherPieces, ChimeraSyncIsCutIntoPiecesBothReplicasRun) {
  const sim::UniformCostModel costs(long_syncs());
  const auto base = compiled(ScheduleKind::kChimera, 4, 8);
  const auto result = run_pipefisher(base, costs, two_linears());
  ASSERT_NO_THROW(sched::validate(result.schedule));
  EXPECT_FALSE(result.report.capped) << result.report.warning;
  EXPECT_EQ(result.report.spilled_tasks, 0);
  EXPECT_LE(result.report.refresh_steps, result.report.refresh_bound + 1);
  check_chains(result.schedule);
  int sync_pieces = 0;
  for (int w = 0; w < 4; ++w) {
    const auto mine = syncs_with(result.schedule, w, 3 - w);
    EXPECT_EQ(mine, syncs_with(result.schedule, 3 - w, w)) << "workers " << w << ", " << 3 - w;
    for (const auto& sync : mine) {
      if (std::get<3>(sync) != 0 || std::get<4>(sync) != sched::kPieceUnits) ++sync_pieces;
    }
  }
  EXPECT_GT(sync_pieces, 0);
  // The simulator pairs the pieces (a missing partner would throw) and prices each with the
  // overhead again; the plan's K-FAC never delays the pipeline beyond the margin.
  const auto simulated = sim::simulate(result.schedule, costs);
  EXPECT_DOUBLE_EQ(simulated.step_time_s, result.after.step_time_s);

  // Kept whole, a sync longer than every gap runs after a flush.
  KfacOptions whole = two_linears();
  whole.split = false;
  const auto indivisible = run_pipefisher(base, costs, whole);
  EXPECT_GT(indivisible.report.spilled_tasks, 0);
  EXPECT_LT(result.report.step_time_overhead, indivisible.report.step_time_overhead);
}

TEST(PipeFisherPieces, SyncPiecesPostedDifferentlyByTheReplicasAreRefused) {
  const sim::UniformCostModel costs(long_syncs());
  const auto result = run_pipefisher(compiled(ScheduleKind::kChimera, 4, 8), costs, two_linears());
  ASSERT_NO_THROW(sched::validate(result.schedule));
  auto message = [](const sched::Schedule& broken) {
    try {
      sched::validate(broken);
    } catch (const sched::ValidationError& error) {
      return std::string(error.what());
    }
    return std::string("accepted");
  };
  // One replica's sync piece cut in two (its chain still whole): the pieces no longer match.
  {
    auto broken = result.schedule;
    auto& stream = broken.streams[0];
    auto it = std::find_if(stream.begin(), stream.end(), [](const sched::Instruction& in) {
      return in.kind == OpKind::kCurvatureSync && in.piece_end - in.piece_begin >= 2;
    });
    ASSERT_NE(it, stream.end());
    sched::Instruction second = *it;
    it->piece_end = static_cast<std::uint16_t>((it->piece_begin + it->piece_end) / 2);
    second.piece_begin = it->piece_end;
    stream.insert(it + 1, second);
    EXPECT_NE(
        message(broken).find("every member posts the same syncs and pieces in the same order"),
        std::string::npos)
        << message(broken);
  }
  // Every piece of one sync missing on one replica: the other's have no partner.
  {
    auto broken = result.schedule;
    auto& stream = broken.streams[0];
    auto first = std::find_if(stream.begin(), stream.end(), [](const sched::Instruction& in) {
      return in.kind == OpKind::kCurvatureSync;
    });
    ASSERT_NE(first, stream.end());
    const sched::Instruction dropped = *first;
    std::erase_if(stream, [&](const sched::Instruction& in) {
      return in.kind == OpKind::kCurvatureSync && in.layer == dropped.layer &&
             in.linear == dropped.linear && in.step == dropped.step;
    });
    EXPECT_NE(message(broken).find("every member posts the same syncs"), std::string::npos)
        << message(broken);
  }
}

TEST(PipeFisherPieces, PiecesSurviveJson) {
  const sim::UniformCostModel costs(long_inversions());
  const auto result = run_pipefisher(compiled(ScheduleKind::kGPipe, 4, 4), costs, two_linears());
  const auto json = sched::to_json(result.schedule);
  const auto back = sched::schedule_from_json(json, "pieces");
  EXPECT_EQ(back.streams, result.schedule.streams);
  EXPECT_GT(check_chains(back), 0);
  // A piece outside [0, kPieceUnits] is refused by the reader.
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
  EXPECT_DOUBLE_EQ(costs.kfac_task_overhead_s(OpKind::kInvertA), 0.1);
  // A curvature-sync piece: its share of the whole all-reduce plus the overhead, whatever its
  // own payload (`bytes`), in the uniform and the analytic models.
  sched::Instruction sync;
  sync.kind = OpKind::kCurvatureSync;
  sync.layer = 0;
  sync.linear = sched::LinearKind::kFfnIn;
  const sim::UniformCostModel uniform(long_syncs());
  EXPECT_DOUBLE_EQ(uniform.duration(schedule, 0, sync), 8.0);
  sync.piece_end = sched::kPieceUnits / 4;
  sync.bytes = 12345;
  EXPECT_DOUBLE_EQ(uniform.duration(schedule, 0, sync), 0.25 * (8.0 - 0.001) + 0.001);
  sim::Workload workload;
  workload.config = model::bert_preset("large");
  workload.seq_len = 128;
  workload.micro_batch_size = 8;
  workload.precision = sim::Precision::kFp16;
  const sim::AnalyticCostModel analytic(workload, sim::device_preset("v100"));
  sched::ScheduleParams chimera;
  chimera.kind = ScheduleKind::kChimera;
  chimera.workers = 4;
  chimera.microbatches = 4;
  chimera.num_layers = 24;
  const auto two_pipelines = sched::compile(chimera);
  sched::Instruction whole_sync = sync;
  whole_sync.piece_end = sched::kPieceUnits;
  whole_sync.bytes = 0;
  const double whole = analytic.duration(two_pipelines, 0, whole_sync);
  const double overhead = analytic.kfac_task_overhead_s(OpKind::kCurvatureSync);
  EXPECT_GT(whole, overhead);
  EXPECT_DOUBLE_EQ(analytic.duration(two_pipelines, 0, sync), 0.25 * (whole - overhead) + overhead);
  // Splitting is never free: the pass's report counts the extra overheads.
  const auto result = run_pipefisher(compiled(ScheduleKind::kOneFOneB, 4, 8),
                                     sim::UniformCostModel(long_inversions(0.01)), two_linears());
  EXPECT_GT(result.report.pieces, 0);
}

// Per-kind overheads (sim/kfac_overheads.h): the pass takes each task's own kind's overhead for
// its smallest piece, whether it may be cut, the bounds and the report.
TEST(PipeFisherPieces, EachTaskUsesItsOwnKindsOverhead) {
  const auto base = compiled(ScheduleKind::kGPipe, 4, 8);
  const sim::UniformCosts common = long_inversions(0.001);
  const auto reference = run_pipefisher(base, sim::UniformCostModel(common), two_linears());
  // Every kind given the common value as its own: the same pass, bit for bit.
  sim::UniformCosts same = common;
  for (auto& own : same.kfac_kind_overheads_s) own = common.kfac_task_overhead_s;
  const auto again = run_pipefisher(base, sim::UniformCostModel(same), two_linears());
  EXPECT_EQ(sched::to_json(again.schedule), sched::to_json(reference.schedule));
  EXPECT_EQ(again.report.refresh_steps, reference.report.refresh_steps);
  EXPECT_EQ(again.report.usable_bound, reference.report.usable_bound);
  EXPECT_EQ(again.report.pieces, reference.report.pieces);
  EXPECT_EQ(again.report.step_time_after_s, reference.report.step_time_after_s);
  // A kind this run has no task of (GPipe, one replica: no curvature sync) changes nothing.
  sim::UniformCosts sync_only = common;
  sync_only.kfac_kind_overheads_s[2] = 0.5;
  const auto unmoved = run_pipefisher(base, sim::UniformCostModel(sync_only), two_linears());
  EXPECT_EQ(sched::to_json(unmoved.schedule), sched::to_json(reference.schedule));

  // The inversions alone at 0.6: no inversion piece costs less than 2 overheads of 0.6
  // (KfacOptions::min_piece_overheads), and the report counts 0.6 per extra inversion piece.
  sim::UniformCosts inversions = common;
  inversions.kfac_kind_overheads_s[3] = inversions.kfac_kind_overheads_s[4] = 0.6;
  const sim::UniformCostModel costly(inversions);
  const auto result = run_pipefisher(base, costly, two_linears());
  EXPECT_NO_THROW(sched::validate(result.schedule));
  EXPECT_GT(check_chains(result.schedule), 0);
  double compute = 0.0;
  int inversion_pieces = 0;
  for (std::size_t w = 0; w < result.schedule.streams.size(); ++w) {
    for (const auto& in : result.schedule.streams[w]) {
      if (!sched::is_kfac(in.kind) || sched::is_kfac_collective(in.kind)) continue;
      const double seconds = costly.duration(result.schedule, static_cast<int>(w), in);
      compute += seconds;
      if ((in.kind == OpKind::kInvertA || in.kind == OpKind::kInvertB) && sched::is_piece(in)) {
        ++inversion_pieces;
        EXPECT_GE(seconds, 2 * 0.6 - 1e-12) << sched::short_label(in);
      }
    }
  }
  EXPECT_GT(inversion_pieces, 0);
  double reported = 0.0;
  for (const auto& worker : result.report.workers) reported += worker.kfac_compute_s;
  EXPECT_NEAR(reported * result.report.refresh_steps, compute, 1e-9 * compute);
  // The curvature (0.02 a task) is still priced with 0.001.
  EXPECT_EQ(costly.kfac_task_overhead_s(OpKind::kCurvatureA), 0.001);
  // The bound in usable gaps counts each task's own overhead: on workers 1 and 2 (longest gap 6,
  // a piece at most 6 / 1.05) an inversion is three pieces at least, each extra one paying 0.6
  // (with 0.001: 0.001): (4 * (12 + 2 * 0.6) + 0.64) * 1.05 / 9 = 6.2, 7 steps, against
  // (4 * 12.002 + 0.64) * 1.05 / 9 = 5.7, 6 steps.
  EXPECT_EQ(reference.report.usable_bound, 6);
  EXPECT_EQ(result.report.usable_bound, 7);

  // An inversion overhead as long as the inversion: no inversion may be cut, so each one (longer
  // than every gap) runs after the flush.
  sim::UniformCosts whole = common;
  whole.kfac_kind_overheads_s[3] = whole.kfac_kind_overheads_s[4] = 12.0;
  const auto uncut = run_pipefisher(base, sim::UniformCostModel(whole), two_linears());
  EXPECT_NO_THROW(sched::validate(uncut.schedule));
  for (const auto& stream : uncut.schedule.streams) {
    for (const auto& in : stream) {
      if (in.kind == OpKind::kInvertA || in.kind == OpKind::kInvertB) {
        EXPECT_FALSE(sched::is_piece(in)) << sched::short_label(in);
      }
    }
  }
  EXPECT_GT(uncut.report.spilled_tasks, 0);
}

}  // namespace
}  // namespace pf::pipefisher
