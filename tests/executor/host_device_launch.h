#pragma once
// pipefisher_train on the executor's device path, run on the CPU backend: a Launch whose
// executors get a device::HostDeviceRuntime (host memory standing in for device memory, the
// CPU's kernels, K-FAC and optimizers). It runs what --device cuda runs (checkpoints' downloads
// and uploads, the evaluation's device copy, device K-FAC layers) on machines without a GPU;
// with AdamW its runs equal the CPU path's bit for bit. Each executor gets a runtime of its
// own, as each pipefisher_train run opens one.
#include <memory>

#include "runtime/device/host_device_runtime.h"
#include "runtime/executor/executor.h"
#include "runtime/train/trainer.h"

namespace pf::train::testing {

class HostDeviceLaunch final : public Launch {
 public:
  using Launch::make_executor;
  std::unique_ptr<exec::Executor<float>> make_executor(exec::RunSetup<float> setup) override {
    setup.device = std::make_shared<device::HostDeviceRuntime>();
    return std::make_unique<exec::ThreadedExecutor<float>>(std::move(setup));
  }
};

}  // namespace pf::train::testing
