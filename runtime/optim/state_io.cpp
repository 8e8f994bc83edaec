#include "runtime/optim/state_io.h"

#include <stdexcept>

namespace pf::optim {

std::string state_record_name(std::string_view prefix, std::string_view param,
                              std::string_view buffer) {
  return std::string(prefix) + "." + std::string(param) + "." + std::string(buffer);
}

ckpt::TensorRecord step_record(std::string_view prefix, std::int64_t steps) {
  const std::int64_t value[] = {steps};
  return ckpt::make_i64_record(std::string(prefix) + ".step", {1}, value);
}

std::int64_t read_step(const ckpt::SafetensorsFile& file, std::string_view prefix) {
  const std::int64_t shape[] = {1};
  const auto steps = ckpt::read_i64(file, std::string(prefix) + ".step", shape).at(0);
  if (steps < 0) {
    throw std::runtime_error("optimizer state '" + std::string(prefix) + ".step' is negative (" +
                             std::to_string(steps) + ")");
  }
  return steps;
}

std::vector<float> read_state_buffer(const ckpt::SafetensorsFile& file, std::string_view prefix,
                                     const ParamView& param, std::string_view buffer) {
  return ckpt::read_f32(file, state_record_name(prefix, param.name, buffer), param.shape);
}

}  // namespace pf::optim
