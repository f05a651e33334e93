// The reference plugin's entry point: device probe (the host CPU); the
// kernel table is generated from manifests/reference.json
// (kd_plugin_kernels.hpp).
//
// The reference kernels: one function per op of manifests/ops/, each the
// op's formula evaluated in float64 from the stored inputs, every output
// rounded once to its dtype. They are the oracle the checks of every other
// backend compare against, so they stay plain: no SIMD, no tables, no
// threads.
#include <kdispatch/plugin_api.h>

#include "kd_plugin.hpp"
#include "kd_plugin_kernels.hpp"

namespace kdispatch::reference {
namespace {

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

}  // namespace
}  // namespace kdispatch::reference

KD_DEFINE_PLUGIN("reference", "0.1.0", "reference", kdispatch::reference::probe, kd_plugin::find_kernel, nullptr)
