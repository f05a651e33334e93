// Both kernels defined, but a kernel table written by hand that forgets
// one: the library links and exports its entry point, and only loading it
// shows the missing symbol.
#include <kdispatch/plugin_helpers.hpp>

#include <cstring>

#include "kd_plugin_kernels.hpp"

kd_status silu_and_mul(const kd_call_args*) noexcept { return KD_STATUS_UNSUPPORTED; }
kd_status gelu_and_mul(const kd_call_args*) noexcept { return KD_STATUS_UNSUPPORTED; }

namespace {
kd_kernel_fn find(const char* symbol) noexcept {
  return std::strcmp(symbol, "silu_and_mul") == 0 ? silu_and_mul : nullptr;
}
kd_status probe(kd_device_info* devices, size_t capacity, size_t* count, char* error, size_t error_capacity) {
  return kd_plugin::probe_host_cpu(devices, capacity, count, error, error_capacity, "host CPU");
}
}  // namespace

KD_DEFINE_PLUGIN(kd_plugin::kPluginName, "0.1.0", kd_plugin::kBackendName, probe, find, nullptr)
