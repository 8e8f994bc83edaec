#include "runtime/comm/mpi_communicator.h"

#include <mpi.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <climits>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

namespace pf::comm {

namespace {

std::string mpi_error_text(int code) {
  std::array<char, MPI_MAX_ERROR_STRING> text{};
  int length = 0;
  if (MPI_Error_string(code, text.data(), &length) != MPI_SUCCESS) {
    return "MPI error code " + std::to_string(code);
  }
  return std::string(text.data(), static_cast<std::size_t>(length));
}

[[noreturn]] void throw_mpi_failure(int rank, const char* call, int code) {
  throw std::runtime_error("rank " + std::to_string(rank) + ": " + call +
                           " failed: " + mpi_error_text(code));
}

}  // namespace

// Every MPI call goes through this: a failure names the rank and the call.
#define PF_MPI_CHECK(rank, call)                                                             \
  do {                                                                                       \
    const int pf_mpi_code = (call);                                                          \
    if (pf_mpi_code != MPI_SUCCESS) ::pf::comm::throw_mpi_failure(rank, #call, pf_mpi_code); \
  } while (false)

// ---------------------------------------------------------------------------------------------
// MpiSession
// ---------------------------------------------------------------------------------------------

namespace {
const char* thread_level_name(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE:
      return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED:
      return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED:
      return "MPI_THREAD_SERIALIZED";
    case MPI_THREAD_MULTIPLE:
      return "MPI_THREAD_MULTIPLE";
    default:
      return "an unknown thread level";
  }
}
}  // namespace

MpiSession::MpiSession(int* argc, char*** argv) {
  int initialized = 0;
  PF_MPI_CHECK(0, MPI_Initialized(&initialized));
  if (initialized != 0) throw std::runtime_error("MPI is already initialised in this process");
  int provided = MPI_THREAD_SINGLE;
  PF_MPI_CHECK(0, MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided));
  // Errors come back as codes, so that PF_MPI_CHECK can say which rank and call failed.
  PF_MPI_CHECK(0, MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
  PF_MPI_CHECK(0, MPI_Comm_rank(MPI_COMM_WORLD, &rank_));
  PF_MPI_CHECK(rank_, MPI_Comm_size(MPI_COMM_WORLD, &size_));
  if (provided < MPI_THREAD_MULTIPLE) {
    const std::string message =
        "rank " + std::to_string(rank_) + ": this MPI provides " + thread_level_name(provided) +
        ", the runtime needs MPI_THREAD_MULTIPLE (its progress thread calls MPI while the worker "
        "does); use an MPI built with thread support (OpenMPI: --enable-mpi-thread-multiple)";
    MPI_Finalize();
    throw std::runtime_error(message);
  }
  MPI_Comm node = MPI_COMM_NULL;
  PF_MPI_CHECK(rank_, MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank_,
                                          MPI_INFO_NULL, &node));
  // The node's lowest world rank names the machine (the split's key is the world rank, so it is
  // the node's rank 0); every rank learns every rank's, numbered in order of appearance.
  int machine_leader = rank_;
  int code = MPI_Comm_size(node, &node_size_);
  if (code == MPI_SUCCESS) code = MPI_Bcast(&machine_leader, 1, MPI_INT, 0, node);
  MPI_Comm_free(&node);
  PF_MPI_CHECK(rank_, code);
  std::vector<int> leaders(static_cast<std::size_t>(size_), 0);
  PF_MPI_CHECK(rank_, MPI_Allgather(&machine_leader, 1, MPI_INT, leaders.data(), 1, MPI_INT,
                                    MPI_COMM_WORLD));
  std::map<int, int> machine_of_leader;
  machine_of_rank_.clear();
  for (const int leader : leaders) {
    const int next = static_cast<int>(machine_of_leader.size());
    machine_of_rank_.push_back(machine_of_leader.emplace(leader, next).first->second);
  }
}

MpiSession::~MpiSession() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized == 0) MPI_Finalize();
}

bool MpiSession::launched_by_mpirun() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"}) {
    if (std::getenv(name) != nullptr) return true;  // NOLINT(concurrency-mt-unsafe)
  }
  return false;
}

// ---------------------------------------------------------------------------------------------
// Progress engine: a thread that tests every outstanding request
// ---------------------------------------------------------------------------------------------

namespace {

// One non-blocking MPI operation. Fields after `request` are guarded by the engine's mutex.
struct Operation {
  MPI_Request request = MPI_REQUEST_NULL;
  bool done = false;
  bool abandoned = false;  // its Request was destroyed before completion
  int error = MPI_SUCCESS;
  int received_bytes = -1;  // receives: the message's size
  // Buffers and argument arrays the operation reads or writes, kept alive until it completes
  // (a wait that times out leaves the operation to MPI, not to freed memory).
  std::vector<std::byte> scratch;
  std::vector<int> ints;
  std::vector<std::int64_t> longs;
};

class ProgressEngine {
 public:
  ProgressEngine() : thread_([this] { loop(); }) {}
  ~ProgressEngine() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    work_.notify_all();
    thread_.join();
    // What is still outstanding is cancelled (receives) or left to MPI_Finalize (sends).
    for (auto& op : active_) {
      if (op->request != MPI_REQUEST_NULL) {
        MPI_Cancel(&op->request);
        MPI_Request_free(&op->request);
      }
    }
  }
  ProgressEngine(const ProgressEngine&) = delete;
  ProgressEngine& operator=(const ProgressEngine&) = delete;

