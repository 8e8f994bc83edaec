// Exact streams of every generator for small cases, written out by hand from the algorithms'
// definitions (docs/scheduler.md), and the refusal of impossible parameters.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "scheduler/compile.h"
#include "scheduler/generators.h"
#include "scheduler/placement.h"
#include "scheduler/schedule_json.h"
#include "tests/scheduler/test_util.h"

namespace pf::sched {
namespace {

using testing::labels;
using testing::make;
using testing::microbatch_labels;

TEST(Generators, GPipeAllForwardsThenAllBackwards) {
  const Schedule s = generate(make(ScheduleKind::kGPipe, 2, 3));
  ASSERT_EQ(s.num_workers(), 2);
  EXPECT_EQ(microbatch_labels(s.streams[0], 0), "F0 F1 F2 B0 B1 B2");
  EXPECT_EQ(microbatch_labels(s.streams[1], 1), "F0 F1 F2 B0 B1 B2");
}

TEST(Generators, OneFOneBFourStagesEightMicrobatches) {
  const Schedule s = generate(make(ScheduleKind::kOneFOneB, 4, 8));
  EXPECT_EQ(microbatch_labels(s.streams[0], 0), "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7");
  EXPECT_EQ(microbatch_labels(s.streams[1], 1), "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7");
  EXPECT_EQ(microbatch_labels(s.streams[2], 2), "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7");
  EXPECT_EQ(microbatch_labels(s.streams[3], 3), "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7");
}

TEST(Generators, OneFOneBSplitBackwardPutsWeightRightAfterInput) {
  ScheduleParams params = make(ScheduleKind::kOneFOneB, 2, 3);
  params.split_backward = true;
  const Schedule s = generate(params);
  EXPECT_EQ(microbatch_labels(s.streams[0], 0), "F0 F1 I0 W0 F2 I1 W1 I2 W2");
  EXPECT_EQ(microbatch_labels(s.streams[1], 1), "F0 I0 W0 F1 I1 W1 F2 I2 W2");
}

TEST(Generators, InterleavedFourStagesTwoChunksEightMicrobatches) {
  const Schedule s = generate(make(ScheduleKind::kInterleaved, 4, 8, 2));
  // Worker 0 holds chunks 0 and 4; warm-up 2(p-1) + (v-1)p = 10 forwards.
  EXPECT_EQ(labels(s.streams[0]),
            "F0.c0 F1.c0 F2.c0 F3.c0 F0.c4 F1.c4 F2.c4 F3.c4 F4.c0 F5.c0 "
            "F6.c0 B0.c4 F7.c0 B1.c4 F4.c4 B2.c4 F5.c4 B3.c4 F6.c4 B0.c0 F7.c4 B1.c0 "
            "B2.c0 B3.c0 B4.c4 B5.c4 B6.c4 B7.c4 B4.c0 B5.c0 B6.c0 B7.c0");
  // Worker 1 (chunks 1 and 5): warm-up 8.
  EXPECT_EQ(labels(s.streams[1]),
            "F0.c1 F1.c1 F2.c1 F3.c1 F0.c5 F1.c5 F2.c5 F3.c5 "
            "F4.c1 B0.c5 F5.c1 B1.c5 F6.c1 B2.c5 F7.c1 B3.c5 "
            "F4.c5 B0.c1 F5.c5 B1.c1 F6.c5 B2.c1 F7.c5 B3.c1 "
            "B4.c5 B5.c5 B6.c5 B7.c5 B4.c1 B5.c1 B6.c1 B7.c1");
  // Worker 3 (chunks 3 and 7): warm-up 4.
  EXPECT_EQ(labels(s.streams[3]),
            "F0.c3 F1.c3 F2.c3 F3.c3 "
            "F0.c7 B0.c7 F1.c7 B1.c7 F2.c7 B2.c7 F3.c7 B3.c7 "
            "F4.c3 B0.c3 F5.c3 B1.c3 F6.c3 B2.c3 F7.c3 B3.c3 "
            "F4.c7 B4.c7 F5.c7 B5.c7 F6.c7 B6.c7 F7.c7 B7.c7 "
            "B4.c3 B5.c3 B6.c3 B7.c3");
}

TEST(Generators, InterleavedWithMEqualToPIsAllWarmUp) {
  const Schedule s = generate(make(ScheduleKind::kInterleaved, 2, 2, 2));
  EXPECT_EQ(labels(s.streams[0]), "F0.c0 F1.c0 F0.c2 F1.c2 B0.c2 B1.c2 B0.c0 B1.c0");
  EXPECT_EQ(labels(s.streams[1]), "F0.c1 F1.c1 F0.c3 F1.c3 B0.c3 B1.c3 B0.c1 B1.c1");
}

TEST(Generators, ChimeraFourStagesFourMicrobatches) {
  // Down pipeline: stage i on worker i; up pipeline ("u"): stage i on worker 3 - i.
  const Schedule s = generate(make(ScheduleKind::kChimera, 4, 4));
  EXPECT_EQ(labels(s.streams[0]), "F0.c0 F1.c0 uF0.c3 uB0.c3 uF1.c3 uB1.c3 B0.c0 B1.c0");
  EXPECT_EQ(labels(s.streams[1]), "F0.c1 uF0.c2 F1.c1 uF1.c2 uB0.c2 B0.c1 uB1.c2 B1.c1");
  EXPECT_EQ(labels(s.streams[2]), "uF0.c1 F0.c2 uF1.c1 F1.c2 B0.c2 uB0.c1 B1.c2 uB1.c1");
  EXPECT_EQ(labels(s.streams[3]), "uF0.c0 uF1.c0 F0.c3 B0.c3 F1.c3 B1.c3 uB0.c0 uB1.c0");
}

TEST(Generators, ChimeraConcatenatesUnits) {
  const Schedule s = generate(make(ScheduleKind::kChimera, 2, 4));
  // D = 2: worker 0 holds down stage 0 and up stage 1; a = 1, b = 0 per unit.
  EXPECT_EQ(labels(s.streams[0]), "F0.c0 uF0.c1 uB0.c1 B0.c0 F1.c0 uF1.c1 uB1.c1 B1.c0");
  EXPECT_EQ(labels(s.streams[1]), "uF0.c0 F0.c1 B0.c1 uB0.c0 uF1.c0 F1.c1 B1.c1 uB1.c0");
}

TEST(Placement, BalancedLayersEndsNeverHeavier) {
  EXPECT_EQ(balanced_layer_counts(24, 8), std::vector<int>(8, 3));
  EXPECT_EQ(balanced_layer_counts(12, 8), (std::vector<int>{1, 1, 1, 2, 2, 2, 2, 1}));
  EXPECT_EQ(balanced_layer_counts(15, 8), (std::vector<int>{2, 2, 2, 2, 2, 2, 2, 1}));
  EXPECT_EQ(balanced_layer_counts(5, 1), std::vector<int>{5});
  for (int chunks = 1; chunks <= 9; ++chunks) {
    for (int layers = chunks; layers <= 40; ++layers) {
      const auto counts = balanced_layer_counts(layers, chunks);
      int total = 0;
      int middle_max = 0;
      for (std::size_t i = 0; i < counts.size(); ++i) {
        total += counts[i];
        if (i != 0 && i + 1 != counts.size()) middle_max = std::max(middle_max, counts[i]);
      }
      EXPECT_EQ(total, layers);
      const auto [lo, hi] = std::minmax_element(counts.begin(), counts.end());
      EXPECT_LE(*hi - *lo, 1);
      if (chunks > 2) {
        EXPECT_LE(counts.front(), middle_max) << layers << "/" << chunks;
        EXPECT_LE(counts.back(), middle_max) << layers << "/" << chunks;
      }
    }
  }
  EXPECT_THROW(balanced_layer_counts(3, 4), std::invalid_argument);
}

TEST(Placement, ChunksWorkersAndModelEnds) {
  ScheduleParams params = make(ScheduleKind::kInterleaved, 4, 8, 2);
  params.num_layers = 24;
  const Placement p = make_placement(params);
  EXPECT_EQ(p.chunks_per_pipeline, 8);
  EXPECT_EQ(p.worker_of(0, 5), 1);
  EXPECT_TRUE(p.at(0, 0).has_embeddings);
  EXPECT_TRUE(p.at(0, 7).has_head);
  EXPECT_FALSE(p.at(0, 3).has_head);
  EXPECT_EQ(p.at(0, 7).first_layer, 21);

  const Placement chimera = make_placement(make(ScheduleKind::kChimera, 4, 4));
  EXPECT_EQ(chimera.num_pipelines, 2);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(chimera.worker_of(0, i), i);
    EXPECT_EQ(chimera.worker_of(1, i), 3 - i);
  }
  EXPECT_TRUE(chimera.at(1, 0).has_embeddings);
  EXPECT_EQ(chimera.at(1, 0).worker, 3);
}

void expect_refused(const ScheduleParams& params, const std::string& fragment) {
  try {
    generate(params);
    FAIL() << "accepted: " << fragment;
  } catch (const std::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find(fragment), std::string::npos) << error.what();
  }
}

