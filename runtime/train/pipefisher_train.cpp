// pipefisher_train: BERT pretraining (MLM + NSP) with pipeline parallelism on worker threads,
// optionally with K-FAC work placed in the pipeline's bubbles (PipeFisher).
// Bad input prints one error line on stderr and exits with status 2; a failure during training
// exits with status 1.
#include <exception>
#include <iostream>

#include <CLI/CLI.hpp>

#include "runtime/train/train_options.h"
#include "runtime/train/trainer.h"

int main(int argc, char** argv) {
  CLI::App app{
      "pipefisher_train: pretrains BERT (masked LM + next sentence) with pipeline parallelism: "
      "one worker thread per pipeline worker (x data-parallel replicas) executes the "
      "compiler's instruction stream (GPipe, 1F1B, interleaved 1F1B, Chimera, or a saved "
      "schedule); --kfac runs K-FAC in the pipeline's bubbles (PipeFisher).",
      "pipefisher_train"};
  pf::train::TrainOptions options;
  pf::train::add_train_options(app, options);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    if (error.get_exit_code() == 0) return app.exit(error);  // --help
    std::cerr << "pipefisher_train: error: " << error.what() << " (see --help)\n";
    return 2;
  }
  try {
    return pf::train::run_training(options, std::cout);
  } catch (const std::invalid_argument& error) {
    std::cerr << "pipefisher_train: error: " << error.what() << "\n";
    return 2;
  } catch (const std::exception& error) {
    std::cerr << "pipefisher_train: training failed: " << error.what() << "\n";
    return 1;
  }
}
