// The pipelined refresh (--kfac-pipelined-refresh on, docs/pipefisher.md "The pipelined
// refresh"): a refresh's inversions may run in the next window's first gaps, so that k reaches
// the work/bubble bound where the plain refresh needs a step more for work released late in its
// window; the validator's rules for that work; simulation and the JSON format.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <map>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "scheduler/compile.h"
#include "scheduler/pipefisher/offload_pass.h"
#include "scheduler/pipefisher/pieces_sweep.h"
#include "scheduler/schedule_json.h"
#include "scheduler/validate.h"
#include "sim/uniform_cost_model.h"

namespace pf::pipefisher {
namespace {

using sched::Instruction;
using sched::OpKind;

// 1F1B on 4 workers, 4 micro-batches, with inversions long against the gaps: the plain refresh
// needs 3 steps, the pipelined 2, with inversions run in the next window whole and as the rest
// of a chain of pieces.
PassResult pipelined_1f1b(bool pipelined) {
  sched::ScheduleParams params;
  params.kind = sched::ScheduleKind::kOneFOneB;
  params.workers = 4;
  params.microbatches = 4;
  params.num_layers = 4;
  sim::UniformCosts costs{.forward_s = 1.0, .backward_s = 2.0, .communication_s = 0.05};
  costs.curvature_a_s = costs.curvature_b_s = 0.05;
  costs.invert_a_s = costs.invert_b_s = 1.0;
  costs.precondition_s = 0.02;
  KfacOptions options;
  options.pipelined_refresh = pipelined;
  // The Linears' sizes: the report's K-FAC memory comes from them (the uniform model has none).
  options.linear_dims.assign(sched::kNumLinearKinds, kfac::LinearDims{8, 16});
  return run_pipefisher(sched::compile(params), sim::UniformCostModel(costs), options);
}

// The simulator counts the second accumulator itself (docs/simulator.md): the previous
// refresh's sums, set aside, from the window's start to their wrapped inversion, the window's
// own from its first curvature. `after` is the plain simulation of the schedule, the state at
// its size, nothing scaled.
TEST(PipelinedRefresh, TheSecondAccumulatorIsCountedOnce) {
  const PassResult pipelined = pipelined_1f1b(true);
  ASSERT_TRUE(pipelined.busiest_replica_holds && pipelined.factor_sum_bytes);
  sim::UniformCosts costs{.forward_s = 1.0, .backward_s = 2.0, .communication_s = 0.05};
  costs.curvature_a_s = costs.curvature_b_s = 0.05;
  costs.invert_a_s = costs.invert_b_s = 1.0;
  costs.precondition_s = 0.02;
  sim::SimOptions options;
  const auto held = pipelined.busiest_replica_holds;
  options.kfac_state_bytes = [held](int w, int layer, sched::LinearKind linear) {
    return held(w, layer, linear).bytes;
  };
  options.kfac_holds_factors = [held](int w, int layer, sched::LinearKind linear) {
    return held(w, layer, linear).factors;
  };
  options.kfac_sum_bytes = pipelined.factor_sum_bytes;
  EXPECT_EQ(pipelined.factor_sum_bytes(0, sched::LinearKind::kQuery, true), 4.0 * 8 * 8);
  EXPECT_EQ(pipelined.factor_sum_bytes(0, sched::LinearKind::kQuery, false), 4.0 * 16 * 16);
  const sim::SimResult plain =
      sim::simulate(pipelined.schedule, sim::UniformCostModel(costs), options);
  int set_aside = 0;
  for (int w = 0; w < pipelined.schedule.num_workers(); ++w) {
    const auto& after = pipelined.after.workers[static_cast<std::size_t>(w)];
    EXPECT_EQ(after.peak_memory_bytes, plain.workers[static_cast<std::size_t>(w)].peak_memory_bytes)
        << "worker " << w;
    // At most the state, and two sums of each factor, of its 6 Linears above the activations.
    EXPECT_LE(after.peak_memory_bytes - pipelined.before.workers[w].peak_memory_bytes,
              6 * (2560.0 + 2 * 1280.0))
        << "worker " << w;
    // The set-aside sums from the window's start (before any K-FAC instruction).
    if (after.memory.front().bytes > pipelined.before.workers[w].memory.front().bytes) ++set_aside;
  }
  EXPECT_GT(set_aside, 0);
}

std::string validation_error(const sched::Schedule& schedule) {
  try {
    sched::validate(schedule);
  } catch (const std::invalid_argument& error) {
    return error.what();
  }
  return {};
}

// The position of the first instruction of worker w matching `match`, or -1.
int find(const sched::Schedule& schedule, int w,
         const std::function<bool(const Instruction&)>& match) {
  const auto& stream = schedule.streams[static_cast<std::size_t>(w)];
  const auto it = std::find_if(stream.begin(), stream.end(), match);
  return it == stream.end() ? -1 : static_cast<int>(it - stream.begin());
}

TEST(PipelinedRefresh, FewerStepsWithInversionsInTheNextWindow) {
  const PassResult plain = pipelined_1f1b(false);
  const PassResult pipelined = pipelined_1f1b(true);
  EXPECT_FALSE(plain.schedule.kfac_pipelined_refresh);
  EXPECT_FALSE(plain.report.pipelined_refresh);
  EXPECT_EQ(plain.report.refresh_steps, 3);
  EXPECT_EQ(pipelined.report.refresh_steps, 2);
  EXPECT_EQ(pipelined.report.plain_refresh_steps, 3);
  EXPECT_TRUE(pipelined.report.pipelined_refresh);
  EXPECT_TRUE(pipelined.schedule.kfac_pipelined_refresh);
  EXPECT_GT(pipelined.report.wrapped_tasks, 0);
  EXPECT_EQ(validation_error(pipelined.schedule), "");
  // Only inversions wrap, with steps of the previous window; some continue a chain of pieces.
  int wrapped = 0, continued = 0;
  for (const auto& stream : pipelined.schedule.streams) {
    for (const Instruction& in : stream) {
      if (!sched::is_wrapped(in)) continue;
      ++wrapped;
      continued += in.piece_begin > 0 ? 1 : 0;
      EXPECT_TRUE(in.kind == OpKind::kInvertA || in.kind == OpKind::kInvertB);
      EXPECT_EQ(in.step, -2);  // the window's first step, of the previous window
    }
  }
  EXPECT_GT(wrapped, continued);
  EXPECT_GT(continued, 0);
  // A second accumulator per factor: the state of factors and inverses grows by half.
  EXPECT_GT(plain.report.kfac_memory_bytes, 0.0);
  EXPECT_DOUBLE_EQ(pipelined.report.kfac_memory_bytes, 1.5 * plain.report.kfac_memory_bytes);
  // The factor sums: the window's and the previous window's set aside for their inversions.
  EXPECT_GT(plain.report.factor_sum_bytes, 0.0);
  EXPECT_DOUBLE_EQ(pipelined.report.factor_sum_bytes, 2.0 * plain.report.factor_sum_bytes);
  // Simulated with the wrapped work in the window's first step.
  EXPECT_GT(pipelined.after.step_time_s, 0.0);
  EXPECT_GE(pipelined.report.step_time_overhead, 0.0);
  // JSON keeps the flag and the negative steps.
  const auto read = sched::schedule_from_json(sched::to_json(pipelined.schedule), "test");
  EXPECT_EQ(read, pipelined.schedule);
}

TEST(PipelinedRefresh, KeptOnlyWhereItHelps) {
  KfacOptions options;
  options.pipelined_refresh = true;
  // The sweep's BERT-Base on a P100, micro-batch 32, D = 8, Chimera: the plain refresh is at the
  // bound with nothing of the refresh after a flush; the pipelined plan (one step staler) reaches
  // the same k and no less after the flush, and is not taken.
  const SweepResult plain =
      run_sweep_case({"analytic", "p100", "base", 32, 8, sched::ScheduleKind::kChimera}, options);
  ASSERT_EQ(plain.refused, "");
  EXPECT_EQ(plain.split.plain_refresh_steps, plain.split.refresh_bound);
  EXPECT_FALSE(plain.split.pipelined_refresh);
  EXPECT_EQ(plain.split.refresh_steps, plain.split.plain_refresh_steps);
  // D = 4: both refreshes take the bound's k, and the pipelined one, its wrapped work in the
  // next window's first gaps (step 0's room held for it: pack's wrap_hold), leaves less work
  // after a flush: it is taken. (Without the hold its wrapped work found the twins of step 0's
  // bubbles full, and the plain refresh was kept here.)
  const SweepResult wrapped =
      run_sweep_case({"analytic", "p100", "base", 32, 4, sched::ScheduleKind::kChimera}, options);
  ASSERT_EQ(wrapped.refused, "");
  EXPECT_TRUE(wrapped.split.pipelined_refresh);
  EXPECT_EQ(wrapped.split.refresh_steps, wrapped.split.plain_refresh_steps);
  EXPECT_GT(wrapped.split.wrapped_tasks, 0);
  EXPECT_EQ(wrapped.invalid, "");
}

TEST(PipelinedRefresh, ReachesTheBoundInTheSweep) {
  // BERT-Base on a P100, micro-batch 8, D = 4, 1F1B: bound 5; the plain refresh needs 6 (worker
  // 3's first-step head can hold no work of its own window), the pipelined one 5.
  const SweepCase config{"analytic", "p100", "base", 8, 4, sched::ScheduleKind::kOneFOneB};
  KfacOptions options;
  options.pipelined_refresh = true;
  const SweepResult result = run_sweep_case(config, options);
  ASSERT_EQ(result.refused, "");
  EXPECT_EQ(result.split.refresh_bound, 5);
  EXPECT_EQ(result.split.plain_refresh_steps, 6);
  EXPECT_EQ(result.split.refresh_steps, 5);
  EXPECT_TRUE(result.split.pipelined_refresh);
}

TEST(PipelinedRefresh, ValidatorNamesTheBrokenRule) {
  const sched::Schedule good = pipelined_1f1b(true).schedule;
  // A wrapped inversion, and its worker.
  int worker = -1, position = -1;
  for (int w = 0; w < good.num_workers() && position < 0; ++w) {
    worker = w;
    position = find(good, w, [](const Instruction& in) { return sched::is_wrapped(in); });
  }
  ASSERT_GE(position, 0);
  const Instruction wrapped =
      good.streams[static_cast<std::size_t>(worker)][static_cast<std::size_t>(position)];
  const auto same_linear = [&](const Instruction& in) {
    return in.layer == wrapped.layer && in.linear == wrapped.linear &&
           in.pipeline == wrapped.pipeline;
  };

  // After this window's inversion of its Linear.
  {
    sched::Schedule bad = good;
    auto& stream = bad.streams[static_cast<std::size_t>(worker)];
    const int own = find(bad, worker, [&](const Instruction& in) {
      return !sched::is_wrapped(in) && same_linear(in) &&
             (in.kind == OpKind::kInvertA || in.kind == OpKind::kInvertB ||
              in.kind == OpKind::kPrecondition);
    });
    ASSERT_GT(own, position);
    stream.insert(stream.begin() + own + 1, wrapped);
    stream.erase(stream.begin() + position);
    const std::string error = validation_error(bad);
    EXPECT_NE(error.find("the previous refresh's inversions of a Linear precede the window's "
                         "inversions of it"),
              std::string::npos)
        << error;
  }
  // Curvature of the window before it is fine: it accumulates into the second set of sums.
  {
    sched::Schedule moved = good;
    auto& stream = moved.streams[static_cast<std::size_t>(worker)];
    const int curvature = find(moved, worker, [&](const Instruction& in) {
      return in.kind == OpKind::kCurvatureA && same_linear(in);
    });
    ASSERT_GE(curvature, 0);
    if (curvature > position) {
      stream.insert(stream.begin() + curvature + 1, wrapped);
      stream.erase(stream.begin() + position);
      EXPECT_EQ(validation_error(moved), "");
    }
  }
  // Without the pipelined flag.
  {
    sched::Schedule bad = good;
    bad.kfac_pipelined_refresh = false;
    const std::string error = validation_error(bad);
    EXPECT_NE(error.find("needs a pipelined refresh"), std::string::npos) << error;
  }
  // Work other than an inversion in the next window.
  {
    sched::Schedule bad = good;
    auto& stream = bad.streams[static_cast<std::size_t>(worker)];
    const int curvature =
        find(bad, worker, [](const Instruction& in) { return in.kind == OpKind::kCurvatureB; });
    ASSERT_GE(curvature, 0);
    stream[static_cast<std::size_t>(curvature)].step = -1;
    const std::string error = validation_error(bad);
    EXPECT_NE(error.find("only inversions and curvature syncs of a pipelined refresh run in the "
                         "next window"),
              std::string::npos)
        << error;
  }
  // A step before the previous window.
  {
    sched::Schedule bad = good;
    bad.streams[static_cast<std::size_t>(worker)][static_cast<std::size_t>(position)].step = -3;
    const std::string error = validation_error(bad);
    EXPECT_NE(error.find("outside [-2, 2)"), std::string::npos) << error;
  }
  // A chain of pieces that does not continue where the window's pieces stopped.
  {
    sched::Schedule bad = good;
    int w = 0, at = -1;
    for (; w < bad.num_workers() && at < 0; ++w) {
      at = find(bad, w,
                [](const Instruction& in) { return sched::is_wrapped(in) && in.piece_begin > 0; });
    }
    ASSERT_GE(at, 0);
    auto& in = bad.streams[static_cast<std::size_t>(w - 1)][static_cast<std::size_t>(at)];
    in.piece_begin = static_cast<std::uint16_t>(in.piece_begin - 1);
    const std::string error = validation_error(bad);
    EXPECT_NE(error.find("broken chain of pieces across refresh windows"), std::string::npos)
        << error;
  }
  // The whole task again in the next window, though it completed in its own.
  {
    sched::Schedule bad = good;
    auto& stream = bad.streams[static_cast<std::size_t>(worker)];
    const int own = find(bad, worker, [&](const Instruction& in) {
      return !sched::is_wrapped(in) && !sched::is_piece(in) && in.kind == OpKind::kInvertA;
    });
    ASSERT_GE(own, 0);
    Instruction again = stream[static_cast<std::size_t>(own)];
    again.step = static_cast<std::int16_t>(again.step - bad.num_steps);
    stream.insert(stream.begin(), again);
    const std::string error = validation_error(bad);
    EXPECT_NE(error.find("the task is complete in its own window"), std::string::npos) << error;
  }
}

// Chimera on 4 workers, 4 micro-batches, with curvature syncs long against the gaps: the syncs
// are the refresh's late work, and with the pipelined refresh they run on into the next
// window's first gaps (pieces on both replicas at once), the inversions after them: k = 10
// against the plain refresh's 11 (the bound).
PassResult pipelined_chimera(bool pipelined) {
  sched::ScheduleParams params;
  params.kind = sched::ScheduleKind::kChimera;
  params.workers = 4;
  params.microbatches = 4;
  params.num_layers = 4;
  sim::UniformCosts costs{.forward_s = 1.0, .backward_s = 2.0, .communication_s = 0.05};
  costs.curvature_a_s = costs.curvature_b_s = 0.05;
  costs.invert_a_s = costs.invert_b_s = 0.1;
  costs.precondition_s = 0.02;
  costs.curvature_sync_s = 3.0;
  KfacOptions options;
  options.pipelined_refresh = pipelined;
  options.linear_dims.assign(sched::kNumLinearKinds, kfac::LinearDims{8, 16});
  return run_pipefisher(sched::compile(params), sim::UniformCostModel(costs), options);
}

TEST(PipelinedRefresh, CurvatureSyncsRunInTheNextWindowOnBothReplicas) {
  const PassResult plain = pipelined_chimera(false);
  const PassResult pipelined = pipelined_chimera(true);
  ASSERT_TRUE(pipelined.report.pipelined_refresh);
  EXPECT_EQ(plain.report.refresh_steps, 11);
  EXPECT_EQ(pipelined.report.refresh_steps, 10);
  EXPECT_EQ(pipelined.report.refresh_bound, 10);
  EXPECT_EQ(validation_error(pipelined.schedule), "");
  // Per worker, its wrapped syncs in stream order; the partner posts the same ones.
  const auto wrapped_syncs = [](const sched::Schedule& schedule, int w) {
    std::vector<Instruction> syncs;
    for (const Instruction& in : schedule.streams[static_cast<std::size_t>(w)]) {
      if (in.kind == OpKind::kCurvatureSync && sched::is_wrapped(in)) syncs.push_back(in);
    }
    return syncs;
  };
  int with_wrapped_syncs = 0;
  for (int w = 0; w < pipelined.schedule.num_workers(); ++w) {
    const auto mine = wrapped_syncs(pipelined.schedule, w);
    if (mine.empty()) continue;
    ++with_wrapped_syncs;
    const auto theirs = wrapped_syncs(pipelined.schedule, mine.front().peer);
    ASSERT_EQ(mine.size(), theirs.size());
    for (std::size_t i = 0; i < mine.size(); ++i) {
      EXPECT_EQ(std::tie(mine[i].step, mine[i].layer, mine[i].linear, mine[i].piece_begin,
                         mine[i].piece_end),
                std::tie(theirs[i].step, theirs[i].layer, theirs[i].linear, theirs[i].piece_begin,
                         theirs[i].piece_end));
    }
  }
  EXPECT_GT(with_wrapped_syncs, 0);

  // A worker with a wrapped sync, the sync's position and its Linear's wrapped inversion.
  int worker = -1, sync = -1;
  for (int w = 0; w < pipelined.schedule.num_workers() && sync < 0; ++w) {
    worker = w;
    sync = find(pipelined.schedule, w, [](const Instruction& in) {
      return in.kind == OpKind::kCurvatureSync && sched::is_wrapped(in);
    });
  }
  ASSERT_GE(sync, 0);
  const Instruction wrapped_sync =
      pipelined.schedule.streams[static_cast<std::size_t>(worker)][static_cast<std::size_t>(sync)];
  // Its partner's syncs in another order: the pairing is broken.
  {
    sched::Schedule bad = pipelined.schedule;
    auto& stream = bad.streams[static_cast<std::size_t>(wrapped_sync.peer)];
    std::vector<std::size_t> syncs;
    for (std::size_t i = 0; i < stream.size(); ++i) {
      if (stream[i].kind == OpKind::kCurvatureSync) syncs.push_back(i);
    }
    ASSERT_GE(syncs.size(), 2U);
    // On the partner, the next sync of another Linear after its first wrapped sync (one that
    // begins its task) moved just ahead of that wrapped sync.
    std::size_t first = 0;
    while (first < syncs.size() && !sched::is_wrapped(stream[syncs[first]])) ++first;
    std::size_t other = first + 1;
    const auto linear_of = [](const Instruction& in) { return std::tie(in.layer, in.linear); };
    while (other < syncs.size() &&
           (linear_of(stream[syncs[other]]) == linear_of(stream[syncs[first]]) ||
            stream[syncs[other]].piece_begin != 0)) {
      ++other;
    }
    ASSERT_LT(other, syncs.size());
    const Instruction moved = stream[syncs[other]];
    stream.erase(stream.begin() + static_cast<std::ptrdiff_t>(syncs[other]));
    stream.insert(stream.begin() + static_cast<std::ptrdiff_t>(syncs[first]), moved);
    const std::string error = validation_error(bad);
    EXPECT_NE(error.find("every member posts the same syncs and pieces in the same order"),
              std::string::npos)
        << error;
  }
  // A wrapped inversion of its Linear moved ahead of it.
  {
    sched::Schedule bad = pipelined.schedule;
    auto& stream = bad.streams[static_cast<std::size_t>(worker)];
    const int inversion = find(bad, worker, [&](const Instruction& in) {
      return sched::is_wrapped(in) &&
             (in.kind == OpKind::kInvertA || in.kind == OpKind::kInvertB) &&
             in.layer == wrapped_sync.layer && in.linear == wrapped_sync.linear &&
             in.pipeline == wrapped_sync.pipeline;
    });
    ASSERT_GT(inversion, sync);
    const Instruction moved = stream[static_cast<std::size_t>(inversion)];
    stream.erase(stream.begin() + inversion);
    stream.insert(stream.begin() + sync, moved);
    const std::string error = validation_error(bad);
    EXPECT_NE(error.find("an inversion follows the last piece of its Linear's curvature sync"),
              std::string::npos)
        << error;
  }
  // Its Linear's inversion run in its own window instead (where it stands in the stream, its
  // step the refresh's own): it would finalize the refresh's sums before the wrapped sync of
  // them, as the packer once planned when the inversion found no room after a wrapped sync.
  {
    sched::Schedule bad = pipelined.schedule;
    auto& stream = bad.streams[static_cast<std::size_t>(worker)];
    const int inversion = find(bad, worker, [&](const Instruction& in) {
      return sched::is_wrapped(in) &&
             (in.kind == OpKind::kInvertA || in.kind == OpKind::kInvertB) &&
             in.layer == wrapped_sync.layer && in.linear == wrapped_sync.linear &&
             in.pipeline == wrapped_sync.pipeline;
    });
    ASSERT_GE(inversion, 0);
    auto& own = stream[static_cast<std::size_t>(inversion)];
    own.step = static_cast<std::int16_t>(own.step + bad.num_steps);
    ASSERT_FALSE(sched::is_wrapped(own));
    const std::string error = validation_error(bad);
    EXPECT_NE(error.find("in its own window, but its refresh's curvature sync runs in the next "
                         "window"),
              std::string::npos)
        << error;
  }
  // Simulated, with both replicas' wrapped pieces paired.
  EXPECT_GT(pipelined.after.step_time_s, 0.0);
  const auto read = sched::schedule_from_json(sched::to_json(pipelined.schedule), "test");
  EXPECT_EQ(read, pipelined.schedule);
}

TEST(PipelinedRefresh, RefusedWhereItIsNotSupported) {
  KfacOptions options;
  options.pipelined_refresh = true;
  options.curvature = CurvatureSource::kEveryStep;
  EXPECT_THROW(options.validate(), std::invalid_argument);
  options.curvature = CurvatureSource::kFirstStep;
  options.state_placement = kfac::uniform_placement({kfac::Placement::kShard, 0});
  EXPECT_THROW(options.validate(), std::invalid_argument);
}

// K-FAC offload (docs/offload.md) with a pipelined refresh: the previous refresh's inversions run
// in the window get factor windows of their own (copies with its negative step), written back
// before the window's first inverse prefetch of their Linear, since every step of the window
// preconditions with their inverses; the window's own inversions write back in windows of their
// own too. Between refreshes no offloaded state is on the device.
TEST(PipelinedRefresh, OffloadedStateMovesAroundTheWrappedInversions) {
  const PassResult pass = pipelined_1f1b(true);
  ASSERT_TRUE(pass.schedule.kfac_pipelined_refresh);
  sim::UniformCosts unit{.forward_s = 1.0, .backward_s = 2.0, .communication_s = 0.05};
  unit.curvature_a_s = unit.curvature_b_s = 0.05;
  unit.invert_a_s = unit.invert_b_s = 1.0;
  unit.precondition_s = 0.02;
  unit.kfac_bytes = 2560.0;  // 2 x 4 x (8^2 + 16^2): the Linears' state, as the pass counts it
  unit.host_bandwidth = 1e5;
  const sim::UniformCostModel costs(unit);
  OffloadOptions options;
  options.mode = OffloadMode::kHost;
  OffloadResult offload;
  ASSERT_NO_THROW(offload = run_offload_pass(pass, costs, options));
  EXPECT_EQ(validation_error(offload.schedule), "");
  int wrapped_windows = 0;
  for (int w = 0; w < offload.schedule.num_workers(); ++w) {
    const auto& stream = offload.schedule.streams[static_cast<std::size_t>(w)];
    // Per Linear: the position of its wrapped write-back, and of its first inverse prefetch.
    std::map<std::pair<int, int>, int> wrapped_write_back, first_prefetch;
    for (std::size_t i = 0; i < stream.size(); ++i) {
      const Instruction& in = stream[i];
      const std::pair<int, int> key{in.layer, static_cast<int>(in.linear)};
      if (in.kind == OpKind::kWriteBackState && sched::is_wrapped(in)) {
        wrapped_write_back[key] = static_cast<int>(i);
      }
      if (in.kind == OpKind::kPrefetchInverses && first_prefetch.count(key) == 0) {
        first_prefetch[key] = static_cast<int>(i);
      }
    }
    for (const auto& [key, position] : wrapped_write_back) {
      ++wrapped_windows;
      ASSERT_TRUE(first_prefetch.contains(key));
      EXPECT_LT(position, first_prefetch.at(key));
    }
    const auto& plan = offload.plan.workers[static_cast<std::size_t>(w)];
    // At the window's end kept and offloaded alike hold the window's factor sums (their
    // inversion runs in the next window); the state differs: the kept one's, none offloaded.
    EXPECT_DOUBLE_EQ(
        pass.after.workers[w].memory.back().bytes - offload.after.workers[w].memory.back().bytes,
        plan.offloaded_bytes)
        << "worker " << w;
  }
  EXPECT_GT(wrapped_windows, 0);
  // The schedule round-trips through JSON with its wrapped copies.
  const auto text = sched::to_json(offload.schedule).dump();
  EXPECT_EQ(sched::schedule_from_json(nlohmann::json::parse(text), "round trip").streams,
            offload.schedule.streams);

  // A broken placement: an inverse prefetch before the write-back of the previous refresh's
  // inverses it reads.
  {
    sched::Schedule bad = offload.schedule;
    int worker = -1, write_back = -1;
    for (int w = 0; w < bad.num_workers() && write_back < 0; ++w) {
      worker = w;
      write_back = find(bad, w, [](const Instruction& in) {
        return in.kind == OpKind::kWriteBackState && sched::is_wrapped(in);
      });
    }
    ASSERT_GE(write_back, 0);
    auto& stream = bad.streams[static_cast<std::size_t>(worker)];
    const Instruction wb = stream[static_cast<std::size_t>(write_back)];
    const int prefetch = find(bad, worker, [&](const Instruction& in) {
      return in.kind == OpKind::kPrefetchInverses && in.layer == wb.layer && in.linear == wb.linear;
    });
    ASSERT_GT(prefetch, write_back);
    const Instruction moved = stream[static_cast<std::size_t>(prefetch)];
    stream.erase(stream.begin() + prefetch);
    stream.insert(stream.begin() + write_back, moved);
    const std::string error = validation_error(bad);
    EXPECT_NE(error.find("before the write-back of the previous refresh's inverses"),
              std::string::npos)
        << error;
  }
  // The previous refresh's factor window and the window's own merged (its write-back and the
  // next factor prefetch dropped): the own inversions would replace the inverses before they
  // are written back.
  {
    sched::Schedule bad = offload.schedule;
    bool merged = false;
    for (int w = 0; w < bad.num_workers() && !merged; ++w) {
      auto& stream = bad.streams[static_cast<std::size_t>(w)];
      for (std::size_t i = 0; i < stream.size() && !merged; ++i) {
        const Instruction wb = stream[i];
        if (wb.kind != OpKind::kWriteBackState || !sched::is_wrapped(wb)) continue;
        const auto own = std::find_if(stream.begin() + static_cast<std::ptrdiff_t>(i), stream.end(),
                                      [&](const Instruction& in) {
                                        return in.kind == OpKind::kPrefetchFactors &&
                                               in.layer == wb.layer && in.linear == wb.linear;
                                      });
        if (own == stream.end()) continue;
        stream.erase(own);
        stream.erase(stream.begin() + static_cast<std::ptrdiff_t>(i));
        merged = true;
      }
    }
    ASSERT_TRUE(merged);
    const std::string error = validation_error(bad);
    EXPECT_NE(error.find("previous refresh's inverses"), std::string::npos) << error;
  }
}

}  // namespace
}  // namespace pf::pipefisher