  void add(const std::shared_ptr<Operation>& op) {
    {
      std::lock_guard lock(mutex_);
      active_.push_back(op);
    }
    work_.notify_all();
  }

  bool done(const Operation& op) {
    std::lock_guard lock(mutex_);
    return op.done;
  }

  // Blocks until op completes (its error, if any, is for the caller to read); throws
  // TimeoutError(describe() + " not complete before the deadline") when the deadline passes.
  void wait(const Operation& op, Deadline deadline, const std::function<std::string()>& describe) {
    std::unique_lock lock(mutex_);
    while (!op.done) {
      if (completed_.wait_until(lock, deadline) == std::cv_status::timeout && !op.done) {
        throw TimeoutError(describe() + " not complete before the deadline");
      }
    }
  }

  // A receive whose Request goes away unfinished is cancelled, so MPI never writes into its
  // freed buffer; a send is left to finish from its own buffer copy-free (the executor keeps
  // send buffers until completion, and an unfinished send at destruction means the run failed).
  void abandon(const std::shared_ptr<Operation>& op, bool is_receive) {
    std::lock_guard lock(mutex_);
    if (op->done) return;
    op->abandoned = true;
    if (is_receive && op->request != MPI_REQUEST_NULL) MPI_Cancel(&op->request);
  }

 private:
  void loop() {
    std::vector<MPI_Request> handles;
    std::vector<int> indices;
    std::vector<MPI_Status> statuses;
    auto idle = std::chrono::microseconds(2);
    std::unique_lock lock(mutex_);
    while (true) {
      work_.wait(lock, [&] { return stopping_ || !active_.empty(); });
      if (stopping_) return;
      const int count = static_cast<int>(active_.size());
      handles.resize(active_.size());
      indices.resize(active_.size());
      statuses.resize(active_.size());
      for (std::size_t i = 0; i < active_.size(); ++i) handles[i] = active_[i]->request;
      int completed = 0;
      const int code =
          MPI_Testsome(count, handles.data(), &completed, indices.data(), statuses.data());
      if (code != MPI_SUCCESS && code != MPI_ERR_IN_STATUS) {
        // The engine cannot tell which request failed: all of them report it.
        for (auto& op : active_) {
          op->error = code;
          op->done = true;
        }
        active_.clear();
        completed_.notify_all();
        continue;
      }
      for (std::size_t i = 0; i < active_.size(); ++i) active_[i]->request = handles[i];
      if (completed == MPI_UNDEFINED) completed = 0;
      for (int c = 0; c < completed; ++c) {
        const auto index = static_cast<std::size_t>(indices[static_cast<std::size_t>(c)]);
        MPI_Status& status = statuses[static_cast<std::size_t>(c)];
        Operation& op = *active_[index];
        op.done = true;
        if (code == MPI_ERR_IN_STATUS) op.error = status.MPI_ERROR;
        int bytes = 0;
        if (MPI_Get_count(&status, MPI_BYTE, &bytes) == MPI_SUCCESS) op.received_bytes = bytes;
      }
      if (completed > 0) {
        std::erase_if(active_, [](const std::shared_ptr<Operation>& op) { return op->done; });
        completed_.notify_all();
        idle = std::chrono::microseconds(2);
      } else {
        // Nothing finished: back off (up to 100 us) so that polling costs little CPU.
        lock.unlock();
        std::this_thread::sleep_for(idle);
        idle = std::min(idle * 2, std::chrono::microseconds(100));
        lock.lock();
      }
    }
  }

  std::mutex mutex_;
  std::condition_variable work_, completed_;
  std::vector<std::shared_ptr<Operation>> active_;
  bool stopping_ = false;
  std::thread thread_;  // last: starts after the members it uses exist
};

class MpiRequest final : public Request {
 public:
  MpiRequest(ProgressEngine& engine, std::shared_ptr<Operation> op, bool is_receive, int rank,
             int peer, std::int64_t tag, std::size_t bytes)
      : engine_(&engine),
        op_(std::move(op)),
        is_receive_(is_receive),
        rank_(rank),
        peer_(peer),
        tag_(tag),
        bytes_(bytes) {}
  ~MpiRequest() override { engine_->abandon(op_, is_receive_); }
  MpiRequest(const MpiRequest&) = delete;
  MpiRequest& operator=(const MpiRequest&) = delete;

