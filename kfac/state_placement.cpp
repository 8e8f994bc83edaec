#include "kfac/state_placement.h"

#include <algorithm>
#include <charconv>
#include <stdexcept>

namespace pf::kfac {
namespace {

constexpr std::int64_t kFloat = 4;
constexpr std::int64_t kDouble = 8;

std::int64_t square(std::int64_t d) {
  return d * d;
}

// Bytes member `position` of `n` sends in the executor's deterministic all-reduce of `count`
// elements of `element` bytes: every other owner's segment, then its own sum to n - 1 members.
std::int64_t all_reduce_sent(std::int64_t count, std::int64_t element, int n, int position) {
  if (n <= 1) return 0;
  const auto begin = [&](int s) { return count * s / n; };
  const std::int64_t own = begin(position + 1) - begin(position);
  return element * (count - own + static_cast<std::int64_t>(n - 1) * own);
}

std::vector<ComponentPlacement> component_choices(int replicas) {
  std::vector<ComponentPlacement> out = {{Placement::kReplicate, 0}};
  for (int g = 2; g < replicas; ++g) {
    if (replicas % g == 0) out.push_back({Placement::kPartial, g});
  }
  if (replicas > 1) out.push_back({Placement::kShard, 0});
  return out;
}

}  // namespace

int ComponentPlacement::holders(int replicas) const {
  switch (placement) {
    case Placement::kReplicate:
      return replicas;
    case Placement::kShard:
      return 1;
    case Placement::kPartial:
      return group;
  }
  return replicas;
}

StatePlacement uniform_placement(ComponentPlacement placement) {
  return {placement, placement};
}

std::string to_string(const ComponentPlacement& placement) {
  switch (placement.placement) {
    case Placement::kReplicate:
      return "replicate";
    case Placement::kShard:
      return "shard";
    case Placement::kPartial:
      return "partial:" + std::to_string(placement.group);
  }
  return "?";
}

std::string to_string(const StatePlacement& placement) {
  if (placement.factors == placement.inverses) return to_string(placement.factors);
  return "factors=" + to_string(placement.factors) + ",inverses=" + to_string(placement.inverses);
}

ShardingChoice parse_kfac_sharding(std::string_view text) {
  const auto fail = [&] {
    return std::invalid_argument("--kfac-sharding: '" + std::string(text) +
                                 "' is not one of auto, replicate, shard, partial:G (G >= 1), "
                                 "factors=P,inverses=P (P one of replicate, shard, partial:G)");
  };
  ShardingChoice choice;
  if (text == "auto") {
    choice.automatic = true;
    return choice;
  }
  // Each component its own (what to_string writes for them, e.g. a placement auto chose).
  constexpr std::string_view kFactors = "factors=", kInverses = ",inverses=";
  if (text.substr(0, kFactors.size()) == kFactors) {
    const auto split = text.find(kInverses);
    if (split == std::string_view::npos) throw fail();
    const auto component = [&](std::string_view part) {
      if (part == "auto" || part.substr(0, kFactors.size()) == kFactors) throw fail();
      return parse_kfac_sharding(part).placement.factors;
    };
    try {
      choice.placement.factors = component(text.substr(kFactors.size(), split - kFactors.size()));
      choice.placement.inverses = component(text.substr(split + kInverses.size()));
    } catch (const std::invalid_argument&) {
      throw fail();
    }
    return choice;
  }
  if (text == "replicate") return choice;
  if (text == "shard") {
    choice.placement = uniform_placement({Placement::kShard, 0});
    return choice;
  }
  constexpr std::string_view kPartial = "partial:";
  if (text.substr(0, kPartial.size()) != kPartial) throw fail();
  const auto digits = text.substr(kPartial.size());
  int group = 0;
  const auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), group);
  if (error != std::errc() || end != digits.data() + digits.size() || group < 1) throw fail();
  choice.placement = uniform_placement({Placement::kPartial, group});
  return choice;
}

void validate_placement(const StatePlacement& placement, int replicas) {
  if (replicas < 1) {
    throw std::invalid_argument("K-FAC placement: data-parallel replicas must be >= 1, got " +
                                std::to_string(replicas));
  }
  for (const auto* component : {&placement.factors, &placement.inverses}) {
    if (component->placement != Placement::kPartial) continue;
    if (component->group < 1 || replicas % component->group != 0) {
      throw std::invalid_argument("--kfac-sharding: " + to_string(*component) +
                                  " needs a group size dividing the " + std::to_string(replicas) +
                                  " data-parallel replica(s)");
    }
  }
  const int factor_holders = placement.factors.holders(replicas);
  const int inverse_holders = placement.inverses.holders(replicas);
  if (inverse_holders % factor_holders != 0) {
    throw std::invalid_argument(
        "--kfac-sharding: " + to_string(placement) + ": the factor holders (" +
        std::to_string(factor_holders) + " per layer) must nest inside the inverse holders (" +
        std::to_string(inverse_holders) + "), which compute their inverses");
  }
}

