// The device `list` and `select` use when none is given: KDISPATCH_DEVICE,
// else the first GPU a vendor driver reports (the driver library is opened
// with dlopen, never linked, and never by loading a plugin), else cpu.
#pragma once

#include <kdispatch/export.h>

#include <string>

#include "kdispatch/device.hpp"

namespace kdispatch KDISPATCH_API {

struct DetectedPlatform {
  Device device;
  std::string source;  // "KDISPATCH_DEVICE", "libcuda.so.1", "/sys/class/kfd", "default"
};

// Throws std::invalid_argument when KDISPATCH_DEVICE is malformed.
DetectedPlatform detect_platform();

// The device a tensor on (type, id) lives on, with its arch: "9.0" for a CUDA
// device (from the driver, dlopen'ed), "gfx90a" for an AMD one (from the
// amdgpu driver's sysfs), host features for the cpu. An arch that cannot be
// found is left empty: only kernels without an arch constraint match then.
// Cached per device; thread-safe.
Device device_of(DeviceType type, int32_t id);

}  // namespace kdispatch
