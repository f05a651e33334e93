// Per-device selection: tensors on two CUDA devices of different arch select
// independently, through one dispatcher and one op handle, and each device's
// resolution is cached on its own. The devices are fixtures (tests/fixtures
// fx_gpu_new, fx_gpu_old): their probes report cuda:0 as 9.0 and cuda:1 as
// 8.0, and ContextOptions::device_of answers the same, as the driver would.
#include <doctest/doctest.h>

#include <atomic>
#include <filesystem>
#include <vector>

#include "kdispatch/context.hpp"
#include "kdispatch/dispatcher.hpp"
#include "kdispatch/error.hpp"

using namespace kdispatch;

namespace {

const std::filesystem::path kFixtures = std::filesystem::path(KDISPATCH_BINARY_DIR) / "tests/fixtures/plugins";

struct TwoGpus {
  std::atomic<int> device_queries{0};
  std::unique_ptr<Context> context;

  TwoGpus() {
    ContextOptions options;
    options.search.replace = {kFixtures / "fx_gpu_new", kFixtures / "fx_gpu_old"};
    options.search.use_environment = false;
    options.search.use_default_path = false;
    options.selector = SelectorOptions{};
    options.device_of = [this](DeviceType type, int32_t id) {
      ++device_queries;
      if (type != DeviceType::cuda) return Device{type, "", {}};
      return Device{DeviceType::cuda, id == 0 ? "9.0" : "8.0", {}};
    };
    context = std::make_unique<Context>(std::move(options));
  }
};

// Runs fixture.device_scale on CUDA device `id` (host buffers under a CUDA
// label: the fixture kernels never touch device memory) and returns out[0].
float scale_on(const OpHandle& op, int32_t id, float x0) {
  std::vector<float> x{x0, 2.0f, 3.0f}, out(3, -999.0f);
  int64_t shape[1] = {3};
  const DLDevice device{kDLCUDA, id};
  const DLDataType f32{kDLFloat, 32, 1};
  op({DLTensor{out.data(), device, 1, f32, shape, nullptr, 0}, DLTensor{x.data(), device, 1, f32, shape, nullptr, 0}},
     {{"factor", 2.0}});
  CHECK(out[1] == doctest::Approx(out[0] / x0 * 2.0f));
  return out[0];
}

}  // namespace

TEST_CASE("devices: the fixture probes report two CUDA devices, each with its own arch") {
  TwoGpus gpus;
  for (const char* plugin : {"fx_gpu_new", "fx_gpu_old"}) {
    CAPTURE(plugin);
    const PluginBinary& binary = gpus.context->load_plugin(plugin);
    REQUIRE(binary.devices.size() == 2);
    CHECK(binary.devices[0].device.str() == "cuda:9.0");
    CHECK(binary.devices[0].id == 0);
    CHECK(binary.devices[1].device.str() == "cuda:8.0");
    CHECK(binary.devices[1].id == 1);
  }
}

TEST_CASE("devices: two GPUs of different arch select independently through one op handle") {
  TwoGpus gpus;
  Dispatcher dispatch(*gpus.context);
  const OpHandle op = dispatch.op("fixture.device_scale");
  // cuda:1 first, then cuda:0: neither's choice leaks into the other's.
  CHECK(scale_on(op, 1, 1.5f) == -3.0f);  // fx_gpu_old (max_arch 8.9) on the 8.0 device
  CHECK(scale_on(op, 0, 1.5f) == 3.0f);   // fx_gpu_new (min_arch 9.0) on the 9.0 device
  for (int i = 0; i < 20; ++i) {
    CAPTURE(i);
    CHECK(scale_on(op, i % 2, 0.5f) == (i % 2 == 0 ? 1.0f : -1.0f));
  }
  // Each device was resolved once; every later call hit its cache entry.
  CHECK(gpus.device_queries.load() == 2);
  CHECK(gpus.context->select({"fixture.device_scale", "", Device{DeviceType::cuda, "9.0", {}}, std::nullopt})
            .backend == "fx_gpu_new");
  CHECK(gpus.context->select({"fixture.device_scale", "", Device{DeviceType::cuda, "8.0", {}}, std::nullopt})
            .backend == "fx_gpu_old");
}

TEST_CASE("devices: a backend named for a device it cannot serve is KD-E006 on that device only") {
  TwoGpus gpus;
  Dispatcher dispatch(*gpus.context);
  const OpHandle op = dispatch.op("fixture.device_scale", "fx_gpu_new");
  CHECK(scale_on(op, 0, 1.0f) == 2.0f);
  try {
    scale_on(op, 1, 1.0f);
    FAIL("fx_gpu_new ran on the sm_80 device");
  } catch (const SelectionError& e) {
    CHECK(e.code() == ErrorCode::backend_not_usable);
    CHECK(std::string(e.what()).find("8.0") != std::string::npos);
  }
  CHECK(scale_on(op, 0, 1.0f) == 2.0f);  // device 0 still served
}
