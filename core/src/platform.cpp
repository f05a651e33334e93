#include "kdispatch/platform.hpp"

#include <dlfcn.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <mutex>
#include <vector>
#include <fstream>
#include <sstream>

#include "kdispatch/environment.hpp"
#include "kdispatch/log.hpp"

namespace kdispatch {
namespace {

// The CUDA driver API, looked up by name: the core never links libcuda.
std::optional<Device> cuda_device(int ordinal) {
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
  if (count(&n) != 0 || ordinal >= n || get(&dev, ordinal) != 0) return std::nullopt;
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
// Nodes are numbered; CPU nodes have gfx_target_version 0.
std::optional<Device> hip_device(int ordinal) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path nodes = "/sys/class/kfd/kfd/topology/nodes";
  if (!fs::is_directory(nodes, ec)) return std::nullopt;
  std::vector<std::pair<int, long long>> gpus;
  for (const auto& node : fs::directory_iterator(nodes, ec)) {
    std::ifstream in(node.path() / "properties");
    std::string key;
    long long value = 0;
    while (in >> key >> value) {
      if (key == "gfx_target_version" && value > 0) {
        gpus.emplace_back(std::atoi(node.path().filename().c_str()), value);
      }
    }
  }
  std::sort(gpus.begin(), gpus.end());
  if (ordinal < 0 || static_cast<size_t>(ordinal) >= gpus.size()) return std::nullopt;
  // gfx_target_version 90010 -> gfx90a (major 9, minor 0, stepping 10).
  const long long v = gpus[static_cast<size_t>(ordinal)].second;
  return Device{DeviceType::hip, fmt::format("gfx{}{:x}{:x}", v / 10000, (v / 100) % 100, v % 100), {}};
}

}  // namespace

DetectedPlatform detect_platform() {
  if (auto env = get_env("KDISPATCH_DEVICE")) return {Device::parse(*env), "KDISPATCH_DEVICE"};
  if (auto cuda = cuda_device(0)) return {*cuda, "libcuda.so.1"};
  if (auto hip = hip_device(0)) return {*hip, "/sys/class/kfd"};
  return {Device::host_cpu(), "default"};
}

Device device_of(DeviceType type, int32_t id) {
  // Never destroyed: calls may still resolve on other threads while the
  // process exits and runs its static destructors.
  static auto* const mutex = new std::mutex();
  static auto* const devices = new std::map<std::pair<int, int32_t>, Device>();
  std::map<std::pair<int, int32_t>, Device>& cache = *devices;
  std::lock_guard lock(*mutex);
  const auto key = std::make_pair(static_cast<int>(type), id);
  if (auto it = cache.find(key); it != cache.end()) return it->second;
  std::optional<Device> found;
  switch (type) {
    case DeviceType::cpu: found = Device::host_cpu(); break;
    case DeviceType::cuda: found = cuda_device(id); break;
    case DeviceType::hip: found = hip_device(id); break;
  }
  if (!found) {
    log(LogLevel::info, "no arch known for {} device {}; only kernels without an arch constraint can run there",
        device_type_name(type), id);
    found = Device{type, "", {}};
  }
  cache.emplace(key, *found);
  return *found;
}

}  // namespace kdispatch
