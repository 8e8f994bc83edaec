#pragma once
// When one instruction runs, in microseconds. Kept free of dependencies so that the scheduler
// (unit layouts) and the simulator can produce it without linking the trace writer.

namespace pf::traces {

struct SpanTiming {
  double start_us = 0;
  double duration_us = 0;
};

}  // namespace pf::traces
