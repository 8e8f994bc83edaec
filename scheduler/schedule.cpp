#include "scheduler/schedule.h"

#include <stdexcept>
#include <string>

namespace pf::sched {

std::string_view to_string(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::kGPipe:
      return "gpipe";
    case ScheduleKind::kOneFOneB:
      return "1f1b";
    case ScheduleKind::kInterleaved:
      return "interleaved";
    case ScheduleKind::kChimera:
      return "chimera";
    case ScheduleKind::kCustom:
      return "custom";
    case ScheduleKind::kZeroBubbleH1:
      return "zbh1";
    case ScheduleKind::kZeroBubbleH2:
      return "zbh2";
    case ScheduleKind::kZeroBubbleV:
      return "zbv";
  }
  return "custom";
}

ScheduleKind schedule_kind_from_string(std::string_view name) {
  for (ScheduleKind kind :
       {ScheduleKind::kGPipe, ScheduleKind::kOneFOneB, ScheduleKind::kInterleaved,
        ScheduleKind::kChimera, ScheduleKind::kCustom, ScheduleKind::kZeroBubbleH1,
        ScheduleKind::kZeroBubbleH2, ScheduleKind::kZeroBubbleV}) {
    if (to_string(kind) == name) return kind;
  }
  throw std::invalid_argument(
      "unknown schedule '" + std::string(name) +
      "' (allowed: gpipe, 1f1b, interleaved, chimera, zbh1, zbh2, zbv, custom)");
}

const ChunkPlacement& Placement::at(int pipeline, int chunk) const {
  if (pipeline < 0 || pipeline >= num_pipelines || chunk < 0 || chunk >= chunks_per_pipeline) {
    throw std::out_of_range("placement has no chunk " + std::to_string(chunk) + " of pipeline " +
                            std::to_string(pipeline) + " (" + std::to_string(num_pipelines) +
                            " pipeline(s) of " + std::to_string(chunks_per_pipeline) + " chunks)");
  }
  return chunks.at(static_cast<std::size_t>(pipeline * chunks_per_pipeline + chunk));
}

std::size_t Schedule::num_instructions() const {
  std::size_t total = 0;
  for (const auto& stream : streams) total += stream.size();
  return total;
}

}  // namespace pf::sched
