// The device seam's CPU-side logic: --device parsing, opening a device where there is none (or
// no CUDA in the build), the in-process message exchange, and the stream timeline that turns
// marks recorded in stream order into instruction times (with host-clock marks on the CPU
// backend, whose work is done when the call returns).
#include <algorithm>
#include <memory>
#include <set>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "runtime/device/buffer_pool.h"
#include "runtime/device/device_runtime.h"
#include "runtime/device/device_spec.h"
#include "runtime/device/message_exchange.h"
#include "runtime/device/stream_timeline.h"
#include "runtime/tensor/cpu_backend.h"

namespace pf::device {
namespace {

using tensor::DeviceKind;

TEST(ParseDevice, AcceptsCpuCudaAndAnIndex) {
  EXPECT_EQ(parse_device("cpu"), (tensor::Device{DeviceKind::kCpu, 0}));
  EXPECT_EQ(parse_device("cuda"), (tensor::Device{DeviceKind::kCuda, 0}));
  EXPECT_EQ(parse_device("cuda:0"), (tensor::Device{DeviceKind::kCuda, 0}));
  EXPECT_EQ(parse_device("cuda:3"), (tensor::Device{DeviceKind::kCuda, 3}));
}

TEST(ParseDevice, RefusesAnythingElseNamingTheValue) {
  for (const char* text :
       {"", "gpu", "CUDA", "cuda:", "cuda:-1", "cuda:1x", "cuda:x", "cpu:0", "cuda:99999999999"}) {
    try {
      parse_device(text);
      ADD_FAILURE() << "accepted '" << text << "'";
    } catch (const std::invalid_argument& error) {
      const std::string message = error.what();
      EXPECT_NE(message.find(std::string("--device ") + text + ":"), std::string::npos) << message;
      EXPECT_NE(message.find("cpu, cuda or cuda:N"), std::string::npos) << message;
    }
  }
}

TEST(OpenDeviceRuntime, TheCpuHasNone) {
  EXPECT_EQ(open_device_runtime({DeviceKind::kCpu, 0}), nullptr);
}

// Without a GPU (CI, this machine) or without CUDA in the build: one line saying which.
TEST(OpenDeviceRuntime, NoDeviceIsOneClearLine) {
  for (const int index : {0, 7}) {
    try {
      const auto runtime = open_device_runtime({DeviceKind::kCuda, index});
      if (runtime) GTEST_SKIP() << "a CUDA device is present";
      ADD_FAILURE() << "no runtime and no error";
    } catch (const DeviceUnavailableError& error) {
      const std::string message = error.what();
      EXPECT_EQ(message.find('\n'), std::string::npos) << message;
      EXPECT_EQ(message.rfind("--device cuda:" + std::to_string(index) + ": ", 0), 0U) << message;
      if (cuda_runtime_compiled()) {
        EXPECT_TRUE(message.find("no CUDA device") != std::string::npos ||
                    message.find("no such CUDA device") != std::string::npos)
            << message;
      } else {
        EXPECT_NE(message.find("this build has no CUDA"), std::string::npos) << message;
      }
    }
  }
}

TEST(OpenDeviceRuntime, UnavailableIsABadArgument) {
  // pipefisher_train maps std::invalid_argument to exit status 2.
  static_assert(std::is_base_of_v<std::invalid_argument, DeviceUnavailableError>);
}

DeviceMessage message_of(tensor::Backend& backend, float value) {
  auto data = tensor::Tensor::empty(backend, {2, 3}, tensor::DType::kF32);
  std::fill_n(data.data<float>(), 6, value);
  std::shared_ptr<tensor::Event> ready = backend.create_event();
  auto stream = backend.create_stream();
  ready->record(*stream);
  return {data, ready};
}

TEST(MessageExchange, TakesWhatWasPostedOnce) {
  tensor::CpuBackend backend;
  MessageExchange exchange;
  const auto first = exchange.post(message_of(backend, 1.0F));
  const auto second = exchange.post(message_of(backend, 2.0F));
  EXPECT_NE(first, second);
  EXPECT_EQ(exchange.pending(), 2U);
  const auto taken = exchange.take(second);
  EXPECT_EQ(taken.data.data<float>()[5], 2.0F);
  EXPECT_TRUE(taken.ready->completed());
  EXPECT_EQ(exchange.pending(), 1U);
  try {
    exchange.take(second);
    ADD_FAILURE() << "taken twice";
  } catch (const std::runtime_error& error) {
    EXPECT_NE(std::string(error.what()).find("message " + std::to_string(second)),
              std::string::npos);
  }
  EXPECT_THROW(exchange.take(12345), std::runtime_error);
  EXPECT_EQ(exchange.take(first).data.data<float>()[0], 1.0F);
  EXPECT_EQ(exchange.pending(), 0U);
}

TEST(MessageExchange, RefusesAMessageWithoutItsReadyEvent) {
  tensor::CpuBackend backend;
  MessageExchange exchange;
  EXPECT_THROW(exchange.post({tensor::Tensor::empty(backend, {1}, tensor::DType::kF32), nullptr}),
               std::invalid_argument);
  EXPECT_EQ(exchange.pending(), 0U);
}

TEST(MessageExchange, TicketsAreUniqueAcrossThreads) {
  tensor::CpuBackend backend;
  MessageExchange exchange;
  constexpr int kThreads = 4, kEach = 50;
  std::vector<std::vector<std::uint64_t>> tickets(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kEach; ++i) {
        tickets[static_cast<std::size_t>(t)].push_back(
            exchange.post(message_of(backend, static_cast<float>(t))));
      }
    });
  }
  for (auto& thread : threads) thread.join();
  std::set<std::uint64_t> all;
  for (const auto& list : tickets) all.insert(list.begin(), list.end());
  EXPECT_EQ(all.size(), static_cast<std::size_t>(kThreads * kEach));
  for (int t = 0; t < kThreads; ++t) {
    for (const auto ticket : tickets[static_cast<std::size_t>(t)]) {
      EXPECT_EQ(exchange.take(ticket).data.data<float>()[0], static_cast<float>(t));
    }
  }
}

