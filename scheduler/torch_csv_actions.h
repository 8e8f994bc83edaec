#pragma once
// The cells of PyTorch's torch.distributed.pipelining schedule CSV, parsed one by one: every
// action PyTorch 2.x writes (compute F, B, I, W; SEND_F/RECV_F/SEND_B/RECV_B; WAIT_SEND_F/B;
// REDUCE_GRAD/WAIT_REDUCE_GRAD; UNSHARD/RESHARD; composite (F;B)OVERLAP_F_B). Every error names
// the source, row, column (both from 1) and the cell's text.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace pf::sched {

enum class TorchActionType : std::uint8_t {
  kForward,
  kBackward,
  kBackwardInput,
  kBackwardWeight,
  kSendF,
  kRecvF,
  kSendB,
  kRecvB,
  kWaitSendF,
  kWaitSendB,
  kReduceGrad,
  kWaitReduceGrad,
  kUnshard,
  kReshard,
};

std::string_view torch_action_name(TorchActionType type);  // "F", "SEND_F", "WAIT_REDUCE_GRAD", ...
bool is_torch_compute(TorchActionType type);               // F, B, I, W

struct TorchAction {
  int stage = 0;
  TorchActionType type = TorchActionType::kForward;
  int microbatch = -1;  // -1 for the per-stage actions (REDUCE_GRAD, UNSHARD, ...)
  // First part of a composite (F;B)OVERLAP_F_B: the next action (same cell) is its backward.
  bool overlap_next = false;
  int row = 0;  // from 1
  int column = 0;
  std::string text;  // the whole cell
};

// "src row 2 column 5 '0F3x'"
std::string torch_cell_location(std::string_view source, int row, int column,
                                std::string_view text);

// One row per rank; empty cells (torch's idle slots) are skipped, a composite cell gives its two
// parts. Throws std::invalid_argument for a malformed cell, an empty row between ranks, or no
// rows at all. Trailing empty lines are ignored.
std::vector<std::vector<TorchAction>> parse_torch_csv(std::string_view text,
                                                      std::string_view source);

}  // namespace pf::sched
