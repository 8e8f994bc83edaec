#include "runtime/device/device_spec.h"

#include <charconv>
#include <stdexcept>
#include <string>

namespace pf::device {

tensor::Device parse_device(std::string_view text) {
  const auto refuse = [&] {
    return std::invalid_argument("--device " + std::string(text) +
                                 ": expected cpu, cuda or cuda:N (N a device index >= 0)");
  };
  if (text == "cpu") return {tensor::DeviceKind::kCpu, 0};
  if (text == "cuda") return {tensor::DeviceKind::kCuda, 0};
  constexpr std::string_view kPrefix = "cuda:";
  if (!text.starts_with(kPrefix)) throw refuse();
  const std::string_view digits = text.substr(kPrefix.size());
  int index = -1;
  const auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), index);
  if (digits.empty() || error != std::errc() || end != digits.data() + digits.size() || index < 0) {
    throw refuse();
  }
  return {tensor::DeviceKind::kCuda, index};
}

}  // namespace pf::device
