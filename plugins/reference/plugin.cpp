// The reference plugin's entry point: device probe (the host CPU); the
// kernel table is generated from manifests/reference.json
// (kd_plugin_kernels.hpp).
//
// The reference kernels: one function per op of manifests/ops/, each the
// op's formula evaluated in float64 from the stored inputs, every output
// rounded once to its dtype. They are the oracle the checks of every other
// backend compare against, so they stay plain: no SIMD, no tables, no
// threads.
#include <kdispatch/plugin_helpers.hpp>

#include "kd_plugin_kernels.hpp"

namespace kdispatch::reference {
namespace {

kd_status probe(kd_device_info* devices, size_t capacity, size_t* count, char* error, size_t error_capacity) noexcept {
  return kd_plugin::probe_host_cpu(devices, capacity, count, error, error_capacity, "host CPU (float64 reference)");
}

}  // namespace
}  // namespace kdispatch::reference

KD_DEFINE_PLUGIN(kd_plugin::kPluginName, "0.1.0", kd_plugin::kBackendName, kdispatch::reference::probe,
                 kd_plugin::find_kernel, nullptr)
