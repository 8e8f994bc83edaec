#include "scheduler/torch_csv.h"

#include <fstream>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "scheduler/key_space.h"
#include "scheduler/placement.h"
#include "scheduler/validate.h"

namespace pf::sched {
namespace {

enum class ActionType : std::uint8_t {
  kForward,
  kBackward,
  kBackwardInput,
  kBackwardWeight,
  kSendF,
  kRecvF,
  kSendB,
  kRecvB,
  kReduceGrad,
  kUnshard,
  kReshard,
};

struct ActionName {
  std::string_view text;
  ActionType type;
};

// Longest names first so that prefixes cannot shadow them.
constexpr ActionName kActionNames[] = {
    {"REDUCE_GRAD", ActionType::kReduceGrad},
    {"UNSHARD", ActionType::kUnshard},
    {"RESHARD", ActionType::kReshard},
    {"SEND_F", ActionType::kSendF},
    {"RECV_F", ActionType::kRecvF},
    {"SEND_B", ActionType::kSendB},
    {"RECV_B", ActionType::kRecvB},
    {"F", ActionType::kForward},
    {"B", ActionType::kBackward},
    {"I", ActionType::kBackwardInput},
    {"W", ActionType::kBackwardWeight},
};

struct Action {
  int stage = 0;
  ActionType type = ActionType::kForward;
  int microbatch = -1;
  int row = 0;     // from 1
  int column = 0;  // from 1
  std::string text;
};

std::string at_cell(std::string_view source, int row, int column, std::string_view text) {
  return std::string(source) + " row " + std::to_string(row) + " column " + std::to_string(column) +
         " '" + std::string(text) + "'";
}

// Parses digits in [begin, end) fully; -1 when empty, throws past 9 digits.
int parse_number(std::string_view digits, const std::string& where) {
  if (digits.empty()) return -1;
  if (digits.size() > 9) throw std::invalid_argument(where + ": number too large");
  int value = 0;
  for (char c : digits) {
    if (c < '0' || c > '9') return -2;
    value = value * 10 + (c - '0');
  }
  return value;
}

Action parse_action(std::string_view cell, std::string_view source, int row, int column) {
  const std::string where = at_cell(source, row, column, cell);
  const std::string expected =
      ": expected <stage><action><micro-batch> with action F, B, I, W, SEND_F, RECV_F, SEND_B, "
      "RECV_B (e.g. 0F3, 1B2, 2SEND_F1) or <stage>REDUCE_GRAD";
  if (!cell.empty() && cell.front() == '(') {
    throw std::invalid_argument(where + ": composite (overlapped) actions are not supported");
  }
  std::size_t digits = 0;
  while (digits < cell.size() && cell[digits] >= '0' && cell[digits] <= '9') ++digits;
  if (digits == 0) throw std::invalid_argument(where + expected);
  Action action;
  action.row = row;
  action.column = column;
  action.text = std::string(cell);
  action.stage = parse_number(cell.substr(0, digits), where);
  const std::string_view rest = cell.substr(digits);
  for (const ActionName& name : kActionNames) {
    if (rest.substr(0, name.text.size()) != name.text) continue;
    const int mb = parse_number(rest.substr(name.text.size()), where);
    if (mb == -2) throw std::invalid_argument(where + expected);
    action.type = name.type;
    action.microbatch = mb;
    if (name.type == ActionType::kUnshard || name.type == ActionType::kReshard) {
      throw std::invalid_argument(where + ": FSDP " + std::string(name.text) +
                                  " actions are not supported");
    }
    if (name.type == ActionType::kReduceGrad) {
      if (mb != -1) throw std::invalid_argument(where + ": REDUCE_GRAD takes no micro-batch");
    } else if (mb < 0) {
      throw std::invalid_argument(where + ": " + std::string(name.text) +
                                  " needs a micro-batch number");
    }
    return action;
  }
  throw std::invalid_argument(where + expected);
}

std::vector<std::vector<Action>> parse_rows(std::string_view text, std::string_view source) {
  std::vector<std::vector<Action>> rows;
  std::size_t start = 0;
  int row = 0;
  while (start < text.size()) {
    std::size_t end = text.find('\n', start);
    if (end == std::string_view::npos) end = text.size();
    std::string_view line = text.substr(start, end - start);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    ++row;
    std::vector<Action> actions;
    std::size_t cell_start = 0;
    int column = 0;
    while (true) {
      std::size_t comma = line.find(',', cell_start);
      const std::string_view cell =
          line.substr(cell_start, comma == std::string_view::npos ? comma : comma - cell_start);
      ++column;
      if (!cell.empty()) actions.push_back(parse_action(cell, source, row, column));
      if (comma == std::string_view::npos) break;
      cell_start = comma + 1;
    }
    rows.push_back(std::move(actions));
    start = end + 1;
  }
  if (rows.empty()) throw std::invalid_argument(std::string(source) + ": empty CSV (no ranks)");
  return rows;
}

// Appends the end-of-step work of a single-step schedule whose communication is complete:
// pipeline reductions (ascending stage, both workers), data-parallel reductions, optimizer step.
void append_step_end(Schedule& schedule, const LoweringOptions& options,
                     std::int64_t next_pair_id) {
  const Placement& placement = schedule.placement;
  auto bytes_of = [&](int pipeline, int chunk) {
    return options.reduction_bytes_per_layer * placement.at(pipeline, chunk).num_layers;
  };
  bool has_dp_reduction = false;
  for (const auto& stream : schedule.streams) {
    for (const Instruction& in : stream) {
      has_dp_reduction |= in.kind == OpKind::kReduceGradDataParallel;
    }
  }
  if (placement.num_pipelines == 2) {
    for (int chunk = 0; chunk < placement.chunks_per_pipeline; ++chunk) {
      Instruction reduce;
      reduce.kind = OpKind::kReduceGradPipelines;
      reduce.chunk = chunk;
      reduce.pair_id = next_pair_id++;
      reduce.bytes = bytes_of(0, chunk);
      const int a = placement.worker_of(0, chunk);
      const int b = placement.worker_of(1, chunk);
      reduce.pipeline = 0;
      reduce.peer = b;
      schedule.streams[static_cast<std::size_t>(a)].push_back(reduce);
      reduce.pipeline = 1;
      reduce.peer = a;
      schedule.streams[static_cast<std::size_t>(b)].push_back(reduce);
    }
  }
  const auto owned = chunks_by_worker(placement, schedule.num_workers());
  for (int w = 0; w < schedule.num_workers(); ++w) {
    auto& stream = schedule.streams[static_cast<std::size_t>(w)];
    if (schedule.params.data_parallel > 1 && !has_dp_reduction) {
      for (const ChunkRef& ref : owned[static_cast<std::size_t>(w)]) {
        Instruction reduce;
        reduce.kind = OpKind::kReduceGradDataParallel;
        reduce.pipeline = static_cast<std::int8_t>(ref.pipeline);
        reduce.chunk = ref.chunk;
        reduce.bytes = bytes_of(ref.pipeline, ref.chunk);
        stream.push_back(reduce);
      }
    }
    if (options.optimizer_step) {
      Instruction opt;
      opt.kind = OpKind::kOptimizerStep;
      stream.push_back(opt);
    }
  }
}

}  // namespace

Schedule schedule_from_torch_csv(std::string_view text, std::string_view source,
                                 const TorchCsvImportOptions& options) {
  const auto rows = parse_rows(text, source);
  const int ranks = static_cast<int>(rows.size());
  int max_stage = -1;
  int max_mb = -1;
  bool has_comm = false;
  for (const auto& row : rows) {
    for (const Action& a : row) {
      max_stage = std::max(max_stage, a.stage);
      max_mb = std::max(max_mb, a.microbatch);
      has_comm |= a.type == ActionType::kSendF || a.type == ActionType::kRecvF ||
                  a.type == ActionType::kSendB || a.type == ActionType::kRecvB;
    }
  }
  if (max_stage < 0 || max_mb < 0) {
    throw std::invalid_argument(std::string(source) + ": no compute actions");
  }
  const int stages = max_stage + 1;
  std::size_t total_actions = 0;
  for (const auto& row : rows) total_actions += row.size();
  // Every stage runs every micro-batch forward: fewer actions than that cannot be a schedule.
  if (static_cast<std::size_t>(stages) * static_cast<std::size_t>(max_mb + 1) > total_actions) {
    throw std::invalid_argument(std::string(source) + ": " + std::to_string(total_actions) +
                                " actions cannot cover " + std::to_string(stages) + " stages x " +
                                std::to_string(max_mb + 1) + " micro-batches");
  }
  ScheduleParams params;
  params.kind = options.kind.value_or(ScheduleKind::kCustom);
  params.workers = ranks;
  params.num_layers = options.num_layers;
  params.data_parallel = options.data_parallel;
  const bool chimera = params.kind == ScheduleKind::kChimera;
  const int pipelines = chimera ? 2 : 1;
  if (chimera) {
    if (stages > 2 * ranks) {
      throw std::invalid_argument(std::string(source) + ": stage " + std::to_string(max_stage) +
                                  " does not exist in chimera over " + std::to_string(ranks) +
                                  " ranks (stages 0.." + std::to_string(2 * ranks - 1) + ")");
    }
    params.chunks_per_worker = 1;
  } else {
    if (stages % ranks != 0) {
      throw std::invalid_argument(std::string(source) + ": " + std::to_string(stages) +
                                  " stages over " + std::to_string(ranks) +
                                  " ranks: the stage count must be a multiple of the rank count");
    }
    params.chunks_per_worker = stages / ranks;
  }
  params.microbatches = (max_mb + 1) * pipelines;
  bool split = false;
  for (const auto& row : rows) {
    for (const Action& a : row) split |= a.type == ActionType::kBackwardInput;
  }
  params.split_backward = split;

  Schedule schedule;
  schedule.params = params;
  try {
    schedule.placement = make_placement(params);
  } catch (const std::invalid_argument& error) {
    throw std::invalid_argument(std::string(source) + ": " + error.what());
  }
  const Placement& placement = schedule.placement;
  const int chunks = placement.chunks_per_pipeline;
  const KeySpace keys{1, pipelines, chunks, max_mb + 1};
  std::vector<std::int64_t> send_f_pair(keys.size(), -1);
  std::vector<std::int64_t> send_b_pair(keys.size(), -1);
  std::int64_t next_pair = 0;
  schedule.streams.resize(static_cast<std::size_t>(ranks));
  for (int rank = 0; rank < ranks; ++rank) {
    auto& stream = schedule.streams[static_cast<std::size_t>(rank)];
    stream.reserve(rows[static_cast<std::size_t>(rank)].size() + 4);
    for (const Action& a : rows[static_cast<std::size_t>(rank)]) {
      const std::string where = at_cell(source, a.row, a.column, a.text);
      Instruction in;
      in.pipeline = static_cast<std::int8_t>(a.stage / chunks);
      in.chunk = a.stage % chunks;
      in.microbatch = a.microbatch;
      const int owner = placement.worker_of(in.pipeline, in.chunk);
      if (owner != rank) {
        throw std::invalid_argument(where + ": stage " + std::to_string(a.stage) +
                                    " lives on rank " + std::to_string(owner) + ", not rank " +
                                    std::to_string(rank));
      }
      auto neighbour = [&](int delta) {
        const int chunk = in.chunk + delta;
        if (chunk < 0 || chunk >= chunks) {
          throw std::invalid_argument(where + ": stage " + std::to_string(a.stage) + " has no " +
                                      (delta > 0 ? "next" : "previous") +
                                      " stage to communicate with");
        }
        return placement.worker_of(in.pipeline, chunk);
      };
      switch (a.type) {
        case ActionType::kForward:
          in.kind = OpKind::kForward;
          break;
        case ActionType::kBackward:
          in.kind = OpKind::kBackward;
          break;
        case ActionType::kBackwardInput:
          in.kind = OpKind::kBackwardInput;
          break;
        case ActionType::kBackwardWeight:
          in.kind = OpKind::kBackwardWeight;
          break;
        case ActionType::kSendF:
          in.kind = OpKind::kSendActivation;
          in.peer = neighbour(+1);
          in.bytes = options.lowering.activation_bytes;
          break;
        case ActionType::kRecvF:
          in.kind = OpKind::kRecvActivation;
          in.peer = neighbour(-1);
          in.bytes = options.lowering.activation_bytes;
          break;
        case ActionType::kSendB:
          in.kind = OpKind::kSendGradient;
          in.peer = neighbour(-1);
          in.bytes = options.lowering.gradient_bytes;
          break;
        case ActionType::kRecvB:
          in.kind = OpKind::kRecvGradient;
          in.peer = neighbour(+1);
          in.bytes = options.lowering.gradient_bytes;
          break;
        case ActionType::kReduceGrad:
          in.kind = OpKind::kReduceGradDataParallel;
          in.microbatch = -1;
          in.bytes = options.lowering.reduction_bytes_per_layer *
                     placement.at(in.pipeline, in.chunk).num_layers;
          break;
        default:
          throw std::invalid_argument(where + ": unsupported action");
      }
      if (in.kind == OpKind::kSendActivation || in.kind == OpKind::kSendGradient) {
        auto& table = in.kind == OpKind::kSendActivation ? send_f_pair : send_b_pair;
        std::int64_t& slot = table[keys.index(0, in.pipeline, in.chunk, in.microbatch)];
        if (slot >= 0) throw std::invalid_argument(where + ": the same send appears twice");
        slot = next_pair++;
        in.pair_id = slot;
      }
      stream.push_back(in);
    }
  }
  if (has_comm) {
    // Receives take the pair id of the send they match.
    for (int rank = 0; rank < ranks; ++rank) {
      auto& stream = schedule.streams[static_cast<std::size_t>(rank)];
      std::size_t action_index = 0;
      for (Instruction& in : stream) {
        const Action& a = rows[static_cast<std::size_t>(rank)][action_index++];
        if (in.kind != OpKind::kRecvActivation && in.kind != OpKind::kRecvGradient) continue;
        const bool activation = in.kind == OpKind::kRecvActivation;
        const int sender_chunk = in.chunk + (activation ? -1 : 1);
        const auto& table = activation ? send_f_pair : send_b_pair;
        const std::int64_t pair = table[keys.index(0, in.pipeline, sender_chunk, in.microbatch)];
        if (pair < 0) {
          throw std::invalid_argument(at_cell(source, a.row, a.column, a.text) + ": no matching " +
                                      std::to_string(in.pipeline * chunks + sender_chunk) +
                                      (activation ? "SEND_F" : "SEND_B") +
                                      std::to_string(in.microbatch) + " on rank " +
                                      std::to_string(in.peer));
        }
        in.pair_id = pair;
      }
    }
    append_step_end(schedule, options.lowering, next_pair);
  }
  try {
    if (!has_comm) schedule = lower(std::move(schedule), options.lowering);
    validate(schedule);
  } catch (const ValidationError& error) {
    throw ValidationError(std::string(source) + ": " + error.what(), error.worker, error.position);
  } catch (const std::invalid_argument& error) {
    throw std::invalid_argument(std::string(source) + ": " + error.what());
  }
  return schedule;
}

Schedule load_torch_csv(const std::filesystem::path& path, const TorchCsvImportOptions& options) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open CSV file " + path.string());
  std::ostringstream text;
  text << in.rdbuf();
  return schedule_from_torch_csv(text.str(), path.string(), options);
}

