#pragma once
// Device buffers reused by size instead of allocated per message: on a GPU a cudaMalloc per
// message is slow and a cudaFree waits for the whole device, which would serialise the streams
// of workers sharing it. A buffer comes back with an event recorded after its last use on a
// stream; it is handed out again only once that event has completed. The caller must hold the
// buffer's only reference when it releases it (message buffers, not shared capture copies).
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "runtime/tensor/backend.h"
#include "runtime/tensor/tensor.h"

namespace pf::device {

class BufferPool {
 public:
  explicit BufferPool(tensor::Backend& backend) : backend_(&backend) {}

  // A buffer of `shape` and `dtype`: a free one of the same element count whose last use has
  // completed, else a new allocation. Contents undefined.
  tensor::Tensor acquire(tensor::Shape shape, tensor::DType dtype);
  // The same, ordered on the device instead of the host: when no free buffer's last use has
  // completed, the one released first is handed out all the same and `user` (the stream that
  // writes it next) waits for its last use. A worker's host thread issues work far ahead of the
  // device, so a completion seen by the host would almost never be there: every request would
  // allocate (cudaMalloc), the pool would grow to every buffer a step used, and the trim would
  // free the surplus (cudaFree, which waits for the whole device and every worker sharing it).
  tensor::Tensor acquire(tensor::Shape shape, tensor::DType dtype, tensor::Stream& user);
  // Takes `buffer` back after the work issued so far on `last_use` (an event is recorded there).
  void release(tensor::Tensor buffer, tensor::Stream& last_use);
  // Frees every pooled buffer (call when the streams are idle or the memory is wanted).
  void clear() { free_.clear(); }
  // Frees the pooled buffers beyond the most that were out of the pool at once since the last
  // trim, per element count and type, and starts counting again (call when the streams are
  // idle). A pool that also takes back buffers it did not hand out (a K-FAC layer's own) keeps
  // only what its users took at once, so it does not grow from one use to the next.
  void trim_to_peak_use();
  std::size_t free_buffers() const { return free_.size(); }
  std::size_t free_bytes() const;
  std::size_t reused() const { return reused_; }
  std::size_t allocated() const { return allocated_; }  // acquires that found no free buffer

 private:
  struct Entry {
    tensor::Tensor buffer;
    std::unique_ptr<tensor::Event> last_use;
  };
  struct Use {
    std::int64_t out = 0;   // handed out and not yet back
    std::int64_t peak = 0;  // the most out at once since the last trim
  };
  using Key = std::pair<tensor::DType, std::int64_t>;
  tensor::Backend* backend_;
  std::vector<Entry> free_;
  std::map<Key, Use> use_;
  std::size_t reused_ = 0;
  std::size_t allocated_ = 0;
  // A free buffer of `count` elements and `dtype` (completed first, else with `user` set to wait
  // for it: the one released first); none: a new allocation.
  tensor::Tensor take(tensor::Shape shape, tensor::DType dtype, tensor::Stream* user);
};

}  // namespace pf::device
