#pragma once
// pipefisher_train's run: data, model, schedule (with K-FAC placed by the PipeFisher pass when
// asked), the executor, progress, metrics, checkpoints, the measured trace and profile.
#include <iosfwd>

#include "runtime/train/train_options.h"

namespace pf::train {

// Returns the process exit code (0). Throws std::invalid_argument for bad input found before
// training starts (exit 2 in main), std::runtime_error for failures during it.
int run_training(const TrainOptions& options, std::ostream& out);

}  // namespace pf::train
