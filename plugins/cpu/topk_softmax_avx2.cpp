// moe.topk_softmax's rows in floats with AVX2 and FMA (and F16C for
// float16), for the hosts that have them: every float32 row, and the 16-bit
// rows that do not go through keys (topk_softmax_keys.cpp). GCC leaves much
// of the portable row scalar or branching (the lane maxima, a select it
// cannot prove to be maxps; the threshold compare, a byte per logit; the lane
// folds, through the stack; the insertion), so this row is written with
// intrinsics: the same passes, operation for operation wherever the results
// depend on the order, and for K <= 8 the selection in registers. Every
// operation rounds as in the portable row (the fused ones too, see exp_plus),
// and both give the same ids and weights, bit for bit (but for which NaN a
// NaN weight is: x86 keeps an operand's NaN, and the rows order some
// operands differently).
#include "topk_softmax_avx2.hpp"

#if KD_TOPK_AVX2

#include <type_traits>

#include "convert.hpp"

namespace kdispatch::cpu::topk {
namespace {

KD_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

KD_AVX2 inline __m256 load8(const Float16* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

KD_AVX2 inline __m256 load8(const BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// threshold_of for the lane maxima in lo (lanes 0-7) and hi (8-15), also
// stored in `lanes`: the same count of exceeding lanes and the same minimum,
// in registers (GCC compiles threshold_of's minimum into scalar, branching
// code).
KD_AVX2 inline float threshold_avx2(__m256 lo, __m256 hi, const float (&lanes)[kReductionLanes],
                                    int64_t k) {
  if (k > kReductionLanes) return -__builtin_inff();
  // A true compare is -1: subtracting it counts.
  __m256i exceeded_lo = _mm256_setzero_si256();
  __m256i exceeded_hi = _mm256_setzero_si256();
  for (int other = 0; other < kReductionLanes; ++other) {
    const __m256 v = _mm256_broadcast_ss(&lanes[other]);
    const __m256 above_lo = _mm256_cmp_ps(v, lo, _CMP_GT_OQ);
    const __m256 above_hi = _mm256_cmp_ps(v, hi, _CMP_GT_OQ);
    exceeded_lo = _mm256_sub_epi32(exceeded_lo, _mm256_castps_si256(above_lo));
    exceeded_hi = _mm256_sub_epi32(exceeded_hi, _mm256_castps_si256(above_hi));
  }
  const __m256i kk = _mm256_set1_epi32(static_cast<int32_t>(k));
  const __m256 inf = _mm256_set1_ps(__builtin_inff());
  const __m256 in_lo = _mm256_castsi256_ps(_mm256_cmpgt_epi32(kk, exceeded_lo));
  const __m256 in_hi = _mm256_castsi256_ps(_mm256_cmpgt_epi32(kk, exceeded_hi));
  __m256 m = _mm256_min_ps(_mm256_blendv_ps(inf, lo, in_lo), _mm256_blendv_ps(inf, hi, in_hi));
  m = _mm256_min_ps(m, _mm256_permute2f128_ps(m, m, 1));
  m = _mm256_min_ps(m, _mm256_permute_ps(m, 0x4e));
  m = _mm256_min_ps(m, _mm256_permute_ps(m, 0xb1));
  return _mm256_cvtss_f32(m);
}

// reduce_max in registers, lanes 0-7 in lo and 8-15 in hi: the same
// pairwise tree, lane l joined with l + width (maxps(v, m) is v > m ? v : m,
// the portable select with v the upper lane).
KD_AVX2 inline float reduce_max_avx2(__m256 lo, __m256 hi) {
  __m256 m = _mm256_max_ps(hi, lo);
  m = _mm256_max_ps(_mm256_permute2f128_ps(m, m, 1), m);
  m = _mm256_max_ps(_mm256_permute_ps(m, 0x4e), m);
  m = _mm256_max_ps(_mm256_permute_ps(m, 0xb1), m);
  return _mm256_cvtss_f32(m);
}

// The best logits so far, as TopList keeps them, one per lane: keys
// descending, their ids alongside. Lanes past those filled hold the key -Inf
// and id 0. All 8 lanes are kept whatever K: the best K are the first K
// lanes of the best 8. Only for rows whose candidates are all above -Inf
// (see select_in_registers), so that an empty lane's key is below every
// candidate's, and no key is NaN; +0 and -0 compare equal, as in TopList
// (which of the two a lane keeps does not change its weight: x - max rounds
// alike for both or gives +-0, whose e^ is 1 either way).
//
// Insertion does not branch: with about 10 candidates a row arriving in
// random places, TopList's compares mispredict several times a row once the
// rows no longer fit the branch predictor's memory (large batches).
struct TopInRegisters {
  __m256 keys;
  __m256i ids;
};

KD_AVX2 inline TopInRegisters empty_top() {
  return {_mm256_set1_ps(-__builtin_inff()), _mm256_setzero_si256()};
}

// TopList::insert in registers (key and id broadcast to every lane): the
// lanes whose key is below the new one (strictly, so that an equal key stays
// in front, as the lower index) move one lane up, the last dropping out, and
// the new key takes the first of them. Keys need no masks: lane l becomes
// min(key[l - 1], max(key[l], new)).
KD_AVX2 inline void insert(TopInRegisters& top, __m256 key, __m256i id) {
  const __m256i one_lane_up = _mm256_setr_epi32(0, 0, 1, 2, 3, 4, 5, 6);
  const __m256 not_lane_0 = _mm256_castsi256_ps(_mm256_setr_epi32(0, -1, -1, -1, -1, -1, -1, -1));
  const __m256 keys_up = _mm256_permutevar8x32_ps(top.keys, one_lane_up);
  const __m256i ids_up = _mm256_permutevar8x32_epi32(top.ids, one_lane_up);
  // below: lanes l with key[l] < new; below_before: those with key[l - 1] < new.
  const __m256 below = _mm256_cmp_ps(top.keys, key, _CMP_LT_OQ);
  const __m256 below_before = _mm256_and_ps(_mm256_cmp_ps(keys_up, key, _CMP_LT_OQ), not_lane_0);
  const __m256 raised = _mm256_max_ps(top.keys, key);
  top.keys = _mm256_blend_ps(_mm256_min_ps(keys_up, raised), raised, 1);
  top.ids = _mm256_castps_si256(_mm256_blendv_ps(
      _mm256_blendv_ps(_mm256_castsi256_ps(top.ids), _mm256_castsi256_ps(id), below),
      _mm256_castsi256_ps(ids_up), below_before));
}

// select_top_k for k <= kRegisterMaxK, from the candidate bits (a 16-bit word
// per block of 16 logits, `blocks` of them padded to whole 64-bit words), for
// a row whose threshold is above -Inf: then so is every candidate (NaN never
// reaches a threshold). Returns false, leaving the row to TopList, when fewer
// than k logits were candidates (insert_all_if_short: it inserts NaN and
// -Inf too).
KD_AVX2 inline bool select_in_registers(const float* logits, int64_t k,
                                        const uint16_t* candidates, int64_t blocks,
                                        TopInRegisters& top) {
  top = empty_top();
  int64_t inserted = 0;
  for_each_candidate(candidates, (blocks + 3) / 4, [&](int64_t j) KD_AVX2 {
    insert(top, _mm256_broadcast_ss(logits + j), _mm256_set1_epi32(static_cast<int32_t>(j)));
    ++inserted;
  });
  return inserted >= k;
}

// write_weights for the first k lanes of `top`: the lanes past k are
// computed but not stored.
KD_AVX2 inline void write_top_in_registers(const RowArgs& a, const RowStats& st,
                                           const TopInRegisters& top, float* weights,
                                           int32_t* ids) {
  store_first_k(top.ids, weights_in_registers(top.keys, st, a.k, a.renormalize), a.k, weights,
                ids);
}

// Bits l set where v[l] >= threshold (never for NaN).
KD_AVX2 inline uint32_t reaching(__m256 v, __m256 threshold) {
  return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(v, threshold, _CMP_GE_OQ)));
}

// The lane maxima of row_stats, lanes 0-7 in lo and 8-15 in hi.
struct LaneMaxima {
  __m256 lo;
  __m256 hi;
};

// The first pass: the lane maxima, and for the 16-bit types the row widened
// into `row` (the logits the later passes read). The last, partial block
// comes padded with -Inf (no lane maximum changes) in `tail` and joins the
// lane maxima last, as in row_stats: the order decides which of +0 and -0
// is kept.
template <class T>
KD_AVX2 inline LaneMaxima widen_and_max(const T* src, int64_t full, const float* tail, float* row) {
  constexpr bool kWiden = !std::is_same_v<T, float>;
  __m256 max_lo = _mm256_set1_ps(-__builtin_inff());
  __m256 max_hi = max_lo;
  for (int64_t j = 0; j < full; j += kReductionLanes) {
    const __m256 lo = load8(src + j);
    const __m256 hi = load8(src + j + 8);
    if constexpr (kWiden) {
      _mm256_storeu_ps(row + j, lo);
      _mm256_storeu_ps(row + j + 8, hi);
    }
    // maxps(v, m) is v > m ? v : m, NaN included, as in row_stats.
    max_lo = _mm256_max_ps(lo, max_lo);
    max_hi = _mm256_max_ps(hi, max_hi);
  }
  max_lo = _mm256_max_ps(_mm256_load_ps(tail), max_lo);
  max_hi = _mm256_max_ps(_mm256_load_ps(tail + 8), max_hi);
  return {max_lo, max_hi};
}

// The second pass: the sum of e^(logit - max), in the lanes of row_stats
// (kSum; otherwise only whether a logit is NaN, which then makes the sum
// NaN, as it would be), and the candidates, a 16-bit word per block of 16
// logits (the bits of the logits that reach the threshold), padded with
// zeros to whole 64-bit words. Sets st.sum and st.full_sum; returns the
// number of words written. Meanwhile it asks for the next row of `src` (the
// row's input; the next row starts `stride` elements on).
template <bool kSum, class T>
KD_AVX2 inline int64_t exp_sum_and_candidates(const float* logits, int64_t full,
                                              const float* tail, int64_t rest,
                                              const T* src, int64_t stride, RowStats& st,
                                              uint16_t* candidates) {
  const __m256 minus_scaled_max = _mm256_set1_ps(-(st.max * kLog2e));
  const __m256 threshold = _mm256_set1_ps(st.threshold);
  __m256 sum_lo = _mm256_setzero_ps();
  __m256 sum_hi = _mm256_setzero_ps();
  __m256 nan = _mm256_setzero_ps();
  int64_t blocks = 0;
  // Two blocks an iteration: less loop overhead, and more independent work
  // between the loop's branches.
#pragma GCC unroll 2
  for (int64_t j = 0; j < full; j += kReductionLanes) {
    // The same block of the next row: a cache line for float32, half of one
    // (asked for twice) for the 16-bit types, so that the first pass of a
    // large batch does not wait for memory (the hardware prefetcher does
    // not run that far ahead). A prefetch past the end of the input is
    // harmless: it never faults.
    _mm_prefetch(reinterpret_cast<const char*>(src + stride + j), _MM_HINT_T0);
    const __m256 lo = _mm256_loadu_ps(logits + j);
    const __m256 hi = _mm256_loadu_ps(logits + j + 8);
    if constexpr (kSum) {
      sum_lo = exp_plus8(lo, minus_scaled_max, sum_lo);
      sum_hi = exp_plus8(hi, minus_scaled_max, sum_hi);
    } else {
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(lo, hi, _CMP_UNORD_Q));
    }
    candidates[blocks++] = static_cast<uint16_t>(reaching(lo, threshold) |
                                                 reaching(hi, threshold) << 8);
  }
  if (rest > 0) {
    // Only the first `rest` lanes take part: the padding would add
    // e^(-Inf) = 2^-126 (the clamp) to the sum, and reaches a threshold of
    // -Inf.
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i rest_lo = _mm256_set1_epi32(static_cast<int32_t>(rest));
    const __m256i rest_hi = _mm256_set1_epi32(static_cast<int32_t>(rest - 8));
    const __m256 in_lo = _mm256_castsi256_ps(_mm256_cmpgt_epi32(rest_lo, lane));
    const __m256 in_hi = _mm256_castsi256_ps(_mm256_cmpgt_epi32(rest_hi, lane));
    const __m256 lo = _mm256_load_ps(tail);
    const __m256 hi = _mm256_load_ps(tail + 8);
    if constexpr (kSum) {
      sum_lo = _mm256_blendv_ps(sum_lo, exp_plus8(lo, minus_scaled_max, sum_lo), in_lo);
      sum_hi = _mm256_blendv_ps(sum_hi, exp_plus8(hi, minus_scaled_max, sum_hi), in_hi);
    } else {
      // The padding is -Inf, never NaN.
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(lo, hi, _CMP_UNORD_Q));
    }
    const uint32_t reached = reaching(lo, threshold) | reaching(hi, threshold) << 8;
    candidates[blocks++] = static_cast<uint16_t>(reached & ((1u << rest) - 1));
  }
  for (int64_t b = blocks; b % 4 != 0; ++b) candidates[b] = 0;
  if constexpr (kSum) {
    st.sum = reduce_sum_avx2(sum_lo, sum_hi);
    st.full_sum = true;
  } else {
    st.full_sum = _mm256_movemask_ps(nan) != 0;
    st.sum = st.full_sum ? __builtin_nanf("") : 0.0f;
  }
  return blocks;
}

