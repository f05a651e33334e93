// float16 and bfloat16 storage types and their conversions to and from float.
//
// The conversions are written with integer bit operations and selects rather
// than with _Float16 or F16C intrinsics: that keeps the plugin runnable on any
// x86-64 (and any other target), and, since nothing branches, the compiler
// vectorises row loops that call them. float -> 16-bit rounds to nearest even,
// keeps NaN a (quiet) NaN and overflows to infinity, as a hardware convert does.
#pragma once

#include <bit>
#include <cstdint>

namespace kdispatch::cpu {

// IEEE binary16 bit pattern.
struct Half {
  uint16_t bits;
};

// bfloat16 bit pattern: the upper half of a float32.
struct BFloat16 {
  uint16_t bits;
};

static_assert(sizeof(Half) == 2 && sizeof(BFloat16) == 2);

[[gnu::always_inline]] inline float to_float(float v) { return v; }

[[gnu::always_inline]] inline float to_float(BFloat16 v) {
  return std::bit_cast<float>(static_cast<uint32_t>(v.bits) << 16);
}

[[gnu::always_inline]] inline float to_float(Half v) {
  const uint32_t h = v.bits;
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t magnitude = h & 0x7fffu;
  // Normal numbers: move exponent and mantissa into place and rebias the
  // exponent by 127 - 15. Infinity and NaN (exponent 31) need a second rebias
  // so that their exponent lands on 255.
  uint32_t normal = (magnitude << 13) + (112u << 23);
  normal = magnitude >= 0x7c00u ? normal + (112u << 23) : normal;
  // Subnormals and zero: the mantissa counts units of 2^-24, exactly.
  const float subnormal = static_cast<float>(static_cast<int32_t>(magnitude)) * 0x1p-24f;
  const uint32_t bits = magnitude < 0x0400u ? std::bit_cast<uint32_t>(subnormal) : normal;
  return std::bit_cast<float>(bits | sign);
}

template <class T>
[[gnu::always_inline]] inline T from_float(float v);

template <>
[[gnu::always_inline]] inline float from_float<float>(float v) {
  return v;
}

template <>
[[gnu::always_inline]] inline BFloat16 from_float<BFloat16>(float v) {
  const uint32_t u = std::bit_cast<uint32_t>(v);
  // Adding 0x7fff plus the lowest kept bit rounds to nearest, ties to even.
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  // NaN: truncate and force the quiet bit so a NaN never rounds into Inf.
  const uint32_t nan = (u >> 16) | 0x0040u;
  const bool is_nan = (u & 0x7fffffffu) > 0x7f800000u;
  return BFloat16{static_cast<uint16_t>(is_nan ? nan : rounded)};
}

template <>
[[gnu::always_inline]] inline Half from_float<Half>(float v) {
  const uint32_t u = std::bit_cast<uint32_t>(v);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;

  // Normal range: rebias the exponent by 15 - 127, then round the 13 dropped
  // mantissa bits to nearest even; a carry into the exponent is what turns
  // 65520 and above into infinity.
  const uint32_t odd = (a >> 13) & 1u;
  const uint32_t normal = (a - (112u << 23) + 0x0fffu + odd) >> 13;

  // Below 2^-14 the result is subnormal: adding 0.5f lines the value up so
  // that the float adder rounds it to a multiple of 2^-24 (nearest even), and
  // the low mantissa bits are then the half's bits.
  const float aligned = std::bit_cast<float>(a) + 0.5f;
  const uint32_t subnormal = std::bit_cast<uint32_t>(aligned) - 0x3f000000u;

  // 65536 and above (and Inf) overflow; NaN stays a quiet NaN.
  const uint32_t big = a > 0x7f800000u ? 0x7e00u : 0x7c00u;

  uint32_t bits = a < 0x38800000u ? subnormal : normal;
  bits = a >= 0x47800000u ? big : bits;
  return Half{static_cast<uint16_t>(bits | sign)};
}

}  // namespace kdispatch::cpu
