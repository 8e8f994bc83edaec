#include "runtime/comm/in_process.h"

#include <algorithm>
#include <cstring>

namespace pf::comm {

namespace {

enum class CollectiveKind : std::uint8_t { kSumFloat, kSumDouble, kBroadcast };

const char* to_string(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kSumFloat:
      return "all-reduce (float)";
    case CollectiveKind::kSumDouble:
      return "all-reduce (double)";
    case CollectiveKind::kBroadcast:
      return "broadcast";
  }
  return "collective";
}

}  // namespace

struct InProcessWorld::Collective {
  CollectiveKind kind = CollectiveKind::kSumFloat;
  std::size_t bytes = 0;
  int root = -1;
  std::vector<const std::byte*> inputs;  // by position in the group
  std::vector<char> joined;              // by position: its input is registered
  // Inputs of non-blocking members, copied when they joined: their callers go on computing,
  // and a copy stays readable whatever happens to the caller's buffer.
  std::vector<std::vector<std::byte>> copies;
  int arrived = 0;
  int departed = 0;
  bool computing = false;
  bool done = false;
  std::optional<std::string> broken;
  std::vector<std::byte> result;
};

void InProcessWorld::throw_if_aborted_locked() const {
  if (abort_reason_) throw AbortedError("aborted: " + *abort_reason_);
}

class InProcessRecv final : public Request {
 public:
  InProcessRecv(InProcessWorld& world, int self, int peer, std::int64_t tag,
                std::span<std::byte> data)
      : world_(&world), self_(self), peer_(peer), tag_(tag), data_(data) {}

  bool test() override {
    std::lock_guard lock(world_->mutex_);
    return try_take_locked();
  }

  void wait(Deadline deadline) override {
    std::unique_lock lock(world_->mutex_);
    while (!try_take_locked()) {
      world_->throw_if_aborted_locked();
      if (world_->changed_.wait_until(lock, deadline) == std::cv_status::timeout &&
          !try_take_locked()) {
        world_->throw_if_aborted_locked();
        throw TimeoutError("rank " + std::to_string(self_) + ": no message from rank " +
                           std::to_string(peer_) + " with tag " + std::to_string(tag_) + " (" +
                           std::to_string(data_.size()) + " bytes) before the deadline");
      }
    }
  }

 private:
  bool try_take_locked() {
    if (done_) return true;
    auto it = world_->mailboxes_.find({peer_, self_, tag_});
    if (it == world_->mailboxes_.end() || it->second.empty()) return false;
    auto& message = it->second.front();
    if (message.size() != data_.size()) {
      throw std::runtime_error("rank " + std::to_string(self_) + ": message from rank " +
                               std::to_string(peer_) + " with tag " + std::to_string(tag_) +
                               " has " + std::to_string(message.size()) + " bytes, expected " +
                               std::to_string(data_.size()));
    }
    if (!message.empty()) std::memcpy(data_.data(), message.data(), message.size());
    it->second.pop_front();
    if (it->second.empty()) world_->mailboxes_.erase(it);
    done_ = true;
    return true;
  }

  InProcessWorld* world_;
  int self_, peer_;
  std::int64_t tag_;
  std::span<std::byte> data_;
  bool done_ = false;
};

namespace {
class CompletedRequest final : public Request {
 public:
  bool test() override { return true; }
  void wait(Deadline) override {}
};
}  // namespace

