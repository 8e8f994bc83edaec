// The executor's device path on the CPU backend (HostDeviceRuntime): messages as tickets through
// the MessageExchange with ready events, hand-offs, staged reductions, the tied-embedding sum
// through the ops, device K-FAC layers (inverses kept for the refresh's earlier steps), timing
// marks resolved at the step's end. Against the CPU path (no runtime) on the same schedule:
// equal bit for bit with AdamW (no gradient norm in the update), with LAMB within the rounding
// of the gradient norm (summed per tensor in float by the ops, in double by the CPU path).
// What these tests cannot show is anything about a GPU: see test_executor_cuda.
#include <algorithm>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "kfac/inverse_chain.h"
#include "runtime/comm/in_process.h"
#include "runtime/device/host_device_communicator.h"
#include "tests/executor/device_run.h"

namespace pf::exec {
namespace {

using testing::device_test_batches;
using testing::device_test_config;
using testing::device_test_schedule;
using testing::device_test_setup;
using testing::run_schedule;

struct DeviceCase {
  sched::ScheduleKind kind;
  int workers;
  int chunks;
  bool kfac;
  bool split_backward;
};

std::string name_of(const DeviceCase& c) {
  return std::string(sched::to_string(c.kind)) + "_p" + std::to_string(c.workers) + "_v" +
         std::to_string(c.chunks) + (c.kfac ? "_kfac" : "") + (c.split_backward ? "_split" : "");
}

class HostDevicePath : public ::testing::TestWithParam<DeviceCase> {};

TEST_P(HostDevicePath, EqualsTheCpuPathBitForBit) {
  const auto c = GetParam();
  const auto config = device_test_config(4);
  const auto schedule =
      device_test_schedule(c.kind, c.workers, c.chunks, 4, c.kfac, c.split_backward);
  const std::int64_t steps = 2 * schedule.num_steps + 1;
  const auto cpu = run_schedule(nullptr, config, schedule, "adamw", steps);
  auto runtime = std::make_shared<device::HostDeviceRuntime>();
  const auto device = run_schedule(runtime, config, schedule, "adamw", steps);

  ASSERT_EQ(device.values.size(), cpu.values.size());
  for (const auto& [name, values] : cpu.values) {
    ASSERT_TRUE(device.values.contains(name)) << name;
    const auto& actual = device.values.at(name);
    for (std::size_t i = 0; i < values.size(); ++i) {
      ASSERT_EQ(actual[i], values[i]) << name << "[" << i << "]";
    }
  }
  ASSERT_EQ(device.steps.size(), cpu.steps.size());
  for (std::size_t s = 0; s < cpu.steps.size(); ++s) {
    EXPECT_EQ(device.steps[s].mlm_loss, cpu.steps[s].mlm_loss) << "step " << s;
    EXPECT_EQ(device.steps[s].nsp_loss, cpu.steps[s].nsp_loss) << "step " << s;
    EXPECT_EQ(device.steps[s].kfac_refresh, cpu.steps[s].kfac_refresh) << "step " << s;
    EXPECT_NEAR(device.steps[s].grad_norm, cpu.steps[s].grad_norm, 1e-5 * cpu.steps[s].grad_norm);
  }
  // Every message was taken, every buffer released; stopped inside a K-FAC refresh, both paths
  // keep the same captures for its remaining curvature tasks.
  EXPECT_EQ(device.exchange_pending, 0U);
  EXPECT_EQ(device.pending_messages, 0U);
  EXPECT_EQ(device.transient_bytes, cpu.transient_bytes);
  if (!c.kfac) {
    EXPECT_EQ(device.transient_bytes, 0U);
  }
  // One event per executed instruction, as on the CPU path, timed by the marks.
  ASSERT_EQ(device.events.size(), cpu.events.size());
  std::multiset<std::tuple<int, int, std::int64_t>> cpu_keys, device_keys;
  for (const auto& e : cpu.events) cpu_keys.insert({e.rank, e.position, e.global_step});
  for (const auto& e : device.events) {
    device_keys.insert({e.rank, e.position, e.global_step});
    EXPECT_LE(e.start_s, e.end_s);
    EXPECT_GE(e.start_s, 0.0);
    EXPECT_DOUBLE_EQ(e.busy_s, e.end_s - e.start_s);
  }
  EXPECT_EQ(device_keys, cpu_keys);
  // What the workers allocated (the profile's static and K-FAC bytes): the same parameters,
  // gradients and optimizer state as the CPU path. Each Linear's K-FAC state at its largest
  // counts the device layer's own buffers (DeviceKfacLayer::device_bytes), which are not the
  // CPU path's matrices one for one (7168 against 8192 B for layer 0's value here), but hold
  // at least both factors' values and inverses on both paths.
  ASSERT_EQ(device.memory.size(), cpu.memory.size());
  for (std::size_t r = 0; r < cpu.memory.size(); ++r) {
    EXPECT_GT(cpu.memory[r].static_bytes(), 0) << "rank " << r;
    EXPECT_EQ(device.memory[r].static_bytes(), cpu.memory[r].static_bytes()) << "rank " << r;
    ASSERT_EQ(device.memory[r].kfac.size(), cpu.memory[r].kfac.size()) << "rank " << r;
    EXPECT_EQ(cpu.memory[r].kfac.empty(), !c.kfac) << "rank " << r;
    for (const auto* run : {&cpu, &device}) {
      for (const auto& linear : run->memory[r].kfac) {
        const std::int64_t d_in = linear.linear == sched::LinearKind::kFfnOut ? 24 : 16;
        const std::int64_t d_out = linear.linear == sched::LinearKind::kFfnIn ? 24 : 16;
        EXPECT_GE(linear.peak_bytes, 2 * 4 * (d_in * d_in + d_out * d_out))
            << (run == &cpu ? "CPU" : "device") << " rank " << r << " layer " << linear.layer << " "
            << sched::to_string(linear.linear);
      }
    }
  }
}

// The device-communicator path (the one NCCL takes on GPUs: sends, receives and reductions of
// device buffers by the communicator, ordered by events, no staging) on the host runtime: one
// Worker per rank on threads, each talking through a HostDeviceCommunicator over its
// InProcessWorld rank. Equal to the CPU path bit for bit.
TEST_P(HostDevicePath, ThroughADeviceCommunicatorEqualsTheCpuPathBitForBit) {
  const auto c = GetParam();
  const auto config = device_test_config(4);
  const auto schedule =
      device_test_schedule(c.kind, c.workers, c.chunks, 4, c.kfac, c.split_backward);
  const std::int64_t steps = 2 * schedule.num_steps + 1;
  const auto cpu = run_schedule(nullptr, config, schedule, "adamw", steps, false);

  SyntheticBatches batches(config, 2, 6, 2, 13);
  RunSetup<float> setup;
  setup.config = config;
  setup.schedule = schedule;
  setup.options.init_seed = 7;
  setup.options.dropout_seed = 11;
  setup.options.wait_timeout = std::chrono::seconds(60);
  setup.options.kfac.damping = 1e-2F;
  device::OptimizerChoice choice;
  choice.name = "adamw";
  setup.make_optimizer = [choice] { return device::make_host_optimizer(choice); };
  setup.device = std::make_shared<device::HostDeviceRuntime>();
  setup.device_optimizer = choice;
  setup.learning_rate = [](std::int64_t step) {
    return 1e-2 * (1.0 + 0.5 * static_cast<double>(step));
  };
  setup.batches = &batches;

  const int ranks = schedule.num_workers();
  comm::InProcessWorld world(ranks);
  std::vector<std::unique_ptr<device::HostDeviceCommunicator>> comms;
  std::vector<std::unique_ptr<Worker<float>>> workers;
  for (int r = 0; r < ranks; ++r) {
    comms.push_back(
        std::make_unique<device::HostDeviceCommunicator>(world.rank(r), std::chrono::seconds(60)));
    workers.push_back(std::make_unique<Worker<float>>(setup, *comms.back()));
  }
  std::vector<StepResult> results;
  std::vector<std::string> errors(static_cast<std::size_t>(ranks));
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      try {
        workers[static_cast<std::size_t>(r)]->run(0, steps, [&](const StepResult& result) {
          if (r == 0) results.push_back(result);
        });
      } catch (const std::exception& error) {
        errors[static_cast<std::size_t>(r)] = error.what();
        world.rank(r).abort(error.what());  // release the others
      }
    });
  }
  for (auto& thread : threads) thread.join();
  for (int r = 0; r < ranks; ++r) {
    ASSERT_EQ(errors[static_cast<std::size_t>(r)], "") << "rank " << r;
  }
  // The path was taken: sends and reductions waited on the producers' events, the executor
  // named its instructions, and every gradient reduction went through the asynchronous call.
  int waits = 0, async_reductions = 0;
  for (const auto& comm : comms) {
    waits += comm->device_waits();
    async_reductions += comm->async_reductions();
    EXPECT_FALSE(comm->last_instruction().empty());
  }
  if (ranks > 1) {
    EXPECT_GT(waits, 0);
  }
  if (c.kind == sched::ScheduleKind::kChimera) {
    EXPECT_GT(async_reductions, 0);
  }
  EXPECT_EQ(world.pending_messages(), 0U);
  EXPECT_EQ(setup.device->exchange().pending(), 0U);  // the exchange is not used

  const auto tied = model::tied_parameter_names();
  std::set<std::string> seen;
  for (const auto& worker : workers) {
    for (auto* chunk : worker->chunks()) {
      for (const auto& p : chunk->parameters()) {
        if (p.name == tied.second || seen.contains(p.name)) continue;
        seen.insert(p.name);
        ASSERT_TRUE(cpu.values.contains(p.name)) << p.name;
        const auto& expected = cpu.values.at(p.name);
        for (std::int64_t i = 0; i < p.size; ++i) {
          ASSERT_EQ(p.value[i], expected[static_cast<std::size_t>(i)]) << p.name << "[" << i << "]";
        }
      }
    }
  }
  EXPECT_EQ(seen.size(), cpu.values.size());
  ASSERT_EQ(results.size(), cpu.steps.size());
  for (std::size_t s = 0; s < results.size(); ++s) {
    EXPECT_EQ(results[s].mlm_loss, cpu.steps[s].mlm_loss) << "step " << s;
    EXPECT_EQ(results[s].nsp_loss, cpu.steps[s].nsp_loss) << "step " << s;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Schedules, HostDevicePath,
    ::testing::Values(DeviceCase{sched::ScheduleKind::kOneFOneB, 1, 1, false, false},
                      DeviceCase{sched::ScheduleKind::kOneFOneB, 2, 1, false, false},
                      DeviceCase{sched::ScheduleKind::kGPipe, 4, 1, false, false},
                      DeviceCase{sched::ScheduleKind::kInterleaved, 2, 2, false, false},
                      DeviceCase{sched::ScheduleKind::kOneFOneB, 2, 1, false, true},
                      DeviceCase{sched::ScheduleKind::kChimera, 2, 1, false, false},
                      DeviceCase{sched::ScheduleKind::kOneFOneB, 2, 1, true, false},
                      DeviceCase{sched::ScheduleKind::kGPipe, 2, 1, true, false}),
    [](const ::testing::TestParamInfo<DeviceCase>& param) { return name_of(param.param); });

