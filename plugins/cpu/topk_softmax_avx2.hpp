// moe.topk_softmax's AVX2 rows (AVX2, FMA and F16C, chosen at load time):
// the pieces both the float rows (topk_softmax_avx2.cpp) and the 16-bit key
// rows (topk_softmax_keys.cpp) use, and their entry points.
#pragma once

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KD_TOPK_AVX2 1
#include <immintrin.h>

#include <cstdint>

#include "convert.hpp"
#include "topk_softmax_rows.hpp"

#define KD_AVX2 __attribute__((target("avx2,f16c,fma")))

namespace kdispatch::cpu::topk {

static_assert(kReductionLanes == 16, "the AVX2 rows keep the lanes in two 8-float registers");

// The portable row's pairwise sum of the lanes (lane l joined with l + width
// for halving widths), lanes 0-7 in lo and 8-15 in hi.
KD_AVX2 inline float reduce_sum_avx2(__m256 lo, __m256 hi) {
  __m256 m = _mm256_add_ps(lo, hi);
  m = _mm256_add_ps(m, _mm256_permute2f128_ps(m, m, 1));
  m = _mm256_add_ps(m, _mm256_permute_ps(m, 0x4e));
  m = _mm256_add_ps(m, _mm256_permute_ps(m, 0xb1));
  return _mm256_cvtss_f32(m);
}

// Up to this K, the AVX2 rows keep the best K in registers.
constexpr int64_t kRegisterMaxK = 8;

// exp_plus on 8 lanes, operation for operation.
KD_AVX2 inline __m256 exp_plus8(__m256 logits, __m256 minus_scaled_max, __m256 addend) {
  const __m256 t0 = _mm256_fmadd_ps(logits, _mm256_set1_ps(kLog2e), minus_scaled_max);
  // maxps(a, b) is a > b ? a : b, so NaN passes as there.
  const __m256 t = _mm256_max_ps(_mm256_set1_ps(-126.0f), t0);
  const __m256 shifted = _mm256_add_ps(t, _mm256_set1_ps(kShiftBiased));
  const __m256 f = _mm256_sub_ps(t, _mm256_sub_ps(shifted, _mm256_set1_ps(kShiftBiased)));
  const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(shifted), 23));
  __m256 p = _mm256_set1_ps(kExpSumC4);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExpSumC3));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExpSumC2));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExpSumC1));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  return _mm256_fmadd_ps(p, scale, addend);
}

// weights_from_logits for the 8 lanes of `logits` (n = 8): the exps and the
// scaling one vector each, the sum of the first k lane by lane as there.
KD_AVX2 inline __m256 weights_in_registers(__m256 logits, const RowStats& st, int64_t k,
                                           bool renormalize) {
  const __m256 exps =
      exp_plus8(logits, _mm256_set1_ps(-(st.max * kLog2e)), _mm256_setzero_ps());
  alignas(32) float lane[8];
  if (!st.full_sum) {
    _mm256_store_ps(lane, exps);
    return _mm256_div_ps(exps, _mm256_set1_ps(sum_of_first(lane, k)));
  }
  const __m256 w = _mm256_mul_ps(exps, _mm256_set1_ps(1.0f / st.sum));
  if (!renormalize) return w;
  _mm256_store_ps(lane, w);
  const float selected_sum = sum_of_first(lane, k);
  return selected_sum > 0.0f ? _mm256_div_ps(w, _mm256_set1_ps(selected_sum)) : w;
}

// The first k lanes of the winners' ids and weights.
KD_AVX2 inline void store_first_k(__m256i lane_ids, __m256 lane_weights, int64_t k,
                                  float* weights, int32_t* ids) {
  if (k == kRegisterMaxK) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(ids), lane_ids);
    _mm256_storeu_ps(weights, lane_weights);
    return;
  }
  alignas(32) int32_t id[8];
  alignas(32) float w[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(id), lane_ids);
  _mm256_store_ps(w, lane_weights);
  for (int64_t i = 0; i < k; ++i) ids[i] = id[i];
  for (int64_t i = 0; i < k; ++i) weights[i] = w[i];
}

// Whether the rows of this shape go through keys (topk_softmax_keys.cpp).
constexpr int64_t kKeyMaxExperts = 65536;
inline bool key_rows(const RowArgs& a) {
  return a.e >= kReductionLanes && a.e <= kKeyMaxExperts && a.k <= kRegisterMaxK;
}

// The rows of a range (src, weights and ids at its first row), for T =
// float, Float16 and BFloat16: the 16-bit rows of key_rows shapes in keys, the
// others in floats.
template <class T>
KD_AVX2 void topk_rows_avx2(const T* src, int64_t rows, const RowArgs& a, float* weights,
                            int32_t* ids);

// One row in floats (the 16-bit types widened), for any shape and input.
template <class T>
KD_AVX2 void float_row_avx2(const T* src, const RowArgs& a, float* weights, int32_t* ids);

// The rows of a range in keys, for T = Float16 and BFloat16 and a key_rows
// shape; a row with a NaN goes to float_row_avx2.
template <class T>
KD_AVX2 void key_rows_avx2(const T* src, int64_t rows, const RowArgs& a, float* weights,
                           int32_t* ids);

}  // namespace kdispatch::cpu::topk

#endif  // x86-64
