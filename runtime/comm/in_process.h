#pragma once
// The communicator for worker threads of one process: mailboxes and rendezvous in shared
// memory. A send copies its data into the receiver's mailbox and completes at once, so it never
// blocks the sender's compute; a receive completes when its message is there.
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "runtime/comm/communicator.h"

namespace pf::comm {

class InProcessWorld {
 public:
  // Throws std::invalid_argument unless size >= 1.
  explicit InProcessWorld(int size);
  InProcessWorld(const InProcessWorld&) = delete;
  InProcessWorld& operator=(const InProcessWorld&) = delete;
  ~InProcessWorld();

  int size() const { return size_; }
  // The communicator of one rank (owned by the world; one per rank, used by one thread).
  Communicator& rank(int index);

  // Messages sent but not yet received, for the no-leftovers checks.
  std::size_t pending_messages() const;

 private:
  friend class InProcessCommunicator;
  friend class InProcessRecv;
  using MailboxKey = std::tuple<int, int, std::int64_t>;  // sender, receiver, tag
  struct Collective;

  std::optional<std::string> aborted_locked() const { return abort_reason_; }
  void throw_if_aborted_locked() const;

  int size_;
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::map<MailboxKey, std::deque<std::vector<std::byte>>> mailboxes_;
  // Collectives in progress, keyed by (group, sequence number of that group's collectives).
  std::map<std::pair<std::vector<int>, std::int64_t>, std::shared_ptr<Collective>> collectives_;
  std::optional<std::string> abort_reason_;
  std::vector<std::unique_ptr<Communicator>> ranks_;
};

}  // namespace pf::comm
