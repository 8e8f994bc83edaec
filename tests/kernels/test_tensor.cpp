// Tensors, the CPU backend and arenas.
#include <gtest/gtest.h>

#include "runtime/tensor/arena.h"
#include "runtime/tensor/cpu_backend.h"
#include "runtime/tensor/tensor.h"

namespace pf::tensor {
namespace {

TEST(Tensor, OwnsAndFreesItsMemory) {
  CpuBackend backend;
  {
    Tensor t = Tensor::zeros(backend, {3, 4}, DType::kF32);
    EXPECT_EQ(t.numel(), 12);
    EXPECT_EQ(t.nbytes(), 48U);
    EXPECT_TRUE(t.is_contiguous());
    EXPECT_EQ(t.strides(), (Shape{4, 1}));
    EXPECT_EQ(t.data<float>()[11], 0.0F);
    EXPECT_EQ(backend.stats().bytes_in_use, 48);
    Tensor copy = t;  // shares the storage
    EXPECT_EQ(copy.raw_data(), t.raw_data());
  }
  EXPECT_EQ(backend.stats().bytes_in_use, 0);
  EXPECT_EQ(backend.stats().allocations, 1);
}

TEST(Tensor, ChecksDTypeOnAccessAndShapes) {
  CpuBackend backend;
  Tensor t = Tensor::empty(backend, {2, 3}, DType::kF32);
  EXPECT_THROW(t.data<double>(), std::invalid_argument);
  EXPECT_THROW(t.reshape({4, 2}), std::invalid_argument);
  EXPECT_THROW(t.slice_rows(1, 3), std::out_of_range);
  Tensor rows = t.slice_rows(1, 2);
  EXPECT_EQ(rows.data<float>(), t.data<float>() + 3);
  EXPECT_EQ(t.reshape({6}).shape(), Shape{6});
  EXPECT_THROW(Tensor::empty(backend, {-1}, DType::kF32), std::invalid_argument);
}

TEST(Arena, SteadyStateAllocatesNothing) {
  CpuBackend backend;
  Arena arena(backend);
  auto cycle = [&] {
    for (int i = 0; i < 5; ++i) {
      Tensor t = arena.allocate({700, 1000}, DType::kF32);  // 2.8 MB each: several blocks
      t.data<float>()[0] = 1.0F;
      EXPECT_EQ(reinterpret_cast<std::uintptr_t>(t.raw_data()) % 64, 0U);
    }
    arena.reset();
  };
  cycle();
  const auto after_warm_up = backend.stats().allocations;
  cycle();
  cycle();
  EXPECT_EQ(backend.stats().allocations, after_warm_up);
}

// After the warm-up an arena holds exactly what its cycle hands out (a stash arena's memory is
// BertChunk::stash_bytes(), what the simulator counts), and the warm-up itself holds little more.
TEST(Arena, HoldsWhatItsCycleUsed) {
  CpuBackend backend;
  Arena arena(backend);
  auto cycle = [&] {
    arena.allocate({100}, DType::kF32);
    for (int i = 0; i < 5; ++i) arena.allocate({700, 1000}, DType::kF32);  // 2.8 MB each
    arena.allocate({100}, DType::kF32);
    const std::size_t used = arena.bytes_used();
    arena.reset();
    return used;
  };
  const std::size_t used = cycle();
  EXPECT_EQ(used, 5U * 2'800'000U + 2U * 448U);
  EXPECT_EQ(arena.capacity(), used);
  EXPECT_EQ(backend.stats().bytes_in_use, static_cast<std::int64_t>(used));
  // Small allocations share 1 MiB blocks; the large ones get blocks of their own size.
  EXPECT_LE(backend.stats().peak_bytes_in_use, static_cast<std::int64_t>(used + (2U << 20)));
  const auto after_warm_up = backend.stats().allocations;
  EXPECT_EQ(cycle(), used);
  EXPECT_EQ(backend.stats().allocations, after_warm_up);
  EXPECT_EQ(arena.capacity(), used);
}

TEST(ArenaPool, ReusesReleasedArenas) {
  CpuBackend backend;
  ArenaPool pool(backend);
  auto a = pool.acquire();
  a->allocate({100}, DType::kF32);
  Arena* address = a.get();
  pool.release(std::move(a));
  EXPECT_EQ(pool.idle(), 1U);
  auto b = pool.acquire();
  EXPECT_EQ(b.get(), address);
  EXPECT_EQ(b->bytes_used(), 0U);
}

TEST(CpuBackend, StreamsAndEventsAreImmediate) {
  CpuBackend backend;
  auto stream = backend.create_stream();
  auto event = backend.create_event();
  event->record(*stream);
  stream->wait(*event);
  EXPECT_TRUE(event->completed());
  float source[3] = {1, 2, 3}, target[3] = {};
  backend.copy(target, source, sizeof(source), CopyKind::kHostToDevice, stream.get());
  stream->synchronize();
  EXPECT_EQ(target[2], 3.0F);
}

}  // namespace
}  // namespace pf::tensor