  bool test() override {
    if (!engine_->done(*op_)) return false;
    check();
    return true;
  }

  void wait(Deadline deadline) override {
    engine_->wait(*op_, deadline, [this] { return describe(); });
    check();
  }

 private:
  std::string describe() const {
    return "rank " + std::to_string(rank_) + ": " + (is_receive_ ? "receive from" : "send to") +
           " rank " + std::to_string(peer_) + " with tag " + std::to_string(tag_) + " (" +
           std::to_string(bytes_) + " bytes)";
  }
  void check() const {
    int error_class = MPI_SUCCESS;
    if (op_->error != MPI_SUCCESS && MPI_Error_class(op_->error, &error_class) != MPI_SUCCESS) {
      error_class = op_->error;
    }
    if (error_class == MPI_ERR_TRUNCATE) {
      throw std::runtime_error("rank " + std::to_string(rank_) + ": message from rank " +
                               std::to_string(peer_) + " with tag " + std::to_string(tag_) +
                               " has more than the " + std::to_string(bytes_) + " bytes expected");
    }
    if (op_->error != MPI_SUCCESS) {
      throw std::runtime_error(describe() + " failed: " + mpi_error_text(op_->error));
    }
    if (is_receive_ && op_->received_bytes != static_cast<int>(bytes_)) {
      throw std::runtime_error("rank " + std::to_string(rank_) + ": message from rank " +
                               std::to_string(peer_) + " with tag " + std::to_string(tag_) +
                               " has " + std::to_string(op_->received_bytes) + " bytes, expected " +
                               std::to_string(bytes_));
    }
  }

  ProgressEngine* engine_;
  std::shared_ptr<Operation> op_;
  bool is_receive_;
  int rank_, peer_;
  std::int64_t tag_;
  std::size_t bytes_;
};

enum class CollectiveKind : std::int64_t { kSumFloat = 1, kSumDouble = 2, kBroadcast = 3 };

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

// ---------------------------------------------------------------------------------------------
// MpiCommunicator
// ---------------------------------------------------------------------------------------------

struct MpiCommunicator::Impl {
  int rank = 0, size = 1;
  MPI_Comm world = MPI_COMM_NULL;        // private duplicate of MPI_COMM_WORLD: point-to-point
  MPI_Comm collectives = MPI_COMM_NULL;  // another: collectives' messages, tagged by group
  int tag_upper_bound = 32767;           // MPI guarantees at least this
  std::map<std::vector<int>, std::int64_t> sequence;  // collectives issued per group
  std::unique_ptr<ProgressEngine> engine;

  // What every message of a collective says about it: members that disagree (another group
  // with the same tag, another size, kind or root, or collectives issued in another order) are
  // told instead of exchanging corrupt data.
  struct Header {
    std::uint64_t group_fingerprint = 0;
    std::int64_t sequence = 0;
    std::int64_t kind = 0;
    std::int64_t bytes = 0;
    std::int64_t root = -1;
    bool operator==(const Header&) const = default;
  };

  std::string where(const std::string& what) const {
    return "rank " + std::to_string(rank) + ": " + what;
  }

  // Waits for a world-wide operation (barrier, gather) and reports its error.
  void await(const std::shared_ptr<Operation>& op, Deadline deadline, const std::string& what) {
    engine->wait(*op, deadline, [&] { return what + " was"; });
    if (op->error != MPI_SUCCESS) {
      throw std::runtime_error(what + " failed: " + mpi_error_text(op->error));
    }
  }

  void check_peer(int peer, std::int64_t tag, const char* what) const {
    if (peer < 0 || peer >= size || peer == rank) {
      throw std::invalid_argument(where(std::string("cannot ") + what + " to/from rank " +
                                        std::to_string(peer) + " (world of " +
                                        std::to_string(size) + ")"));
    }
    if (tag < 0 || tag > tag_upper_bound) {
      throw std::invalid_argument(where("tag " + std::to_string(tag) +
                                        " is outside MPI's tag range [0, " +
                                        std::to_string(tag_upper_bound) + "]"));
    }
  }

  static int checked_count(std::size_t count, const std::string& context) {
    if (count > static_cast<std::size_t>(INT_MAX)) {
      throw std::invalid_argument(context + ": " + std::to_string(count) +
                                  " elements exceed MPI's int count");
    }
    return static_cast<int>(count);
  }

  // This rank's position in `group` (validated: sorted, distinct, in the world, has this rank).
  int position_in(std::span<const int> group) const {
    int position = -1;
    for (std::size_t i = 0; i < group.size(); ++i) {
      if (group[i] < 0 || group[i] >= size || (i > 0 && group[i] <= group[i - 1])) {
        throw std::invalid_argument(
            where("group " + group_to_string(group) +
                  " must list distinct ranks of the world in ascending order"));
      }
      if (group[i] == rank) position = static_cast<int>(i);
    }
    if (position < 0) {
      throw std::invalid_argument(where("not in the group " + group_to_string(group)));
    }
    return position;
  }

