#pragma once
// The message of the std::invalid_argument an action throws, "(no error)" when it throws none:
// the simulator's tests check that bad input is refused with a message naming what is wrong.
#include <functional>
#include <stdexcept>
#include <string>

namespace pf::sim::test {

inline std::string error_of(const std::function<void()>& action) {
  try {
    action();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace pf::sim::test
