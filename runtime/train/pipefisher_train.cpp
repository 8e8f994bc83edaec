// pipefisher_train: BERT pretraining (MLM + NSP) with pipeline parallelism on worker threads,
// optionally with K-FAC work placed in the pipeline's bubbles (PipeFisher). Under mpirun, one
// process per rank (runtime/train/mpi_launch.h).
// Errors print one line on stderr (rank 0 only for bad input under MPI); exit status 2 for bad
// input or usage (a missing or malformed file, a field out of range, a checkpoint that cannot be
// used), 1 for a failure during training (under MPI it ends the whole job; common/exit_codes.h).
#include <exception>
#include <iostream>
#include <optional>

#include <CLI/CLI.hpp>

#include "common/exit_codes.h"
#include "runtime/train/train_options.h"
#include "runtime/train/trainer.h"
#if PF_HAVE_MPI
#include "runtime/train/mpi_launch.h"
#endif

namespace {

int run(int argc, char** argv, pf::train::Launch& launch) {
  CLI::App app{
      "pipefisher_train: pretrains BERT (masked LM + next sentence) with pipeline parallelism: "
      "one worker thread per pipeline worker (x data-parallel replicas) executes the "
      "compiler's instruction stream (GPipe, 1F1B, interleaved 1F1B, Chimera, or a saved "
      "schedule); --kfac runs K-FAC in the pipeline's bubbles (PipeFisher). Under mpirun, one "
      "process per worker and replica (mpirun -np stages x data-parallel).",
      "pipefisher_train"};
  pf::train::TrainOptions options;
  pf::train::add_train_options(app, options);
  const bool root = launch.is_root();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    if (error.get_exit_code() == 0) return root ? app.exit(error) : 0;  // --help
    if (root) std::cerr << "pipefisher_train: error: " << error.what() << " (see --help)\n";
    return pf::kExitBadInput;
  }
  std::ostream quiet(nullptr);  // other ranks' output goes nowhere
  try {
    return pf::train::run_training(options, root ? std::cout : quiet, launch);
  } catch (const std::exception& error) {
    if (pf::is_input_error(error)) {
      // Every process checks the same input alike: rank 0 speaks for all.
      if (root) std::cerr << "pipefisher_train: error: " << error.what() << "\n";
      return pf::kExitBadInput;
    }
    std::cerr << "pipefisher_train: training failed: " << error.what() << "\n";
    return pf::kExitInternalError;
  }
}

}  // namespace

int main(int argc, char** argv) {
#if PF_HAVE_MPI
  if (pf::comm::MpiSession::launched_by_mpirun()) {
    std::optional<pf::comm::MpiSession> session;
    try {
      session.emplace(&argc, &argv);
    } catch (const std::exception& error) {
      std::cerr << "pipefisher_train: error: " << error.what() << "\n";
      return pf::kExitBadInput;
    }
    pf::comm::MpiCommunicator comm(*session);
    pf::train::MpiLaunch launch(comm, session->machine_of_rank());
    const int status = run(argc, argv, launch);
    // A failure after the ranks started together ends the job: the others would only wait.
    if (status == pf::kExitInternalError)
      comm.abort("pipefisher_train failed on this rank (see above)");
    return status;
  }
#endif
  pf::train::Launch threads;
  return run(argc, argv, threads);
}
