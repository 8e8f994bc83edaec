// Parity with PyTorch 2.x schedule CSVs: files written by torch's own schedule classes, lowering
// and _dump_csv (tests/fixtures/torch_schedules, written by `scripts/torch_parity.py fixtures`
// with torch 2.15.0) load here, validate, simulate, and export back identical where the format
// allows; a file is never reinterpreted as another kind; malformed files get messages naming row,
// column and text.
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <sstream>

#include "scheduler/compile.h"
#include "scheduler/generators.h"
#include "scheduler/placement.h"
#include "scheduler/schedule_json.h"
#include "scheduler/torch_csv.h"
#include "scheduler/unit_timings.h"
#include "scheduler/validate.h"
#include "tests/scheduler/test_util.h"

namespace pf::sched {
namespace {

using testing::labels;
using testing::make;

const char* const kFixtures[] = {
    "gpipe_p2_m1",
    "gpipe_p4_m8",
    "looped_bfs_p2_v2_m4",
    "interleaved_1f1b_p4_v2_m8",
    "interleaved_zb_p4_v2_m8",
    "zbv_p4_m8",
    "zbv_p2_m3",
    "dualpipev_p4_m8",
};

std::string read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << path;
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

std::string fixture(const std::string& name, const std::string& format) {
  return read("tests/fixtures/torch_schedules/" + name + "." + format + ".csv");
}

// The cells of a CSV, row by row, without empty cells and without the actions named in `drop`.
std::vector<std::vector<std::string>> cells(const std::string& csv,
                                            const std::vector<std::string>& drop = {}) {
  std::vector<std::vector<std::string>> rows;
  std::istringstream lines(csv);
  std::string line;
  while (std::getline(lines, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    std::vector<std::string> row;
    std::istringstream fields(line);
    std::string cell;
    while (std::getline(fields, cell, ',')) {
      if (cell.empty()) continue;
      bool dropped = false;
      for (const std::string& name : drop) {
        const auto at = cell.find(name);
        dropped |= at != std::string::npos && at > 0 && cell.front() != '(' &&
                   cell.find_first_not_of("0123456789") == at &&
                   cell.find_first_not_of("0123456789", at + name.size()) == std::string::npos;
      }
      if (!dropped) row.push_back(cell);
    }
    rows.push_back(row);
  }
  return rows;
}

// Pair ids only tie a send to its receive; the CSV does not carry them, so an import numbers
// them in file order and a lowering in issue order. Renumbered by first appearance, rank by rank,
// two streams that pair the same sends with the same receives compare equal.
std::vector<std::vector<Instruction>> with_canonical_pair_ids(
    std::vector<std::vector<Instruction>> streams) {
  std::map<std::int64_t, std::int64_t> renamed;
  for (auto& stream : streams) {
    for (Instruction& in : stream) {
      if (in.pair_id < 0) continue;
      in.pair_id =
          renamed.emplace(in.pair_id, static_cast<std::int64_t>(renamed.size())).first->second;
    }
  }
  return streams;
}

TEST(TorchParity, EveryTorchFileLoadsValidatesAndSimulates) {
  for (const char* name : kFixtures) {
    for (const char* format : {"compute_only", "compute_comms"}) {
      SCOPED_TRACE(std::string(name) + "." + format);
      const Schedule s = schedule_from_torch_csv(fixture(name, format), name);
      EXPECT_NO_THROW(validate(s));
      EXPECT_NO_THROW(unit_timings(s, UnitDurations{}));
    }
  }
}

TEST(TorchParity, PlacementsAreReadFromTheFile) {
  const Schedule zbv = schedule_from_torch_csv(fixture("zbv_p4_m8", "compute_comms"), "zbv");
  EXPECT_TRUE(zbv.params.v_shape);
  EXPECT_EQ(zbv.params.chunks_per_worker, 2);
  EXPECT_EQ(zbv.params.microbatches, 8);
  EXPECT_TRUE(zbv.params.split_backward);
  const int v[8] = {0, 1, 2, 3, 3, 2, 1, 0};
  for (int c = 0; c < 8; ++c) EXPECT_EQ(zbv.placement.worker_of(0, c), v[c]) << c;
  const Schedule looped =
      schedule_from_torch_csv(fixture("interleaved_1f1b_p4_v2_m8", "compute_only"), "i");
  EXPECT_FALSE(looped.params.v_shape);
  EXPECT_EQ(looped.placement.worker_of(0, 7), 3);
}

// torch's own ZBV order is the one generate() emits for zbv.
TEST(TorchParity, TorchZbvIsOurZbv) {
  for (const auto& [name, p, m] : {std::tuple{"zbv_p4_m8", 4, 8}, std::tuple{"zbv_p2_m3", 2, 3}}) {
    SCOPED_TRACE(name);
    TorchCsvImportOptions options;
    options.kind = ScheduleKind::kZeroBubbleV;
    const Schedule theirs = schedule_from_torch_csv(fixture(name, "compute_only"), name, options);
    const Schedule ours = compile(make(ScheduleKind::kZeroBubbleV, p, m, 2));
    for (int w = 0; w < p; ++w) {
      EXPECT_EQ(labels(theirs.streams[static_cast<std::size_t>(w)], true),
                labels(ours.streams[static_cast<std::size_t>(w)], true));
    }
    EXPECT_EQ(theirs.placement, ours.placement);
  }
}

TEST(TorchParity, CompositeOverlapIsKeptAsTwoParts) {
  const Schedule s =
      schedule_from_torch_csv(fixture("dualpipev_p4_m8", "compute_comms"), "dualpipev");
  // Rank 0's first composite: (0F7;7B3)OVERLAP_F_B.
  const auto& stream = s.streams[0];
  std::size_t i = 0;
  while (i < stream.size() && !stream[i].overlap_next) ++i;
  ASSERT_LT(i + 1, stream.size());
  EXPECT_EQ(short_label(stream[i]), "F7.c0");
  EXPECT_EQ(short_label(stream[i + 1]), "B3.c7");
}

// The overlap survives JSON, and the validator names a composite that is not a forward directly
// followed by a backward of another chunk.
TEST(TorchParity, CompositeOverlapInJsonAndValidation) {
  const Schedule s =
      schedule_from_torch_csv(fixture("dualpipev_p4_m8", "compute_comms"), "dualpipev");
  const Schedule back = schedule_from_json(to_json(s), "dualpipev.json");
  EXPECT_EQ(back.streams, s.streams);

  auto first_overlap = [](Schedule& schedule) {
    auto& stream = schedule.streams[0];
    std::size_t i = 0;
    while (!stream[i].overlap_next) ++i;
    return i;
  };
  auto error_of = [](const Schedule& schedule) -> std::string {
    try {
      validate(schedule);
    } catch (const std::invalid_argument& error) {
      return error.what();
    }
    return "valid";
  };
  EXPECT_EQ(error_of(s), "valid");
  Schedule on_backward = s;
  const std::size_t at = first_overlap(on_backward);
  on_backward.streams[0][at].overlap_next = false;
  on_backward.streams[0][at + 1].overlap_next = true;  // the backward, followed by a send
  EXPECT_NE(error_of(on_backward).find("only a forward can overlap with the next instruction"),
            std::string::npos)
      << error_of(on_backward);
  Schedule swapped = s;
  std::swap(swapped.streams[0][at], swapped.streams[0][at + 1]);
  swapped.streams[0][at].overlap_next = false;
  swapped.streams[0][at + 1].overlap_next = true;  // a forward followed by whatever comes next
  EXPECT_NE(error_of(swapped).find("needs a backward or backward-input right after it"),
            std::string::npos)
      << error_of(swapped);
}

// Export of a torch file gives torch's file back: compute-only exactly (without idle cells);
// with communication the same actions in the same order, except that UNSHARD/RESHARD (FSDP only)
// are left out, WAIT_REDUCE_GRAD follows its REDUCE_GRAD directly, and REDUCE_GRAD may stand on
// the other side of a receive for another stage.
TEST(TorchParity, ExportGivesTheTorchFileBack) {
  for (const char* name : kFixtures) {
    SCOPED_TRACE(name);
    const std::string compute_only = fixture(name, "compute_only");
    const Schedule from_compute = schedule_from_torch_csv(compute_only, name);
    EXPECT_EQ(cells(to_torch_csv(from_compute, false)), cells(compute_only));

    const std::string comms = fixture(name, "compute_comms");
    const Schedule from_comms = schedule_from_torch_csv(comms, name);
    const std::string exported = to_torch_csv(from_comms, true);
    const std::vector<std::string> drop = {"UNSHARD", "RESHARD", "REDUCE_GRAD", "WAIT_REDUCE_GRAD"};
    EXPECT_EQ(cells(exported, drop), cells(comms, drop));
    // REDUCE_GRAD (a no-op with one replica) sits between the stage's last backward and the
    // rank's next compute in both; torch's lowering spends a round on it, so a receive posted
    // for another stage may land on either side of it.
    const std::vector<std::string> communication = {"UNSHARD", "RESHARD",     "WAIT_REDUCE_GRAD",
                                                    "SEND_F",  "RECV_F",      "SEND_B",
                                                    "RECV_B",  "WAIT_SEND_F", "WAIT_SEND_B"};
    EXPECT_EQ(cells(exported, communication), cells(comms, communication));
    // Both forms describe the same compute order.
    for (std::size_t w = 0; w < from_comms.streams.size(); ++w) {
      EXPECT_EQ(labels(from_comms.streams[w], true), labels(from_compute.streams[w], true));
    }
    // And our own file of it reads back to the same schedule and the same file.
    const std::string ours = to_torch_csv(from_comms, true);
    const Schedule again = schedule_from_torch_csv(ours, "ours.csv");
    EXPECT_EQ(with_canonical_pair_ids(again.streams), with_canonical_pair_ids(from_comms.streams));
    EXPECT_EQ(to_torch_csv(again, true), ours);
  }
}

// Our files carry what torch's compute_comms loader requires: one WAIT_SEND per send after it,
// and every REDUCE_GRAD followed by its WAIT_REDUCE_GRAD.
TEST(TorchParity, OurCommunicationFilesHaveTheWaitsTorchRequires) {
  for (const ScheduleParams& params :
       {make(ScheduleKind::kOneFOneB, 4, 8), make(ScheduleKind::kZeroBubbleV, 4, 8, 2),
        make(ScheduleKind::kZeroBubbleH1, 3, 6), make(ScheduleKind::kInterleaved, 2, 4, 2)}) {
    SCOPED_TRACE(std::string(to_string(params.kind)));
    const std::string csv = to_torch_csv(compile(params), true);
    for (const auto& row : cells(csv)) {
      std::vector<std::string> pending;
      bool reducing = false;
      for (const std::string& cell : row) {
        const auto kind_at = cell.find_first_not_of("0123456789");
        const std::string stage = cell.substr(0, kind_at);
        const std::string rest = cell.substr(kind_at);
        if (rest.rfind("SEND_", 0) == 0) pending.push_back(stage + rest);
        if (rest.rfind("WAIT_SEND_", 0) == 0) {
          const auto it = std::find(pending.begin(), pending.end(), stage + rest.substr(5));
          ASSERT_NE(it, pending.end()) << cell;
          pending.erase(it);
        }
        if (rest == "REDUCE_GRAD") {
          EXPECT_FALSE(reducing) << cell;
          reducing = true;
        }
        if (rest == "WAIT_REDUCE_GRAD") {
          EXPECT_TRUE(reducing) << cell;
          reducing = false;
        }
      }
      EXPECT_TRUE(pending.empty());
      EXPECT_FALSE(reducing);
    }
    // One REDUCE_GRAD per stage (torch scales and reduces gradients there).
    std::size_t reductions = 0;
    for (const auto& row : cells(csv)) {
      for (const std::string& cell : row)
        reductions += cell.find("WAIT_REDUCE_GRAD") != std::string::npos;
    }
    EXPECT_EQ(reductions, static_cast<std::size_t>(params.workers * params.chunks_per_worker));
  }
}

TEST(TorchParity, RoundTripsOfOurZeroBubbleSchedules) {
  for (const ScheduleParams& params :
       {make(ScheduleKind::kZeroBubbleH1, 4, 8), make(ScheduleKind::kZeroBubbleH2, 4, 8),
        make(ScheduleKind::kZeroBubbleV, 4, 8, 2), make(ScheduleKind::kZeroBubbleV, 3, 2, 2)}) {
    SCOPED_TRACE(std::string(to_string(params.kind)));
    const Schedule s = compile(params);
    for (bool comms : {false, true}) {
      TorchCsvImportOptions options;
      options.kind = params.kind;
      const std::string csv = to_torch_csv(s, comms);
      const Schedule back = schedule_from_torch_csv(csv, "zb.csv", options);
      SCOPED_TRACE(comms ? "with communication" : "compute only");
      ASSERT_EQ(back.streams.size(), s.streams.size());
      for (std::size_t w = 0; w < s.streams.size(); ++w) {
        EXPECT_EQ(labels(back.streams[w]), labels(s.streams[w])) << "worker " << w;
      }
      EXPECT_EQ(with_canonical_pair_ids(back.streams), with_canonical_pair_ids(s.streams));
      EXPECT_EQ(back.placement, s.placement);
      EXPECT_EQ(to_torch_csv(back, comms), csv);
    }
  }
}

std::string csv_error(const std::string& text, std::optional<ScheduleKind> kind = std::nullopt) {
  TorchCsvImportOptions options;
  options.kind = kind;
  try {
    schedule_from_torch_csv(text, "bad.csv", options);
  } catch (const std::invalid_argument& error) {
    return error.what();
  }
  return "accepted";
}

TEST(TorchParity, AFileIsNeverReinterpreted) {
  const std::string zbv = fixture("zbv_p4_m8", "compute_only");
  EXPECT_EQ(csv_error(zbv, ScheduleKind::kChimera),
            "bad.csv: refusing to read this file as chimera: its compute order is also a valid "
            "single V-shaped pipeline over 8 stages (torch's ZBV / DualPipeV layout), which is "
            "how torch reads it (a file is never reinterpreted as another schedule kind; without "
            "a requested kind the file's own placement is used)");
  EXPECT_EQ(csv_error(zbv, ScheduleKind::kInterleaved),
            "bad.csv: refusing to read this file as interleaved: the file runs stage 4 on rank 3, "
            "but interleaved places it on rank 0 (stage s on rank s mod 4) (a file is never "
            "reinterpreted as another schedule kind; without a requested kind the file's own "
            "placement is used)");
  EXPECT_EQ(
      csv_error(fixture("interleaved_1f1b_p4_v2_m8", "compute_only"), ScheduleKind::kZeroBubbleV),
      "bad.csv: refusing to read this file as zbv: the file runs stage 4 on rank 0, but zbv "
      "places it on rank 3 (stages i and 7-i on rank i) (a file is never reinterpreted as "
      "another schedule kind; without a requested kind the file's own placement is used)");
  EXPECT_NE(csv_error(fixture("looped_bfs_p2_v2_m4", "compute_only"), ScheduleKind::kGPipe)
                .find("it holds one stage per rank; the file has 4 stages on 2 ranks"),
            std::string::npos);
  EXPECT_EQ(csv_error(zbv, ScheduleKind::kZeroBubbleV), "accepted");
  // Our own Chimera files stay Chimera.
  const Schedule chimera = compile(make(ScheduleKind::kChimera, 4, 8));
  EXPECT_EQ(csv_error(to_torch_csv(chimera, false), ScheduleKind::kChimera), "accepted");
}

TEST(TorchParity, MalformedCellsAndRowsAreNamed) {
  EXPECT_EQ(csv_error("0F0,0F0,0B0\n"),
            "bad.csv row 1 column 2 '0F0': a second forward of stage 0 micro-batch 0 (the first "
            "is at row 1 column 1)");
  EXPECT_EQ(csv_error("0F0,0F1,0B0\n"),
            "bad.csv: stage 0 micro-batch 1 has no backward (B, or I and W) (rank 0, row 1)");
  EXPECT_EQ(csv_error("0F0,0I0\n"),
            "bad.csv row 1 column 2 '0I0': backward-input without a backward-weight (W) of stage 0 "
            "micro-batch 0");
  EXPECT_EQ(csv_error("0F0,0B0\n\n1F0,1B0\n"),
            "bad.csv row 2: empty row between ranks (every rank runs at least one stage; rows are "
            "ranks 0, 1, ...)");
  EXPECT_EQ(csv_error("0F0,0B0\n,,,\n1F0,1B0\n"),
            "bad.csv row 2: empty row between ranks (every rank runs at least one stage; rows are "
            "ranks 0, 1, ...)");
  EXPECT_EQ(csv_error("0F0,0B0\n\n"), "accepted");  // trailing empty lines are fine
  EXPECT_EQ(csv_error("(0F0;0B0)OVERLAP_F_B\n"),
            "bad.csv row 1 column 1 '(0F0;0B0)OVERLAP_F_B': OVERLAP_F_B needs two different "
            "stages");
  EXPECT_EQ(csv_error("(0B0;1F0)OVERLAP_F_B\n"),
            "bad.csv row 1 column 1 '(0B0;1F0)OVERLAP_F_B': OVERLAP_F_B pairs a forward with a "
            "backward (F then B or I)");
  EXPECT_EQ(csv_error("(0F0;1B0)OVERLAP\n"),
            "bad.csv row 1 column 1 '(0F0;1B0)OVERLAP': a composite action is written "
            "(<forward>;<backward>)OVERLAP_F_B");
  EXPECT_EQ(csv_error("0F0,0SEND_F0,0WAIT_SEND_F0,0WAIT_SEND_F0,0B0\n1F0,1B0\n"),
            "bad.csv row 1 column 4 '0WAIT_SEND_F0': a second wait for the same send");
  EXPECT_EQ(csv_error("0F0,0WAIT_SEND_F0,0B0\n1F0,1B0\n"),
            "bad.csv row 1 column 2 '0WAIT_SEND_F0': waits for SEND_F of stage 0 micro-batch 0, "
            "which has not been sent before it on this rank");
  EXPECT_EQ(csv_error("0F0,0SEND_F0,0RECV_B0,0B0,0WAIT_SEND_F0\n"
                      "1RECV_F0,1F0,1B0,1SEND_B0\n"),
            "bad.csv row 2 column 4 '1SEND_B0': this send has no WAIT_SEND after it on its rank "
            "(the file has waits for other sends; torch requires one per send)");
  EXPECT_EQ(csv_error("0F0,0B0,0REDUCE_GRAD,0REDUCE_GRAD,0WAIT_REDUCE_GRAD\n"),
            "bad.csv row 1 column 4 '0REDUCE_GRAD': a second REDUCE_GRAD of stage 0");
  EXPECT_EQ(csv_error("0UNSHARD,0F0,0B0,0REDUCE_GRAD,0WAIT_REDUCE_GRAD,0RESHARD\n"), "accepted");
}

}  // namespace
}  // namespace pf::sched