  static std::uint64_t fingerprint(std::span<const int> group) {
    std::uint64_t hash = 1469598103934665603ULL;  // FNV-1a over the member list
    for (int member : group) {
      for (int byte = 0; byte < 4; ++byte) {
        hash ^= (static_cast<std::uint64_t>(static_cast<unsigned>(member)) >> (8 * byte)) & 0xFFU;
        hash *= 1099511628211ULL;
      }
    }
    return hash;
  }
  // The tag of one phase of one collective of a group: collectives in flight together on a
  // group (gradient buckets, a curvature sum) never share a tag, so the order in which their
  // messages are posted does not matter; the headers catch the rare collision between groups.
  int tag_of(std::uint64_t group_fingerprint, std::int64_t number, int phase) const {
    std::uint64_t hash = group_fingerprint;
    for (std::uint64_t word :
         {static_cast<std::uint64_t>(number), static_cast<std::uint64_t>(phase)}) {
      hash ^= word + 0x9E3779B97F4A7C15ULL + (hash << 6) + (hash >> 2);
      hash *= 1099511628211ULL;
    }
    return static_cast<int>(hash % (static_cast<std::uint64_t>(tag_upper_bound) + 1));
  }

  // Posts a send of a copy of `bytes` on the collectives' communicator (the copy lives in the
  // operation, so a caller's timeout never leaves MPI reading freed memory).
  // Payload bytes handed to MPI (headers left out); read by the rank's own thread.
  std::atomic<std::int64_t> payload_sent{0};
  std::shared_ptr<Operation> send_payload(const void* bytes, std::size_t length, int peer, int tag,
                                          const std::string& what) {
    payload_sent += static_cast<std::int64_t>(length);
    return send_copy(bytes, length, peer, tag, what);
  }
  std::shared_ptr<Operation> send_copy(const void* bytes, std::size_t length, int peer, int tag,
                                       const std::string& what) {
    auto op = std::make_shared<Operation>();
    op->scratch.resize(length);
    if (length > 0) std::memcpy(op->scratch.data(), bytes, length);
    PF_MPI_CHECK(rank, MPI_Isend(op->scratch.data(), checked_count(length, what), MPI_BYTE, peer,
                                 tag, collectives, &op->request));
    engine->add(op);
    return op;
  }
  std::shared_ptr<Operation> receive_into_scratch(std::size_t length, int peer, int tag,
                                                  const std::string& what) {
    auto op = std::make_shared<Operation>();
    op->scratch.resize(length);
    PF_MPI_CHECK(rank, MPI_Irecv(op->scratch.data(), checked_count(length, what), MPI_BYTE, peer,
                                 tag, collectives, &op->request));
    engine->add(op);
    return op;
  }

  // Waits for a received message of exactly `length` bytes from group member `peer`.
  void await_receive(const std::shared_ptr<Operation>& op, std::size_t length, int peer,
                     Deadline deadline, const std::string& what) {
    engine->wait(*op, deadline,
                 [&] { return what + ": the message from rank " + std::to_string(peer) + " was"; });
    if (op->error != MPI_SUCCESS) {
      throw std::runtime_error(what + ": receiving from rank " + std::to_string(peer) +
                               " failed: " + mpi_error_text(op->error));
    }
    if (op->received_bytes != static_cast<int>(length)) {
      throw std::runtime_error(what + ": rank " + std::to_string(peer) + " sent " +
                               std::to_string(op->received_bytes) + " bytes, expected " +
                               std::to_string(length));
    }
  }

  void check_header(const std::shared_ptr<Operation>& op, const Header& expected, int peer,
                    const std::string& what) const {
    Header theirs;
    std::memcpy(&theirs, op->scratch.data(), sizeof(Header));
    if (theirs == expected) return;
    auto describe = [](const Header& h) {
      return std::string(to_string(static_cast<CollectiveKind>(h.kind))) + " #" +
             std::to_string(h.sequence) + " of " + std::to_string(h.bytes) + " bytes (root " +
             std::to_string(h.root) + ", group fingerprint " + std::to_string(h.group_fingerprint) +
             ")";
    };
    throw std::runtime_error(what + ": members disagree: rank " + std::to_string(peer) + " is in " +
                             describe(theirs) + ", this rank in " + describe(expected));
  }

