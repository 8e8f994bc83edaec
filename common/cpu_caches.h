#pragma once
// The data and unified cache levels of this machine's first CPU, as sysfs lists them (Linux:
// /sys/devices/system/cpu/cpu0/cache/indexN/{level,type,size}). The simulator's start device for
// this CPU places the memory class's two bandwidth cliffs at its L2 and last-level cache
// (sim/cpu_device.h); bench_sim_calibrate records them beside its measurements. Header-only:
// common/ has no library of its own.
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

namespace pf {

struct CacheLevel {
  int level = 0;
  double bytes = 0.0;
};

// A sysfs size ("48K", "2048K", "32M", "1G" or a plain byte count) in bytes; 0 when it is not one.
inline double cache_size_bytes(const std::string& text) {
  if (text.empty()) return 0.0;
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  if (end == text.c_str() || !(value > 0.0)) return 0.0;
  const std::string unit(end);
  if (unit.empty()) return value;
  if (unit == "K") return value * 1024.0;
  if (unit == "M") return value * 1024.0 * 1024.0;
  if (unit == "G") return value * 1024.0 * 1024.0 * 1024.0;
  return 0.0;
}

// Innermost first; instruction caches and entries without a readable size are left out. Empty
// where the directory does not exist (another operating system, a sandbox without sysfs).
inline std::vector<CacheLevel> cpu_data_caches(
    const std::string& directory = "/sys/devices/system/cpu/cpu0/cache") {
  std::vector<CacheLevel> levels;
  for (int index = 0; index < 16; ++index) {
    const std::string dir = directory + "/index" + std::to_string(index);
    std::ifstream level_file(dir + "/level"), type_file(dir + "/type"), size_file(dir + "/size");
    if (!level_file || !type_file || !size_file) break;
    CacheLevel cache;
    std::string type, size;
    level_file >> cache.level;
    type_file >> type;
    size_file >> size;
    cache.bytes = cache_size_bytes(size);
    if (type == "Instruction" || cache.bytes <= 0.0 || cache.level <= 0) continue;
    levels.push_back(cache);
  }
  return levels;
}

}  // namespace pf
