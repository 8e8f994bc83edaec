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

std::vector<ckpt::TensorRecord> adam_moment_records(std::string_view prefix, std::int64_t steps,
                                                    const AdamMomentsMap& moments) {
  std::vector<ckpt::TensorRecord> records{step_record(prefix, steps)};
  for (const auto& [name, state] : moments) {
    records.push_back(ckpt::make_f32_record(state_record_name(prefix, name, "exp_avg"), state.shape,
                                            state.exp_avg));
    records.push_back(ckpt::make_f32_record(state_record_name(prefix, name, "exp_avg_sq"),
                                            state.shape, state.exp_avg_sq));
  }
  return records;
}

AdamMomentsMap read_adam_moments(const ckpt::SafetensorsFile& file,
                                 std::span<const ParamView> params, std::string_view prefix,
                                 std::int64_t& steps) {
  steps = read_step(file, prefix);
  AdamMomentsMap moments;
  if (steps > 0) {
    for (const auto& param : params) {
      moments[param.name] =
          AdamMoments{read_state_buffer(file, prefix, param, "exp_avg"),
                      read_state_buffer(file, prefix, param, "exp_avg_sq"), param.shape};
    }
  }
  return moments;
}

}  // namespace pf::optim
