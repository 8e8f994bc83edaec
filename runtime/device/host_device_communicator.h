#pragma once
// A DeviceCommunicator for the HostDeviceRuntime (device memory = host memory, streams that run
// their work as it is issued): the executor's device-communicator path (the one NCCL takes on
// GPUs: buffers moved by the communicator itself, ordered with the worker's streams by events,
// reductions in place with no staging) run on the CPU over any host communicator (an
// InProcessWorld rank). Not a stand-in for NCCL: the ordering calls wait on the host, which is
// what host streams mean; it exists so that the executor's logic for that path is exercised and
// compared with the CPU path on machines without a GPU (tests/executor/test_executor_device).
#include <string>

#include "runtime/comm/device_communicator.h"

namespace pf::device {

class HostDeviceCommunicator final : public comm::DeviceCommunicator {
 public:
  // `inner` carries the bytes; `deadline_after` bounds the waits that order streams.
  HostDeviceCommunicator(comm::Communicator& inner, std::chrono::milliseconds deadline_after)
      : inner_(&inner), deadline_after_(deadline_after) {}

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::unique_ptr<comm::Request> isend(int peer, std::int64_t tag,
                                       std::span<const std::byte> data) override {
    return inner_->isend(peer, tag, data);
  }
  std::unique_ptr<comm::Request> irecv(int peer, std::int64_t tag,
                                       std::span<std::byte> data) override {
    return inner_->irecv(peer, tag, data);
  }
  void all_reduce_sum(std::span<float> data, std::span<const int> group,
                      comm::Deadline deadline) override {
    inner_->all_reduce_sum(data, group, deadline);
  }
  void all_reduce_sum(std::span<double> data, std::span<const int> group,
                      comm::Deadline deadline) override {
    inner_->all_reduce_sum(data, group, deadline);
  }
  std::unique_ptr<comm::Request> iall_reduce_sum(std::span<float> data, std::span<const int> group,
                                                 comm::Deadline deadline) override {
    return inner_->iall_reduce_sum(data, group, deadline);
  }
  std::unique_ptr<comm::Request> iall_reduce_sum(std::span<double> data, std::span<const int> group,
                                                 comm::Deadline deadline) override {
    return inner_->iall_reduce_sum(data, group, deadline);
  }
  void broadcast(std::span<std::byte> data, int root, std::span<const int> group,
                 comm::Deadline deadline) override {
    inner_->broadcast(data, root, group, deadline);
  }
  void abort(const std::string& reason) override { inner_->abort(reason); }
  std::int64_t payload_bytes_sent() const override { return inner_->payload_bytes_sent(); }

  // Host streams: the producer's work is done once the event is (it completes as recorded).
  void wait_on_device(const tensor::Event& ready) override {
    ready.synchronize();
    ++device_waits_;
  }
  // Every operation but a receive completes before its call returns.
  void order_before(tensor::Stream& /*stream*/) override {}
  // The consumer's stream may only run once the receive has landed: on the host, wait for it.
  void order_before(comm::Request& request, tensor::Stream& /*stream*/) override {
    request.wait(comm::Clock::now() + deadline_after_);
  }
  void all_reduce_sum_async(std::span<float> device_data, std::span<const int> group,
                            comm::Deadline deadline) override {
    inner_->all_reduce_sum(device_data, group, deadline);
    ++async_reductions_;
  }
  void set_activity(int position, std::string instruction) override {
    position_ = position;
    instruction_ = std::move(instruction);
  }

  // What the executor did through this path (the tests check it was taken).
  int device_waits() const { return device_waits_; }
  int async_reductions() const { return async_reductions_; }
  int last_position() const { return position_; }
  const std::string& last_instruction() const { return instruction_; }

 private:
  comm::Communicator* inner_;
  std::chrono::milliseconds deadline_after_;
  int device_waits_ = 0;
  int async_reductions_ = 0;
  int position_ = -1;
  std::string instruction_;
};

}  // namespace pf::device
