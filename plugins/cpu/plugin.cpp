// The cpu plugin's entry point: device probe; the kernel table is generated
// from manifests/cpu.json (kd_plugin_kernels.hpp).

#include <kdispatch/plugin_api.h>

#include <fstream>
#include <string>

#include "kd_plugin.hpp"
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
    if (count == nullptr || (capacity > 0 && devices == nullptr)) {
      kd_plugin::copy_string(error, error_capacity, "probe: null output pointer");
      return KD_STATUS_INVALID_ARGUMENT;
    }
    *count = 1;
    if (capacity == 0) return KD_STATUS_OK;
    kd_device_info& d = devices[0];
    if (!KD_STRUCT_HAS_FIELD(kd_device_info, name, d.struct_size)) {
      kd_plugin::copy_string(error, error_capacity, "probe: kd_device_info too small");
      return KD_STATUS_INVALID_ARGUMENT;
    }
    d.device_type = kDLCPU;
    d.device_id = 0;
    kd_plugin::copy_string(d.arch, sizeof(d.arch), "");
    static const std::string name = read_cpu_name();
    kd_plugin::copy_string(d.name, sizeof(d.name), name.c_str());
    return KD_STATUS_OK;
  } catch (...) {
    kd_plugin::copy_string(error, error_capacity, "probe: unexpected exception");
    return KD_STATUS_INTERNAL;
  }
}

}  // namespace
}  // namespace kdispatch::cpu

KD_DEFINE_PLUGIN("cpu", "0.1.0", "cpu", kdispatch::cpu::probe, kd_plugin::find_kernel, nullptr)