// Data-parallel gradient buckets on the device-communicator path (what NCCL takes): each bucket
// enqueued through all_reduce_sum_async as its layers finish, the DP reduction only ordering
// the compute stream after them. 1F1B p = 2 x DP = 2 on four threads, against the CPU path
// without buckets: bit for bit on every rank.
TEST(HostDevicePath, DataParallelBucketsThroughADeviceCommunicatorEqualTheCpuPath) {
  const auto config = device_test_config(4);
  sched::ScheduleParams params;
  params.kind = sched::ScheduleKind::kOneFOneB;
  params.workers = 2;
  params.microbatches = 4;
  params.num_layers = 4;
  params.data_parallel = 2;
  const auto schedule = sched::compile(params);
  const std::int64_t steps = 3;
  const auto cpu = run_schedule(nullptr, config, schedule, "adamw", steps, false, 0);

  SyntheticBatches batches(config, 2, 6, 2, 13);
  RunSetup<float> setup;
  setup.config = config;
  setup.schedule = schedule;
  setup.options.init_seed = 7;
  setup.options.dropout_seed = 11;
  setup.options.wait_timeout = std::chrono::seconds(60);
  setup.options.dp_bucket_bytes = 1;  // every finished range of the model alone
  device::OptimizerChoice choice;
  choice.name = "adamw";
  setup.make_optimizer = [choice] { return device::make_host_optimizer(choice); };
  setup.device = std::make_shared<device::HostDeviceRuntime>();
  setup.device_optimizer = choice;
  setup.learning_rate = [](std::int64_t step) {
    return 1e-2 * (1.0 + 0.5 * static_cast<double>(step));
  };
  setup.batches = &batches;
  const int ranks = 4;
  comm::InProcessWorld world(ranks);
  std::vector<std::unique_ptr<device::HostDeviceCommunicator>> comms;
  std::vector<std::unique_ptr<Worker<float>>> workers;
  for (int r = 0; r < ranks; ++r) {
    comms.push_back(
        std::make_unique<device::HostDeviceCommunicator>(world.rank(r), std::chrono::seconds(60)));
    workers.push_back(std::make_unique<Worker<float>>(setup, *comms.back()));
  }
  std::vector<std::string> errors(static_cast<std::size_t>(ranks));
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      try {
        workers[static_cast<std::size_t>(r)]->run(0, steps, {});
      } catch (const std::exception& error) {
        errors[static_cast<std::size_t>(r)] = error.what();
        world.rank(r).abort(error.what());
      }
    });
  }
  for (auto& thread : threads) thread.join();
  for (int r = 0; r < ranks; ++r) ASSERT_EQ(errors[static_cast<std::size_t>(r)], "") << r;
  // Each rank's chunk has its layers, and the embeddings or the head: more buckets than the
  // one whole-chunk reduction per step.
  for (int r = 0; r < ranks; ++r) {
    EXPECT_GE(comms[static_cast<std::size_t>(r)]->async_reductions(), 3 * steps) << "rank " << r;
  }
  const auto tied = model::tied_parameter_names();
  for (int r = 0; r < ranks; ++r) {
    for (auto* chunk : workers[static_cast<std::size_t>(r)]->chunks()) {
      for (const auto& p : chunk->parameters()) {
        if (p.name == tied.second) continue;
        const auto& expected = cpu.values.at(p.name);
        for (std::int64_t i = 0; i < p.size; ++i) {
          ASSERT_EQ(p.value[i], expected[static_cast<std::size_t>(i)])
              << "rank " << r << " " << p.name << "[" << i << "]";
        }
      }
    }
  }
}

