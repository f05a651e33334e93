// The plugin's entry point: the one symbol it exports, returning its table.
#include <kdispatch/plugin_api.h>

#include <cstring>

// Generated from the manifest by kdispatch_add_plugin(): the kernels'
// prototypes and kd_plugin::find_kernel, the symbol -> kernel table.
#include "kd_plugin_kernels.hpp"

// The manifest text, compiled in by kdispatch_add_plugin().
extern "C" const char kd_plugin_embedded_manifest[];

namespace {

// This backend runs on the host: one cpu device, always there.
kd_status probe(kd_device_info* devices, size_t capacity, size_t* count, char* /*error*/,
                size_t /*error_capacity*/) {
  *count = 1;
  if (capacity >= 1) {
    devices[0].device_type = kDLCPU;
    devices[0].device_id = 0;
    devices[0].arch[0] = '\0';
    std::strncpy(devices[0].name, "host cpu (example_cpu)", sizeof devices[0].name - 1);
    devices[0].name[sizeof devices[0].name - 1] = '\0';
  }
  return KD_STATUS_OK;
}

}  // namespace

extern "C" __attribute__((visibility("default"))) const kd_plugin_api* kdispatch_plugin_api(void) {
  static const kd_plugin_api api = {
      KD_PLUGIN_API_STRUCT_SIZE,  // struct_size
      KDISPATCH_ABI_MAJOR,
      KDISPATCH_ABI_MINOR,
      "example_cpu",  // plugin_name, as in the manifest
      "0.1.0",        // plugin_version
      "example_cpu",  // backend, as in the manifest
      kd_plugin_embedded_manifest,
      probe,
      kd_plugin::find_kernel,
      nullptr,  // memory: tensors live in host memory
  };
  return &api;
}
