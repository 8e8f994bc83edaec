#pragma once
// PyTorch torch.distributed.pipelining's CSV action format: one row per rank, one action per
// cell, e.g. 0F3 (stage 0 forward of micro-batch 3), 1B2 (full backward), 0I1 / 0W1 (backward
// input / weight), 2SEND_F1, 3RECV_F1, 1SEND_B0, 0RECV_B0, 2WAIT_SEND_F1, 0REDUCE_GRAD,
// 0WAIT_REDUCE_GRAD, 0UNSHARD, 0RESHARD and composite (0F7;7B3)OVERLAP_F_B. Empty cells (idle
// slots in torch's compute-only tables) are skipped. Cells are parsed by torch_csv_actions.h.
//
// Two forms, as torch's _dump_csv / _load_csv(format=...) have them:
// - compute-only (F, B, I, W, OVERLAP_F_B): what torchtitan's schedule loader reads; imported
//   files are checked cell by cell (every stage and micro-batch has one forward and one backward
//   or I + W) and then lowered;
// - compute_comms (torch's lowered form): communication as written, WAIT_SEND_* as the
//   completion points of their sends (checked, then implied: this IR's sends complete at their
//   rendezvous), REDUCE_GRAD/WAIT_REDUCE_GRAD as the data-parallel reduction (a no-op with one
//   replica, as torch has it), UNSHARD/RESHARD as no-ops (FSDP all-gather and free; this project
//   does not shard parameters).
//
// Stage index = global virtual stage = pipeline * chunks_per_pipeline + chunk. Which rank runs a
// stage is read from the file (torch infers it the same way): stage s on rank s mod ranks
// (looped: GPipe, 1F1B, interleaved, ZB-H1/H2), or V-shaped (stage s and 2R-1-s on rank s, as
// torch's ZBV and DualPipeV). For Chimera (D ranks, requested explicitly) stages 0..D-1 are the
// down pipeline (stage i on rank i) and D..2D-1 the up pipeline (stage D+i is chunk i of
// pipeline 1, on rank D-1-i); micro-batch numbers are per pipeline. A file is never
// reinterpreted: when a schedule kind is requested and the file's placement or shape
// contradicts it, the import is refused.
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>

#include "scheduler/lowering.h"
#include "scheduler/schedule.h"

namespace pf::sched {

struct TorchCsvImportOptions {
  // The kind the file must be (refused when it is not); nothing: read the placement from the
  // file and record kCustom. kChimera reads stage indices as two pipelines.
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

// One row per worker.
// with_communication = false: compute only (F, B, I, W, OVERLAP_F_B) — torch's "compute_only",
// what torchtitan loads.
// with_communication = true: torch's "compute_comms" form, which
// _load_csv(format="compute_comms") accepts: SEND/RECV as lowered here, WAIT_SEND_F right after
// the local backward of the same stage and micro-batch, the remaining WAIT_SEND_* at the end of
// the row, and REDUCE_GRAD + WAIT_REDUCE_GRAD after the last backward of each stage (torch
// reduces and scales gradients there even with one replica). No UNSHARD/RESHARD (no FSDP).
// Instructions the format cannot express (optimizer step, Chimera's pipeline reductions, K-FAC
// work) are left out, so CSV -> schedule -> CSV is identical. Throws for multi-step schedules.
std::string to_torch_csv(const Schedule& schedule, bool with_communication = true);
void save_torch_csv(const std::filesystem::path& path, const Schedule& schedule,
                    bool with_communication = true);

}  // namespace pf::sched