// A pipelined K-FAC refresh on the device path: the window's start sets the previous refresh's
// unfinalized sums aside in the device layers, its inversions run in this window finalize them,
// and every step of a window preconditions with the previous refresh's inverses. Equal to the
// CPU path bit for bit over three refreshes and a step, with every task whole and with divided
// tasks (inversions wrapped whole and as the last pieces of a chain begun in the refresh's own
// window, k automatic: the device layer runs the CPU's InverseChain piece by piece).
void expect_pipelined_refresh_matches_the_cpu(bool split) {
  const auto config = device_test_config(4);
  const auto schedule = testing::device_test_pipelined_schedule(4, split);
  ASSERT_TRUE(schedule.kfac_pipelined_refresh);
  int wrapped = 0, continued = 0;  // wrapped inversions; those that end a chain of pieces
  for (const auto& stream : schedule.streams) {
    for (const auto& in : stream) {
      wrapped += sched::is_wrapped(in) ? 1 : 0;
      continued += sched::is_wrapped(in) && in.piece_begin > 0 ? 1 : 0;
    }
  }
  EXPECT_GT(wrapped, continued);
  if (split) {
    EXPECT_GT(continued, 0);
  }
  const std::int64_t steps = 3 * schedule.num_steps + 1;
  const auto cpu = run_schedule(nullptr, config, schedule, "adamw", steps, false);
  const auto device = run_schedule(std::make_shared<device::HostDeviceRuntime>(), config, schedule,
                                   "adamw", steps, false);
  ASSERT_EQ(device.values.size(), cpu.values.size());
  for (const auto& [name, values] : cpu.values) {
    ASSERT_TRUE(device.values.contains(name)) << name;
    const auto& actual = device.values.at(name);
    for (std::size_t i = 0; i < values.size(); ++i) {
      ASSERT_EQ(actual[i], values[i]) << name << "[" << i << "]";
    }
  }
  ASSERT_EQ(device.steps.size(), cpu.steps.size());
  int refreshes = 0;
  for (std::size_t s = 0; s < cpu.steps.size(); ++s) {
    EXPECT_EQ(device.steps[s].mlm_loss, cpu.steps[s].mlm_loss) << "step " << s;
    EXPECT_EQ(device.steps[s].nsp_loss, cpu.steps[s].nsp_loss) << "step " << s;
    EXPECT_EQ(device.steps[s].kfac_refresh, cpu.steps[s].kfac_refresh) << "step " << s;
    refreshes += device.steps[s].kfac_refresh ? 1 : 0;
  }
  // Each of the three refreshes completed serves from the next window's first step on.
  EXPECT_EQ(refreshes, 3);
}

