// The random stream of CPython's random.Random(seed) (MT19937 seeded by init_by_array), so that
// instance creation draws the same numbers Google's create_pretraining_data.py draws.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

namespace pf::data {

class PythonRandom {
 public:
  explicit PythonRandom(std::uint64_t seed);

  std::uint32_t next_u32();
  // random.random(): 53-bit float in [0, 1).
  double random();
  // random.getrandbits(k) for 1 <= k <= 64.
  std::uint64_t getrandbits(int bits);
  // random.randint(low, high), both inclusive (low <= high).
  std::int64_t randint(std::int64_t low, std::int64_t high);
  // random.shuffle(items).
  template <class T>
  void shuffle(std::vector<T>& items) {
    for (std::size_t i = items.size(); i-- > 1;) {
      const auto j = static_cast<std::size_t>(below(i + 1));
      std::swap(items[i], items[j]);
    }
  }

  // random._randbelow(n) for n >= 1.
  std::uint64_t below(std::uint64_t n);

 private:
  void twist();

  static constexpr std::size_t kStateSize = 624;
  std::array<std::uint32_t, kStateSize> state_{};
  std::size_t index_ = kStateSize;
};

}  // namespace pf::data
