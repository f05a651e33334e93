// The cpu plugin's entry point: device probe; the kernel table is generated
// from manifests/cpu.json (kd_plugin_kernels.hpp).

#include <kdispatch/plugin_helpers.hpp>

#include <fstream>
#include <string>

#include "kd_plugin_kernels.hpp"

namespace kdispatch::cpu {
namespace {

// "model name" from /proc/cpuinfo (x86), else a generic name.
std::string read_cpu_name() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("model name", 0) != 0) continue;
    const size_t colon = line.find(':');
    if (colon == std::string::npos) break;
    const size_t start = line.find_first_not_of(" \t", colon + 1);
    if (start == std::string::npos) break;
    return line.substr(start);
  }
  return "host CPU";
}

kd_status probe(kd_device_info* devices, size_t capacity, size_t* count, char* error,
                size_t error_capacity) noexcept {
  try {
    static const std::string name = read_cpu_name();
    return kd_plugin::probe_host_cpu(devices, capacity, count, error, error_capacity, name.c_str());
  } catch (...) {
    kd_plugin::copy_string(error, error_capacity, "probe: unexpected exception");
    return KD_STATUS_INTERNAL;
  }
}

}  // namespace
}  // namespace kdispatch::cpu

KD_DEFINE_PLUGIN(kd_plugin::kPluginName, "0.1.0", kd_plugin::kBackendName, kdispatch::cpu::probe,
                 kd_plugin::find_kernel, nullptr)
