#include "scheduler/torch_csv_actions.h"

#include <array>
#include <stdexcept>

namespace pf::sched {
namespace {

struct ActionName {
  std::string_view text;
  TorchActionType type;
};

// Longest names first: a name matches only when the rest of the cell is digits, so WAIT_SEND_F0
// is never read as W followed by junk.
constexpr std::array<ActionName, 14> kActionNames = {{
    {"WAIT_REDUCE_GRAD", TorchActionType::kWaitReduceGrad},
    {"REDUCE_GRAD", TorchActionType::kReduceGrad},
    {"WAIT_SEND_F", TorchActionType::kWaitSendF},
    {"WAIT_SEND_B", TorchActionType::kWaitSendB},
    {"UNSHARD", TorchActionType::kUnshard},
    {"RESHARD", TorchActionType::kReshard},
    {"SEND_F", TorchActionType::kSendF},
    {"RECV_F", TorchActionType::kRecvF},
    {"SEND_B", TorchActionType::kSendB},
    {"RECV_B", TorchActionType::kRecvB},
    {"F", TorchActionType::kForward},
    {"B", TorchActionType::kBackward},
    {"I", TorchActionType::kBackwardInput},
    {"W", TorchActionType::kBackwardWeight},
}};

constexpr std::string_view kExpected =
    "expected <stage><action>[<micro-batch>] with action F, B, I, W, SEND_F, RECV_F, SEND_B, "
    "RECV_B, WAIT_SEND_F, WAIT_SEND_B (with a micro-batch) or REDUCE_GRAD, WAIT_REDUCE_GRAD, "
    "UNSHARD, RESHARD (without), e.g. 0F3, 2SEND_F1, 1REDUCE_GRAD, or a composite "
    "(0F3;2B1)OVERLAP_F_B";

bool all_digits(std::string_view text) {
  for (char c : text) {
    if (c < '0' || c > '9') return false;
  }
  return true;
}

bool needs_microbatch(TorchActionType type) {
  switch (type) {
    case TorchActionType::kReduceGrad:
    case TorchActionType::kWaitReduceGrad:
    case TorchActionType::kUnshard:
    case TorchActionType::kReshard:
      return false;
    default:
      return true;
  }
}

class CellParser {
 public:
  CellParser(std::string_view source, int row, int column, std::string_view cell)
      : where_(torch_cell_location(source, row, column, cell)),
        row_(row),
        column_(column),
        cell_(cell) {}

  void parse(std::vector<TorchAction>& out) const {
    if (!cell_.empty() && cell_.front() == '(') {
      parse_composite(out);
      return;
    }
    out.push_back(parse_simple(cell_));
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw std::invalid_argument(where_ + ": " + what);
  }

  int number(std::string_view digits) const {
    if (digits.size() > 9)
      fail("number '" + std::string(digits) + "' too large (at most 9 digits)");
    int value = 0;
    for (char c : digits) value = value * 10 + (c - '0');
    return value;
  }

  TorchAction parse_simple(std::string_view text) const {
    std::size_t digits = 0;
    while (digits < text.size() && text[digits] >= '0' && text[digits] <= '9') ++digits;
    if (digits == 0) fail(std::string(kExpected));
    const std::string_view rest = text.substr(digits);
    for (const ActionName& name : kActionNames) {
      if (rest.substr(0, name.text.size()) != name.text) continue;
      const std::string_view tail = rest.substr(name.text.size());
      if (!all_digits(tail)) continue;
      TorchAction action;
      action.stage = number(text.substr(0, digits));
      action.type = name.type;
      action.row = row_;
      action.column = column_;
      action.text = std::string(cell_);
      if (needs_microbatch(name.type)) {
        if (tail.empty()) fail(std::string(name.text) + " needs a micro-batch number");
        action.microbatch = number(tail);
      } else if (!tail.empty()) {
        fail(std::string(name.text) + " takes no micro-batch");
      }
      return action;
    }
    fail("unknown action '" + std::string(rest) + "'; " + std::string(kExpected));
  }

  // "(0F3;2B1)OVERLAP_F_B": a forward and a backward (B or I) of another stage that may run at
  // the same time.
  void parse_composite(std::vector<TorchAction>& out) const {
    const std::size_t close = cell_.find(')');
    constexpr std::string_view kSuffix = "OVERLAP_F_B";
    if (close == std::string_view::npos || cell_.substr(close + 1) != kSuffix) {
      fail("a composite action is written (<forward>;<backward>)OVERLAP_F_B");
    }
    const std::string_view inner = cell_.substr(1, close - 1);
    const std::size_t semicolon = inner.find(';');
    if (semicolon == std::string_view::npos ||
        inner.find(';', semicolon + 1) != std::string_view::npos) {
      fail("OVERLAP_F_B holds exactly two actions separated by ';'");
    }
    TorchAction forward = parse_simple(inner.substr(0, semicolon));
    TorchAction backward = parse_simple(inner.substr(semicolon + 1));
    if (forward.type != TorchActionType::kForward ||
        (backward.type != TorchActionType::kBackward &&
         backward.type != TorchActionType::kBackwardInput)) {
      fail("OVERLAP_F_B pairs a forward with a backward (F then B or I)");
    }
    if (forward.stage == backward.stage) fail("OVERLAP_F_B needs two different stages");
    forward.overlap_next = true;
    out.push_back(std::move(forward));
    out.push_back(std::move(backward));
  }

  std::string where_;
  int row_;
  int column_;
  std::string_view cell_;
};

}  // namespace

std::string_view torch_action_name(TorchActionType type) {
  for (const ActionName& name : kActionNames) {
    if (name.type == type) return name.text;
  }
  return "?";
}

bool is_torch_compute(TorchActionType type) {
  return type == TorchActionType::kForward || type == TorchActionType::kBackward ||
         type == TorchActionType::kBackwardInput || type == TorchActionType::kBackwardWeight;
}

std::string torch_cell_location(std::string_view source, int row, int column,
                                std::string_view text) {
  return std::string(source) + " row " + std::to_string(row) + " column " + std::to_string(column) +
         " '" + std::string(text) + "'";
}

std::vector<std::vector<TorchAction>> parse_torch_csv(std::string_view text,
                                                      std::string_view source) {
  std::vector<std::vector<TorchAction>> rows;
  int empty_row = 0;  // first empty row not yet followed by a non-empty one
  std::size_t start = 0;
  int row = 0;
  while (start < text.size()) {
    std::size_t end = text.find('\n', start);
    if (end == std::string_view::npos) end = text.size();
    std::string_view line = text.substr(start, end - start);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    ++row;
    start = end + 1;
    std::vector<TorchAction> actions;
    std::size_t cell_start = 0;
    int column = 0;
    while (true) {
      const std::size_t comma = line.find(',', cell_start);
      const std::string_view cell =
          line.substr(cell_start, comma == std::string_view::npos ? std::string_view::npos
                                                                  : comma - cell_start);
      ++column;
      if (!cell.empty()) CellParser(source, row, column, cell).parse(actions);
      if (comma == std::string_view::npos) break;
      cell_start = comma + 1;
    }
    if (actions.empty()) {
      if (empty_row == 0) empty_row = row;
      continue;
    }
    if (empty_row != 0) {
      throw std::invalid_argument(std::string(source) + " row " + std::to_string(empty_row) +
                                  ": empty row between ranks (every rank runs at least one "
                                  "stage; rows are ranks 0, 1, ...)");
    }
    rows.push_back(std::move(actions));
  }
  if (rows.empty()) throw std::invalid_argument(std::string(source) + ": empty CSV (no ranks)");
  return rows;
}

}  // namespace pf::sched
