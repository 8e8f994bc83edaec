// The K-FAC work model: which tasks a refresh needs, on which worker, after what.
#include <gtest/gtest.h>

#include <map>

#include "scheduler/compile.h"
#include "scheduler/pipefisher/kfac_work.h"

namespace pf::pipefisher {
namespace {

using sched::OpKind;

sched::Schedule compiled(sched::ScheduleKind kind, int workers, int microbatches, int layers = 0,
                         int chunks_per_worker = 1, int data_parallel = 1) {
  sched::ScheduleParams params;
  params.kind = kind;
  params.workers = workers;
  params.microbatches = microbatches;
  params.num_layers = layers;
  params.chunks_per_worker = chunks_per_worker;
  params.data_parallel = data_parallel;
  return sched::compile(params);
}

double unit_duration(int, const sched::Instruction&) {
  return 1.0;
}

std::map<OpKind, int> count(const KfacWork& work) {
  std::map<OpKind, int> counts;
  for (const auto& task : work.tasks) ++counts[task.kind()];
  return counts;
}

TEST(KfacWork, OneFOneBCountsAndDependencies) {
  const auto base = compiled(sched::ScheduleKind::kOneFOneB, 4, 8, 8);  // 2 layers per worker
  const auto work = build_kfac_work(base, {}, 3, unit_duration);
  auto counts = count(work);
  EXPECT_EQ(counts[OpKind::kCurvatureA], 4 * 8 * 2 * 6);  // workers x micro-batches x layers x 6
  EXPECT_EQ(counts[OpKind::kCurvatureB], 4 * 8 * 2 * 6);
  EXPECT_EQ(counts[OpKind::kCurvatureSync], 0);  // one pipeline, no data parallelism
  EXPECT_EQ(counts[OpKind::kInvertA], 8 * 6);
  EXPECT_EQ(counts[OpKind::kInvertB], 8 * 6);
  EXPECT_EQ(counts[OpKind::kPrecondition], 3 * 8 * 6);  // every step of the refresh
  for (std::size_t t = 0; t < work.tasks.size(); ++t) {
    const auto& task = work.tasks[t];
    ASSERT_EQ(task.workers.size(), 1u);
    const auto& in = task.instructions[0];
    // Every task runs on the worker that holds its layer.
    const auto& chunk = base.placement.at(in.pipeline, in.chunk);
    EXPECT_EQ(chunk.worker, task.workers[0]);
    EXPECT_GE(in.layer, chunk.first_layer);
    EXPECT_LT(in.layer, chunk.first_layer + chunk.num_layers);
    for (int dep : task.task_deps) EXPECT_LT(dep, static_cast<int>(t));
    const auto& stream = base.streams[static_cast<std::size_t>(task.workers[0])];
    switch (task.kind()) {
      case OpKind::kCurvatureA:
      case OpKind::kCurvatureB: {
        ASSERT_EQ(task.base_deps.size(), 1u);
        const auto& source = stream[static_cast<std::size_t>(task.base_deps[0].position)];
        EXPECT_EQ(source.kind,
                  task.kind() == OpKind::kCurvatureA ? OpKind::kForward : OpKind::kBackward);
        EXPECT_EQ(source.microbatch, in.microbatch);
        EXPECT_EQ(task.base_deps[0].step, 0);  // curvature from the refresh's first step
        break;
      }
      case OpKind::kInvertA:
      case OpKind::kInvertB:
        // Both factors' curvature of every micro-batch: pi-adjusted damping needs A and B.
        EXPECT_EQ(task.task_deps.size(), 16u);
        for (int dep : task.task_deps) {
          const auto kind = work.tasks[static_cast<std::size_t>(dep)].kind();
          EXPECT_TRUE(kind == OpKind::kCurvatureA || kind == OpKind::kCurvatureB);
          EXPECT_EQ(work.tasks[static_cast<std::size_t>(dep)].instructions[0].layer, in.layer);
        }
        break;
      case OpKind::kPrecondition: {
        ASSERT_EQ(task.base_deps.size(), 1u);
        EXPECT_EQ(task.step_bound, in.step);
        EXPECT_EQ(task.base_deps[0].step, in.step);
        // After the chunk's last backward.
        const int last = task.base_deps[0].position;
        EXPECT_EQ(stream[static_cast<std::size_t>(last)].kind, OpKind::kBackward);
        for (std::size_t x = static_cast<std::size_t>(last) + 1; x < stream.size(); ++x) {
          EXPECT_NE(stream[x].kind, OpKind::kBackward);
        }
        // Only the refresh's last step waits for the new inverses.
        EXPECT_EQ(task.task_deps.size(), in.step == 2 ? 2u : 0u);
        break;
      }
      default:
        ADD_FAILURE() << "unexpected kind";
    }
  }
}

TEST(KfacWork, ChimeraSyncsReplicas) {
  const auto base = compiled(sched::ScheduleKind::kChimera, 4, 4, 4);
  const auto work = build_kfac_work(base, {}, 1, unit_duration);
  auto counts = count(work);
  EXPECT_EQ(counts[OpKind::kCurvatureSync], 4 * 6);
  EXPECT_EQ(counts[OpKind::kInvertA], 2 * 4 * 6);  // both replicas invert
  for (const auto& task : work.tasks) {
    if (task.kind() != OpKind::kCurvatureSync) continue;
    ASSERT_EQ(task.workers.size(), 2u);
    EXPECT_EQ(task.instructions[0].peer, task.workers[1]);
    EXPECT_EQ(task.instructions[1].peer, task.workers[0]);
    EXPECT_NE(task.instructions[0].pipeline, task.instructions[1].pipeline);
    EXPECT_EQ(task.instructions[0].chunk, task.instructions[1].chunk);
    // After the curvature of both replicas: each took half of the micro-batches, A and B.
    EXPECT_EQ(task.task_deps.size(), 2u * 2u * 2u);
  }
}

TEST(KfacWork, DataParallelSyncHasNoPeer) {
  const auto base = compiled(sched::ScheduleKind::kGPipe, 2, 2, 2, 1, 4);
  const auto work = build_kfac_work(base, {}, 1, unit_duration);
  EXPECT_EQ(count(work)[OpKind::kCurvatureSync], 2 * 6);
  for (const auto& task : work.tasks) {
    if (task.kind() == OpKind::kCurvatureSync) {
      EXPECT_EQ(task.instructions[0].peer, -1);
    }
  }
}

TEST(KfacWork, OptionsSelectLayersLinearsAndCurvatureSteps) {
  const auto base = compiled(sched::ScheduleKind::kGPipe, 2, 4, 4);
  KfacOptions options;
  options.layers = {1, 2};
  options.linears = {sched::LinearKind::kFfnIn};
  auto counts = count(build_kfac_work(base, options, 2, unit_duration));
  EXPECT_EQ(counts[OpKind::kCurvatureA], 2 * 4);
  EXPECT_EQ(counts[OpKind::kInvertB], 2);
  options.curvature = CurvatureSource::kEveryStep;
  counts = count(build_kfac_work(base, options, 2, unit_duration));
  EXPECT_EQ(counts[OpKind::kCurvatureA], 2 * 2 * 4);

  options.layers = {4};
  EXPECT_THROW(build_kfac_work(base, options, 1, unit_duration), std::invalid_argument);
  options.layers = {};
  options.linears = {};
  EXPECT_THROW(build_kfac_work(base, options, 1, unit_duration), std::invalid_argument);
  EXPECT_THROW(build_kfac_work(base, {}, 0, unit_duration), std::invalid_argument);
  auto two_steps = base;
  two_steps.num_steps = 2;
  EXPECT_THROW(build_kfac_work(two_steps, {}, 1, unit_duration), std::invalid_argument);
}

}  // namespace
}  // namespace pf::pipefisher
