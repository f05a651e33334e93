// A plugin whose one kernel does nothing: what a call costs beyond the kernel.
#include <kdispatch/plugin_helpers.hpp>

#include "kd_plugin_kernels.hpp"

kd_status kd_bench::noop(const kd_call_args* /*args*/) noexcept { return KD_STATUS_OK; }

namespace {

kd_status probe(kd_device_info* devices, size_t capacity, size_t* count, char*, size_t) noexcept {
  *count = 1;
  if (capacity > 0) {
    devices[0].device_type = kDLCPU;
    devices[0].device_id = 0;
    kd_plugin::copy_string(devices[0].arch, sizeof devices[0].arch, "");
    kd_plugin::copy_string(devices[0].name, sizeof devices[0].name, "host cpu");
  }
  return KD_STATUS_OK;
}

}  // namespace

KD_DEFINE_PLUGIN("bench_noop", "0.1.0", "bench_noop", probe, kd_plugin::find_kernel, nullptr)
