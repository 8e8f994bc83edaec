#include "scheduler/placement.h"

#include <stdexcept>
#include <string>

#include "common/comma_list.h"

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

std::vector<int> parse_layer_counts(std::string_view text) {
  return parse_positive_int_list(text, "--layers-per-stage", kMaxLayers);
}

std::string format_layer_counts(const std::vector<int>& counts) {
  std::string text;
  for (std::size_t i = 0; i < counts.size(); ++i) {
    if (i > 0) text += ',';
    text += std::to_string(counts[i]);
  }
  return text;
}

namespace {

// The explicit per-chunk counts, checked against the placement's chunks and layers. num_layers
// is the requested total (0: the counts define it).
std::vector<int> explicit_layer_counts(const ScheduleParams& params, int chunks, int num_layers) {
  const std::vector<int>& counts = params.layers_per_chunk;
  const std::string flag = "--layers-per-stage " + format_layer_counts(counts);
  const std::string shape = std::to_string(params.workers) + " stages x " +
                            std::to_string(params.chunks_per_worker) + " chunk(s) per worker";
  if (static_cast<std::int64_t>(counts.size()) != chunks) {
    throw std::invalid_argument(flag + ": " + std::to_string(counts.size()) +
                                " counts, but a pipeline has " + std::to_string(chunks) +
                                " chunks (" + shape +
                                "); give one count per chunk, in chunk order");
  }
  std::int64_t sum = 0;
  for (std::size_t c = 0; c < counts.size(); ++c) {
    if (counts[c] < 1) {
      throw std::invalid_argument(flag + ": chunk " + std::to_string(c) + " gets " +
                                  std::to_string(counts[c]) +
                                  " layers; every chunk needs at least one");
    }
    sum += counts[c];
  }
  if (num_layers != 0 && sum != num_layers) {
    throw std::invalid_argument(flag + ": the counts sum to " + std::to_string(sum) +
                                " layers, but the model has " + std::to_string(num_layers) +
                                " encoder layers");
  }
  if (sum > kMaxLayers) {
    throw std::invalid_argument(flag + ": at most " + std::to_string(kMaxLayers) +
                                " layers, the counts sum to " + std::to_string(sum));
  }
  return counts;
}

}  // namespace

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
  std::vector<int> counts;
  if (params.layers_per_chunk.empty()) {
    placement.num_layers =
        params.num_layers == 0 ? placement.chunks_per_pipeline : params.num_layers;
    counts = balanced_layer_counts(placement.num_layers, placement.chunks_per_pipeline);
  } else {
    counts = explicit_layer_counts(params, placement.chunks_per_pipeline, params.num_layers);
    placement.num_layers = 0;
    for (const int count : counts) placement.num_layers += count;
  }
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
