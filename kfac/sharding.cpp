#include "kfac/sharding.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>
#include <string>

namespace pf::kfac {

std::vector<int> assign_greedy(std::span<const double> costs, int workers) {
  if (workers < 1) {
    throw std::invalid_argument("assign_greedy: need at least one worker, got " +
                                std::to_string(workers));
  }
  for (std::size_t i = 0; i < costs.size(); ++i) {
    if (!(costs[i] >= 0.0) || !std::isfinite(costs[i])) {
      throw std::invalid_argument("assign_greedy: cost of item " + std::to_string(i) + " is " +
                                  std::to_string(costs[i]));
    }
  }
  std::vector<std::size_t> order(costs.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t x, std::size_t y) { return costs[x] > costs[y]; });
  std::vector<double> load(static_cast<std::size_t>(workers), 0.0);
  std::vector<int> owner(costs.size(), 0);
  for (const auto item : order) {
    const auto least = std::min_element(load.begin(), load.end()) - load.begin();
    owner[item] = static_cast<int>(least);
    load[static_cast<std::size_t>(least)] += costs[item];
  }
  return owner;
}

double inversion_flops(LinearDims dims) {
  const auto cube = [](std::int64_t d) {
    const auto x = static_cast<double>(d);
    return x * x * x;
  };
  return cube(dims.d_in) + cube(dims.d_out);  // (1/3 + 2/3) d^3 per factor
}

KfacShardingPlan plan_kfac_sharding(std::span<const LinearDims> layers, int world_size,
                                    double grad_worker_fraction) {
  if (world_size < 1) {
    throw std::invalid_argument("plan_kfac_sharding: world_size must be >= 1, got " +
                                std::to_string(world_size));
  }
  if (!(grad_worker_fraction > 0.0 && grad_worker_fraction <= 1.0)) {
    throw std::invalid_argument(
        "plan_kfac_sharding: grad_worker_fraction must lie in (0, 1], got " +
        std::to_string(grad_worker_fraction));
  }
  const int grad_workers =
      std::max(1, static_cast<int>(std::lround(grad_worker_fraction * world_size)));
  if (world_size % grad_workers != 0) {
    throw std::invalid_argument("plan_kfac_sharding: " + std::to_string(grad_workers) +
                                " grad workers per layer do not divide " +
                                std::to_string(world_size) + " replicas");
  }
  KfacShardingPlan plan;
  plan.world_size = world_size;
  plan.grad_workers = grad_workers;
  std::vector<double> costs;
  costs.reserve(layers.size());
  for (const auto& dims : layers) {
    if (dims.d_in <= 0 || dims.d_out <= 0) {
      throw std::invalid_argument("plan_kfac_sharding: layer " + std::to_string(costs.size()) +
                                  " has a non-positive dimension");
    }
    costs.push_back(inversion_flops(dims));
  }
  plan.inverse_worker = assign_greedy(costs, world_size);
  plan.inversion_load.assign(static_cast<std::size_t>(world_size), 0.0);
  plan.inverse_bytes.assign(static_cast<std::size_t>(world_size), 0);
  for (std::size_t i = 0; i < layers.size(); ++i) {
    const int owner = plan.inverse_worker[i];
    plan.inversion_load[static_cast<std::size_t>(owner)] += costs[i];
    const int first = owner / grad_workers * grad_workers;
    std::vector<int> ranks(static_cast<std::size_t>(grad_workers));
    std::iota(ranks.begin(), ranks.end(), first);
    const auto bytes = static_cast<std::int64_t>(sizeof(float)) *
                       (layers[i].d_in * layers[i].d_in + layers[i].d_out * layers[i].d_out);
    for (const int rank : ranks) plan.inverse_bytes[static_cast<std::size_t>(rank)] += bytes;
    plan.grad_worker_ranks.push_back(std::move(ranks));
  }
  return plan;
}

}  // namespace pf::kfac
