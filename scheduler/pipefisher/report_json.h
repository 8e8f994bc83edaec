#pragma once
// The PipeFisher pass's report as JSON (the `kfac` object of pipefisher_sim --report).
#include <nlohmann/json.hpp>

#include "scheduler/pipefisher/pass.h"

namespace pf::pipefisher {

nlohmann::json to_json(const KfacReport& report);

}  // namespace pf::pipefisher