  // Deterministic sum: member s owns elements [begin(s), begin(s + 1)); every member sends each
  // owner its part, the owner adds the parts in ascending rank order (as InProcessWorld does:
  // ((x0 + x1) + x2) + ...) and sends the sum back to every member. Non-blocking: phase 1
  // (headers and parts to their owners) is posted when the sum is issued; phase 2 (each owner's
  // sum to every member) by advance(), called from the rank's own thread by test() and wait(),
  // once phase 1 is complete; the result reaches the caller's data when phase 2 is.
  struct PendingSum {
    CollectiveKind kind = CollectiveKind::kSumFloat;
    std::size_t element_bytes = 0;
    std::span<std::byte> data;  // the caller's, written at completion
    std::vector<int> group;
    int position = 0;
    Header header;
    int tag_parts = 0, tag_sums = 0;
    std::string what;
    std::vector<std::byte> own_part;  // this rank's part, as it was when issued
    std::vector<std::byte> owned_sum;
    std::vector<std::shared_ptr<Operation>> headers, parts, sums;  // by member position
    bool summing = false;                                          // phase 2 posted
    bool finished = false;
    bool abandoned = false;

    int members() const { return static_cast<int>(group.size()); }
    std::size_t count() const { return data.size() / element_bytes; }
    // First element owned by member s.
    std::size_t begin(int s) const {
      return count() * static_cast<std::size_t>(s) / static_cast<std::size_t>(members());
    }
    std::size_t segment_bytes(int s) const { return (begin(s + 1) - begin(s)) * element_bytes; }
  };
  // Sums in flight per group, in issue order (phase 2 is posted in that order on every member).
  std::map<std::vector<int>, std::deque<std::shared_ptr<PendingSum>>> pending_sums;

  template <typename V>
  static void add_into(std::byte* target, const std::byte* part, std::size_t count) {
    auto* sum = reinterpret_cast<V*>(target);
    const auto* addend = reinterpret_cast<const V*>(part);
    for (std::size_t e = 0; e < count; ++e) sum[e] += addend[e];
  }

  std::shared_ptr<PendingSum> start_sum(CollectiveKind kind, std::size_t element_bytes,
                                        std::span<std::byte> data, std::span<const int> group) {
    auto sum = std::make_shared<PendingSum>();
    sum->kind = kind;
    sum->element_bytes = element_bytes;
    sum->data = data;
    sum->position = position_in(group);
    sum->group.assign(group.begin(), group.end());
    const std::int64_t number = sequence[sum->group]++;
    sum->what = where(std::string(to_string(kind)) + " #" + std::to_string(number) + " over " +
                      group_to_string(group));
    const int n = sum->members();
    if (n == 1) {
      sum->finished = true;
      return sum;
    }
    checked_count(sum->count(), sum->what);
    sum->header = {fingerprint(group), number, static_cast<std::int64_t>(kind),
                   static_cast<std::int64_t>(data.size()), -1};
    sum->tag_parts = tag_of(sum->header.group_fingerprint, number, 1);
    sum->tag_sums = tag_of(sum->header.group_fingerprint, number, 2);
    const std::size_t mine_begin = sum->begin(sum->position) * element_bytes;
    const std::size_t mine = sum->segment_bytes(sum->position);
    sum->own_part.assign(data.begin() + static_cast<std::ptrdiff_t>(mine_begin),
                         data.begin() + static_cast<std::ptrdiff_t>(mine_begin + mine));
    sum->headers.resize(static_cast<std::size_t>(n));
    sum->parts.resize(static_cast<std::size_t>(n));
    sum->sums.resize(static_cast<std::size_t>(n));
    for (int m = 0; m < n; ++m) {
      if (m == sum->position) continue;
      const auto i = static_cast<std::size_t>(m);
      sum->headers[i] = receive_into_scratch(sizeof(Header), group[i], sum->tag_parts, sum->what);
      sum->parts[i] = receive_into_scratch(mine, group[i], sum->tag_parts, sum->what);
    }
    for (int s = 0; s < n; ++s) {
      if (s == sum->position) continue;
      const auto i = static_cast<std::size_t>(s);
      send_copy(&sum->header, sizeof(Header), group[i], sum->tag_parts, sum->what);
      send_payload(data.data() + sum->begin(s) * element_bytes, sum->segment_bytes(s), group[i],
                   sum->tag_parts, sum->what);
    }
    // Phase 2's payload counts now, with the sum's issue: it is posted later, maybe inside
    // another collective's wait, whose payload it must not inflate.
    payload_sent += static_cast<std::int64_t>(mine) * (n - 1);
    pending_sums[sum->group].push_back(sum);
    return sum;
  }

  bool all_done(const std::vector<std::shared_ptr<Operation>>& ops) const {
    for (const auto& op : ops) {
      if (op && !engine->done(*op)) return false;
    }
    return true;
  }

