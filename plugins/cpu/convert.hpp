// The cpu plugin's storage types (float, and Float16 and BFloat16 with their
// element conversions, from <kdispatch/plugin_helpers.hpp>), and block
// conversions between them and float.
//
// The row kernels widen a block of their inputs to float, do their math on
// float arrays (which the x86-64-v3 clone vectorises), and narrow the block
// back. The conversions themselves are the expensive part for the 16-bit
// types when written portably (the helper header's), so they live here, behind
// one indirect call per block: on a CPU with AVX2 and F16C they use the
// hardware converts (float16) and 256-bit integer ops (bfloat16), picked once
// at load time; elsewhere the portable conversions. Both round to nearest
// even and treat NaN, Inf and subnormals alike, so results do not depend on
// the host CPU.
#pragma once

#include <kdispatch/plugin_helpers.hpp>

#include <cstdint>
#include <type_traits>

namespace kdispatch::cpu {

using kd_plugin::BFloat16;
using kd_plugin::Float16;
using kd_plugin::Float8E4M3FN;
using kd_plugin::Float8E5M2;
using kd_plugin::from_float;
using kd_plugin::to_float;

// How narrow() writes its destination.
enum class Store {
  // Ordinary stores: the data stays in cache for whoever reads it next.
  kCached,
  // Non-temporal stores: for outputs far larger than the caches, where an
  // ordinary store first reads every destination line from memory (a third
  // of the traffic) only to evict it again. Followed by store_fence().
  kStreaming,
};

// Outputs at least this large are written with Store::kStreaming: well past
// the last-level cache of most hosts, so the consumer will not find them in
// cache anyway.
inline constexpr int64_t kStreamingMinBytes = int64_t{16} << 20;

inline Store store_for(int64_t output_bytes) {
  return output_bytes >= kStreamingMinBytes ? Store::kStreaming : Store::kCached;
}

// dst[0, n) = float(src[0, n)).
void widen(const Float16* src, float* dst, int64_t n) noexcept;
void widen(const BFloat16* src, float* dst, int64_t n) noexcept;

// dst[0, n) = T(src[0, n)), rounded to nearest even. For float, a copy.
void narrow(const float* src, Float16* dst, int64_t n, Store store) noexcept;
void narrow(const float* src, BFloat16* dst, int64_t n, Store store) noexcept;
void narrow(const float* src, float* dst, int64_t n, Store store) noexcept;

// The same for the 8-bit floats, rounded to nearest even and saturating
// (from_float); `store` is not used: fp8 outputs are a quarter of a float32
// row, ordinary stores.
template <class F8, class = std::enable_if_t<std::is_same_v<F8, Float8E4M3FN> || std::is_same_v<F8, Float8E5M2>>>
[[gnu::always_inline]] inline void narrow(const float* src, F8* dst, int64_t n, Store) noexcept {
  for (int64_t i = 0; i < n; ++i) dst[i] = from_float<F8>(src[i]);
}

// Orders this thread's streaming stores before whatever it does next (in
// particular before the pool reports its range done). Call once after a run
// of narrow(..., Store::kStreaming).
void store_fence() noexcept;

// src[0, n) as float: src itself for float, else widened into `scratch`.
template <class T>
[[gnu::always_inline]] inline const float* as_float(const T* src, float* scratch, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    widen(src, scratch, n);
    return scratch;
  }
}

}  // namespace kdispatch::cpu
