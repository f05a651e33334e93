// exp and the normal CDF in float, written so that row loops calling them
// vectorise: no libm call, no branch, only selects and bit operations.
// libm's expf/erff are scalar calls, and at 4 to 8 bytes of traffic per
// element a scalar call per element costs more than the memory traffic.
//
// Accuracy (checked against float64): exp_bounded, times_sigmoid and
// gelu_erf come in two precisions (see Precision), with their errors given
// below.
#pragma once

#include <bit>
#include <cstdint>
#include <type_traits>

namespace kdispatch::cpu {

// How accurate the float math before a result's rounding needs to be. A
// float32 result is checked to 1e-4 relative; a result rounded to a 16-bit
// type resolves at best 2^-12 (float16; bfloat16 2^-9), so errors of a few
// 1e-6 there change a rounded result only now and then, by one unit, and
// cost fewer polynomial terms.
enum class Precision { kFloat32, kHalf };

template <class T>
inline constexpr Precision kPrecisionFor =
    std::is_same_v<T, float> ? Precision::kFloat32 : Precision::kHalf;

// x^P for P a power of two, by squaring.
template <int P>
[[gnu::always_inline]] inline float power_of(float x) {
  static_assert(P >= 1 && (P & (P - 1)) == 0);
  if constexpr (P == 1) {
    return x;
  } else {
    const float half = power_of<P / 2>(x);
    return half * half;
  }
}

// c[0] + c[1] x + ... + c[N-1] x^(N-1) by Estrin's scheme: the low and high
// halves are evaluated independently and joined by a power of x, so the
// dependency chain is log2(N) multiply-adds long rather than Horner's N - 1.
// The element-wise loops are otherwise bound by that latency (a few
// iterations fit in the out-of-order window), not by the arithmetic.
template <int N>
[[gnu::always_inline]] inline float polynomial(float x, const float* c) {
  static_assert(N >= 1 && N <= 16);
  if constexpr (N == 1) {
    return c[0];
  } else {
    // Split at the largest power of two below N.
    constexpr int kLow = N > 8 ? 8 : (N > 4 ? 4 : (N > 2 ? 2 : 1));
    return polynomial<kLow>(x, c) + polynomial<N - kLow>(x, c + kLow) * power_of<kLow>(x);
  }
}

template <int N>
[[gnu::always_inline]] inline float polynomial(float x, const float (&c)[N]) {
  return polynomial<N>(x, &c[0]);
}

// 2^f for f in [-0.5, 0.5]: least squares (relative) on Chebyshev nodes,
// 1 + f (...) so that 2^0 is exact. Relative error 1.1e-7 (degree 5, float32)
// and 2.9e-6 (degree 4, 16-bit results).
inline constexpr float kExp2Float32[] = {1.0f,          0.693147004f,  0.240222424f,
                                         0.0555073358f, 0.00967151299f, 0.00132647238f};
inline constexpr float kExp2Half[] = {1.0f, 0.693124175f, 0.240240991f, 0.0559064299f,
                                      0.00958285108f};

template <Precision P>
[[gnu::always_inline]] inline float exp2_reduced(float f) {
  if constexpr (P == Precision::kFloat32) {
    return polynomial(f, kExp2Float32);
  } else {
    return polynomial(f, kExp2Half);
  }
}

// e^x for x in [-87.3, 0] (x log2(e) >= -126), the range where the
// activations need it: the exponent is formed in base 2 from the rounded
// x log2(e) (no split ln2), and a short polynomial gives 2^f. Relative error:
// that of exp2_reduced plus up to |x| 9e-8 from rounding x log2(e), so 7e-7
// (float32) and 3.4e-6 (16-bit) for |x| <= 10, 1e-5 at worst. No compares or
// selects: callers bound the argument, usually once for several uses.
inline constexpr float kExpBoundedMin = -87.3f;

template <Precision P>
[[gnu::always_inline]] inline float exp_bounded(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  const float t = x * kLog2e;
  // Round to an integer n via the 1.5 * 2^23 trick, with 127 added on the
  // way: the low bits of `shifted` then hold n + 127, and shifting them into
  // the exponent field gives 2^n (the shift drops the 1.5 * 2^23).
  constexpr float kShiftBiased = 12582912.0f + 127.0f;
  const float shifted = t + kShiftBiased;
  const float f = t - (shifted - kShiftBiased);  // in [-0.5, 0.5]
  const uint32_t scale_bits = std::bit_cast<uint32_t>(shifted) << 23;
  return exp2_reduced<P>(f) * std::bit_cast<float>(scale_bits);
}

// a / (1 + e^-s), the sigmoid of s scaled by a, through e = e^-|s| in (0, 1]
// so that no exponential overflows: a / (1 + e) for s >= 0 and a e / (1 + e)
// below. Where |s| reaches -kExpBoundedMin (or is NaN), e is taken as 0
// rather than clamped: e^-87.3 is tiny, but a e is not when a is as large as
// float allows (silu of -1e36 would be -0.01). The same 0 makes a = -Inf give
// NaN (-Inf times 0), as the formula does (-Inf times a sigmoid of 0) and as
// the GPU kernels do. Relative error that of exp_bounded plus a few
// roundings. NaN in a gives NaN; a NaN s alone does not (the callers' s is
// NaN only where a is).
template <Precision P>
[[gnu::always_inline]] inline float times_sigmoid(float a, float s) {
  constexpr float kBound = -kExpBoundedMin;
  const float magnitude = __builtin_fabsf(s);
  const bool in_range = magnitude < kBound;
  const float e_bounded = exp_bounded<P>(-(in_range ? magnitude : kBound));
  const float e = in_range ? e_bounded : 0.0f;
  const float numerator = s < 0.0f ? a * e : a;
  return numerator / (1.0f + e);
}

// erfc(z) / 2 for z in [0, kErfcMaxArg], as exp(-z^2) g(u) / (z + K) with
// u = (z - K) / (z + K) in [-1, 1): g is smooth there, and a polynomial fits
// it (least squares, relative, on Chebyshev nodes, z in [0, 10]). Degree 7
// with K = 3 fits to 1.5e-7 (float32), degree 6 with K = 2 to 1.4e-6
// (16-bit). The coefficients include the factor 1/2. One division: u and the
// quotient share 1 / (z + K).
inline constexpr float kErfcMaxArg = 9.3f;  // z^2 stays inside exp_bounded's range
static_assert(kErfcMaxArg * kErfcMaxArg < -kExpBoundedMin);

template <Precision P>
[[gnu::always_inline]] inline float half_erfc(float z) {
  constexpr float kK = P == Precision::kFloat32 ? 3.0f : 2.0f;
  const float inv = 1.0f / (z + kK);
  const float u = (z - kK) * inv;
  float g = 0.0f;
  if constexpr (P == Precision::kFloat32) {
    constexpr float kC[] = {0.537003517f,   -0.441697299f,  0.295109212f,
                            -0.15523088f,   0.0598192848f,  -0.0134203453f,
                            -0.000814978557f, 0.00146578019f};
    g = polynomial(u, kC);
  } else {
    constexpr float kC[] = {0.510791421f,   -0.343586892f,  0.139736339f,  -0.0181256328f,
                            -0.0107409265f, 0.00287891179f, 0.00137819571f};
    g = polynomial(u, kC);
  }
  return exp_bounded<P>(-z * z) * g * inv;
}

// gelu(a) = a Phi(a), Phi(a) = P(N(0,1) <= a) = erfc(-a / sqrt(2)) / 2,
// through erfc of |a| so that the negative tail stays relatively accurate:
// Phi within 1.8e-6 (float32) and 5e-6 (16-bit) relative for a >= -4, 2e-5
// down to a = -13 (the rounding of z^2 inside exp(-z^2) dominates in the far
// tail). Below a = -13.15 (|a| / sqrt(2) >= kErfcMaxArg) the tail is taken
// as 0, where the exact one is below 1e-38: a clamped tail would leave
// a * 1e-39, which is not small for the largest floats. NaN propagates
// through the product; a = -Inf gives NaN (-Inf times 0), as the formula does
// (-Inf times Phi = 0) and as the GPU kernels do.
template <Precision P>
[[gnu::always_inline]] inline float gelu_erf(float a) {
  constexpr float kRsqrt2 = 0.707106781186547524f;
  const float z_unbounded = __builtin_fabsf(a) * kRsqrt2;
  const bool in_range = z_unbounded < kErfcMaxArg;
  const float tail_bounded = half_erfc<P>(in_range ? z_unbounded : kErfcMaxArg);
  const float tail = in_range ? tail_bounded : 0.0f;
  return a * (a < 0.0f ? tail : 1.0f - tail);
}

}  // namespace kdispatch::cpu
