#pragma once
// The K-FAC state of one offloaded Linear in pinned host memory, on the executor's device path
// (docs/offload.md): what HostKfacState is to the CPU path, with the same rules (both factors'
// values, the newest inverses written back and the ones they replaced), but the copies are
// asynchronous on the worker's copy stream and the device side is the DeviceKfacLayer's
// buffers, which the layer lends (detach) and takes (attach):
//   - a write-back waits (on the copy stream) for the compute stream's work so far, copies the
//     device buffers out, and hands them to `staging` once the copies have run;
//   - a prefetch takes a buffer from `staging`, copies into it on the copy stream and attaches
//     it; the caller makes the compute stream wait for the copy stream before the first
//     instruction that reads it (ready()).
// The host reads the pinned buffers only after waiting for the copy stream.
#include <cstdint>

#include "runtime/device/buffer_pool.h"
#include "runtime/device/device_runtime.h"
#include "runtime/executor/host_kfac_state.h"
#include "runtime/tensor/backend.h"

namespace pf::exec {

// What the copies run on: the worker's streams, its runtime and the pool the device buffers of
// offloaded matrices come from and go back to.
struct OffloadStreams {
  device::DeviceRuntime* runtime = nullptr;
  tensor::Stream* compute = nullptr;
  tensor::Stream* copy = nullptr;
  device::BufferPool* staging = nullptr;
};

class PinnedKfacState {
 public:
  using Matrix = device::DeviceKfacLayer::Matrix;

  // device -> host after an inversion: both factor values, and the new inverse of each factor
  // marked new (the host's inverse before it becomes the previous one); the layer gives up
  // those buffers. `this_round` as HostKfacState::write_back's.
  void write_back(const OffloadStreams& on, device::DeviceKfacLayer& layer, bool new_a, bool new_b,
                  bool this_round = true);
  // host -> device before an inversion: both factor values (a factor with none on the host
  // before the first write-back has its device value dropped, as on the CPU path).
  void prefetch_factors(const OffloadStreams& on, device::DeviceKfacLayer& layer, std::int64_t d_in,
                        std::int64_t d_out) const;
  // host -> device: one factor's inverse (the newest written back, or the one it replaced:
  // `previous`) into the layer's matrix `into` (kInverse or kPreviousInverse); with none on the
  // host the layer's matrix is dropped (before the first refresh: preconditioning is the
  // identity).
  void prefetch_inverse(const OffloadStreams& on, device::DeviceKfacLayer& layer, bool a,
                        bool previous, std::int64_t d, Matrix into) const;

  // Allocates up front the pinned buffers this Linear will hold on this replica: both factors'
  // values (`values`), and their newest and previous inverses (`inverses`). Pinning pages
  // (cudaHostAlloc) is slow and serialised in the driver: done at a refresh's first write-backs,
  // it held up every worker sharing the device in the steps that wrote back (the H200 run of
  // 2026-11-28: 2.0-1.4 s against 0.63-0.69 s without offload in steps 2-4, 0.71 s in the step
  // without write-backs).
  void reserve(const OffloadStreams& on, std::int64_t d_in, std::int64_t d_out, bool values,
               bool inverses);
  bool written_back(bool a) const { return a ? written_a_ : written_b_; }
  void begin_round() { written_a_ = written_b_ = false; }
  std::int64_t bytes() const;  // pinned host memory allocated

  // Checkpoints (HostKfacState's): after the copy stream's work so far. load throws
  // std::invalid_argument for a matrix that is neither empty nor d x d.
  OffloadedFactor to_host(const OffloadStreams& on, bool a, std::int64_t d) const;
  void load(const OffloadStreams& on, bool a, std::int64_t d, const OffloadedFactor& factor,
            bool written);

 private:
  // A pinned buffer and whether it holds a matrix (a reserved one may not yet, and one whose
  // device matrix was gone at a write-back no longer does).
  struct Held {
    device::PinnedHostBuffer buffer;
    bool held = false;
  };
  struct Factor {
    Held value, inverse, previous_inverse;
  };
  Factor a_, b_;
  bool written_a_ = false, written_b_ = false;
};

// A device buffer the layer gave up (or that a prefetch replaced) back to `staging`, reused once
// the work issued so far on `last_use` has run. Nothing for an empty tensor.
void release_staging(const OffloadStreams& on, tensor::Tensor buffer, tensor::Stream& last_use);

}  // namespace pf::exec