TEST(HostDevicePath, PipelinedKfacRefreshEqualsTheCpuPathBitForBit) {
  expect_pipelined_refresh_matches_the_cpu(false);
}

TEST(HostDevicePath, PipelinedKfacRefreshWithChainsAcrossWindowsEqualsTheCpuPathBitForBit) {
  expect_pipelined_refresh_matches_the_cpu(true);
}

// A device layer's second accumulator: sums set aside while the window accumulates anew, saved
// through the extras, restored into a fresh layer, and finalized there into the same factor as
// in the original; a second set-aside, or finalizing none, is a logic error.
TEST(HostDevicePath, SetAsideSumsRoundTripThroughTheExtras) {
  device::HostDeviceRuntime runtime;
  const auto original = runtime.make_kfac_layer(nullptr, 3, 2, "layer 0 query");
  const std::vector<float> a = {1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 0, 2};  // 4 tokens x 3
  const std::vector<float> g = {1, -1, 2, 0, 3, 1, -2, 2};            // 4 tokens x 2
  original->accumulate(true, {a.data(), 4, 3}, 1.0F, 0, kfac::kPieceUnits);
  original->accumulate(false, {g.data(), 4, 2}, 0.5F, 0, kfac::kPieceUnits);
  original->set_aside(true);
  original->set_aside(false);
  EXPECT_EQ(original->set_aside_microbatches(true), 1);
  EXPECT_EQ(original->pending_microbatches(true), 0);
  EXPECT_THROW(original->set_aside(true), std::logic_error);
  original->accumulate(true, {a.data() + 3, 3, 3}, 1.0F, 0, kfac::kPieceUnits);  // the window's
  const auto extras = original->extras_to_host();
  EXPECT_EQ(extras.set_aside_a_microbatches, 1);
  EXPECT_EQ(extras.set_aside_b_sum.rows(), 2);

  const auto restored = runtime.make_kfac_layer(nullptr, 3, 2, "layer 0 query");
  restored->load(original->to_host());
  restored->load_extras(extras);
  for (auto* layer : {original.get(), restored.get()}) {
    layer->finalize_set_aside(true, 0.0F);
    layer->finalize_set_aside(false, 0.0F);
    EXPECT_THROW(layer->finalize_set_aside(true, 0.0F), std::logic_error);
    EXPECT_EQ(layer->pending_microbatches(true), 1);  // the window's accumulation untouched
  }
  const auto x = original->to_host(), y = restored->to_host();
  EXPECT_EQ(x.a.value, y.a.value);
  EXPECT_EQ(x.b.value, y.b.value);
  EXPECT_EQ(x.a.sum, y.a.sum);
  EXPECT_GT(x.a.value.norm(), 0.0F);
  // A count without its sum is refused naming the layer.
  auto bad = extras;
  bad.set_aside_a_sum = Eigen::MatrixXf();
  try {
    restored->load_extras(bad);
    ADD_FAILURE() << "a set-aside count without its sum was accepted";
  } catch (const std::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find("layer 0 query"), std::string::npos) << error.what();
  }
}