class Timeline : public ::testing::Test {
 protected:
  tensor::CpuBackend backend_;
  std::unique_ptr<tensor::Stream> stream_ = backend_.create_stream();
  StreamTimeline timeline_{[] { return std::make_unique<HostTimingMark>(); }};
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  double now_s() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }
};

TEST_F(Timeline, SpansAreTheWorkBetweenTheirMarksOnTheHostClock) {
  EXPECT_THROW(timeline_.begin(*stream_), std::logic_error);  // no epoch yet
  const double before = now_s();
  timeline_.set_epoch(*stream_, [this] { return now_s(); });
  const auto first = timeline_.begin(*stream_);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  timeline_.end(first, *stream_);
  const auto second = timeline_.begin(*stream_);
  timeline_.end(second, *stream_);
  const double after = now_s();
  EXPECT_EQ(timeline_.open_spans(), 2U);
  const auto spans = timeline_.resolve();
  ASSERT_EQ(spans.size(), 2U);
  EXPECT_GE(spans[0].end_s - spans[0].start_s, 0.019);
  EXPECT_GE(spans[0].start_s, before);
  EXPECT_LE(spans[0].end_s, spans[1].start_s);
  EXPECT_LE(spans[1].start_s, spans[1].end_s);
  EXPECT_LE(spans[1].end_s, after + 1e-3);
  EXPECT_EQ(timeline_.open_spans(), 0U);
  // Marks are reused: a second round works the same.
  const auto again = timeline_.begin(*stream_);
  EXPECT_EQ(again, 0U);
  timeline_.end(again, *stream_);
  EXPECT_EQ(timeline_.resolve().size(), 1U);
}

TEST_F(Timeline, RestartLeavesTheWaitOutOfTheSpan) {
  timeline_.set_epoch(*stream_, [this] { return now_s(); });
  const auto span = timeline_.begin(*stream_);
  std::this_thread::sleep_for(std::chrono::milliseconds(30));  // waiting for an input
  timeline_.restart(span, *stream_);
  timeline_.end(span, *stream_);
  const auto spans = timeline_.resolve();
  ASSERT_EQ(spans.size(), 1U);
  EXPECT_LT(spans[0].end_s - spans[0].start_s, 0.025);
}

