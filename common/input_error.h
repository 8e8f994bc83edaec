#pragma once
// Bad input: a file, a field of a file, or a command-line value that is missing, malformed or out
// of range. Readers of binary and text files throw it (JSON readers throw std::invalid_argument,
// which the programs treat the same way); the programs turn both into exit status 2
// (common/exit_codes.h). It derives from std::runtime_error so that callers written against the
// readers' earlier std::runtime_error keep working.
#include <stdexcept>
#include <string>

namespace pf {

class InputError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace pf
