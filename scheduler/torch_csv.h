#pragma once
// PyTorch torch.distributed.pipelining's CSV action format: one row per rank, one action per
// cell, e.g. 0F3 (stage 0 forward of micro-batch 3), 1B2 (full backward), 0I1 / 0W1 (backward
// input / weight), 2SEND_F1, 3RECV_F1, 1SEND_B0, 0RECV_B0, 0REDUCE_GRAD. Empty cells (idle slots
// in torch's compute-only tables) are skipped.
//
// Stage index = global virtual stage = pipeline * chunks_per_pipeline + chunk. For one pipeline
// that is the chunk itself (stage s on rank s mod ranks, as in torch's looped schedules); for
// Chimera (D ranks) stages 0..D-1 are the down pipeline (stage i on rank i) and D..2D-1 the up
// pipeline (stage D+i is chunk i of pipeline 1, on rank D-1-i). Micro-batch numbers are per
// pipeline.
//
// Parsing is a full match: a cell with trailing junk ("0F3x"), spaces or an unknown action is an
// error naming its row, column (both from 1) and text.
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>

#include "scheduler/lowering.h"
#include "scheduler/schedule.h"

namespace pf::sched {

struct TorchCsvImportOptions {
  // How to read stage indices: kChimera means two pipelines; anything else (or nothing) one
  // pipeline with stage s on rank s mod ranks (recorded as that kind, kCustom by default).
  std::optional<ScheduleKind> kind;
  int num_layers = 0;  // 0: one per chunk
  int data_parallel = 1;
  LoweringOptions lowering;  // bytes; used to lower compute-only files and to fill byte counts
};

// Compute-only files go through lower(); files with communication get pair ids by matching
// each send with its receive and then the end-of-step work (pipeline reductions, optimizer
// step). The result is validated.
Schedule schedule_from_torch_csv(std::string_view text, std::string_view source,
                                 const TorchCsvImportOptions& options = {});
Schedule load_torch_csv(const std::filesystem::path& path,
                        const TorchCsvImportOptions& options = {});

// One row per worker. with_communication=false writes compute only (F, B, I, W). Instructions
// the format cannot express (optimizer step, Chimera's pipeline reductions, K-FAC work) are
// left out; data-parallel reductions become REDUCE_GRAD. Throws for multi-step schedules.
std::string to_torch_csv(const Schedule& schedule, bool with_communication = true);
void save_torch_csv(const std::filesystem::path& path, const Schedule& schedule,
                    bool with_communication = true);

}  // namespace pf::sched