// The selection as in the portable row (from the candidate bits for
// k <= kInsertionMaxK): for k > kRegisterMaxK, and for the rows that
// select_in_registers leaves.
KD_AVX2 inline void select_in_memory(const float* logits, const RowArgs& a,
                                     const uint16_t* candidates, int64_t blocks, int32_t* ids) {
  if (a.k <= kInsertionMaxK) {
    TopList top(a.k, a.keys, ids);
    for_each_candidate(candidates, (blocks + 3) / 4,
                       [&](int64_t j) { top.insert(logits[j], static_cast<int32_t>(j)); });
    insert_all_if_short(logits, a.e, top);
  } else {
    // a.order holds the candidates, no longer needed.
    sort_top_k(logits, a.e, a.k, a.order, ids);
  }
}

}  // namespace

// The passes of row_stats, then the selection and the weights, in registers
// where K allows.
template <class T>
KD_AVX2 void float_row_avx2(const T* src, const RowArgs& a, float* weights, int32_t* ids) {
  const int64_t e = a.e;
  const int64_t k = a.k;
  const int64_t full = e - e % kReductionLanes;
  const int64_t rest = e - full;
  // A local copy: stores through `row` could otherwise alias a.row, which
  // the compiler then reloads after every store.
  float* const row = a.row;
  const float* logits = nullptr;
  if constexpr (std::is_same_v<T, float>) {
    logits = src;
  } else {
    logits = row;
  }
  alignas(32) float tail[kReductionLanes];
  for (int64_t l = 0; l < rest; ++l) tail[l] = to_float(src[full + l]);
  for (int64_t l = rest; l < kReductionLanes; ++l) tail[l] = -__builtin_inff();
  if constexpr (!std::is_same_v<T, float>) {
    for (int64_t l = 0; l < rest; ++l) row[full + l] = tail[l];
  }

  const LaneMaxima m = widen_and_max(src, full, tail, row);
  alignas(32) float lanes[kReductionLanes];
  _mm256_store_ps(lanes, m.lo);
  _mm256_store_ps(lanes + 8, m.hi);
  RowStats st{};
  st.threshold = threshold_avx2(m.lo, m.hi, lanes, k);
  st.max = reduce_max_avx2(m.lo, m.hi);

  uint16_t* const candidates = reinterpret_cast<uint16_t*>(a.order);
  const int64_t blocks =
      a.renormalize
          ? exp_sum_and_candidates<false>(logits, full, tail, rest, src, a.stride, st, candidates)
          : exp_sum_and_candidates<true>(logits, full, tail, rest, src, a.stride, st, candidates);

  if (k <= kRegisterMaxK && st.threshold > -__builtin_inff()) {
    TopInRegisters top;
    if (select_in_registers(logits, k, candidates, blocks, top)) {
      write_top_in_registers(a, st, top, weights, ids);
      return;
    }
  }
  select_in_memory(logits, a, candidates, blocks, ids);
  write_weights(logits, a, st, weights, ids);
}

template <class T>
KD_AVX2 void topk_rows_avx2(const T* src, int64_t rows, const RowArgs& a, float* weights,
                            int32_t* ids) {
  if constexpr (!std::is_same_v<T, float>) {
    if (key_rows(a)) {
      key_rows_avx2(src, rows, a, weights, ids);
      return;
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float_row_avx2(src + r * a.stride, a, weights + r * a.k, ids + r * a.k);
  }
}

template void topk_rows_avx2<float>(const float*, int64_t, const RowArgs&, float*, int32_t*);
template void topk_rows_avx2<Float16>(const Float16*, int64_t, const RowArgs&, float*, int32_t*);
template void topk_rows_avx2<BFloat16>(const BFloat16*, int64_t, const RowArgs&, float*, int32_t*);
template void float_row_avx2<Float16>(const Float16*, const RowArgs&, float*, int32_t*);
template void float_row_avx2<BFloat16>(const BFloat16*, const RowArgs&, float*, int32_t*);

}  // namespace kdispatch::cpu::topk

#endif  // KD_TOPK_AVX2
