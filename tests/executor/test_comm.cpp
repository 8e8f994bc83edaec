// The in-process communicator: ordering, sizes, collectives, deadlines and abort.
#include <cstring>
#include <random>
#include <thread>

#include <gtest/gtest.h>

#include "runtime/comm/in_process.h"

namespace pf::comm {
namespace {

Deadline soon(int ms = 2000) {
  return Clock::now() + std::chrono::milliseconds(ms);
}

TEST(InProcessComm, MessagesWithOneTagArriveInOrder) {
  InProcessWorld world(2);
  for (int value : {1, 2, 3}) {
    world.rank(0).isend(1, 7, std::as_bytes(std::span<const int>(&value, 1)))->wait(soon());
  }
  for (int expected : {1, 2, 3}) {
    int got = 0;
    world.rank(1).irecv(0, 7, std::as_writable_bytes(std::span<int>(&got, 1)))->wait(soon());
    EXPECT_EQ(got, expected);
  }
  EXPECT_EQ(world.pending_messages(), 0U);
}

TEST(InProcessComm, SizeMismatchAndBadPeerAreErrors) {
  InProcessWorld world(2);
  const double value = 1.0;
  world.rank(0).isend(1, 1, std::as_bytes(std::span<const double>(&value, 1)));
  float small = 0;
  auto request = world.rank(1).irecv(0, 1, std::as_writable_bytes(std::span<float>(&small, 1)));
  EXPECT_THROW(request->wait(soon()), std::runtime_error);
  EXPECT_THROW(world.rank(0).isend(0, 1, {}), std::invalid_argument);
  EXPECT_THROW(world.rank(0).isend(5, 1, {}), std::invalid_argument);
}

TEST(InProcessComm, ReceiveTimesOutNamingThePeerAndTag) {
  InProcessWorld world(2);
  float value = 0;
  auto request = world.rank(1).irecv(0, 42, std::as_writable_bytes(std::span<float>(&value, 1)));
  try {
    request->wait(soon(50));
    FAIL();
  } catch (const TimeoutError& error) {
    EXPECT_NE(std::string(error.what()).find("rank 0 with tag 42"), std::string::npos);
  }
}

TEST(InProcessComm, AllReduceIsIdenticalOnEveryMember) {
  InProcessWorld world(3);
  std::vector<std::vector<float>> data = {{0.1F, 1e8F}, {0.2F, -1e8F}, {0.3F, 1.0F}};
  std::vector<std::thread> threads;
  const std::vector<int> group = {0, 1, 2};
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] {
      world.rank(r).all_reduce_sum(std::span<float>(data[static_cast<std::size_t>(r)]), group,
                                   soon());
    });
  }
  for (auto& t : threads) t.join();
  const float expected0 = (0.1F + 0.2F) + 0.3F;
  const float expected1 = (1e8F + -1e8F) + 1.0F;
  for (const auto& d : data) {
    EXPECT_EQ(d[0], expected0);
    EXPECT_EQ(d[1], expected1);
  }
}

