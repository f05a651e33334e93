// The plugin's entry point: the one symbol it exports, returning its table.
// Its name and backend come from the manifest (kd_plugin::kPluginName and
// kd_plugin::kBackendName of the generated kd_plugin_kernels.hpp), and its
// kernel table, kd_plugin::find_kernel, holds every kernel the manifest
// lists, the reference kernel included.
#include <kdispatch/plugin_helpers.hpp>

#include "kd_plugin_kernels.hpp"

namespace {

// This backend runs on the host: one cpu device, always there.
kd_status probe(kd_device_info* devices, size_t capacity, size_t* count, char* error, size_t error_capacity) {
  return kd_plugin::probe_host_cpu(devices, capacity, count, error, error_capacity, "host CPU (example)");
}

}  // namespace

KD_DEFINE_PLUGIN(kd_plugin::kPluginName, "0.1.0", kd_plugin::kBackendName, probe, kd_plugin::find_kernel,
                 nullptr)  // memory: tensors live in host memory