// A device layer's divided inversion: pieces in order give kfac::InverseChain's bits, the last
// installs the inverse and keeps the replaced one as the previous inverse; a chain saved between
// two pieces through the extras and resumed in a fresh layer ends with the same bits; pieces out
// of order, or without the chain's first piece, are logic errors naming the layer.
TEST(HostDevicePath, InversionChainInPiecesIsTheCpuChainAndResumesFromTheExtras) {
  constexpr std::int64_t kIn = 300, kOut = 8, kTokens = 400;  // A: 3 block columns of 128
  std::vector<float> a(kTokens * kIn), g(kTokens * kOut);
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>((i * 7919) % 23) - 11.0F;
  for (std::size_t i = 0; i < g.size(); ++i) g[i] = static_cast<float>((i * 104729) % 17) - 8.0F;
  device::HostDeviceRuntime runtime;
  const auto make_layer = [&] {
    auto layer = runtime.make_kfac_layer(nullptr, kIn, kOut, "layer 2 intermediate");
    layer->accumulate(true, {a.data(), kTokens, kIn}, 1.0F, 0, kfac::kPieceUnits);
    layer->accumulate(false, {g.data(), kTokens, kOut}, 1.0F, 0, kfac::kPieceUnits);
    layer->finalize(true, 0.0F);
    layer->finalize(false, 0.0F);
    layer->invert(true, 0.5F, kfac::InverseMethod::kCholesky);  // the inverse a chain replaces
    return layer;
  };
  const float damping = 0.01F;
  const int cuts[] = {0, 100, 400, 700, kfac::kPieceUnits};

  const auto layer = make_layer();
  const Eigen::MatrixXf first_inverse = layer->to_host().a.inverse;
  kfac::InverseChain reference(layer->to_host().a.value, damping);
  EXPECT_THROW(layer->run_inverse_chain(true, 0, 100), std::logic_error);  // no chain yet
  layer->begin_inverse_chain(true, damping);
  const std::int64_t idle_bytes = make_layer()->device_bytes();
  EXPECT_EQ(layer->device_bytes(), idle_bytes + reference.bytes());
  try {
    layer->run_inverse_chain(true, 100, 400);  // skips [0, 100)
    ADD_FAILURE() << "a piece out of order ran";
  } catch (const std::logic_error& error) {
    EXPECT_NE(std::string(error.what()).find("layer 2 intermediate"), std::string::npos)
        << error.what();
  }
  device::KfacLayerExtras saved;
  for (int p = 0; p + 1 < 5; ++p) {
    layer->run_inverse_chain(true, cuts[p], cuts[p + 1]);
    reference.run(cuts[p], cuts[p + 1]);
    if (cuts[p + 1] == 400) saved = layer->extras_to_host();
    if (cuts[p + 1] < kfac::kPieceUnits) {
      EXPECT_EQ(layer->to_host().a.inverse, first_inverse) << "installed before the last piece";
    }
  }
  const auto expected = reference.take();
  const auto state = layer->to_host();
  EXPECT_EQ(state.a.inverse, expected.inverse);
  EXPECT_EQ(state.a.damping, damping);
  EXPECT_EQ(layer->extras_to_host().previous_a_inverse, first_inverse);
  EXPECT_EQ(layer->extras_to_host().chain_a_next_unit, 0);  // finished: none in progress
  EXPECT_EQ(layer->device_bytes(),
            idle_bytes + static_cast<std::int64_t>(sizeof(float)) * kIn * kIn);

  ASSERT_EQ(saved.chain_a_next_unit, 400);
  EXPECT_EQ(saved.chain_a_damping, damping);
  EXPECT_EQ(saved.chain_b_next_unit, 0);
  const auto resumed = make_layer();
  resumed->load_extras(saved);
  resumed->run_inverse_chain(true, 400, 700);
  resumed->run_inverse_chain(true, 700, kfac::kPieceUnits);
  EXPECT_EQ(resumed->to_host().a.inverse, expected.inverse);

  // A chain's progress outside (0, kPieceUnits), or without its factor, is refused.
  auto bad = saved;
  bad.chain_a_next_unit = kfac::kPieceUnits;
  EXPECT_THROW(resumed->load_extras(bad), std::invalid_argument);
  bad = saved;
  bad.chain_a_factor = Eigen::MatrixXf();
  EXPECT_THROW(resumed->load_extras(bad), std::invalid_argument);
  bad = saved;
  bad.chain_a_factor = Eigen::MatrixXf::Identity(kIn - 1, kIn - 1);
  EXPECT_THROW(resumed->load_extras(bad), std::invalid_argument);
}

