#pragma once
// The packer before its best-fit index (a linear scan of the step per item): the reference that
// tests compare the indexed packer's placements with, item for item.
#include <vector>

#include "scheduler/pipefisher/packer.h"

namespace pf::pipefisher::reference {

PackResult pack(const PackProblem& problem, const std::vector<PackItem>& items,
                PackingPolicy policy, double safety_margin);

}  // namespace pf::pipefisher::reference