  // Phase 1 complete: adds the parts in ascending rank order, posts phase 2.
  void post_sums(PendingSum& sum, Deadline deadline) {
    const int n = sum.members();
    const auto& group = sum.group;
    const std::size_t mine = sum.segment_bytes(sum.position);
    for (int m = 0; m < n; ++m) {
      if (m == sum.position) continue;
      const auto i = static_cast<std::size_t>(m);
      await_receive(sum.headers[i], sizeof(Header), group[i], deadline, sum.what);
      check_header(sum.headers[i], sum.header, group[i], sum.what);
    }
    const std::size_t count = mine / sum.element_bytes;
    for (int m = 0; m < n; ++m) {
      const auto i = static_cast<std::size_t>(m);
      const std::byte* part = sum.own_part.data();
      if (m != sum.position) {
        await_receive(sum.parts[i], mine, group[i], deadline, sum.what);
        part = sum.parts[i]->scratch.data();
      }
      if (m == 0) {
        sum.owned_sum.assign(part, part + mine);
      } else if (sum.kind == CollectiveKind::kSumFloat) {
        add_into<float>(sum.owned_sum.data(), part, count);
      } else {
        add_into<double>(sum.owned_sum.data(), part, count);
      }
    }
    for (int s = 0; s < n; ++s) {
      if (s == sum.position) continue;
      const auto i = static_cast<std::size_t>(s);
      sum.sums[i] = receive_into_scratch(sum.segment_bytes(s), group[i], sum.tag_sums, sum.what);
    }
    for (int m = 0; m < n; ++m) {
      if (m == sum.position) continue;
      send_copy(sum.owned_sum.data(), mine, group[static_cast<std::size_t>(m)], sum.tag_sums,
                sum.what);  // its payload was counted when the sum was issued
    }
    sum.summing = true;
  }

  // Phase 2 complete: every owner's sum into the caller's data.
  void finish_sum(PendingSum& sum, Deadline deadline) {
    for (int s = 0; s < sum.members(); ++s) {
      const auto i = static_cast<std::size_t>(s);
      const std::size_t offset = sum.begin(s) * sum.element_bytes;
      const std::size_t length = sum.segment_bytes(s);
      const std::byte* source = sum.owned_sum.data();
      if (s != sum.position) {
        await_receive(sum.sums[i], length, sum.group[i], deadline, sum.what);
        source = sum.sums[i]->scratch.data();
      }
      if (length > 0) std::memcpy(sum.data.data() + offset, source, length);
    }
    sum.finished = true;
  }

  // Moves the group's sums on as far as they can go without waiting: phase 2 is posted in
  // issue order (a sum whose parts are missing holds back the later ones), finished sums leave.
  void advance(const std::vector<int>& group) {
    auto it = pending_sums.find(group);
    if (it == pending_sums.end()) return;
    const Deadline now = Clock::now();  // nothing below waits: every operation read is done
    bool in_order = true;
    for (const auto& sum : it->second) {
      if (!sum->summing && in_order) {
        if (all_done(sum->headers) && all_done(sum->parts)) {
          post_sums(*sum, now);
        } else {
          in_order = false;
        }
      }
      if (sum->summing && !sum->finished && all_done(sum->sums)) finish_sum(*sum, now);
    }
    std::erase_if(it->second, [](const auto& sum) { return sum->finished; });
    if (it->second.empty()) pending_sums.erase(it);
  }

  // The operation `sum` waits for next: a part of the oldest sum of its group whose phase 1 is
  // incomplete (phase 2 goes in issue order), else one of its own sums.
  std::pair<std::shared_ptr<Operation>, const PendingSum*> next_blocker(const PendingSum& sum) {
    auto it = pending_sums.find(sum.group);
    if (it != pending_sums.end()) {
      for (const auto& earlier : it->second) {
        if (!earlier->summing) {
          for (const auto* ops : {&earlier->headers, &earlier->parts}) {
            for (const auto& op : *ops) {
              if (op && !engine->done(*op)) return {op, earlier.get()};
            }
          }
        }
        if (earlier.get() == &sum) break;
      }
    }
    for (const auto& op : sum.sums) {
      if (op && !engine->done(*op)) return {op, &sum};
    }
    return {nullptr, &sum};
  }

  void wait_sum(PendingSum& sum, Deadline deadline) {
    while (true) {
      advance(sum.group);
      if (sum.finished) return;
      if (sum.abandoned) throw std::logic_error(sum.what + ": waited for after it was abandoned");
      const auto [op, owner] = next_blocker(sum);
      if (!op) continue;  // completed meanwhile: the next advance takes it
      engine->wait(*op, deadline, [&, owner = owner] {
        std::string member = "a member";
        for (std::size_t i = 0; i < owner->group.size(); ++i) {
          if (op == owner->headers[i] || op == owner->parts[i] || op == owner->sums[i]) {
            member = "rank " + std::to_string(owner->group[i]);
          }
        }
        return owner->what + ": the message from " + member + " was";
      });
    }
  }

  void abandon_sum(const std::shared_ptr<PendingSum>& sum) {
    if (sum->finished) return;
    sum->abandoned = true;
    auto it = pending_sums.find(sum->group);
    if (it == pending_sums.end()) return;
    std::erase(it->second, sum);
    if (it->second.empty()) pending_sums.erase(it);
  }