TEST(Generators, RefusesImpossibleParameters) {
  expect_refused(make(ScheduleKind::kInterleaved, 4, 6, 2), "multiple of stages (m=6, p=4)");
  expect_refused(make(ScheduleKind::kInterleaved, 4, 6, 2), "use m = 4, 8, 12");
  expect_refused(make(ScheduleKind::kChimera, 3, 6), "even number of stages");
  expect_refused(make(ScheduleKind::kChimera, 4, 6), "units of D");
  expect_refused(make(ScheduleKind::kOneFOneB, 4, 2), "micro-batches >= stages");
  expect_refused(make(ScheduleKind::kGPipe, 0, 2), "stages must be at least 1");
  expect_refused(make(ScheduleKind::kGPipe, 2, -1), "micro-batches must be at least 1");
  expect_refused(make(ScheduleKind::kInterleaved, 2, 2, 0), "chunks per worker must be at least 1");
  expect_refused(make(ScheduleKind::kGPipe, 2, 2, 2), "one chunk per worker");
  ScheduleParams layers = make(ScheduleKind::kInterleaved, 4, 8, 2);
  layers.num_layers = 6;
  expect_refused(layers, "more chunks than layers");
  ScheduleParams dp = make(ScheduleKind::kGPipe, 2, 2);
  dp.data_parallel = 0;
  expect_refused(dp, "data-parallel");
  expect_refused(make(ScheduleKind::kCustom, 2, 2), "not generated");
  expect_refused(make(ScheduleKind::kGPipe, 64, 2000000000), "too large");
  expect_refused(make(ScheduleKind::kInterleaved, 1 << 30, 1 << 30, 64), "too many chunks");
}

}  // namespace
}  // namespace pf::sched

