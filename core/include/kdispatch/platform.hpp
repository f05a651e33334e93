// The device `list` and `select` use when none is given: KDISPATCH_DEVICE,
// else the first GPU a vendor driver reports (the driver library is opened
// with dlopen, never linked, and never by loading a plugin), else cpu.
#pragma once

#include <string>

#include "kdispatch/device.hpp"

namespace kdispatch {

struct DetectedPlatform {
  Device device;
  std::string source;  // "KDISPATCH_DEVICE", "libcuda.so.1", "/sys/class/kfd", "default"
};

// Throws std::invalid_argument when KDISPATCH_DEVICE is malformed.
DetectedPlatform detect_platform();

}  // namespace kdispatch
