// Opening plugin binaries (DESIGN.md section 3). plugin_loader.cpp is the only
// file of the core that includes Boost.DLL.
#pragma once

#include <kdispatch/plugin_api.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kdispatch/device.hpp"
#include "kdispatch/manifest.hpp"

namespace kdispatch {

struct ProbedDevice {
  Device device;      // type + arch ("cuda:9.0")
  int32_t id = 0;     // ordinal within its type
  std::string name;   // "NVIDIA H200"
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

// Opens the library of `manifest` with RTLD_NOW | RTLD_LOCAL and checks, in
// this order, each failure with its own code and a message naming the file
// and the cause:
//   library location is safe and, when the manifest gives sha256, matches
//                                                          (KD-E012/E025/E026)
//   the library opens (dlopen error classified: not found, wrong
//   architecture, missing dependency, undefined symbol)  (KD-E020)
//   the entry symbol exists and returns a table            (KD-E021)
//   ABI major equal, struct_size covers what is read       (KD-E022)
//   the embedded manifest agrees with the file's: plugin, backend and
//   kernels (op + symbol)                                  (KD-E023)
//   probe succeeds                                         (KD-E024)
//   every declared kernel symbol is found                  (KD-E023)
// Throws PluginError. Not thread-safe by itself: the caller serialises loads.
std::unique_ptr<PluginBinary> load_plugin_binary(const Manifest& manifest);

}  // namespace kdispatch
