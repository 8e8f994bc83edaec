// The libFuzzer harness of one parser: PF_FUZZ_TARGET names its entry point in fuzz_targets.cpp
// (CMakeLists.txt builds fuzz_<target> for each). A finding is anything run_target lets escape,
// or a sanitizer report; scripts/fuzz.sh runs them.
#include <cstddef>
#include <cstdint>

#include "tests/fuzz/fuzz_targets.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const pf::fuzz::Target& target = pf::fuzz::target_named(PF_FUZZ_TARGET);
  (void)pf::fuzz::run_target(target, {data, size});
  return 0;
}
