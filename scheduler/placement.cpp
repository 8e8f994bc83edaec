#include "scheduler/placement.h"

#include <stdexcept>
#include <string>

namespace pf::sched {

int num_pipelines(ScheduleKind kind) {
  return kind == ScheduleKind::kChimera ? 2 : 1;
}

int microbatches_per_pipeline(const ScheduleParams& params) {
  return params.microbatches / num_pipelines(params.kind);
}

bool uses_v_shape(const ScheduleParams& params) {
  return params.kind == ScheduleKind::kZeroBubbleV || params.v_shape;
}

int looped_worker(int chunk, int workers) {
  return chunk % workers;
}

int v_shape_worker(int chunk, int workers) {
  const int block = chunk / workers;
  const int offset = chunk % workers;
  return block % 2 == 0 ? offset : workers - 1 - offset;
}

std::vector<int> balanced_layer_counts(int num_layers, int num_chunks) {
  if (num_chunks <= 0) {
    throw std::invalid_argument("cannot place layers on " + std::to_string(num_chunks) +
                                " chunks: need at least one chunk");
  }
  if (num_layers < num_chunks) {
    throw std::invalid_argument("more chunks than layers: " + std::to_string(num_chunks) +
                                " chunks need at least " + std::to_string(num_chunks) +
                                " encoder layers, got " + std::to_string(num_layers));
  }
  std::vector<int> counts(static_cast<std::size_t>(num_chunks), num_layers / num_chunks);
  const int remainder = num_layers % num_chunks;
  for (int i = 0; i < remainder; ++i) {
    counts[static_cast<std::size_t>(num_chunks - 2 - i)] += 1;
  }
  return counts;
}

Placement make_placement(const ScheduleParams& params) {
  auto positive = [](int value, const char* what) {
    if (value <= 0) {
      throw std::invalid_argument(std::string(what) + " must be at least 1, got " +
                                  std::to_string(value));
    }
  };
  positive(params.workers, "workers (stages)");
  positive(params.chunks_per_worker, "chunks per worker");
  positive(params.microbatches, "micro-batches");
  positive(params.data_parallel, "data-parallel replicas");
  if (params.num_layers < 0) {
    throw std::invalid_argument("number of layers must be >= 0 (0 means one per chunk), got " +
                                std::to_string(params.num_layers));
  }
  if (params.num_layers > kMaxLayers) {
    throw std::invalid_argument("at most " + std::to_string(kMaxLayers) + " layers, got " +
                                std::to_string(params.num_layers));
  }
  if (std::int64_t{params.workers} * params.chunks_per_worker > kMaxChunks) {
    throw std::invalid_argument(
        "at most " + std::to_string(kMaxChunks) +
        " chunks per pipeline (stages x chunks per worker), got " +
        std::to_string(std::int64_t{params.workers} * params.chunks_per_worker));
  }
  const int pipelines = num_pipelines(params.kind);
  if (pipelines == 2 && params.chunks_per_worker != 1) {
    throw std::invalid_argument(
        "chimera holds exactly one chunk per worker and pipeline: chunks per worker must be 1, "
        "got " +
        std::to_string(params.chunks_per_worker));
  }
  const bool v_shape = uses_v_shape(params);
  if (pipelines == 2 && v_shape) {
    throw std::invalid_argument(
        "chimera's two pipelines have their own placement: a V-shaped placement is not allowed");
  }
  Placement placement;
  placement.num_pipelines = pipelines;
  placement.chunks_per_pipeline = params.workers * params.chunks_per_worker;
  placement.num_layers = params.num_layers == 0 ? placement.chunks_per_pipeline : params.num_layers;
  const std::vector<int> counts =
      balanced_layer_counts(placement.num_layers, placement.chunks_per_pipeline);
  placement.chunks.reserve(static_cast<std::size_t>(pipelines * placement.chunks_per_pipeline));
  for (int pipeline = 0; pipeline < pipelines; ++pipeline) {
    int first_layer = 0;
    for (int chunk = 0; chunk < placement.chunks_per_pipeline; ++chunk) {
      ChunkPlacement cp;
      cp.pipeline = pipeline;
      cp.chunk = chunk;
      if (pipeline == 1) {
        cp.worker = params.workers - 1 - chunk;
      } else {
        cp.worker =
            v_shape ? v_shape_worker(chunk, params.workers) : looped_worker(chunk, params.workers);
      }
      cp.first_layer = first_layer;
      cp.num_layers = counts[static_cast<std::size_t>(chunk)];
      cp.has_embeddings = chunk == 0;
      cp.has_head = chunk == placement.chunks_per_pipeline - 1;
      first_layer += cp.num_layers;
      placement.chunks.push_back(cp);
    }
  }
  return placement;
}

std::vector<std::vector<ChunkRef>> chunks_by_worker(const Placement& placement, int num_workers) {
  std::vector<std::vector<ChunkRef>> result(static_cast<std::size_t>(num_workers));
  for (const ChunkPlacement& cp : placement.chunks) {
    if (cp.worker < 0 || cp.worker >= num_workers) {
      throw std::invalid_argument("placement puts chunk " + std::to_string(cp.chunk) +
                                  " of pipeline " + std::to_string(cp.pipeline) + " on worker " +
                                  std::to_string(cp.worker) + ", but there are only " +
                                  std::to_string(num_workers) + " workers");
    }
    result[static_cast<std::size_t>(cp.worker)].push_back({cp.pipeline, cp.chunk});
  }
  return result;
}

}  // namespace pf::sched