TEST_F(Timeline, MisuseIsALogicError) {
  timeline_.set_epoch(*stream_, [this] { return now_s(); });
  EXPECT_THROW(timeline_.end(0, *stream_), std::logic_error);  // never begun
  const auto span = timeline_.begin(*stream_);
  EXPECT_THROW(timeline_.resolve(), std::logic_error);  // not closed
  timeline_.end(span, *stream_);
  EXPECT_THROW(timeline_.end(span, *stream_), std::logic_error);      // closed
  EXPECT_THROW(timeline_.restart(span, *stream_), std::logic_error);  // closed
  // A new epoch drops what a stopped run left unresolved.
  timeline_.begin(*stream_);
  timeline_.set_epoch(*stream_, [this] { return now_s(); });
  EXPECT_EQ(timeline_.open_spans(), 0U);
  EXPECT_TRUE(timeline_.resolve().empty());
}

TEST(BufferPool, ReusesAReleasedBufferOfTheSameSizeOnceItsLastUseRan) {
  tensor::CpuBackend backend;
  auto stream = backend.create_stream();
  BufferPool pool(backend);
  auto first = pool.acquire({4, 6}, tensor::DType::kF32);
  void* memory = first.raw_data();
  pool.release(std::move(first), *stream);  // the CPU's work has run when the call returns
  EXPECT_EQ(pool.free_buffers(), 1U);
  EXPECT_EQ(pool.free_bytes(), 4U * 6U * sizeof(float));
  const auto other_size = pool.acquire({5, 6}, tensor::DType::kF32);
  EXPECT_NE(other_size.raw_data(), memory);
  const auto other_type = pool.acquire({4, 6}, tensor::DType::kF64);
  EXPECT_NE(other_type.raw_data(), memory);
  const auto again = pool.acquire({3, 8}, tensor::DType::kF32);  // same count, new shape
  EXPECT_EQ(again.raw_data(), memory);
  EXPECT_EQ(again.shape(), (tensor::Shape{3, 8}));
  EXPECT_EQ(pool.reused(), 1U);
  EXPECT_EQ(pool.free_buffers(), 0U);
  pool.release(again, *stream);
  pool.clear();
  EXPECT_EQ(pool.free_buffers(), 0U);
  // Views of memory the pool does not own are not taken.
  float outside[4] = {};
  pool.release(tensor::Tensor::view(outside, {4}, tensor::DType::kF32), *stream);
  EXPECT_EQ(pool.free_buffers(), 0U);
}

// What the K-FAC offload staging pool does at each step's end: it keeps, per size, as many
// buffers as were out at once since the last trim (the next step's copies reuse them, with no
// allocation), and frees the rest, among them buffers it never handed out (a layer's own new
// inverse given back at a write-back), so it does not grow from step to step.
TEST(BufferPool, TrimKeepsWhatWasOutAtOnceAndFreesTheRest) {
  tensor::CpuBackend backend;
  auto stream = backend.create_stream();
  BufferPool pool(backend);
  std::vector<tensor::Tensor> out;
  for (int i = 0; i < 3; ++i) out.push_back(pool.acquire({4, 6}, tensor::DType::kF32));
  for (auto& buffer : out) pool.release(std::move(buffer), *stream);
  out.clear();
  // Not from the pool: a layer's own buffer of the same size, and one of a size never taken.
  pool.release(tensor::Tensor::empty(backend, {4, 6}, tensor::DType::kF32), *stream);
  pool.release(tensor::Tensor::empty(backend, {7}, tensor::DType::kF32), *stream);
  EXPECT_EQ(pool.free_buffers(), 5U);
  pool.trim_to_peak_use();
  EXPECT_EQ(pool.free_buffers(), 3U);  // three were out at once
  EXPECT_EQ(pool.free_bytes(), 3U * 24U * sizeof(float));
  // The next step takes one at a time: reused, nothing allocated; the trim then keeps one.
  const auto allocations = backend.stats().allocations;
  for (int i = 0; i < 2; ++i) pool.release(pool.acquire({24}, tensor::DType::kF32), *stream);
  EXPECT_EQ(backend.stats().allocations, allocations);
  EXPECT_EQ(pool.reused(), 2U);
  pool.trim_to_peak_use();
  EXPECT_EQ(pool.free_buffers(), 1U);
  // A buffer still out at the trim counts for the next one.
  auto held = pool.acquire({24}, tensor::DType::kF32);
  pool.trim_to_peak_use();
  EXPECT_EQ(pool.free_buffers(), 0U);
  pool.release(std::move(held), *stream);
  pool.trim_to_peak_use();
  EXPECT_EQ(pool.free_buffers(), 1U);
}

