#pragma once
// Which device a run uses, as the command line spells it: "cpu", "cuda" (device 0) or
// "cuda:N". Pure parsing, no device access (what exists is open_device_runtime's business).
#include <string_view>

#include "runtime/tensor/backend.h"

namespace pf::device {

// Throws std::invalid_argument naming the value and what is allowed.
tensor::Device parse_device(std::string_view text);

}  // namespace pf::device