std::vector<int> LayerPlacement::inverse_broadcast_group() const {
  std::vector<int> group = {owner};
  for (int r = inverse_first; r < inverse_first + inverse_count; ++r) {
    if (!holds_factors(r)) group.push_back(r);
  }
  std::sort(group.begin(), group.end());
  return group;
}

std::vector<int> LayerPlacement::gradient_broadcast_group(int replicas) const {
  std::vector<int> group = {owner};
  for (int r = 0; r < replicas; ++r) {
    if (!holds_inverses(r)) group.push_back(r);
  }
  std::sort(group.begin(), group.end());
  return group;
}

StatePlan plan_state(std::span<const LinearDims> layers, int replicas,
                     const StatePlacement& placement) {
  validate_placement(placement, replicas);
  const int factor_group = placement.factors.holders(replicas);
  const int inverse_group = placement.inverses.holders(replicas);
  std::vector<double> costs;
  costs.reserve(layers.size());
  for (const auto& dims : layers) {
    if (dims.d_in <= 0 || dims.d_out <= 0) {
      throw std::invalid_argument("K-FAC placement: Linear " + std::to_string(costs.size()) +
                                  " has a non-positive dimension");
    }
    costs.push_back(inversion_flops(dims));
  }
  // Inverting groups: replicas / factor_group of them, each inverting the layers given to it.
  const auto group_of = assign_greedy(costs, replicas / factor_group);
  StatePlan plan;
  plan.replicas = replicas;
  plan.placement = placement;
  for (std::size_t i = 0; i < layers.size(); ++i) {
    LayerPlacement layer;
    layer.owner = group_of[i] * factor_group;
    layer.factor_first = layer.owner;
    layer.factor_count = factor_group;
    layer.inverse_first = layer.owner / inverse_group * inverse_group;
    layer.inverse_count = inverse_group;
    plan.layers.push_back(layer);
  }
  return plan;
}

std::int64_t StateCost::max_memory_bytes() const {
  return memory_bytes.empty() ? 0 : *std::max_element(memory_bytes.begin(), memory_bytes.end());
}
std::int64_t StateCost::max_sent_bytes() const {
  return sent_bytes_per_refresh.empty()
             ? 0
             : *std::max_element(sent_bytes_per_refresh.begin(), sent_bytes_per_refresh.end());
}
std::int64_t StateCost::total_sent_bytes() const {
  std::int64_t total = 0;
  for (auto bytes : sent_bytes_per_refresh) total += bytes;
  return total;
}
double StateCost::max_inversion_flops() const {
  return inversion_flops.empty()
             ? 0.0
             : *std::max_element(inversion_flops.begin(), inversion_flops.end());
}

StateCost state_cost(const StatePlan& plan, std::span<const LinearDims> layers, int refresh_steps) {
  if (layers.size() != plan.layers.size()) {
    throw std::invalid_argument("state_cost: the plan has " + std::to_string(plan.layers.size()) +
                                " Linears, given " + std::to_string(layers.size()));
  }
  if (refresh_steps < 1) {
    throw std::invalid_argument("state_cost: refresh_steps must be >= 1, got " +
                                std::to_string(refresh_steps));
  }
  const int n = plan.replicas;
  const auto size = static_cast<std::size_t>(n);
  StateCost cost;
  cost.memory_bytes.assign(size, 0);
  cost.sent_bytes_per_refresh.assign(size, 0);
  cost.inversion_flops.assign(size, 0.0);
  for (std::size_t i = 0; i < layers.size(); ++i) {
    const auto& dims = layers[i];
    const auto& layer = plan.layers[i];
    const std::int64_t factor_bytes = kFloat * (square(dims.d_in) + square(dims.d_out));
    const std::int64_t gradient_bytes = kFloat * (dims.d_in * dims.d_out + dims.d_out);
    for (int r = 0; r < n; ++r) {
      const auto x = static_cast<std::size_t>(r);
      if (layer.holds_factors(r)) {
        cost.memory_bytes[x] += factor_bytes;
        cost.inversion_flops[x] += inversion_flops(dims);
      }
      if (layer.holds_inverses(r)) cost.memory_bytes[x] += factor_bytes;
      // The factor sync: A's and B's sums (float) and their micro-batch counts (one double).
      for (const std::int64_t d : {dims.d_in, dims.d_out}) {
        cost.sent_bytes_per_refresh[x] +=
            all_reduce_sent(square(d), kFloat, n, r) + all_reduce_sent(1, kDouble, n, r);
      }
    }
    const auto owner = static_cast<std::size_t>(layer.owner);
    if (layer.broadcasts_inverses()) {
      const auto members = static_cast<std::int64_t>(layer.inverse_broadcast_group().size());
      cost.sent_bytes_per_refresh[owner] += (members - 1) * factor_bytes;
    }
    if (layer.broadcasts_gradient(n)) {
      const auto members = static_cast<std::int64_t>(layer.gradient_broadcast_group(n).size());
      cost.sent_bytes_per_refresh[owner] += refresh_steps * (members - 1) * gradient_bytes;
    }
  }
  return cost;
}