class InProcessCommunicator final : public Communicator {
 public:
  InProcessCommunicator(InProcessWorld& world, int rank) : world_(&world), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return world_->size(); }

  std::unique_ptr<Request> isend(int peer, std::int64_t tag,
                                 std::span<const std::byte> data) override {
    check_peer(peer, "send");
    std::vector<std::byte> copy(data.begin(), data.end());
    {
      std::lock_guard lock(world_->mutex_);
      world_->throw_if_aborted_locked();
      world_->mailboxes_[{rank_, peer, tag}].push_back(std::move(copy));
    }
    world_->changed_.notify_all();
    return std::make_unique<CompletedRequest>();
  }

  std::unique_ptr<Request> irecv(int peer, std::int64_t tag, std::span<std::byte> data) override {
    check_peer(peer, "receive");
    return std::make_unique<InProcessRecv>(*world_, rank_, peer, tag, data);
  }

  void all_reduce_sum(std::span<float> data, std::span<const int> group,
                      Deadline deadline) override {
    collective(CollectiveKind::kSumFloat, std::as_writable_bytes(data), -1, group, deadline);
  }
  void all_reduce_sum(std::span<double> data, std::span<const int> group,
                      Deadline deadline) override {
    collective(CollectiveKind::kSumDouble, std::as_writable_bytes(data), -1, group, deadline);
  }
  std::unique_ptr<Request> iall_reduce_sum(std::span<float> data, std::span<const int> group,
                                           Deadline /*deadline*/) override {
    return start_sum(CollectiveKind::kSumFloat, std::as_writable_bytes(data), group);
  }
  std::unique_ptr<Request> iall_reduce_sum(std::span<double> data, std::span<const int> group,
                                           Deadline /*deadline*/) override {
    return start_sum(CollectiveKind::kSumDouble, std::as_writable_bytes(data), group);
  }
  void broadcast(std::span<std::byte> data, int root, std::span<const int> group,
                 Deadline deadline) override {
    collective(CollectiveKind::kBroadcast, data, root, group, deadline);
  }

  void abort(const std::string& reason) override {
    {
      std::lock_guard lock(world_->mutex_);
      if (!world_->abort_reason_) world_->abort_reason_ = reason;
    }
    world_->changed_.notify_all();
  }

 private:
  void check_peer(int peer, const char* what) const {
    if (peer < 0 || peer >= world_->size() || peer == rank_) {
      throw std::invalid_argument("rank " + std::to_string(rank_) + ": cannot " + what +
                                  " to/from rank " + std::to_string(peer) + " (world of " +
                                  std::to_string(world_->size()) + ")");
    }
  }

  int position_in(std::span<const int> group) const {
    for (std::size_t i = 0; i < group.size(); ++i) {
      if (group[i] < 0 || group[i] >= world_->size() || (i > 0 && group[i] <= group[i - 1])) {
        throw std::invalid_argument("rank " + std::to_string(rank_) + ": group " +
                                    group_to_string(group) +
                                    " must list distinct ranks of the world in ascending order");
      }
    }
    for (std::size_t i = 0; i < group.size(); ++i) {
      if (group[i] == rank_) return static_cast<int>(i);
    }
    throw std::invalid_argument("rank " + std::to_string(rank_) + " is not in the group " +
                                group_to_string(group));
  }

  static void reduce(CollectiveKind kind, const InProcessWorld::Collective& op,
                     std::vector<std::byte>& out) {
    out.resize(op.bytes);
    auto sum = [&](auto zero) {
      using V = decltype(zero);
      const std::size_t count = op.bytes / sizeof(V);
      auto* target = reinterpret_cast<V*>(out.data());
      std::memcpy(target, op.inputs[0], op.bytes);
      for (std::size_t m = 1; m < op.inputs.size(); ++m) {
        const auto* source = reinterpret_cast<const V*>(op.inputs[m]);
        for (std::size_t i = 0; i < count; ++i) target[i] += source[i];
      }
    };
    if (kind == CollectiveKind::kSumFloat) sum(0.0F);
    if (kind == CollectiveKind::kSumDouble) sum(0.0);
  }

  // This rank's part in one collective of a group, between joining it and taking its result.
  struct Membership {
    std::shared_ptr<InProcessWorld::Collective> op;  // null: a group of one (nothing to do)
    std::vector<int> members;
    std::int64_t sequence = 0;
    std::string where;  // "rank R: all-reduce (float) #S over {...}"
    bool departed = false;
  };

  // Registers this rank's input in the group's next collective (a copy when `copy_input`: the
  // caller does not wait). The last member to arrive computes the result outside the lock
  // (blocking members wait, so their inputs live; the others' are copies).
  Membership join(CollectiveKind kind, std::span<std::byte> data, int root,
                  std::span<const int> group, bool copy_input) {
    const int position = position_in(group);
    Membership m;
    m.members.assign(group.begin(), group.end());
    int root_position = -1;
    if (kind == CollectiveKind::kBroadcast) {
      auto it = std::find(m.members.begin(), m.members.end(), root);
      if (it == m.members.end()) {
        throw std::invalid_argument("rank " + std::to_string(rank_) + ": broadcast root " +
                                    std::to_string(root) + " is not in the group " +
                                    group_to_string(group));
      }
      root_position = static_cast<int>(it - m.members.begin());
    }
    m.sequence = sequence_[m.members]++;
    m.where = "rank " + std::to_string(rank_) + ": " + to_string(kind) + " #" +
              std::to_string(m.sequence) + " over " + group_to_string(group);
    if (m.members.size() == 1) return m;
    std::unique_lock lock(world_->mutex_);
    world_->throw_if_aborted_locked();
    auto& slot = world_->collectives_[{m.members, m.sequence}];
    if (!slot) {
      slot = std::make_shared<InProcessWorld::Collective>();
      slot->kind = kind;
      slot->bytes = data.size();
      slot->root = root;
      slot->inputs.assign(m.members.size(), nullptr);
      slot->joined.assign(m.members.size(), 0);
      slot->copies.resize(m.members.size());
    }
    m.op = slot;
    auto& op = *m.op;
    if (op.broken) throw std::runtime_error(m.where + ": " + *op.broken);
    if (op.kind != kind || op.bytes != data.size() || op.root != root) {
      op.broken = "members disagree: " + std::string(to_string(op.kind)) + " of " +
                  std::to_string(op.bytes) + " bytes (root " + std::to_string(op.root) +
                  ") against " + to_string(kind) + " of " + std::to_string(data.size()) +
                  " bytes (root " + std::to_string(root) + ")";
      world_->changed_.notify_all();
      throw std::runtime_error(m.where + ": " + *op.broken);
    }
    const auto index = static_cast<std::size_t>(position);
    if (copy_input) {
      op.copies[index].assign(data.begin(), data.end());
      op.inputs[index] = op.copies[index].data();
    } else {
      op.inputs[index] = data.data();
    }
    op.joined[index] = 1;
    if (++op.arrived == static_cast<int>(m.members.size())) {
      op.computing = true;
      lock.unlock();
      std::vector<std::byte> result;
      if (kind == CollectiveKind::kBroadcast) {
        const auto* source = op.inputs[static_cast<std::size_t>(root_position)];
        result.assign(source, source + op.bytes);
      } else {
        reduce(kind, op, result);
      }
      lock.lock();
      op.result = std::move(result);
      op.done = true;
      world_->changed_.notify_all();
    }
    return m;
  }

  // The members that have not joined (for timeouts), "2, 3".
  static std::string missing_members(const Membership& m) {
    std::string missing;
    for (std::size_t i = 0; i < m.members.size(); ++i) {
      if (m.op->joined[i] == 0)
        missing += (missing.empty() ? "" : ", ") + std::to_string(m.members[i]);
    }
    return missing;
  }

  // Copies the result out; the last member to leave removes the collective.
  void depart_locked(Membership& m, std::span<std::byte> data) {
    if (m.op->bytes > 0) std::memcpy(data.data(), m.op->result.data(), m.op->bytes);
    m.departed = true;
    if (++m.op->departed == static_cast<int>(m.members.size())) {
      world_->collectives_.erase({m.members, m.sequence});
    }
  }

  // Blocks until the collective is done and takes its result.
  void finish(Membership& m, std::span<std::byte> data, Deadline deadline) {
    if (!m.op) return;
    std::unique_lock lock(world_->mutex_);
    auto& op = *m.op;
    while (!op.done) {
      if (op.broken) throw std::runtime_error(m.where + ": " + *op.broken);
      if (world_->abort_reason_ && !op.computing) {
        op.broken = "aborted";
        world_->throw_if_aborted_locked();
      }
      if (world_->changed_.wait_until(lock, deadline) == std::cv_status::timeout && !op.done &&
          !op.computing) {
        const std::string missing = missing_members(m);
        op.broken = "rank " + std::to_string(rank_) + " gave up waiting for rank(s) " + missing;
        world_->changed_.notify_all();
        throw TimeoutError(m.where + ": ranks " + missing + " did not join before the deadline");
      }
    }
    depart_locked(m, data);
  }

  // Takes the result if the collective is done; never blocks.
  bool try_finish(Membership& m, std::span<std::byte> data) {
    if (!m.op) return true;
    std::lock_guard lock(world_->mutex_);
    auto& op = *m.op;
    if (op.done) {
      depart_locked(m, data);
      return true;
    }
    if (op.broken) throw std::runtime_error(m.where + ": " + *op.broken);
    if (world_->abort_reason_ && !op.computing) {
      op.broken = "aborted";
      world_->throw_if_aborted_locked();
    }
    return false;
  }

  // A request destroyed before its result was taken: the others are told instead of waiting.
  void abandon(Membership& m) {
    if (!m.op || m.departed) return;
    {
      std::lock_guard lock(world_->mutex_);
      if (m.op->done) {
        m.departed = true;
        if (++m.op->departed == static_cast<int>(m.members.size())) {
          world_->collectives_.erase({m.members, m.sequence});
        }
        return;
      }
      if (!m.op->broken) m.op->broken = "rank " + std::to_string(rank_) + " abandoned it";
    }
    world_->changed_.notify_all();
  }

  void collective(CollectiveKind kind, std::span<std::byte> data, int root,
                  std::span<const int> group, Deadline deadline) {
    Membership m = join(kind, data, root, group, false);
    finish(m, data, deadline);
  }

  class SumRequest final : public Request {
   public:
    SumRequest(InProcessCommunicator& comm, Membership membership, std::span<std::byte> data)
        : comm_(&comm), membership_(std::move(membership)), data_(data) {}
    ~SumRequest() override { comm_->abandon(membership_); }
    SumRequest(const SumRequest&) = delete;
    SumRequest& operator=(const SumRequest&) = delete;
    bool test() override { return membership_.departed || comm_->try_finish(membership_, data_); }
    void wait(Deadline deadline) override {
      if (!membership_.departed) comm_->finish(membership_, data_, deadline);
    }

   private:
    InProcessCommunicator* comm_;
    Membership membership_;
    std::span<std::byte> data_;
  };

  std::unique_ptr<Request> start_sum(CollectiveKind kind, std::span<std::byte> data,
                                     std::span<const int> group) {
    Membership m = join(kind, data, -1, group, true);
    if (!m.op) m.departed = true;  // a group of one: the sum is the data
    return std::make_unique<SumRequest>(*this, std::move(m), data);
  }

  InProcessWorld* world_;
  int rank_;
  std::map<std::vector<int>, std::int64_t> sequence_;  // collectives issued per group
};

InProcessWorld::InProcessWorld(int size) : size_(size) {
  if (size < 1) {
    throw std::invalid_argument("in-process world: size must be >= 1, got " + std::to_string(size));
  }
  for (int r = 0; r < size; ++r)
    ranks_.push_back(std::make_unique<InProcessCommunicator>(*this, r));
}

InProcessWorld::~InProcessWorld() = default;

Communicator& InProcessWorld::rank(int index) {
  if (index < 0 || index >= size_) {
    throw std::out_of_range("in-process world: no rank " + std::to_string(index) +
                            " in a world of " + std::to_string(size_));
  }
  return *ranks_[static_cast<std::size_t>(index)];
}

std::size_t InProcessWorld::pending_messages() const {
  std::lock_guard lock(mutex_);
  std::size_t count = 0;
  for (const auto& [key, queue] : mailboxes_) count += queue.size();
  return count;
}

}  // namespace pf::comm
