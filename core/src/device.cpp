#include "kdispatch/device.hpp"

#include <dlpack/dlpack.h>
#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <stdexcept>

namespace kdispatch {

std::string_view device_type_name(DeviceType type) {
  switch (type) {
    case DeviceType::cpu: return "cpu";
    case DeviceType::cuda: return "cuda";
    case DeviceType::hip: return "hip";
  }
  return "?";
}

std::optional<DeviceType> parse_device_type(std::string_view name) {
  if (name == "cpu") return DeviceType::cpu;
  if (name == "cuda") return DeviceType::cuda;
  if (name == "hip") return DeviceType::hip;
  return std::nullopt;
}

int32_t to_dlpack_device_type(DeviceType type) {
  switch (type) {
    case DeviceType::cpu: return kDLCPU;
    case DeviceType::cuda: return kDLCUDA;
    case DeviceType::hip: return kDLROCM;
  }
  return 0;
}

std::optional<DeviceType> from_dlpack_device_type(int32_t dl_type) {
  switch (dl_type) {
    case kDLCPU: return DeviceType::cpu;
    case kDLCUDA: return DeviceType::cuda;
    case kDLROCM: return DeviceType::hip;
    default: return std::nullopt;
  }
}

std::optional<CudaArch> CudaArch::parse(std::string_view text) {
  const auto dot = text.find('.');
  if (dot == std::string_view::npos || dot == 0 || dot + 1 == text.size()) return std::nullopt;
  CudaArch arch;
  const char* begin = text.data();
  auto [p1, e1] = std::from_chars(begin, begin + dot, arch.major);
  auto [p2, e2] = std::from_chars(begin + dot + 1, begin + text.size(), arch.minor);
  if (e1 != std::errc() || p1 != begin + dot || e2 != std::errc() || p2 != begin + text.size()) {
    return std::nullopt;
  }
  if (arch.major < 0 || arch.major > 99 || arch.minor < 0 || arch.minor > 9) return std::nullopt;
  return arch;
}

std::string CudaArch::str() const { return fmt::format("{}.{}", major, minor); }

bool is_hip_arch(std::string_view arch) {
  if (!arch.starts_with("gfx") || arch.size() < 4) return false;
  return std::all_of(arch.begin() + 3, arch.end(),
                     [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z'); });
}

namespace {

std::vector<std::string> detect_cpu_features() {
  std::vector<std::string> features;
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("sse4.2")) features.emplace_back("sse4_2");
  if (__builtin_cpu_supports("avx")) features.emplace_back("avx");
  if (__builtin_cpu_supports("avx2")) features.emplace_back("avx2");
  if (__builtin_cpu_supports("fma")) features.emplace_back("fma");
  if (__builtin_cpu_supports("avx512f")) features.emplace_back("avx512f");
  if (__builtin_cpu_supports("avx512bw")) features.emplace_back("avx512bw");
#elif defined(__aarch64__)
  features.emplace_back("neon");
#endif
  return features;
}

}  // namespace

Device Device::host_cpu() {
  // Never destroyed: calls may still run on other threads while the process exits.
  static const auto* const features = new std::vector<std::string>(detect_cpu_features());
  return Device{DeviceType::cpu, "", *features};
}

Device Device::parse(std::string_view text) {
  const auto colon = text.find(':');
  const std::string_view type_text = text.substr(0, colon);
  const std::string_view arch = colon == std::string_view::npos ? std::string_view{} : text.substr(colon + 1);
  const auto type = parse_device_type(type_text);
  const auto bad = [&](std::string_view why) {
    return std::invalid_argument(fmt::format(
        "invalid device '{}': {}; expected cpu, cuda, cuda:<major>.<minor> (e.g. cuda:9.0), hip or "
        "hip:<gfx arch> (e.g. hip:gfx90a)",
        text, why));
  };
  if (!type) throw bad(fmt::format("unknown device type '{}'", type_text));
  if (colon != std::string_view::npos && arch.empty()) throw bad("empty arch after ':'");
  switch (*type) {
    case DeviceType::cpu:
      if (!arch.empty()) throw bad("cpu takes no arch");
      return host_cpu();
    case DeviceType::cuda:
      if (!arch.empty() && !CudaArch::parse(arch)) throw bad("cuda arch must be <major>.<minor>");
      return Device{DeviceType::cuda, std::string(arch), {}};
    case DeviceType::hip:
      if (!arch.empty() && !is_hip_arch(arch)) throw bad("hip arch must look like gfx90a");
      return Device{DeviceType::hip, std::string(arch), {}};
  }
  throw bad("unknown device type");
}

std::string Device::str() const {
  if (arch.empty()) return std::string(device_type_name(type));
  return fmt::format("{}:{}", device_type_name(type), arch);
}

bool Target::matches(const Device& dev, std::string* why) const {
  const auto reject = [&](std::string reason) {
    if (why) *why = std::move(reason);
    return false;
  };
  if (dev.type != device) {
    return reject(fmt::format("targets {}, not {}", device_type_name(device), device_type_name(dev.type)));
  }
  switch (device) {
    case DeviceType::cuda: {
      if (!min_arch && !max_arch) return true;
      const auto arch = CudaArch::parse(dev.arch);
      if (!arch) return reject(fmt::format("needs cuda arch in {}, device arch is unknown", str()));
      if (min_arch && *arch < *min_arch) {
        return reject(fmt::format("needs cuda arch >= {}, device has {}", min_arch->str(), arch->str()));
      }
      if (max_arch && *arch > *max_arch) {
        return reject(fmt::format("needs cuda arch <= {}, device has {}", max_arch->str(), arch->str()));
      }
      return true;
    }
    case DeviceType::hip:
      if (archs.empty()) return true;
      if (std::find(archs.begin(), archs.end(), dev.arch) != archs.end()) return true;
      return reject(fmt::format("needs hip arch in [{}], device has {}", fmt::join(archs, ", "),
                                dev.arch.empty() ? "unknown" : dev.arch));
    case DeviceType::cpu:
      for (const auto& f : features) {
        if (std::find(dev.features.begin(), dev.features.end(), f) == dev.features.end()) {
          return reject(fmt::format("needs cpu feature '{}'", f));
        }
      }
      return true;
  }
  return reject("unknown device type");
}

std::string Target::str() const {
  std::string s(device_type_name(device));
  if (min_arch || max_arch) {
    s += fmt::format("[{}, {}]", min_arch ? min_arch->str() : "-", max_arch ? max_arch->str() : "-");
  }
  if (!archs.empty()) s += fmt::format("{{{}}}", fmt::join(archs, ","));
  if (!features.empty()) s += fmt::format("{{{}}}", fmt::join(features, ","));
  return s;
}

bool targets_match(const std::vector<Target>& targets, const Device& device, std::string* why) {
  if (targets.empty()) return true;
  std::vector<std::string> reasons;
  for (const auto& t : targets) {
    std::string reason;
    if (t.matches(device, &reason)) return true;
    reasons.push_back(std::move(reason));
  }
  if (why) *why = reasons.size() == 1 ? reasons[0] : fmt::format("{}", fmt::join(reasons, "; "));
  return false;
}

}  // namespace kdispatch
