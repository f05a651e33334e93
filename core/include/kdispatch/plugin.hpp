// A plugin library as the core sees it once it opened: the devices its probe
// reported and its kernels (Context::load_plugin).
#pragma once

#include <kdispatch/export.h>
#include <kdispatch/plugin_api.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "kdispatch/device.hpp"

namespace kdispatch KDISPATCH_API {

struct ProbedDevice {
  Device device;      // type + arch ("cuda:9.0")
  int32_t id = 0;     // ordinal within its type
  std::string name;   // "NVIDIA H200"
  std::string driver_version;   // kd_device_info 1.1; "" when not reported
  std::string runtime_version;
};

// A plugin library that opened and passed every check. Never unloaded: the
// library stays mapped until the process exits, so `api` and the kernel
// pointers stay valid.
struct PluginBinary {
  std::string plugin;
  std::string backend;
  std::string version;
  std::string library_path;
  uint32_t abi_major = 0;
  uint32_t abi_minor = 0;
  const kd_plugin_api* api = nullptr;
  std::vector<ProbedDevice> devices;          // from probe(); may be empty
  std::map<std::string, kd_kernel_fn> kernels;  // every declared symbol
};

}  // namespace kdispatch
