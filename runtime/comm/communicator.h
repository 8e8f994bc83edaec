#pragma once
// How workers talk: point-to-point messages matched by (peer, tag = the schedule's pair id),
// and collectives over an explicit group of ranks. The executor sees only this interface, so
// threads (InProcessWorld), MPI processes and NCCL on GPUs can sit behind it.
//
// Every blocking call takes a deadline and throws TimeoutError when it passes, AbortedError when
// another rank has failed and called abort(): distributed code never hangs.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace pf::comm {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

// A wait ran past its deadline; what() says what was awaited.
class TimeoutError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
// The run was aborted by another rank's failure; what() carries that rank's reason.
class AbortedError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// An outstanding send or receive.
class Request {
 public:
  virtual ~Request() = default;
  Request() = default;
  Request(const Request&) = delete;
  Request& operator=(const Request&) = delete;
  // True once the operation has completed (a receive's buffer holds the data).
  virtual bool test() = 0;
  // Blocks until completion; throws TimeoutError / AbortedError.
  virtual void wait(Deadline deadline) = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  virtual int rank() const = 0;
  virtual int size() const = 0;

  // Messages between one (sender, receiver) pair with one tag are delivered in the order sent
  // (MPI's non-overtaking rule), so pair ids may repeat from one training step to the next.
  // The send's data may be reused as soon as the request completes.
  virtual std::unique_ptr<Request> isend(int peer, std::int64_t tag,
                                         std::span<const std::byte> data) = 0;
  // The receive's buffer must stay alive until the request completes; a message of another
  // size is an error naming both sizes.
  virtual std::unique_ptr<Request> irecv(int peer, std::int64_t tag, std::span<std::byte> data) = 0;

  // In-place sum over `group` (distinct ranks in ascending order, this rank among them). The
  // members add in ascending rank order, so every member gets the same bits. Every member must
  // make its collectives over a given group in the same order.
  virtual void all_reduce_sum(std::span<float> data, std::span<const int> group,
                              Deadline deadline) = 0;
  virtual void all_reduce_sum(std::span<double> data, std::span<const int> group,
                              Deadline deadline) = 0;
  // The same sum, started now and finished later (data-parallel gradient buckets overlapping
  // the backward): the request completes when every member has issued it, and its completion
  // (test() returning true, or wait()) writes the sum into `data`, bit-identical to
  // all_reduce_sum's. `data` must stay alive and unchanged until then. It takes its place in
  // the group's order of collectives when issued, like a blocking collective; requests on one
  // group may be completed in any order. Destroying an unfinished request abandons it (the
  // other members' waits end in an error). The base implementation, for communicators without
  // a non-blocking collective, sums at once (with `deadline`) and returns a completed request.
  virtual std::unique_ptr<Request> iall_reduce_sum(std::span<float> data,
                                                   std::span<const int> group, Deadline deadline);
  virtual std::unique_ptr<Request> iall_reduce_sum(std::span<double> data,
                                                   std::span<const int> group, Deadline deadline);
  // root's data to every member of `group`.
  virtual void broadcast(std::span<std::byte> data, int root, std::span<const int> group,
                         Deadline deadline) = 0;

  // Makes every current and future blocking call of every rank throw AbortedError(reason).
  virtual void abort(const std::string& reason) = 0;

  // Payload bytes this rank has handed to the transport (sends and the collectives' parts,
  // without their headers; a non-blocking collective's all counted when it is issued), or -1
  // where nothing crosses a wire (threads of one process).
  virtual std::int64_t payload_bytes_sent() const { return -1; }
};

// "{0, 2, 3}"
std::string group_to_string(std::span<const int> group);

}  // namespace pf::comm
