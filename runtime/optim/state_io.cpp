#include "runtime/optim/state_io.h"

#include <stdexcept>
#include <type_traits>

#include "common/input_error.h"

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
    throw InputError("safetensors '" + file.source + "': optimizer state '" + std::string(prefix) +
                     ".step' is negative (" + std::to_string(steps) + ")");
  }
  return steps;
}

template <typename T>
ckpt::TensorRecord state_buffer_record(std::string_view prefix, std::string_view param,
                                       std::string_view buffer, std::vector<std::int64_t> shape,
                                       std::span<const T> values) {
  auto name = state_record_name(prefix, param, buffer);
  if constexpr (std::is_same_v<T, float>) {
    return ckpt::make_f32_record(std::move(name), std::move(shape), values);
  } else {
    return ckpt::make_f64_record(std::move(name), std::move(shape), values);
  }
}

template <typename T>
std::vector<T> read_state_buffer(const ckpt::SafetensorsFile& file, std::string_view prefix,
                                 const BasicParamView<T>& param, std::string_view buffer) {
  const auto name = state_record_name(prefix, param.name, buffer);
  if constexpr (std::is_same_v<T, float>) {
    return ckpt::read_f32(file, name, param.shape);
  } else {
    return ckpt::read_f64(file, name, param.shape);
  }
}

template <typename T>
AdamMoments<T>& moments_for(AdamMomentsMap<T>& moments, const BasicParamView<T>& param,
                            std::string_view optimizer) {
  auto [it, inserted] = moments.try_emplace(param.name);
  auto& state = it->second;
  if (inserted) {
    state.exp_avg.assign(param.size, T{0});
    state.exp_avg_sq.assign(param.size, T{0});
    state.shape = param.shape;
  } else if (state.exp_avg.size() != param.size) {
    throw std::invalid_argument(std::string(optimizer) + ": parameter '" + param.name +
                                "' changed size from " + std::to_string(state.exp_avg.size()) +
                                " to " + std::to_string(param.size));
  }
  return state;
}

template <typename T>
std::vector<ckpt::TensorRecord> adam_moment_records(std::string_view prefix, std::int64_t steps,
                                                    const AdamMomentsMap<T>& moments) {
  std::vector<ckpt::TensorRecord> records{step_record(prefix, steps)};
  for (const auto& [name, state] : moments) {
    records.push_back(state_buffer_record<T>(prefix, name, "exp_avg", state.shape, state.exp_avg));
    records.push_back(
        state_buffer_record<T>(prefix, name, "exp_avg_sq", state.shape, state.exp_avg_sq));
  }
  return records;
}

template <typename T>
AdamMomentsMap<T> read_adam_moments(const ckpt::SafetensorsFile& file,
                                    std::span<const BasicParamView<T>> params,
                                    std::string_view prefix, std::int64_t& steps) {
  steps = read_step(file, prefix);
  AdamMomentsMap<T> moments;
  if (steps > 0) {
    for (const auto& param : params) {
      moments[param.name] =
          AdamMoments<T>{read_state_buffer(file, prefix, param, "exp_avg"),
                         read_state_buffer(file, prefix, param, "exp_avg_sq"), param.shape};
    }
  }
  return moments;
}

#define PF_INSTANTIATE_STATE_IO(T)                                                                \
  template ckpt::TensorRecord state_buffer_record<T>(std::string_view, std::string_view,          \
                                                     std::string_view, std::vector<std::int64_t>, \
                                                     std::span<const T>);                         \
  template std::vector<T> read_state_buffer<T>(const ckpt::SafetensorsFile&, std::string_view,    \
                                               const BasicParamView<T>&, std::string_view);       \
  template AdamMoments<T>& moments_for<T>(AdamMomentsMap<T>&, const BasicParamView<T>&,           \
                                          std::string_view);                                      \
  template std::vector<ckpt::TensorRecord> adam_moment_records<T>(std::string_view, std::int64_t, \
                                                                  const AdamMomentsMap<T>&);      \
  template AdamMomentsMap<T> read_adam_moments<T>(const ckpt::SafetensorsFile&,                   \
                                                  std::span<const BasicParamView<T>>,             \
                                                  std::string_view, std::int64_t&);
PF_INSTANTIATE_STATE_IO(float)
PF_INSTANTIATE_STATE_IO(double)
#undef PF_INSTANTIATE_STATE_IO

}  // namespace pf::optim
