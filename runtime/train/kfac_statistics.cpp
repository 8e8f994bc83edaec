#include "runtime/train/kfac_statistics.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <list>
#include <map>
#include <tuple>
#include <vector>

namespace pf::train {

nlohmann::json kfac_statistics(exec::ThreadedExecutor<float>& executor) {
  const auto& schedule = executor.setup().schedule;
  // Chimera's second pipeline holds the same layers as the first; replica 0, pipeline 0..1.
  const int pipelines = schedule.params.kind == sched::ScheduleKind::kChimera ? 2 : 1;
  std::int64_t layers = 0, refreshes_min = -1, refreshes_max = 0, fallbacks = 0;
  std::vector<double> pis;
  double damping_a = 0.0, damping_b = 0.0;
  // Each Linear once, from a replica that holds its factors: with the state sharded across the
  // data-parallel replicas (--kfac-sharding) only the owner's group refreshes them.
  std::map<std::tuple<int, int, int>, const kfac::KfacLayerState*> held;
  // With offloaded Linears' matrices from host memory (--kfac-offload); kept while `held` points
  // into them.
  std::list<kfac::KfacState> states;
  for (int rank = 0; rank < executor.num_ranks(); ++rank) {
    for (int pipeline = 0; pipeline < pipelines; ++pipeline) {
      states.push_back(executor.worker(rank).kfac_state_with_offloaded(pipeline));
      for (const auto& [key, layer] : states.back().layers()) {
        auto& slot = held[{pipeline, key.layer, static_cast<int>(key.linear)}];
        if (slot == nullptr || (slot->a.refreshes == 0 && layer.a.refreshes > 0)) slot = &layer;
      }
    }
  }
  for (const auto& [key, held_layer] : held) {
    const auto& layer = *held_layer;
    ++layers;
    const std::int64_t refreshes = std::min(layer.a.refreshes, layer.b.refreshes);
    refreshes_min = refreshes_min < 0 ? refreshes : std::min(refreshes_min, refreshes);
    refreshes_max = std::max(refreshes_max, refreshes);
    fallbacks += layer.a.cholesky_fallbacks + layer.b.cholesky_fallbacks;
    if (layer.a.inverse.size() == 0 || layer.b.inverse.size() == 0) continue;
    if (layer.a.damping > 0 && layer.b.damping > 0) {
      pis.push_back(std::sqrt(static_cast<double>(layer.a.damping) / layer.b.damping));
    }
    damping_a += layer.a.damping;
    damping_b += layer.b.damping;
  }
  nlohmann::json stats = {{"layers", layers},
                          {"layers_inverted", pis.size()},
                          {"refreshes_min", std::max<std::int64_t>(refreshes_min, 0)},
                          {"refreshes_max", refreshes_max},
                          {"cholesky_fallbacks", fallbacks}};
  if (!pis.empty()) {
    std::sort(pis.begin(), pis.end());
    const auto inverted = static_cast<double>(pis.size());
    stats["pi_min"] = pis.front();
    stats["pi_median"] = pis[pis.size() / 2];
    stats["pi_max"] = pis.back();
    stats["damping_a_mean"] = damping_a / inverted;
    stats["damping_b_mean"] = damping_b / inverted;
  }
  return stats;
}

}  // namespace pf::train
