#pragma once
// Device-to-device messages between workers of one process that share a device (p pipeline
// workers on one GPU). The payload never leaves the device: the sender fills a device buffer on
// one of its streams, records `ready` there and posts both here; the communicator then carries
// only the 8-byte ticket, so its matching (peer, tag), ordering, deadlines and aborts apply
// unchanged. The receiver takes the message by ticket and makes its consuming stream wait on
// `ready` before reading the buffer, which stays alive as long as the receiver holds it.
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

#include "runtime/tensor/backend.h"
#include "runtime/tensor/tensor.h"

namespace pf::device {

struct DeviceMessage {
  tensor::Tensor data;
  std::shared_ptr<tensor::Event> ready;  // recorded after the last write of `data`
};

class MessageExchange {
 public:
  // Thread-safe. Tickets are never reused (a 64-bit counter from 1).
  std::uint64_t post(DeviceMessage message);
  // Throws std::runtime_error naming the ticket when it was never posted or already taken.
  DeviceMessage take(std::uint64_t ticket);
  std::size_t pending() const;

 private:
  mutable std::mutex mutex_;
  std::uint64_t next_ = 1;
  std::map<std::uint64_t, DeviceMessage> messages_;
};

}  // namespace pf::device
