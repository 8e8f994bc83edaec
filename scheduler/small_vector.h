#pragma once
// A vector of trivially copyable values that keeps up to N of them inline and moves to the heap
// beyond. The PipeFisher pass builds ~800k K-FAC tasks and packing items per candidate refresh
// interval at p = 64, m = 1024, nearly all with one worker, one instruction and one
// dependency: a std::vector per field was one allocation each, and allocation and the page
// faults of freeing and refilling the heap were a third of the pass (docs/benchmarks.md).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <iterator>
#include <new>
#include <type_traits>
#include <vector>

namespace pf {

template <typename T, std::size_t N>
class SmallVector {
  static_assert(std::is_trivially_copyable_v<T>, "SmallVector holds trivially copyable values");
  static_assert(N >= 1);

 public:
  using value_type = T;
  using size_type = std::size_t;
  using difference_type = std::ptrdiff_t;
  using reference = T&;
  using const_reference = const T&;
  using pointer = T*;
  using const_pointer = const T*;
  using iterator = T*;
  using const_iterator = const T*;

  SmallVector() = default;
  SmallVector(std::initializer_list<T> values) { assign(values.begin(), values.end()); }
  SmallVector(const std::vector<T>& values) {  // NOLINT: a drop-in for std::vector fields
    assign(values.data(), values.data() + values.size());
  }
  template <typename It>
  SmallVector(It first, It last) {
    assign(first, last);
  }
  SmallVector(const SmallVector& other) { assign(other.begin(), other.end()); }
  SmallVector(SmallVector&& other) noexcept { take(other); }
  SmallVector& operator=(const SmallVector& other) {
    if (this != &other) {
      size_ = 0;
      assign(other.begin(), other.end());
    }
    return *this;
  }
  SmallVector& operator=(SmallVector&& other) noexcept {
    if (this != &other) {
      release();
      take(other);
    }
    return *this;
  }
  SmallVector& operator=(std::initializer_list<T> values) {
    size_ = 0;
    assign(values.begin(), values.end());
    return *this;
  }
  ~SmallVector() { release(); }

  operator std::vector<T>() const { return std::vector<T>(begin(), end()); }  // NOLINT

  T* data() { return on_heap() ? heap_ : std::launder(reinterpret_cast<T*>(inline_)); }
  const T* data() const {
    return on_heap() ? heap_ : std::launder(reinterpret_cast<const T*>(inline_));
  }
  std::size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  std::size_t capacity() const { return capacity_; }
  iterator begin() { return data(); }
  iterator end() { return data() + size_; }
  const_iterator begin() const { return data(); }
  const_iterator end() const { return data() + size_; }
  T& operator[](std::size_t i) { return data()[i]; }
  const T& operator[](std::size_t i) const { return data()[i]; }
  T& front() { return data()[0]; }
  const T& front() const { return data()[0]; }
  T& back() { return data()[size_ - 1]; }
  const T& back() const { return data()[size_ - 1]; }

  void clear() { size_ = 0; }
  void reserve(std::size_t wanted) {
    if (wanted <= capacity_) return;
    T* grown = static_cast<T*>(::operator new(wanted * sizeof(T)));
    const std::uint32_t kept = size_;
    if (kept > 0) std::memcpy(static_cast<void*>(grown), data(), kept * sizeof(T));
    release();
    heap_ = grown;
    capacity_ = static_cast<std::uint32_t>(wanted);
    size_ = kept;
  }
  void push_back(const T& value) {
    if (size_ == capacity_) {
      const T copy = value;  // `value` may live in this vector
      reserve(2 * std::size_t{capacity_});
      data()[size_++] = copy;
      return;
    }
    data()[size_++] = value;
  }
  template <typename... Args>
  T& emplace_back(Args&&... args) {
    push_back(T{std::forward<Args>(args)...});
    return back();
  }
  // Inserts [first, last) before `at` (which must point into this vector or be end()).
  template <typename It>
  iterator insert(const_iterator at, It first, It last) {
    const auto offset = static_cast<std::size_t>(at - begin());
    const auto count = static_cast<std::size_t>(std::distance(first, last));
    if (count == 0) return begin() + offset;
    if (size_ + count > capacity_) reserve(std::max(size_ + count, 2 * std::size_t{capacity_}));
    T* base = data();
    std::memmove(static_cast<void*>(base + offset + count), base + offset,
                 (size_ - offset) * sizeof(T));
    std::copy(first, last, base + offset);
    size_ = static_cast<std::uint32_t>(size_ + count);
    return base + offset;
  }

  friend bool operator==(const SmallVector& a, const SmallVector& b) {
    return std::equal(a.begin(), a.end(), b.begin(), b.end());
  }

 private:
  bool on_heap() const { return capacity_ > N; }
  template <typename It>
  void assign(It first, It last) {
    const auto count = static_cast<std::size_t>(std::distance(first, last));
    reserve(count);
    std::copy(first, last, data());
    size_ = static_cast<std::uint32_t>(count);
  }
  void release() {
    if (on_heap()) ::operator delete(heap_);
    capacity_ = N;
    size_ = 0;
  }
  void take(SmallVector& other) {
    if (other.on_heap()) {
      heap_ = other.heap_;
      capacity_ = other.capacity_;
    } else {
      std::memcpy(inline_, other.inline_, other.size_ * sizeof(T));
    }
    size_ = other.size_;
    other.capacity_ = N;
    other.size_ = 0;
  }

  // Raw storage: T need not be default-constructible for the union (trivially copyable values
  // come to life by memcpy and copy).
  union {
    alignas(T) std::byte inline_[N * sizeof(T)];
    T* heap_;
  };
  std::uint32_t size_ = 0;  // 32-bit: a task's dependencies number thousands, not billions
  std::uint32_t capacity_ = N;
};

}  // namespace pf
