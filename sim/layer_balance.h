#pragma once
// Choosing how many encoder layers each chunk of a pipeline holds (--layers-per-stage auto).
//
// The balanced split gives every chunk the same number of layers, but the chunks are not equal:
// the first also holds the embeddings, the last the MLM head and its vocabulary-wide decoder,
// and with K-FAC a chunk's layers set its curvature and inversion work against its bubbles. The
// search starts from the balanced split and moves one layer at a time between neighbouring
// chunks while the predicted step time falls (steepest descent over those moves), so it
// simulates a few dozen splits rather than every composition (C(23, 7) = 245 157 for 24 layers
// on 8 stages).

#include <functional>
#include <string>
#include <vector>

namespace pf::sim {

struct SplitEvaluation {
  std::vector<int> layers;   // per chunk of a pipeline, in pipeline order
  double step_time_s = 0.0;  // the objective; infinity: the split does not fit
  int refresh_steps = 0;     // with K-FAC: the refresh interval the pass chose (0: no K-FAC)
};

struct LayerBalance {
  SplitEvaluation start;                   // the split the search began from
  SplitEvaluation best;                    // the split it chose (start when nothing is faster)
  std::vector<SplitEvaluation> evaluated;  // every split simulated, fastest first
};

// Steepest descent from `start` over the moves of one layer from a chunk to a neighbouring
// chunk (every chunk keeps at least one layer), each split evaluated once; stops when no move
// lowers the step time by more than `min_gain` (relative). Throws std::invalid_argument when
// `start` is empty or holds a count below 1.
LayerBalance balance_layers(const std::vector<int>& start,
                            const std::function<SplitEvaluation(const std::vector<int>&)>& evaluate,
                            double min_gain = 1e-4);

// The text table of the fastest `rows` evaluated splits, with the start's and the choice's line.
std::string layer_balance_table(const LayerBalance& balance, int rows = 8);

}  // namespace pf::sim