std::string to_torch_csv(const Schedule& schedule, bool with_communication) {
  if (schedule.num_steps != 1) {
    throw std::invalid_argument("the torch CSV format holds one step; this schedule has " +
                                std::to_string(schedule.num_steps));
  }
  const int chunks = schedule.placement.chunks_per_pipeline;
  std::string out;
  for (const auto& stream : schedule.streams) {
    bool first = true;
    for (const Instruction& in : stream) {
      const char* name = nullptr;
      bool communication = false;
      switch (in.kind) {
        case OpKind::kForward:
          name = "F";
          break;
        case OpKind::kBackward:
          name = "B";
          break;
        case OpKind::kBackwardInput:
          name = "I";
          break;
        case OpKind::kBackwardWeight:
          name = "W";
          break;
        case OpKind::kSendActivation:
          name = "SEND_F";
          communication = true;
          break;
        case OpKind::kRecvActivation:
          name = "RECV_F";
          communication = true;
          break;
        case OpKind::kSendGradient:
          name = "SEND_B";
          communication = true;
          break;
        case OpKind::kRecvGradient:
          name = "RECV_B";
          communication = true;
          break;
        case OpKind::kReduceGradDataParallel:
          name = "REDUCE_GRAD";
          communication = true;
          break;
        default:
          break;  // not expressible in the format
      }
      if (name == nullptr || (communication && !with_communication)) continue;
      if (!first) out += ',';
      first = false;
      out += std::to_string(in.pipeline * chunks + in.chunk);
      out += name;
      if (in.microbatch >= 0) out += std::to_string(in.microbatch);
    }
    out += '\n';
  }
  return out;
}

void save_torch_csv(const std::filesystem::path& path, const Schedule& schedule,
                    bool with_communication) {
  std::ofstream out(path, std::ios::binary);
  if (!out) throw std::runtime_error("cannot write CSV file " + path.string());
  out << to_torch_csv(schedule, with_communication);
  if (!out) throw std::runtime_error("failed writing CSV file " + path.string());
}

}  // namespace pf::sched