  template <typename V>
  void sum(std::span<V> data, std::span<const int> group, Deadline deadline) {
    constexpr CollectiveKind kind =
        std::is_same_v<V, float> ? CollectiveKind::kSumFloat : CollectiveKind::kSumDouble;
    auto pending = start_sum(kind, sizeof(V), std::as_writable_bytes(data), group);
    try {
      wait_sum(*pending, deadline);
    } catch (...) {
      abandon_sum(pending);
      throw;
    }
  }

  void broadcast(std::span<std::byte> data, int root, std::span<const int> group,
                 Deadline deadline) {
    const int position = position_in(group);
    std::vector<int> members(group.begin(), group.end());
    const std::int64_t number = sequence[members]++;
    const std::string what = where(std::string(to_string(CollectiveKind::kBroadcast)) + " #" +
                                   std::to_string(number) + " over " + group_to_string(group));
    const auto root_it = std::find(group.begin(), group.end(), root);
    if (root_it == group.end()) {
      throw std::invalid_argument(what + ": root " + std::to_string(root) + " is not in the group");
    }
    if (group.size() == 1) return;
    checked_count(data.size(), what);
    const Header header{fingerprint(group), number,
                        static_cast<std::int64_t>(CollectiveKind::kBroadcast),
                        static_cast<std::int64_t>(data.size()), root};
    const int tag = tag_of(header.group_fingerprint, number, 1);
    if (group[static_cast<std::size_t>(position)] == root) {
      for (int member : group) {
        if (member == root) continue;
        send_copy(&header, sizeof(Header), member, tag, what);
        send_payload(data.data(), data.size(), member, tag, what);
      }
      return;
    }
    auto header_op = receive_into_scratch(sizeof(Header), root, tag, what);
    auto payload = receive_into_scratch(data.size(), root, tag, what);
    await_receive(header_op, sizeof(Header), root, deadline, what);
    check_header(header_op, header, root, what);
    await_receive(payload, data.size(), root, deadline, what);
    if (!data.empty()) std::memcpy(data.data(), payload->scratch.data(), data.size());
  }
};

MpiCommunicator::MpiCommunicator(const MpiSession& session) : impl_(std::make_unique<Impl>()) {
  impl_->rank = session.world_rank();
  impl_->size = session.world_size();
  const int rank = impl_->rank;
  PF_MPI_CHECK(rank, MPI_Comm_dup(MPI_COMM_WORLD, &impl_->world));
  PF_MPI_CHECK(rank, MPI_Comm_set_errhandler(impl_->world, MPI_ERRORS_RETURN));
  PF_MPI_CHECK(rank, MPI_Comm_dup(MPI_COMM_WORLD, &impl_->collectives));
  PF_MPI_CHECK(rank, MPI_Comm_set_errhandler(impl_->collectives, MPI_ERRORS_RETURN));
  int* upper = nullptr;
  int found = 0;
  PF_MPI_CHECK(rank, MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &upper, &found));
  if (found != 0 && upper != nullptr) impl_->tag_upper_bound = *upper;
  impl_->engine = std::make_unique<ProgressEngine>();
}

MpiCommunicator::~MpiCommunicator() {
  impl_->engine.reset();
  MPI_Comm_free(&impl_->collectives);
  MPI_Comm_free(&impl_->world);
}

int MpiCommunicator::rank() const {
  return impl_->rank;
}
int MpiCommunicator::size() const {
  return impl_->size;
}

std::unique_ptr<Request> MpiCommunicator::isend(int peer, std::int64_t tag,
                                                std::span<const std::byte> data) {
  impl_->check_peer(peer, tag, "send");
  const int count = Impl::checked_count(data.size(), impl_->where("send"));
  const int rank = impl_->rank;
  auto op = std::make_shared<Operation>();
  PF_MPI_CHECK(rank, MPI_Isend(data.data(), count, MPI_BYTE, peer, static_cast<int>(tag),
                               impl_->world, &op->request));
  impl_->payload_sent += static_cast<std::int64_t>(data.size());
  impl_->engine->add(op);
  return std::make_unique<MpiRequest>(*impl_->engine, std::move(op), false, rank, peer, tag,
                                      data.size());
}

std::unique_ptr<Request> MpiCommunicator::irecv(int peer, std::int64_t tag,
                                                std::span<std::byte> data) {
  impl_->check_peer(peer, tag, "receive");
  const int count = Impl::checked_count(data.size(), impl_->where("receive"));
  const int rank = impl_->rank;
  auto op = std::make_shared<Operation>();
  PF_MPI_CHECK(rank, MPI_Irecv(data.data(), count, MPI_BYTE, peer, static_cast<int>(tag),
                               impl_->world, &op->request));
  impl_->engine->add(op);
  return std::make_unique<MpiRequest>(*impl_->engine, std::move(op), true, rank, peer, tag,
                                      data.size());
}

void MpiCommunicator::all_reduce_sum(std::span<float> data, std::span<const int> group,
                                     Deadline deadline) {
  impl_->sum(data, group, deadline);
}