namespace pf::sched {
namespace {

std::string placement_error(const ScheduleParams& params) {
  try {
    make_placement(params);
  } catch (const std::invalid_argument& error) {
    return error.what();
  }
  return "(no error)";
}

TEST(Placement, ExplicitLayerCountsAreContiguousWithModelEnds) {
  ScheduleParams params = testing::make(ScheduleKind::kInterleaved, 2, 4, 2);
  params.num_layers = 8;
  params.layers_per_chunk = {3, 1, 2, 2};
  const Placement p = make_placement(params);
  ASSERT_EQ(p.chunks_per_pipeline, 4);
  EXPECT_EQ(p.num_layers, 8);
  const int firsts[] = {0, 3, 4, 6};
  const int counts[] = {3, 1, 2, 2};
  for (int c = 0; c < 4; ++c) {
    EXPECT_EQ(p.at(0, c).first_layer, firsts[c]) << c;
    EXPECT_EQ(p.at(0, c).num_layers, counts[c]) << c;
    EXPECT_EQ(p.worker_of(0, c), c % 2) << c;
    EXPECT_EQ(p.at(0, c).has_embeddings, c == 0) << c;
    EXPECT_EQ(p.at(0, c).has_head, c == 3) << c;
  }
  // num_layers 0: the counts define it.
  ScheduleParams defined = testing::make(ScheduleKind::kOneFOneB, 2, 4);
  defined.layers_per_chunk = {3, 1};
  EXPECT_EQ(make_placement(defined).num_layers, 4);
  // Chimera: both pipelines use the counts by chunk index.
  ScheduleParams chimera = testing::make(ScheduleKind::kChimera, 2, 4);
  chimera.num_layers = 4;
  chimera.layers_per_chunk = {3, 1};
  const Placement c = make_placement(chimera);
  EXPECT_EQ(c.at(1, 0).num_layers, 3);
  EXPECT_EQ(c.at(1, 0).worker, 1);
  EXPECT_EQ(c.at(1, 1).num_layers, 1);
  EXPECT_EQ(c.at(1, 1).worker, 0);
}

TEST(Placement, ExplicitLayerCountErrorsNameTheFlag) {
  ScheduleParams params = testing::make(ScheduleKind::kOneFOneB, 2, 4);
  params.num_layers = 4;
  params.layers_per_chunk = {1, 1, 2};
  EXPECT_NE(
      placement_error(params).find("--layers-per-stage 1,1,2: 3 counts, but a pipeline has 2"),
      std::string::npos)
      << placement_error(params);
  params.layers_per_chunk = {4, 0};
  EXPECT_NE(placement_error(params).find("chunk 1 gets 0 layers"), std::string::npos)
      << placement_error(params);
  params.layers_per_chunk = {2, 1};
  EXPECT_NE(placement_error(params).find("sum to 3 layers, but the model has 4"), std::string::npos)
      << placement_error(params);
}

TEST(Placement, UnevenLayerCountsRoundTripThroughJson) {
  ScheduleParams params = testing::make(ScheduleKind::kOneFOneB, 2, 4);
  params.num_layers = 4;
  params.layers_per_chunk = {3, 1};
  const Schedule schedule = compile(params);
  const nlohmann::json saved = to_json(schedule);
  EXPECT_EQ(saved["params"]["layers_per_chunk"], nlohmann::json::array({3, 1}));
  const Schedule loaded = schedule_from_json(saved, "uneven");
  EXPECT_EQ(loaded.params, schedule.params);
  EXPECT_EQ(loaded.placement, schedule.placement);
  EXPECT_EQ(loaded.placement.at(0, 1).first_layer, 3);
  nlohmann::json bad = saved;
  bad["params"]["layers_per_chunk"] = nlohmann::json::array({3, 0});
  EXPECT_THROW(schedule_from_json(bad, "bad"), std::invalid_argument);
}

std::string parse_error(std::string_view text) {
  try {
    parse_layer_counts(text);
  } catch (const std::invalid_argument& error) {
    return error.what();
  }
  return "(no error)";
}

TEST(Placement, ParsesLayerCountLists) {
  EXPECT_EQ(parse_layer_counts("3,1"), (std::vector<int>{3, 1}));
  EXPECT_EQ(parse_layer_counts(" 2 , 2 "), (std::vector<int>{2, 2}));
  EXPECT_EQ(parse_layer_counts("12"), std::vector<int>{12});
  EXPECT_EQ(format_layer_counts({3, 1, 2}), "3,1,2");
  // common/comma_list.h's one format: flag, value, item position, item.
  EXPECT_EQ(parse_error(""), "--layers-per-stage '': item 1 is empty");
  EXPECT_EQ(parse_error("3,,1"), "--layers-per-stage '3,,1': item 2 is empty");
  EXPECT_EQ(parse_error("3,x"), "--layers-per-stage '3,x': item 2 'x' is not a positive integer");
  EXPECT_EQ(parse_error("-1,2"),
            "--layers-per-stage '-1,2': item 1 '-1' is not a positive integer");
  EXPECT_EQ(parse_error("0,4"), "--layers-per-stage '0,4': item 1 '0' is not a positive integer");
  EXPECT_EQ(parse_error("99999999999"),
            "--layers-per-stage '99999999999': item 1 '99999999999' "
            "exceeds " +
                std::to_string(kMaxLayers));
}

}  // namespace
}  // namespace pf::sched
