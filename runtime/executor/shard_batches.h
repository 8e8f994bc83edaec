#pragma once
// Micro-batches from pretraining shards (runtime/data): one streaming loader per data-parallel
// replica (a disjoint split of the data), read in step order — replica r's micro-batches of step
// t are the loader's micro-batches t*m .. t*m+m-1 counted from the start position — and cached
// until the executor releases the step.
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "runtime/data/loader.h"
#include "runtime/executor/batch_source.h"

namespace pf::exec {

// The model's batch layout from a loader's micro-batch.
model::Batch to_model_batch(const data::MicroBatch& micro);

class ShardBatches final : public BatchSource {
 public:
  // options.replica_rank/replica_count are set per replica. starts: one position per replica
  // (resume) or empty; first_step: the global step of the first micro-batches read.
  ShardBatches(data::LoaderOptions options, int replicas, int microbatches_per_replica,
               std::vector<data::LoaderPosition> starts, std::int64_t first_step);
  ~ShardBatches() override;

  std::shared_ptr<const model::Batch> batch(std::int64_t step, int index) override;
  void release_before(std::int64_t step) override;

  // Where each replica's stream stands after step `step` (which must have been read): the
  // positions a checkpoint taken after that step resumes from.
  std::vector<data::LoaderPosition> positions_after(std::int64_t step);
  // The same for one replica (a process under MPI reads its own replica's stream only).
  data::LoaderPosition position_after(std::int64_t step, int replica);
  const data::ShardLoader& loader(int replica) const;

 private:
  struct Replica {
    std::unique_ptr<data::ShardLoader> loader;
    std::int64_t next_step = 0;  // the next step to read
    std::map<std::int64_t, std::vector<std::shared_ptr<const model::Batch>>> steps;
    std::map<std::int64_t, data::LoaderPosition> positions;
  };
  void read_through(Replica& replica, std::int64_t step);

  int microbatches_;
  std::mutex mutex_;
  std::vector<Replica> replicas_;
};

}  // namespace pf::exec