TEST(HostDevicePath, LambWithinTheGradientNormsRounding) {
  const auto config = device_test_config(4);
  const auto schedule = device_test_schedule(sched::ScheduleKind::kOneFOneB, 2, 1, 4, false);
  const auto cpu = run_schedule(nullptr, config, schedule, "lamb", 3, false);
  const auto device = run_schedule(std::make_shared<device::HostDeviceRuntime>(), config, schedule,
                                   "lamb", 3, false);
  EXPECT_LT(testing::max_relative_difference(device, cpu), 1e-5);
  EXPECT_TRUE(device.events.empty());  // not recorded when not asked for
}

TEST(HostDevicePath, ADoubleModelIsRefusedOnADevice) {
  const auto config = device_test_config(2);
  SyntheticBatches batches(config, 2, 6, 2, 13);
  RunSetup<double> setup;
  setup.config = config;
  setup.schedule = device_test_schedule(sched::ScheduleKind::kOneFOneB, 2, 1, 2, false);
  setup.make_optimizer = [] { return nullptr; };
  setup.learning_rate = [](std::int64_t) { return 1e-3; };
  setup.batches = &batches;
  setup.device = std::make_shared<device::HostDeviceRuntime>();
  try {
    ThreadedExecutor<double> executor(setup);
    FAIL() << "a double model was accepted on a device";
  } catch (const std::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find("runs float models"), std::string::npos)
        << error.what();
  }
}

// A checkpoint inside a K-FAC refresh window on a device: every K-FAC record (the device
// layers' state, the inverses the refresh replaced, the captures awaiting their curvature
// tasks, all downloaded from the device) equals the CPU path's bit for bit, and a fresh device
// executor restores them exactly (uploaded, downloaded again: the same records). The whole
// resume (weights, optimizer, K-FAC) is CheckpointingTest's *OnTheDevicePath.
std::map<std::string, ckpt::TensorRecord> kfac_records(ThreadedExecutor<float>& executor) {
  std::map<std::string, ckpt::TensorRecord> records;
  for (int r = 0; r < executor.num_ranks(); ++r) {
    auto& worker = executor.worker(r);
    const std::string prefix = "kfac.rank" + std::to_string(r);
    auto all = worker.kfac_state(0).state_records(prefix);
    for (auto& record : worker.kfac_progress_records(prefix + ".progress")) {
      all.push_back(std::move(record));
    }
    for (auto& record : all) records.emplace(record.name, std::move(record));
  }
  return records;
}

// Bit for bit, except that +0 and -0 count as equal: a few captured gradients of padded tokens
// are GEMM sums of denormal products (inputs about 1e-44) that underflow to zero, and such a zero's
// sign follows the denormal-level rounding before it. On an AMD EPYC (Zen 4) in the sanitizer build
// (OpenBLAS's AVX-512 Cooperlake kernels beside Eigen's SSE2 ones) the two paths got opposite signs
// for 1-6 such zeros in 10 of the captures (2026-11-29; none with OpenBLAS's Haswell kernels or
// with Eigen's products); every other value, every factor and every inverse was identical.
bool equal_but_for_signed_zeros(const ckpt::TensorRecord& a, const ckpt::TensorRecord& b) {
  if (a.data == b.data) return true;
  if (a.dtype != ckpt::DType::kF32 || a.data.size() != b.data.size()) return false;
  for (std::size_t i = 0; i + 4 <= a.data.size(); i += 4) {
    float x = 0.0F, y = 0.0F;
    std::memcpy(&x, a.data.data() + i, 4);
    std::memcpy(&y, b.data.data() + i, 4);
    if (std::memcmp(&x, &y, 4) != 0 && !(x == 0.0F && y == 0.0F)) return false;
  }
  return true;
}

