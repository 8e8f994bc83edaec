#pragma once
// The one exit-status convention of every program in the project (README "Exit status"):
//   0  success
//   1  internal failure: a bug, an exhausted resource (std::bad_alloc), a device or library error
//   2  bad input or usage: a missing or malformed file, a field out of range, a wrong option
// Programs catch everything in main, print one line "<program>: error: <what>" (the message names
// the file, the field, the value and what is allowed) and return exit_code_for(error).
#include <exception>
#include <filesystem>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "common/input_error.h"

namespace pf {

inline constexpr int kExitSuccess = 0;
inline constexpr int kExitInternalError = 1;
inline constexpr int kExitBadInput = 2;

// Bad input: our readers' errors (std::invalid_argument, pf::InputError), an index from the input
// out of range (std::out_of_range), a path the user named that the file system refuses, and a
// JSON document that a reader let through to nlohmann's own checks.
inline bool is_input_error(const std::exception& error) {
  return dynamic_cast<const InputError*>(&error) != nullptr ||
         dynamic_cast<const std::invalid_argument*>(&error) != nullptr ||
         dynamic_cast<const std::out_of_range*>(&error) != nullptr ||
         dynamic_cast<const std::filesystem::filesystem_error*>(&error) != nullptr ||
         dynamic_cast<const nlohmann::json::exception*>(&error) != nullptr;
}

inline int exit_code_for(const std::exception& error) {
  return is_input_error(error) ? kExitBadInput : kExitInternalError;
}

}  // namespace pf