void MpiCommunicator::all_reduce_sum(std::span<double> data, std::span<const int> group,
                                     Deadline deadline) {
  impl_->sum(data, group, deadline);
}

namespace {
// A non-blocking sum: test() and wait() move its group's sums on from this rank's thread.
class MpiSumRequest final : public Request {
 public:
  MpiSumRequest(MpiCommunicator::Impl& impl, std::shared_ptr<MpiCommunicator::Impl::PendingSum> sum)
      : impl_(&impl), sum_(std::move(sum)) {}
  ~MpiSumRequest() override { impl_->abandon_sum(sum_); }
  MpiSumRequest(const MpiSumRequest&) = delete;
  MpiSumRequest& operator=(const MpiSumRequest&) = delete;
  bool test() override {
    if (!sum_->finished) impl_->advance(sum_->group);
    return sum_->finished;
  }
  void wait(Deadline deadline) override { impl_->wait_sum(*sum_, deadline); }

 private:
  MpiCommunicator::Impl* impl_;
  std::shared_ptr<MpiCommunicator::Impl::PendingSum> sum_;
};
}  // namespace

std::unique_ptr<Request> MpiCommunicator::iall_reduce_sum(std::span<float> data,
                                                          std::span<const int> group,
                                                          Deadline /*deadline*/) {
  return std::make_unique<MpiSumRequest>(*impl_,
                                         impl_->start_sum(CollectiveKind::kSumFloat, sizeof(float),
                                                          std::as_writable_bytes(data), group));
}

std::unique_ptr<Request> MpiCommunicator::iall_reduce_sum(std::span<double> data,
                                                          std::span<const int> group,
                                                          Deadline /*deadline*/) {
  return std::make_unique<MpiSumRequest>(
      *impl_, impl_->start_sum(CollectiveKind::kSumDouble, sizeof(double),
                               std::as_writable_bytes(data), group));
}

void MpiCommunicator::broadcast(std::span<std::byte> data, int root, std::span<const int> group,
                                Deadline deadline) {
  impl_->broadcast(data, root, group, deadline);
}

std::int64_t MpiCommunicator::payload_bytes_sent() const {
  return impl_->payload_sent.load();
}

void MpiCommunicator::abort(const std::string& reason) {
  std::fprintf(stderr, "rank %d: aborting the MPI job: %s\n", impl_->rank, reason.c_str());
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::abort();  // MPI_Abort does not return; should it, the process still ends with an error
}

void MpiCommunicator::barrier(Deadline deadline) {
  auto op = std::make_shared<Operation>();
  PF_MPI_CHECK(impl_->rank, MPI_Ibarrier(impl_->world, &op->request));
  impl_->engine->add(op);
  impl_->await(op, deadline, impl_->where("barrier over the world"));
}

std::vector<std::vector<std::byte>> MpiCommunicator::gather_to_root(std::span<const std::byte> data,
                                                                    Deadline deadline) {
  const int rank = impl_->rank, size = impl_->size;
  const std::string what = impl_->where("gather to rank 0");
  const int count = Impl::checked_count(data.size(), what);
  auto sizes = std::make_shared<Operation>();
  sizes->ints.assign(static_cast<std::size_t>(size) + 1, count);  // [0]: this rank's
  PF_MPI_CHECK(rank, MPI_Igather(sizes->ints.data(), 1, MPI_INT, sizes->ints.data() + 1, 1, MPI_INT,
                                 0, impl_->world, &sizes->request));
  impl_->engine->add(sizes);
  impl_->await(sizes, deadline, what + " (sizes)");
  auto payload = std::make_shared<Operation>();
  payload->ints.resize(2 * static_cast<std::size_t>(size));
  int* counts = payload->ints.data();
  int* offsets = counts + size;
  std::size_t total = 0;
  if (rank == 0) {
    std::copy(sizes->ints.begin() + 1, sizes->ints.end(), counts);
    for (std::size_t r = 0; r < static_cast<std::size_t>(size); ++r) {
      offsets[r] = Impl::checked_count(total, what);
      total += static_cast<std::size_t>(counts[r]);
    }
    Impl::checked_count(total, what);
  }
  payload->scratch.resize(data.size() + total);
  std::memcpy(payload->scratch.data(), data.data(), data.size());
  PF_MPI_CHECK(rank, MPI_Igatherv(payload->scratch.data(), count, MPI_BYTE,
                                  payload->scratch.data() + data.size(), counts, offsets, MPI_BYTE,
                                  0, impl_->world, &payload->request));
  impl_->engine->add(payload);
  impl_->await(payload, deadline, what);
  std::vector<std::vector<std::byte>> result;
  if (rank != 0) return result;
  const std::byte* gathered = payload->scratch.data() + data.size();
  for (std::size_t r = 0; r < static_cast<std::size_t>(size); ++r) {
    result.emplace_back(gathered + offsets[r], gathered + offsets[r] + counts[r]);
  }
  return result;
}

}  // namespace pf::comm
