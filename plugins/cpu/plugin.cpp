// The cpu plugin's entry point: kernel table and device probe.

#include <kdispatch/plugin_api.h>

#include <fstream>
#include <string>

#include "kd_plugin.hpp"
#include "kernels.hpp"

namespace kdispatch::cpu {
namespace {

// Symbols as listed in manifests/cpu.json.
constexpr kd_plugin::KernelEntry kKernels[] = {
    {"kd_cpu_rmsnorm", rmsnorm},
    {"kd_cpu_fused_add_rmsnorm", fused_add_rmsnorm},
    {"kd_cpu_layernorm", layernorm},
    {"kd_cpu_silu_and_mul", silu_and_mul},
    {"kd_cpu_gelu_and_mul", gelu_and_mul},
    {"kd_cpu_gelu_tanh_and_mul", gelu_tanh_and_mul},
    {"kd_cpu_rotary_embedding", rotary_embedding},
    {"kd_cpu_topk_softmax", topk_softmax},
};

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

kd_kernel_fn find_kernel(const char* symbol) noexcept {
  return kd_plugin::find_kernel(kKernels, symbol);
}

}  // namespace
}  // namespace kdispatch::cpu

KD_DEFINE_PLUGIN("cpu", "0.1.0", "cpu", kdispatch::cpu::probe, kdispatch::cpu::find_kernel, nullptr)
