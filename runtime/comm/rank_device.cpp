#include "runtime/comm/rank_device.h"

#include <stdexcept>
#include <string>

namespace pf::comm {

int device_for_local_rank(int rank, int local_rank, int devices, bool share_devices) {
  const std::string who = "rank " + std::to_string(rank) + " (local rank " +
                          std::to_string(local_rank) + " on its node)";
  if (local_rank < 0) throw std::invalid_argument(who + ": the local rank is negative");
  if (devices <= 0) throw std::invalid_argument(who + ": no CUDA device is visible");
  if (local_rank < devices) return local_rank;
  if (share_devices) return local_rank % devices;
  throw std::invalid_argument(who + ": only " + std::to_string(devices) +
                              " GPU(s) visible on its node; start at most one rank per GPU "
                              "(mpirun -np <nodes x GPUs per node>)");
}

}  // namespace pf::comm