// A device the host has run ahead of: host memory as the CPU's, but no event has completed
// when the host asks, and a stream counts the waits it was given (a GPU would order them).
class BehindBackend final : public tensor::Backend {
 public:
  struct Stream final : tensor::Stream {
    void synchronize() override {}
    void wait(const tensor::Event& /*event*/) override { ++waits; }
    int waits = 0;
  };
  struct Event final : tensor::Event {
    void record(tensor::Stream& /*stream*/) override {}
    void synchronize() const override {}
    bool completed() const override { return false; }
  };
  tensor::Device device() const override { return cpu_.device(); }
  void* allocate(std::size_t bytes) override { return cpu_.allocate(bytes); }
  void deallocate(void* pointer, std::size_t bytes) noexcept override {
    cpu_.deallocate(pointer, bytes);
  }
  void copy(void* destination, const void* source, std::size_t bytes, tensor::CopyKind kind,
            tensor::Stream* /*stream*/) override {
    cpu_.copy(destination, source, bytes, kind);
  }
  void fill_zero(void* destination, std::size_t bytes, tensor::Stream* /*stream*/) override {
    cpu_.fill_zero(destination, bytes);
  }
  std::unique_ptr<tensor::Stream> create_stream() override { return std::make_unique<Stream>(); }
  std::unique_ptr<tensor::Event> create_event() override { return std::make_unique<Event>(); }
  void synchronize() override {}
  tensor::AllocationStats stats() const override { return cpu_.stats(); }

 private:
  tensor::CpuBackend cpu_;
};

// The K-FAC offload staging pool on a GPU whose work lags the host: the offload's prefetches
// take the buffers the previous preconditionings released, ordered on the copy stream, instead
// of a new allocation each (which made the pool hold every buffer a step used, and the trim
// free them with a cudaFree that waits for the whole device). The message pool's host-ordered
// acquire still allocates rather than hand out a buffer the device may be reading.
TEST(BufferPool, AnOrderedAcquireReusesABufferStillInUseByMakingTheStreamWait) {
  BehindBackend backend;
  auto compute = backend.create_stream();
  auto copy = backend.create_stream();
  auto& copy_waits = dynamic_cast<BehindBackend::Stream&>(*copy).waits;
  BufferPool pool(backend);
  auto first = pool.acquire({4, 6}, tensor::DType::kF32, *copy);
  auto second = pool.acquire({4, 6}, tensor::DType::kF32, *copy);
  EXPECT_EQ(pool.allocated(), 2U);
  void* released_first = first.raw_data();
  pool.release(std::move(first), *compute);
  pool.release(std::move(second), *compute);
  EXPECT_NE(pool.acquire({4, 6}, tensor::DType::kF32).raw_data(), released_first);
  EXPECT_EQ(pool.allocated(), 3U);  // host-ordered: the device may still read both
  const auto allocations = backend.stats().allocations;
  for (int step = 0; step < 4; ++step) {
    auto buffer = pool.acquire({4, 6}, tensor::DType::kF32, *copy);
    pool.release(std::move(buffer), *compute);
  }
  EXPECT_EQ(backend.stats().allocations, allocations);  // nothing allocated
  EXPECT_EQ(pool.allocated(), 3U);
  EXPECT_EQ(pool.reused(), 4U);
  EXPECT_EQ(copy_waits, 4);  // each reuse waits, on the device, for the last use
  auto oldest = pool.acquire({4, 6}, tensor::DType::kF32, *copy);
  EXPECT_EQ(oldest.raw_data(), released_first) << "the buffer released longest ago";
  pool.release(std::move(oldest), *compute);
  pool.trim_to_peak_use();
  EXPECT_EQ(pool.free_buffers(), 2U);  // two were out at once
}

TEST(HostTimingMark, ReadBeforeRecordedIsALogicError) {
  HostTimingMark early, late;
  EXPECT_THROW((void)late.seconds_since(early), std::logic_error);
}

}  // namespace
}  // namespace pf::device
