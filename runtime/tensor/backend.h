#pragma once
// The device abstraction every compute backend implements: memory, copies, streams and events.
// Calls that take a Stream are asynchronous with respect to the host on devices that have
// streams (CUDA); the CPU backend runs them immediately and its streams and events are no-ops,
// so code written against this interface (record an event after a send, make the compute
// stream wait on it) is correct on both.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace pf::tensor {

enum class DeviceKind : std::uint8_t { kCpu, kCuda };

struct Device {
  DeviceKind kind = DeviceKind::kCpu;
  int index = 0;
  friend bool operator==(const Device&, const Device&) = default;
};
std::string to_string(const Device& device);  // "cpu", "cuda:0"

class Event;

// An ordered queue of device work. Work on one stream runs in issue order.
class Stream {
 public:
  virtual ~Stream() = default;
  virtual void synchronize() = 0;             // host waits for all work issued so far
  virtual void wait(const Event& event) = 0;  // later work on this stream waits for `event`
};

// A marker in a stream, to order work across streams and with the host.
class Event {
 public:
  virtual ~Event() = default;
  virtual void record(Stream& stream) = 0;  // completes when the stream's prior work has
  virtual void synchronize() const = 0;     // host waits for completion
  virtual bool completed() const = 0;       // non-blocking query
};

enum class CopyKind : std::uint8_t { kHostToDevice, kDeviceToHost, kDeviceToDevice };

struct AllocationStats {
  std::int64_t allocations = 0;  // calls to allocate over the backend's life
  std::int64_t bytes_in_use = 0;
  std::int64_t peak_bytes_in_use = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual Device device() const = 0;
  // Memory aligned to at least 64 bytes; throws std::bad_alloc (or a runtime_error naming the
  // device) when it cannot be had. deallocate takes the size that was allocated.
  virtual void* allocate(std::size_t bytes) = 0;
  virtual void deallocate(void* pointer, std::size_t bytes) noexcept = 0;
  // stream == nullptr means the backend's default stream.
  virtual void copy(void* destination, const void* source, std::size_t bytes, CopyKind kind,
                    Stream* stream = nullptr) = 0;
  virtual void fill_zero(void* destination, std::size_t bytes, Stream* stream = nullptr) = 0;
  virtual std::unique_ptr<Stream> create_stream() = 0;
  virtual std::unique_ptr<Event> create_event() = 0;
  virtual void synchronize() = 0;  // waits for all work on all streams of this backend
  virtual AllocationStats stats() const = 0;
};

}  // namespace pf::tensor
