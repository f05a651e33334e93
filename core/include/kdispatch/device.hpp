// Devices and device targets. A Device is where a call runs ("cpu",
// "cuda:9.0", "hip:gfx90a"); a Target is what a kernel declares it runs on.
#pragma once

#include <kdispatch/export.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kdispatch KDISPATCH_API {

enum class DeviceType : uint8_t { cpu, cuda, hip };

std::string_view device_type_name(DeviceType type);  // "cpu", "cuda", "hip"
std::optional<DeviceType> parse_device_type(std::string_view name);
// The DLDeviceType of a device type (kDLCPU, kDLCUDA, kDLROCM) and back.
int32_t to_dlpack_device_type(DeviceType type);
std::optional<DeviceType> from_dlpack_device_type(int32_t dl_type);

// A CUDA compute capability "major.minor", ordered.
struct CudaArch {
  int major = 0;
  int minor = 0;
  static std::optional<CudaArch> parse(std::string_view text);  // "9.0"
  std::string str() const;
  friend auto operator<=>(const CudaArch&, const CudaArch&) = default;
};

// A HIP arch name: "gfx" and at least one of [0-9a-z] ("gfx90a").
bool is_hip_arch(std::string_view arch);

struct Device {
  DeviceType type = DeviceType::cpu;
  // cuda: "9.0"; hip: "gfx90a"; cpu: "". Empty for cuda/hip means "arch
  // unknown": only targets without an arch constraint match.
  std::string arch;
  // cpu only: features present ("avx2", "avx512f"); filled in by detection.
  std::vector<std::string> features;

  // "cpu", "cuda", "cuda:9.0", "hip", "hip:gfx90a". Throws
  // std::invalid_argument with a message naming the accepted forms.
  static Device parse(std::string_view text);
  // The host CPU with its detected features.
  static Device host_cpu();
  std::string str() const;  // "cpu", "cuda:9.0", "hip:gfx90a"
  bool operator==(const Device&) const = default;
};

// One entry of a kernel's "targets": the kernel may run on a device that
// matches any entry (OR).
struct Target {
  DeviceType device = DeviceType::cpu;
  std::optional<CudaArch> min_arch;  // cuda, inclusive
  std::optional<CudaArch> max_arch;  // cuda, inclusive
  std::vector<std::string> archs;    // hip: one of these ("gfx90a")
  std::vector<std::string> features; // cpu: all of these

  // True when `device` satisfies this target; otherwise *why says what did
  // not match ("needs cuda arch >= 9.0, device has 8.0").
  bool matches(const Device& device, std::string* why = nullptr) const;
  std::string str() const;  // "cuda[9.0, 12.0]", "hip{gfx90a}", "cpu{avx2}"
  bool operator==(const Target&) const = default;
};

// OR over `targets`; an empty list matches any device.
bool targets_match(const std::vector<Target>& targets, const Device& device,
                   std::string* why = nullptr);

}  // namespace kdispatch
