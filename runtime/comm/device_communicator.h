#pragma once
// A communicator that moves device memory itself (NCCL) on its own device stream. Beyond the
// Communicator interface (whose spans may then point to device memory), the executor orders the
// communicator's stream with its compute stream by events, so that no host thread waits on the
// critical path:
//   producer stream --event--> communicator stream (sends, reductions read the data)
//   communicator stream --event--> consumer stream (received data, reduced gradients)
// Host memory is accepted too (staged through device memory, and waited for on the host).
#include <span>
#include <string>

#include "runtime/comm/communicator.h"
#include "runtime/tensor/backend.h"

namespace pf::comm {

class DeviceCommunicator : public Communicator {
 public:
  // The communicator's operations issued from now on start on the device only after `ready`
  // (recorded on the producing stream) has completed. The host does not wait.
  virtual void wait_on_device(const tensor::Event& ready) = 0;
  // `stream`'s later work waits (on the device) for every operation issued so far.
  virtual void order_before(tensor::Stream& stream) = 0;
  // `stream`'s later work waits (on the device) for `request` (a receive has landed). The
  // watchdog still guards the request's deadline.
  virtual void order_before(Request& request, tensor::Stream& stream) = 0;
  // Enqueues the in-place sum of device memory over `group` and returns at once; consumers
  // order themselves after it with order_before. A stuck or failed reduction surfaces through
  // the watchdog at a later call, naming the instruction it was issued for.
  virtual void all_reduce_sum_async(std::span<float> device_data, std::span<const int> group,
                                    Deadline deadline) = 0;
  // The stream position and instruction that the following operations are issued for (the
  // watchdog's messages name them); position -1: outside the stream.
  virtual void set_activity(int position, std::string instruction) = 0;
};

}  // namespace pf::comm