TEST(InProcessComm, BroadcastAndSubgroups) {
  InProcessWorld world(4);
  std::vector<std::array<double, 2>> data = {{1, 2}, {0, 0}, {5, 5}, {0, 0}};
  std::vector<std::thread> threads;
  for (int r = 0; r < 4; ++r) {
    threads.emplace_back([&, r] {
      const std::vector<int> group = r % 2 == 0 ? std::vector<int>{0, 2} : std::vector<int>{1, 3};
      auto& mine = data[static_cast<std::size_t>(r)];
      if (r % 2 == 0) {
        world.rank(r).broadcast(std::as_writable_bytes(std::span<double>(mine)), 0, group, soon());
      } else {
        mine = {static_cast<double>(r), 1};
        world.rank(r).all_reduce_sum(std::span<double>(mine), group, soon());
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(data[2][0], 1);
  EXPECT_EQ(data[2][1], 2);
  EXPECT_EQ(data[1][0], 4);
  EXPECT_EQ(data[3][1], 2);
}

TEST(InProcessComm, CollectiveTimeoutNamesTheMissingRanks) {
  InProcessWorld world(3);
  double value = 1;
  try {
    world.rank(0).all_reduce_sum(std::span<double>(&value, 1), std::vector<int>{0, 1, 2}, soon(50));
    FAIL();
  } catch (const TimeoutError& error) {
    EXPECT_NE(std::string(error.what()).find("ranks 1, 2 did not join"), std::string::npos)
        << error.what();
  }
}

TEST(InProcessComm, AbortWakesEveryWaiter) {
  InProcessWorld world(2);
  std::thread waiter([&] {
    float value = 0;
    auto request = world.rank(1).irecv(0, 3, std::as_writable_bytes(std::span<float>(&value, 1)));
    EXPECT_THROW(request->wait(soon(20000)), AbortedError);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const auto start = Clock::now();
  world.rank(0).abort("rank 0 failed: out of data");
  waiter.join();
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(5));
  double value = 0;
  EXPECT_THROW(
      world.rank(0).all_reduce_sum(std::span<double>(&value, 1), std::vector<int>{0, 1}, soon()),
      AbortedError);
}

// Rank r's values: mixed magnitudes and signs, so that the order of addition shows.
std::vector<float> values_of(int rank, std::size_t count) {
  std::mt19937 random(static_cast<unsigned>(rank) * 7919U + 1U);
  std::uniform_real_distribution<float> mantissa(-1.0F, 1.0F);
  std::uniform_int_distribution<int> exponent(-8, 8);
  std::vector<float> values(count);
  for (auto& v : values) v = std::ldexp(mantissa(random), exponent(random));
  return values;
}

// Non-blocking sums (data-parallel buckets) in flight together with a blocking one on the same
// group, completed in another order than issued, give the blocking sums' bits.
TEST(InProcessComm, NonBlockingSumsEqualBlockingOnesInAnyCompletionOrder) {
  const std::vector<int> group = {0, 1, 2};
  const std::vector<std::size_t> sizes = {1001, 3, 17};
  std::vector<std::vector<std::vector<float>>> blocking(3), non_blocking(3);
  {
    InProcessWorld world(3);
    std::vector<std::thread> threads;
    for (int r = 0; r < 3; ++r) {
      threads.emplace_back([&, r] {
        for (std::size_t i = 0; i < sizes.size(); ++i) {
          auto data = values_of(r * 10 + static_cast<int>(i), sizes[i]);
          world.rank(r).all_reduce_sum(std::span<float>(data), group, soon());
          blocking[static_cast<std::size_t>(r)].push_back(std::move(data));
        }
      });
    }
    for (auto& t : threads) t.join();
  }
  InProcessWorld world(3);
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] {
      auto& mine = non_blocking[static_cast<std::size_t>(r)];
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        mine.push_back(values_of(r * 10 + static_cast<int>(i), sizes[i]));
      }
      auto first = world.rank(r).iall_reduce_sum(std::span<float>(mine[0]), group, soon());
      auto second = world.rank(r).iall_reduce_sum(std::span<float>(mine[1]), group, soon());
      world.rank(r).all_reduce_sum(std::span<float>(mine[2]), group, soon());
      // Polling never blocks; the last to complete is the first issued.
      while (!second->test()) std::this_thread::yield();
      EXPECT_TRUE(second->test());
      first->wait(soon());
    });
  }
  for (auto& t : threads) t.join();
  for (std::size_t r = 0; r < 3; ++r) {
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      EXPECT_EQ(
          std::memcmp(non_blocking[r][i].data(), blocking[r][i].data(), sizes[i] * sizeof(float)),
          0)
          << "rank " << r << " sum " << i;
    }
  }
  // A group of one: complete at once, the data unchanged.
  std::vector<float> alone = {1.5F};
  EXPECT_TRUE(
      world.rank(1).iall_reduce_sum(std::span<float>(alone), std::vector<int>{1}, soon())->test());
  EXPECT_EQ(alone[0], 1.5F);
}

TEST(InProcessComm, NonBlockingSumTimesOutOrIsAbandonedWithoutHanging) {
  InProcessWorld world(3);
  std::vector<double> value = {1.0};
  auto request =
      world.rank(0).iall_reduce_sum(std::span<double>(value), std::vector<int>{0, 2}, soon());
  EXPECT_FALSE(request->test());
  const auto start = Clock::now();
  try {
    request->wait(soon(50));
    FAIL();
  } catch (const TimeoutError& error) {
    EXPECT_NE(std::string(error.what())
                  .find("rank 0: all-reduce (double) #0 over {0, 2}: ranks 2 did not join"),
              std::string::npos)
        << error.what();
  }
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(5));
  // A member that gives up on a sum (its request destroyed) fails the others' at once.
  auto abandoned =
      world.rank(1).iall_reduce_sum(std::span<double>(value), std::vector<int>{1, 2}, soon());
  abandoned.reset();
  std::vector<double> other = {2.0};
  try {
    world.rank(2).all_reduce_sum(std::span<double>(other), std::vector<int>{1, 2}, soon(20000));
    FAIL();
  } catch (const std::runtime_error& error) {
    EXPECT_NE(std::string(error.what()).find("rank 1 abandoned it"), std::string::npos)
        << error.what();
  }
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(5));
}

TEST(InProcessComm, GroupsMustBeSortedAndContainTheCaller) {
  InProcessWorld world(3);
  double value = 0;
  EXPECT_THROW(
      world.rank(0).all_reduce_sum(std::span<double>(&value, 1), std::vector<int>{1, 2}, soon()),
      std::invalid_argument);
  EXPECT_THROW(
      world.rank(0).all_reduce_sum(std::span<double>(&value, 1), std::vector<int>{1, 0}, soon()),
      std::invalid_argument);
  EXPECT_THROW(InProcessWorld(0), std::invalid_argument);
}

}  // namespace
}  // namespace pf::comm
