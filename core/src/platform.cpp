#include "kdispatch/platform.hpp"

#include <dlfcn.h>
#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "kdispatch/environment.hpp"
#include "kdispatch/log.hpp"

namespace kdispatch {
namespace {

// The CUDA driver API, looked up by name: the core never links libcuda.
std::optional<Device> first_cuda_device() {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) return std::nullopt;
  using InitFn = int (*)(unsigned);
  using CountFn = int (*)(int*);
  using GetFn = int (*)(int*, int);
  using AttrFn = int (*)(int*, int, int);
  auto init = reinterpret_cast<InitFn>(dlsym(lib, "cuInit"));
  auto count = reinterpret_cast<CountFn>(dlsym(lib, "cuDeviceGetCount"));
  auto get = reinterpret_cast<GetFn>(dlsym(lib, "cuDeviceGet"));
  auto attr = reinterpret_cast<AttrFn>(dlsym(lib, "cuDeviceGetAttribute"));
  // The library stays open: unloading a CUDA driver after cuInit is unsafe.
  if (!init || !count || !get || !attr || init(0) != 0) return std::nullopt;
  int n = 0;
  int dev = 0;
  if (count(&n) != 0 || n <= 0 || get(&dev, 0) != 0) return std::nullopt;
  constexpr int kComputeCapabilityMajor = 75;
  constexpr int kComputeCapabilityMinor = 76;
  int major = 0;
  int minor = 0;
  if (attr(&major, kComputeCapabilityMajor, dev) != 0 || attr(&minor, kComputeCapabilityMinor, dev) != 0) {
    return std::nullopt;
  }
  return Device{DeviceType::cuda, fmt::format("{}.{}", major, minor), {}};
}

// AMD GPUs as the amdgpu kernel driver lists them: no ROCm library needed.
std::optional<Device> first_hip_device() {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path nodes = "/sys/class/kfd/kfd/topology/nodes";
  if (!fs::is_directory(nodes, ec)) return std::nullopt;
  for (const auto& node : fs::directory_iterator(nodes, ec)) {
    std::ifstream in(node.path() / "properties");
    std::string key;
    long long value = 0;
    while (in >> key >> value) {
      // gfx_target_version 90010 -> gfx90a (major 9, minor 0, stepping 10).
      if (key == "gfx_target_version" && value > 0) {
        return Device{DeviceType::hip,
                      fmt::format("gfx{}{:x}{:x}", value / 10000, (value / 100) % 100, value % 100), {}};
      }
    }
  }
  return std::nullopt;
}

}  // namespace

DetectedPlatform detect_platform() {
  if (auto env = get_env("KDISPATCH_DEVICE")) return {Device::parse(*env), "KDISPATCH_DEVICE"};
  if (auto cuda = first_cuda_device()) return {*cuda, "libcuda.so.1"};
  if (auto hip = first_hip_device()) return {*hip, "/sys/class/kfd"};
  return {Device::host_cpu(), "default"};
}

}  // namespace kdispatch
