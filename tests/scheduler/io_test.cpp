// JSON and torch CSV: round trips, imports, and errors that point at the bad field or cell.
#include <unistd.h>

#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "scheduler/compile.h"
#include "scheduler/generators.h"
#include "scheduler/schedule_json.h"
#include "scheduler/torch_csv.h"
#include "scheduler/validate.h"
#include "tests/scheduler/test_util.h"

namespace pf::sched {
namespace {

using testing::labels;
using testing::make;

std::vector<Schedule> samples() {
  std::vector<Schedule> out;
  out.push_back(compile(make(ScheduleKind::kGPipe, 3, 4)));
  out.push_back(compile(make(ScheduleKind::kOneFOneB, 4, 8)));
  ScheduleParams interleaved = make(ScheduleKind::kInterleaved, 4, 8, 2);
  interleaved.split_backward = true;
  interleaved.num_layers = 12;
  LoweringOptions bytes;
  bytes.activation_bytes = 1 << 20;
  bytes.gradient_bytes = 1 << 19;
  out.push_back(compile(interleaved, bytes));
  ScheduleParams chimera = make(ScheduleKind::kChimera, 4, 8);
  chimera.data_parallel = 2;
  out.push_back(compile(chimera));
  return out;
}

TEST(Json, RoundTripIsIdentical) {
  for (const Schedule& s : samples()) {
    const nlohmann::json first = to_json(s);
    EXPECT_EQ(first["format_version"], kScheduleFormatVersion);
    const Schedule back = schedule_from_json(first, "memory");
    EXPECT_EQ(back, s);
    EXPECT_EQ(to_json(back), first);
    // Through text, too.
    EXPECT_EQ(to_json(schedule_from_json(nlohmann::json::parse(first.dump()), "text")), first);
  }
}

TEST(Json, FileRoundTrip) {
  const auto path = std::filesystem::temp_directory_path() /
                    ("pf_sched_roundtrip_" + std::to_string(::getpid()) + ".json");
  const Schedule s = samples()[1];
  save_schedule_json(path, s);
  EXPECT_EQ(load_schedule_json(path), s);
  std::filesystem::remove(path);
}

std::string json_error(const nlohmann::json& j) {
  try {
    schedule_from_json(j, "plan.json");
  } catch (const std::invalid_argument& error) {
    return error.what();
  }
  return "accepted";
}

TEST(Json, ErrorsNameTheField) {
  const nlohmann::json good = to_json(samples()[0]);
  nlohmann::json j = good;
  j["streams"][1][2]["kind"] = "fwd";
  EXPECT_NE(json_error(j).find("plan.json.streams[1][2].kind: unknown kind 'fwd' (allowed: "
                               "forward, backward"),
            std::string::npos)
      << json_error(j);
  j = good;
  j["format_version"] = 99;
  EXPECT_NE(json_error(j).find("unsupported version 99"), std::string::npos);
  j = good;
  j["streams"][0][0]["colour"] = "red";
  EXPECT_NE(json_error(j).find("plan.json.streams[0][0]: unknown field(s): colour"),
            std::string::npos)
      << json_error(j);
  j = good;
  j["params"]["workers"] = "two";
  EXPECT_NE(json_error(j).find("plan.json.params.workers: expected an integer"), std::string::npos);
  j = good;
  j["streams"][0][0]["microbatch"] = 9;  // validation runs on load
  EXPECT_NE(json_error(j).find("plan.json: invalid schedule: worker 0 position 0"),
            std::string::npos)
      << json_error(j);
  j = good;
  j["params"]["microbatches"] = 2000000000;  // refused before any per-key allocation
  EXPECT_NE(json_error(j).find("but the streams hold only"), std::string::npos) << json_error(j);
  j = good;
  j.erase("placement");  // derived from params
  EXPECT_EQ(json_error(j), "accepted");
}

// Issue #16 defect 3: first_layer + num_layers overflowed int in the placement check, and the
// release build accepted a placement that gave no chunk layer 0.
TEST(Json, PlacementLayerRangeCannotOverflow) {
  ScheduleParams params = make(ScheduleKind::kGPipe, 2, 2);
  params.num_layers = 2;
  nlohmann::json j = to_json(compile(params));
  j["placement"]["chunks"][1]["first_layer"] = 2147483647;
  j["placement"]["chunks"][1]["num_layers"] = 1;
  EXPECT_NE(json_error(j).find("placement gives pipeline 0 chunk 1 layers [2147483647, "
                               "2147483648) outside the model's 2 layers"),
            std::string::npos)
      << json_error(j);
}

TEST(TorchCsv, RoundTripWithCommunicationIsIdentical) {
  for (const Schedule& s : samples()) {
    SCOPED_TRACE(std::string(to_string(s.params.kind)));
    const std::string csv = to_torch_csv(s);
    TorchCsvImportOptions options;
    if (s.params.kind == ScheduleKind::kChimera) options.kind = ScheduleKind::kChimera;
    options.data_parallel = s.params.data_parallel;
    const Schedule back = schedule_from_torch_csv(csv, "in.csv", options);
    EXPECT_EQ(to_torch_csv(back), csv);
    // Same streams apart from what the format cannot carry.
    for (int w = 0; w < s.num_workers(); ++w) {
      EXPECT_EQ(labels(back.streams[static_cast<std::size_t>(w)], true),
                labels(s.streams[static_cast<std::size_t>(w)], true));
    }
  }
}

TEST(TorchCsv, ComputeOnlyImportIsLoweredLikeOurs) {
  for (const Schedule& s : samples()) {
    SCOPED_TRACE(std::string(to_string(s.params.kind)));
    const std::string csv = to_torch_csv(s, /*with_communication=*/false);
    TorchCsvImportOptions options;
    if (s.params.kind == ScheduleKind::kChimera) options.kind = ScheduleKind::kChimera;
    options.data_parallel = s.params.data_parallel;
    options.num_layers = s.params.num_layers;
    if (s.params.kind == ScheduleKind::kInterleaved) {
      options.lowering.activation_bytes = 1 << 20;
      options.lowering.gradient_bytes = 1 << 19;
    }
    const Schedule back = schedule_from_torch_csv(csv, "in.csv", options);
    EXPECT_EQ(to_torch_csv(back, false), csv);
    EXPECT_EQ(back.streams, s.streams);  // lowering the same compute order gives the same streams
  }
}

TEST(TorchCsv, ReadsTorchStyleRowsWithIdleCells) {
  // A compute-only 1F1B table in the style torch dumps (None -> empty cell, CRLF line ends).
  const std::string csv =
      "0F0,0F1,,0B0,,0B1\r\n"
      ",1F0,1B0,1F1,1B1,\r\n";
  const Schedule s = schedule_from_torch_csv(csv, "torch.csv");
  EXPECT_EQ(s.params.workers, 2);
  EXPECT_EQ(s.params.microbatches, 2);
  EXPECT_EQ(s.params.kind, ScheduleKind::kCustom);
  EXPECT_EQ(labels(s.streams[0]),
            "F0.c0 SA0.c0->w1 F1.c0 SA1.c0->w1 RG0.c0<-w1 B0.c0 RG1.c0<-w1 B1.c0 OPT");
}

TEST(TorchCsv, InterleavedStagesMapToRanksModuloAndChimeraToTwoPipelines) {
  const Schedule s = schedule_from_torch_csv("0F0,2F0,2B0,0B0\n1F0,3F0,3B0,1B0\n", "i.csv");
  EXPECT_EQ(s.params.chunks_per_worker, 2);
  EXPECT_EQ(s.placement.worker_of(0, 2), 0);
  // Chimera D=2: stages 0,1 down (ranks 0,1); stages 2,3 up: chunk 0 on rank 1, chunk 1 on rank 0.
  TorchCsvImportOptions chimera;
  chimera.kind = ScheduleKind::kChimera;
  const Schedule c =
      schedule_from_torch_csv("0F0,3F0,3B0,0B0\n2F0,1F0,1B0,2B0\n", "c.csv", chimera);
  EXPECT_EQ(labels(c.streams[0], true), "F0.c0 uF0.c1 uB0.c1 B0.c0");
  EXPECT_EQ(c.params.microbatches, 2);
}

std::string csv_error(const std::string& text, TorchCsvImportOptions options = {}) {
  try {
    schedule_from_torch_csv(text, "bad.csv", options);
  } catch (const std::invalid_argument& error) {
    return error.what();
  }
  return "accepted";
}

TEST(TorchCsv, FullMatchParsingWithRowAndColumn) {
  EXPECT_NE(csv_error("0F0,0F1x\n1F0\n").find("bad.csv row 1 column 2 '0F1x'"), std::string::npos)
      << csv_error("0F0,0F1x\n1F0\n");
  EXPECT_NE(csv_error("0F0\n1F0, 1B0\n").find("row 2 column 2 ' 1B0'"), std::string::npos);
  EXPECT_NE(csv_error("0X0\n").find("row 1 column 1 '0X0'"), std::string::npos);
  EXPECT_NE(csv_error("0F\n").find("needs a micro-batch number"), std::string::npos);
  EXPECT_NE(csv_error("F0\n").find("'F0'"), std::string::npos);
  EXPECT_NE(csv_error("0REDUCE_GRAD1\n").find("REDUCE_GRAD takes no micro-batch"),
            std::string::npos);
  EXPECT_EQ(csv_error("0WAIT_REDUCEGRAD\n"),
            "bad.csv row 1 column 1 '0WAIT_REDUCEGRAD': unknown action 'WAIT_REDUCEGRAD'; "
            "expected <stage><action>[<micro-batch>] with action F, B, I, W, SEND_F, RECV_F, "
            "SEND_B, RECV_B, WAIT_SEND_F, WAIT_SEND_B (with a micro-batch) or REDUCE_GRAD, "
            "WAIT_REDUCE_GRAD, UNSHARD, RESHARD (without), e.g. 0F3, 2SEND_F1, 1REDUCE_GRAD, or a "
            "composite (0F3;2B1)OVERLAP_F_B");
  EXPECT_EQ(csv_error("0F0,0B0,0WAIT_REDUCE_GRAD\n"),
            "bad.csv row 1 column 3 '0WAIT_REDUCE_GRAD': no pending REDUCE_GRAD of stage 0 to "
            "wait for on this rank");
  EXPECT_EQ(csv_error("0F0,0B1234567890\n"),
            "bad.csv row 1 column 2 '0B1234567890': number '1234567890' too large (at most 9 "
            "digits)");
  EXPECT_EQ(csv_error("0F0,1F0,1B0,0B0\n0F1\n"),
            "bad.csv row 2 column 1 '0F1': stage 0 runs on rank 1 here but on rank 0 at row 1 "
            "column 1 (a stage lives on one rank; rows are ranks 0, 1, ...)");
  EXPECT_EQ(csv_error("0F0,0B0\n1RECV_F0,1F0,1B0\n"),
            "bad.csv row 2 column 1 '1RECV_F0': no matching 0SEND_F0 on rank 0");
  EXPECT_EQ(csv_error("999999999F0\n"),
            "bad.csv row 1 column 1 '999999999F0': stage 999999999 but the file has only 1 "
            "compute actions; stages are numbered 0, 1, ... and each needs its compute");
  EXPECT_EQ(csv_error("0F0,0B0\n1F0,1B0\n0F1\n"),
            "bad.csv row 3 column 1 '0F1': stage 0 runs on rank 2 here but on rank 0 at row 1 "
            "column 1 (a stage lives on one rank; rows are ranks 0, 1, ...)");
  EXPECT_EQ(csv_error("0F0,0B0,1F0,1B0\n2F0,2B0\n"),
            "bad.csv: stage 1 runs on rank 0; the stages of 2 ranks must be looped (stage s on "
            "rank s mod 2) or V-shaped (stage s and 3-s on rank s, then zig-zag), with the stage "
            "count a multiple of the rank count");
  // Looped, but 3 stages on 2 ranks (the fuzzer's heap overflow: a chunk the placement lacks).
  EXPECT_EQ(csv_error("0F0,0B0,2F0,2B0\n1F0,1B0\n"),
            "bad.csv: 3 stages on 2 ranks (allowed: the stage count a multiple of the rank count, "
            "every rank holding as many stages)");
  // Valid cells, invalid schedule: the validator speaks, prefixed with the file.
  EXPECT_EQ(csv_error("0B0,0F0\n1F0,1B0\n"),
            "bad.csv: the compute order can never finish; every rank waits for work that comes "
            "later: rank 0 at row 1 column 1 '0B0' waits for 0F0; rank 1 at row 2 column 1 '1F0' "
            "waits for 0F0");
  EXPECT_NE(csv_error("0F0,0SEND_F0,0B0\n1F0,1RECV_F0,1B0\n").find("bad.csv: invalid schedule"),
            std::string::npos)
      << csv_error("0F0,0SEND_F0,0B0\n1F0,1RECV_F0,1B0\n");
}

TEST(TorchCsv, RefusesMultiStepExport) {
  Schedule s = samples()[0];
  s.num_steps = 2;
  EXPECT_THROW(to_torch_csv(s), std::invalid_argument);
}

}  // namespace
}  // namespace pf::sched