double placement_seconds_per_step(const StateCost& cost, const StatePlan& plan,
                                  const PlacementMachine& machine, int refresh_steps) {
  const int n = plan.replicas;
  std::vector<double> messages(static_cast<std::size_t>(n), 0.0);
  for (const auto& layer : plan.layers) {
    for (int r = 0; r < n; ++r) {
      messages[static_cast<std::size_t>(r)] += 4.0 * 2.0 * (n - 1);  // four all-reduces
    }
    const auto owner = static_cast<std::size_t>(layer.owner);
    if (layer.broadcasts_inverses()) {
      messages[owner] += 2.0 * static_cast<double>(layer.inverse_broadcast_group().size() - 1);
    }
    if (layer.broadcasts_gradient(n)) {
      messages[owner] +=
          2.0 * refresh_steps * static_cast<double>(layer.gradient_broadcast_group(n).size() - 1);
    }
  }
  double worst = 0.0;
  for (int r = 0; r < n; ++r) {
    const auto x = static_cast<std::size_t>(r);
    const double seconds =
        static_cast<double>(cost.sent_bytes_per_refresh[x]) / machine.link_bandwidth +
        messages[x] * machine.link_latency_s + cost.inversion_flops[x] / machine.inversion_flops;
    worst = std::max(worst, seconds);
  }
  return worst / refresh_steps;
}

PlacementChoice choose_state_placement(std::span<const std::vector<LinearDims>> workers,
                                       int replicas, int refresh_steps,
                                       const PlacementMachine& machine) {
  if (!(machine.link_bandwidth > 0.0) || !(machine.inversion_flops > 0.0) ||
      !(machine.link_latency_s >= 0.0) || !(machine.memory_budget_bytes >= 0.0)) {
    throw std::invalid_argument(
        "choose_state_placement: bandwidth and FLOP rate must be > 0, latency and budget >= 0");
  }
  PlacementChoice choice;
  const auto factor_choices = component_choices(replicas);
  for (const auto& factors : factor_choices) {
    for (const auto& inverses : component_choices(replicas)) {
      const StatePlacement placement{factors, inverses};
      if (inverses.holders(replicas) % factors.holders(replicas) != 0) continue;
      PlacementCandidate candidate;
      candidate.placement = placement;
      candidate.cost.memory_bytes.assign(static_cast<std::size_t>(replicas), 0);
      candidate.cost.sent_bytes_per_refresh.assign(static_cast<std::size_t>(replicas), 0);
      candidate.cost.inversion_flops.assign(static_cast<std::size_t>(replicas), 0.0);
      for (const auto& layers : workers) {
        const auto plan = plan_state(layers, replicas, placement);
        const auto cost = state_cost(plan, layers, refresh_steps);
        const double seconds = placement_seconds_per_step(cost, plan, machine, refresh_steps);
        // The busiest worker sets the step; the largest worker's memory the budget.
        if (seconds > candidate.seconds_per_step) candidate.seconds_per_step = seconds;
        if (cost.max_memory_bytes() > candidate.cost.max_memory_bytes()) {
          candidate.cost = cost;
        }
      }
      candidate.within_budget =
          machine.memory_budget_bytes <= 0.0 ||
          static_cast<double>(candidate.cost.max_memory_bytes()) <= machine.memory_budget_bytes;
      choice.candidates.push_back(std::move(candidate));
    }
  }
  const PlacementCandidate* best = nullptr;
  for (const auto& candidate : choice.candidates) {
    if (!candidate.within_budget) continue;
    if (best == nullptr || candidate.seconds_per_step < best->seconds_per_step ||
        (candidate.seconds_per_step == best->seconds_per_step &&
         candidate.cost.max_memory_bytes() < best->cost.max_memory_bytes())) {
      best = &candidate;
    }
  }
  if (best == nullptr) {
    // Nothing fits: the least memory wins (the budget is a preference, not a refusal).
    for (const auto& candidate : choice.candidates) {
      if (best == nullptr || candidate.cost.max_memory_bytes() < best->cost.max_memory_bytes()) {
        best = &candidate;
      }
    }
  }
  if (best == nullptr) throw std::invalid_argument("choose_state_placement: no candidate");
  choice.chosen = best->placement;
  return choice;
}

}  // namespace pf::kfac
