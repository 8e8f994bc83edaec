#include "runtime/device/message_exchange.h"

#include <stdexcept>
#include <string>

namespace pf::device {

std::uint64_t MessageExchange::post(DeviceMessage message) {
  if (!message.ready)
    throw std::invalid_argument("MessageExchange::post: a message without its ready event");
  const std::lock_guard lock(mutex_);
  const std::uint64_t ticket = next_++;
  messages_.emplace(ticket, std::move(message));
  return ticket;
}

DeviceMessage MessageExchange::take(std::uint64_t ticket) {
  const std::lock_guard lock(mutex_);
  const auto it = messages_.find(ticket);
  if (it == messages_.end()) {
    throw std::runtime_error("device message " + std::to_string(ticket) +
                             " was never posted or was taken already");
  }
  DeviceMessage message = std::move(it->second);
  messages_.erase(it);
  return message;
}

std::size_t MessageExchange::pending() const {
  const std::lock_guard lock(mutex_);
  return messages_.size();
}

}  // namespace pf::device