TEST(HostDevicePath, KfacProgressCheckpointsEqualTheCpuPathsAndRoundTrip) {
  const auto config = device_test_config(4);
  const auto schedule = device_test_schedule(sched::ScheduleKind::kOneFOneB, 2, 1, 4, true);
  ASSERT_EQ(schedule.num_steps, 2);
  const std::int64_t inside = 2 * schedule.num_steps + 1;  // one step into the third window
  auto run_to_inside = [&](const std::shared_ptr<device::DeviceRuntime>& runtime) {
    auto batches = testing::device_test_batches(config);
    ThreadedExecutor<float> executor(
        testing::device_test_setup(runtime, config, schedule, "adamw", batches, false));
    executor.run(0, inside);
    std::size_t captures = 0;
    for (int r = 0; r < executor.num_ranks(); ++r) {
      captures += executor.worker(r).transient_memory().kfac_captures;
    }
    EXPECT_GT(captures, 0U) << "the window's curvature tasks left no capture to save";
    return kfac_records(executor);
  };
  const auto cpu = run_to_inside(nullptr);
  const auto device = run_to_inside(std::make_shared<device::HostDeviceRuntime>());
  int replaced_inverses = 0, captures = 0;
  for (const auto& [name, record] : cpu) {
    replaced_inverses += name.find("_prev_inv") != std::string::npos ? 1 : 0;
    captures += name.find(".capture.") != std::string::npos ? 1 : 0;
  }
  EXPECT_GT(replaced_inverses, 0);
  EXPECT_GT(captures, 0);
  ASSERT_EQ(device.size(), cpu.size());
  for (const auto& [name, record] : cpu) {
    ASSERT_TRUE(device.contains(name)) << name;
    const auto& actual = device.at(name);
    EXPECT_EQ(actual.dtype, record.dtype) << name;
    EXPECT_EQ(actual.shape, record.shape) << name;
    EXPECT_TRUE(equal_but_for_signed_zeros(actual, record)) << name << " differs";
  }

  // Into a fresh device executor, and out again.
  auto batches = testing::device_test_batches(config);
  ThreadedExecutor<float> fresh(testing::device_test_setup(
      std::make_shared<device::HostDeviceRuntime>(), config, schedule, "adamw", batches, false));
  ckpt::SafetensorsFile file;
  for (const auto& [name, record] : device) file.tensors.emplace(name, record);
  for (int r = 0; r < fresh.num_ranks(); ++r) {
    const std::string prefix = "kfac.rank" + std::to_string(r);
    fresh.worker(r).load_kfac_state(0, file, prefix);
    fresh.worker(r).load_kfac_progress(file, prefix + ".progress");
  }
  const auto restored = kfac_records(fresh);
  ASSERT_EQ(restored.size(), device.size());
  for (const auto& [name, record] : device) {
    ASSERT_TRUE(restored.contains(name)) << name;
    EXPECT_TRUE(restored.at(name).data == record.data) << name << " differs after the round trip";
  }
  // A capture of the wrong width is refused naming it.
  auto bad = file;
  const auto victim = std::find_if(bad.tensors.begin(), bad.tensors.end(), [](const auto& entry) {
    return entry.first.rfind("kfac.rank0.progress.capture.", 0) == 0 &&
           entry.second.dtype == ckpt::DType::kF32;
  });
  ASSERT_NE(victim, bad.tensors.end());
  const std::string victim_name = victim->first;
  victim->second.shape = {1, 3};
  victim->second.data.resize(3 * sizeof(float));
  try {
    fresh.worker(0).load_kfac_progress(bad, "kfac.rank0.progress");
    ADD_FAILURE() << "a capture of the wrong width was accepted";
  } catch (const std::runtime_error& error) {
    EXPECT_NE(std::string(error.what()).find(victim_name), std::string::npos) << error.what();
  }
}

// Steady state allocates nothing on a device: messages and the K-FAC captures (the inputs and
// output gradients held for the curvature tasks) come back to the worker's pool once the work
// that reads them has run, and the next refresh reuses them; a cudaMalloc/cudaFree per capture
// would wait for the whole GPU. Twice the steps, the same allocations.
TEST(HostDevicePath, KfacCapturesAreReusedNotReallocated) {
  const auto config = device_test_config(4);
  const auto schedule = device_test_schedule(sched::ScheduleKind::kOneFOneB, 2, 1, 4, true);
  const auto allocations_after = [&](std::int64_t steps) {
    auto runtime = std::make_shared<device::HostDeviceRuntime>();
    run_schedule(runtime, config, schedule, "adamw", steps);
    return runtime->backend().stats().allocations;
  };
  const std::int64_t window = schedule.num_steps;
  const auto two_windows = allocations_after(2 * window);
  EXPECT_EQ(allocations_after(4 * window), two_windows);
}

