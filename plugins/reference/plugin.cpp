// The reference plugin's entry point: kernel table and device probe (the
// host CPU).
#include <kdispatch/plugin_api.h>

#include "kd_plugin.hpp"
#include "kernels.hpp"

namespace kdispatch::reference {
namespace {

// Symbols as listed in manifests/reference.json.
constexpr kd_plugin::KernelEntry kKernels[] = {
    {"kd_ref_rmsnorm", rmsnorm},
    {"kd_ref_fused_add_rmsnorm", fused_add_rmsnorm},
    {"kd_ref_layernorm", layernorm},
    {"kd_ref_silu_and_mul", silu_and_mul},
    {"kd_ref_gelu_and_mul", gelu_and_mul},
    {"kd_ref_gelu_tanh_and_mul", gelu_tanh_and_mul},
    {"kd_ref_rotary_embedding", rotary_embedding},
    {"kd_ref_topk_softmax", topk_softmax},
};

kd_status probe(kd_device_info* devices, size_t capacity, size_t* count, char* error, size_t error_capacity) noexcept {
  if (count == nullptr || (capacity > 0 && devices == nullptr)) {
    kd_plugin::copy_string(error, error_capacity, "probe: null output pointer");
    return KD_STATUS_INVALID_ARGUMENT;
  }
  *count = 1;
  if (capacity == 0) return KD_STATUS_OK;
  if (!KD_STRUCT_HAS_FIELD(kd_device_info, name, devices[0].struct_size)) {
    kd_plugin::copy_string(error, error_capacity, "probe: kd_device_info too small");
    return KD_STATUS_INVALID_ARGUMENT;
  }
  devices[0].device_type = kDLCPU;
  devices[0].device_id = 0;
  kd_plugin::copy_string(devices[0].arch, sizeof(devices[0].arch), "");
  kd_plugin::copy_string(devices[0].name, sizeof(devices[0].name), "host CPU (float64 reference)");
  return KD_STATUS_OK;
}

kd_kernel_fn find_kernel(const char* symbol) noexcept { return kd_plugin::find_kernel(kKernels, symbol); }

}  // namespace
}  // namespace kdispatch::reference

KD_DEFINE_PLUGIN("reference", "0.1.0", "reference", kdispatch::reference::probe, kdispatch::reference::find_kernel,
                 nullptr)