// A rank's communicator whose all-reduces of doubles (the statistics that every optimizer step
// sums over all ranks: gradient norm and losses) start late by `delay`: every other rank waits
// that long at its step's end.
class LateStatistics final : public comm::Communicator {
 public:
  LateStatistics(comm::Communicator& inner, std::chrono::milliseconds delay)
      : inner_(inner), delay_(delay) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  std::unique_ptr<comm::Request> isend(int peer, std::int64_t tag,
                                       std::span<const std::byte> data) override {
    return inner_.isend(peer, tag, data);
  }
  std::unique_ptr<comm::Request> irecv(int peer, std::int64_t tag,
                                       std::span<std::byte> data) override {
    return inner_.irecv(peer, tag, data);
  }
  void all_reduce_sum(std::span<float> data, std::span<const int> group,
                      comm::Deadline deadline) override {
    inner_.all_reduce_sum(data, group, deadline);
  }
  void all_reduce_sum(std::span<double> data, std::span<const int> group,
                      comm::Deadline deadline) override {
    std::this_thread::sleep_for(delay_);
    inner_.all_reduce_sum(data, group, deadline);
  }
  std::unique_ptr<comm::Request> iall_reduce_sum(std::span<float> data, std::span<const int> group,
                                                 comm::Deadline deadline) override {
    return inner_.iall_reduce_sum(data, group, deadline);
  }
  std::unique_ptr<comm::Request> iall_reduce_sum(std::span<double> data, std::span<const int> group,
                                                 comm::Deadline deadline) override {
    return inner_.iall_reduce_sum(data, group, deadline);
  }
  void broadcast(std::span<std::byte> data, int root, std::span<const int> group,
                 comm::Deadline deadline) override {
    inner_.broadcast(data, root, group, deadline);
  }
  void abort(const std::string& reason) override { inner_.abort(reason); }

 private:
  comm::Communicator& inner_;
  std::chrono::milliseconds delay_;
};

// The optimizer step's measured time is its update, not its waits: with rank 0 late to every
// step's statistics, rank 1's optimizer events stay short on both paths (the device path's span
// restarts after the all-reduce, as the CPU path leaves waits out of busy time), and the wait
// shows in StepEndTimes::statistics_s, the summary's "step end" line, instead. Before the
// restart, the device path's optimizer events held the whole wait (on an H200, 1F1B p = 4 on one
// GPU: 317 ms of a 434 ms step).
TEST(HostDevicePath, OptimizerStepTimeLeavesTheOtherRanksWaitOut) {
  constexpr auto kDelay = std::chrono::milliseconds(200);
  const double delay_s = 0.2;
  const auto config = device_test_config(4);
  const auto schedule = device_test_schedule(sched::ScheduleKind::kOneFOneB, 2, 1, 4, false);
  constexpr std::int64_t kSteps = 3;
  for (const bool on_device : {false, true}) {
    SCOPED_TRACE(on_device ? "device path" : "CPU path");
    auto batches = device_test_batches(config);
    const auto runtime = on_device ? std::make_shared<device::HostDeviceRuntime>() : nullptr;
    const auto setup = device_test_setup(runtime, config, schedule, "adamw", batches);
    comm::InProcessWorld world(2);
    LateStatistics late(world.rank(0), kDelay);
    std::vector<std::unique_ptr<Worker<float>>> workers;
    workers.push_back(std::make_unique<Worker<float>>(setup, late));
    workers.push_back(std::make_unique<Worker<float>>(setup, world.rank(1)));
    std::vector<std::string> errors(2);
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        try {
          workers[static_cast<std::size_t>(r)]->run(0, kSteps, nullptr);
        } catch (const std::exception& error) {
          errors[static_cast<std::size_t>(r)] = error.what();
          world.rank(r).abort(error.what());
        }
      });
    }
    for (auto& thread : threads) thread.join();
    ASSERT_EQ(errors[0], "");
    ASSERT_EQ(errors[1], "");

    int optimizer_steps = 0;
    for (const auto& event : workers[1]->take_events()) {
      if (event.instruction.kind != sched::OpKind::kOptimizerStep) continue;
      ++optimizer_steps;
      EXPECT_LT(event.busy_s, delay_s / 2) << "step " << event.global_step;
    }
    EXPECT_EQ(optimizer_steps, kSteps);
    for (int r = 0; r < 2; ++r) {
      const auto t = workers[static_cast<std::size_t>(r)]->step_end_times();
      EXPECT_EQ(t.steps, kSteps - 1) << "rank " << r;  // the first step is not counted
      EXPECT_GE(t.statistics_s / static_cast<double>(t.steps), 0.8 * delay_s) << "rank " << r;
      for (const double phase :
           {t.sends_s, t.tied_embedding_s, t.gradient_norm_s, t.update_s, t.synchronize_s}) {
        EXPECT_GE(phase, 0.0) << "rank " << r;
        EXPECT_LT(phase / static_cast<double>(t.steps), delay_s / 2) << "rank " << r;
      }
    }
  }
}

}  // namespace
}  // namespace pf::exec
