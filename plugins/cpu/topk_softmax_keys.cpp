// moe.topk_softmax's float16 and bfloat16 rows in integer keys, with AVX2.
#include "topk_softmax_avx2.hpp"

#if KD_TOPK_AVX2

#include <type_traits>

namespace kdispatch::cpu::topk {
namespace {

// The 16-bit rows in integer keys. A float16 or bfloat16 value is a sign and
// a magnitude, and among the numbers the magnitude's bits order as the
// values do: the magnitude, negated for a negative number, is a signed 16-bit
// key in the order of the values, +0 and -0 both 0. Sixteen keys fill a
// register, so the lane maxima (the same 16 lanes as row_stats), the
// threshold and the candidates cost half of what they cost in floats, and
// the row is never widened to memory; only the exps for the sum see floats.
// The selection orders the 32-bit composites key * 65536 - j, so that a
// larger composite is a larger logit or, for equal ones, the lower index:
// the insertion then needs no separate ids, and both come back from the
// composite. Rows with a NaN (whose key is past infinity's) take the float
// row, and so do shapes outside key_rows (fewer than 16 or more than 65536
// logits, K > 8).
template <class T>
struct Bits16;
template <>
struct Bits16<Float16> {
  static constexpr int16_t kInfinity = 0x7c00;
};
template <>
struct Bits16<BFloat16> {
  static constexpr int16_t kInfinity = 0x7f80;
};

KD_AVX2 inline __m256i magnitudes16(__m256i bits) {
  return _mm256_and_si256(bits, _mm256_set1_epi16(0x7fff));
}

// psignw negates the magnitude where the value is negative (and leaves the
// zero magnitude of -0 at 0).
KD_AVX2 inline __m256i keys16(__m256i bits) { return _mm256_sign_epi16(magnitudes16(bits), bits); }

// The values of 16-bit keys held in 32-bit lanes.
template <class T>
KD_AVX2 inline __m256 key_values(__m256i key) {
  const __m256i magnitude = _mm256_abs_epi32(key);
  const __m256i sign = _mm256_and_si256(key, _mm256_set1_epi32(INT32_MIN));
  if constexpr (std::is_same_v<T, BFloat16>) {
    return _mm256_castsi256_ps(_mm256_or_si256(_mm256_slli_epi32(magnitude, 16), sign));
  } else {
    const __m256i bits = _mm256_or_si256(magnitude, _mm256_srli_epi32(sign, 16));
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0x08);
    return _mm256_cvtph_ps(_mm256_castsi256_si128(packed));
  }
}

// The largest of 16 signed lanes: phminposuw finds the smallest unsigned,
// and x ^ 0x7fff turns the signed order into the reverse unsigned one.
KD_AVX2 inline int16_t max16(__m256i v) {
  __m128i m = _mm_max_epi16(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  m = _mm_xor_si128(m, _mm_set1_epi16(0x7fff));
  return static_cast<int16_t>(_mm_cvtsi128_si32(_mm_minpos_epu16(m)) ^ 0x7fff);
}

// threshold_avx2 for 16 lanes of keys in one register: for every lane, the
// number of lanes above it, counted over the 15 rotations of the register;
// then the smallest of the lanes that fewer than k exceed (x ^ 0x8000 turns
// the signed order into the unsigned one).
KD_AVX2 inline int16_t kth_largest16(__m256i v, int64_t k) {
  const __m256i swapped = _mm256_permute2x128_si256(v, v, 1);
  __m256i above = _mm256_setzero_si256();
  __m256i above_far = _mm256_setzero_si256();
  // Rotation by r lanes (r < 8) and by 8 + r: alignr shifts within each
  // 128-bit half, so the two halves come from v and its swapped copy.
#define KD_ROTATIONS(r)                                                                          \
  above = _mm256_sub_epi16(above, _mm256_cmpgt_epi16(_mm256_alignr_epi8(swapped, v, 2 * (r)), v)); \
  above_far = _mm256_sub_epi16(above_far,                                                        \
                               _mm256_cmpgt_epi16(_mm256_alignr_epi8(v, swapped, 2 * (r)), v));
  KD_ROTATIONS(1) KD_ROTATIONS(2) KD_ROTATIONS(3) KD_ROTATIONS(4) KD_ROTATIONS(5)
  KD_ROTATIONS(6) KD_ROTATIONS(7)
#undef KD_ROTATIONS
  above = _mm256_sub_epi16(above, _mm256_cmpgt_epi16(swapped, v));  // by 8
  above = _mm256_add_epi16(above, above_far);
  const __m256i in_top_k = _mm256_cmpgt_epi16(_mm256_set1_epi16(static_cast<int16_t>(k)), above);
  const __m256i m = _mm256_blendv_epi8(_mm256_set1_epi16(INT16_MAX), v, in_top_k);
  __m128i h = _mm_min_epi16(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
  h = _mm_xor_si128(h, _mm_set1_epi16(INT16_MIN));
  return static_cast<int16_t>(_mm_cvtsi128_si32(_mm_minpos_epu16(h)) ^ 0x8000);
}

// One bit per lane, in lane order, for the compares of two blocks.
KD_AVX2 inline uint32_t bits_of_two_blocks(__m256i first, __m256i second) {
  // packsswb interleaves the halves of its operands; vpermq restores the order.
  return static_cast<uint32_t>(
      _mm256_movemask_epi8(_mm256_permute4x64_epi64(_mm256_packs_epi16(first, second), 0xd8)));
}

// The best 8 composites so far, descending: TopInRegisters without the ids,
// in two halves, so that moving a lane up stays within 128 bits (palignr, one
// cycle, where a lane-crossing permute takes three): each insertion is two
// operations deep, the halves updated side by side from their old values.
struct TopComposites {
  __m128i first;   // lanes 0-3
  __m128i second;  // lanes 4-7
};

// TopInRegisters::insert: lane l becomes min(top[l - 1], max(top[l], c)),
// with top[-1] above everything.
KD_AVX2 inline void insert(TopComposites& top, int32_t composite) {
  const __m128i c = _mm_set1_epi32(composite);
  const __m128i first_up = _mm_alignr_epi8(top.first, _mm_set1_epi32(INT32_MAX), 12);
  const __m128i second_up = _mm_alignr_epi8(top.second, top.first, 12);
  top.first = _mm_min_epi32(first_up, _mm_max_epi32(top.first, c));
  top.second = _mm_min_epi32(second_up, _mm_max_epi32(top.second, c));
}

// A block of 16 logits as two registers of floats, and which logits they
// hold. bfloat16 is the upper half of a float32: interleaving with zeros
// widens it in one operation per register, but gives logits 0-3 and 8-11 in
// the first and 4-7 and 12-15 in the second. float16 goes through F16C, in
// order.
struct Widened {
  __m256 first;
  __m256 second;
};

template <class T>
KD_AVX2 inline Widened widen_block(const uint16_t* bits) {
  if constexpr (std::is_same_v<T, BFloat16>) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bits));
    const __m256i zero = _mm256_setzero_si256();
    return {_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, x)),
            _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, x))};
  } else {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bits))),
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bits + 8)))};
  }
}

// The logit (mod 16) in each lane of the two registers.
template <class T>
KD_AVX2 inline Widened block_lanes() {
  if constexpr (std::is_same_v<T, BFloat16>) {
    return {_mm256_setr_ps(0, 1, 2, 3, 8, 9, 10, 11), _mm256_setr_ps(4, 5, 6, 7, 12, 13, 14, 15)};
  } else {
    return {_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), _mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15)};
  }
}

// One float16 or bfloat16 row between the passes of the key rows.
struct KeyRow {
  const uint16_t* bits;
  int16_t* keys;  // scratch: the keys, e rounded up to whole pairs of blocks
  void* words;    // scratch: the candidate bits, see key_candidates
  int64_t word_count;
  RowStats st;
  // The last, partial block, zeros past the row (sum_of_exps).
  alignas(32) uint16_t tail[kReductionLanes];
};

// The first passes of a row in keys, in three steps so that two rows can go
// through them step by step (each step's dependency chains beside the other
// row's): the keys with their lane maxima and largest magnitude; the max and
// the threshold; the candidates.
struct KeyScan {
  __m256i lane_max;
  int16_t largest_magnitude;
};

// The passes take the row length e apart from RowArgs, so that the common
// lengths can be compile-time constants (see key_row_pairs).
//
// The keys, their lane maxima, and the largest magnitude (NaN or not).
template <class T>
[[gnu::always_inline]] KD_AVX2 inline KeyScan scan_keys(int64_t e, KeyRow& row) {
  const int64_t full = e - e % kReductionLanes;
  const int64_t rest = e - full;
  const uint16_t* const bits = row.bits;
  int16_t* const keys = row.keys;
  __m256i lane_max = _mm256_set1_epi16(INT16_MIN);
  __m256i magnitude_max = _mm256_setzero_si256();
#pragma GCC unroll 2
  for (int64_t j = 0; j < full; j += kReductionLanes) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bits + j));
    magnitude_max = _mm256_max_epi16(magnitude_max, magnitudes16(x));
    const __m256i key = keys16(x);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(keys + j), key);
    lane_max = _mm256_max_epi16(lane_max, key);
  }
  _mm256_store_si256(reinterpret_cast<__m256i*>(row.tail), _mm256_setzero_si256());
  if (rest > 0) {
    // The last block with the lowest key past the row: below every value's,
    // so it changes no maximum and reaches no threshold.
    for (int64_t l = 0; l < rest; ++l) row.tail[l] = bits[full + l];
    const __m256i x = _mm256_load_si256(reinterpret_cast<const __m256i*>(row.tail));
    magnitude_max = _mm256_max_epi16(magnitude_max, magnitudes16(x));
    const __m256i lane = _mm256_setr_epi16(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m256i in = _mm256_cmpgt_epi16(_mm256_set1_epi16(static_cast<int16_t>(rest)), lane);
    const __m256i key = _mm256_blendv_epi8(_mm256_set1_epi16(INT16_MIN), keys16(x), in);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(keys + full), key);
    lane_max = _mm256_max_epi16(lane_max, key);
  }
  return {lane_max, max16(magnitude_max)};
}

// The max and the threshold (as the key just below it); false for a row
// with a NaN.
template <class T>
[[gnu::always_inline]] KD_AVX2 inline bool key_threshold(const RowArgs& a, const KeyScan& scan,
                                                         KeyRow& row, __m256i& below_threshold) {
  if (scan.largest_magnitude > Bits16<T>::kInfinity) return false;
  // Every lane holds a logit (e >= 16), so the threshold is a logit's key
  // and above INT16_MIN. The max is row_stats' but for the sign of a zero
  // max, which no weight depends on: x log2(e) - max log2(e) is the same for
  // +0 and -0 but for zero x, whose exp is 1 either way.
  row.st = RowStats{};
  row.st.max = _mm256_cvtss_f32(key_values<T>(_mm256_set1_epi32(max16(scan.lane_max))));
  below_threshold =
      _mm256_set1_epi16(static_cast<int16_t>(kth_largest16(scan.lane_max, a.k) - 1));
  return true;
}

// The candidates: 16 bits per block, four blocks to a 64-bit word (the last
// word's missing blocks zero). Each word is stored whole, so that the
// selection's loads of them are forwarded from the stores (a load spanning
// two narrower stores waits until they reach the cache).
[[gnu::always_inline]] KD_AVX2 inline void key_candidates(int64_t e, KeyRow& row,
                                                          __m256i below_threshold) {
  const int64_t blocks = (e + kReductionLanes - 1) / kReductionLanes;
  int16_t* const keys = row.keys;
  if (blocks % 2 != 0) {
    // An odd block count: one more block of keys that reach no threshold.
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(keys + blocks * 16),
                        _mm256_set1_epi16(INT16_MIN));
  }
  const auto pair_bits = [&](int64_t b) KD_AVX2 {
    const __m256i first = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(keys + b * 16));
    const __m256i second = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(keys + b * 16 + 16));
    return bits_of_two_blocks(_mm256_cmpgt_epi16(first, below_threshold),
                              _mm256_cmpgt_epi16(second, below_threshold));
  };
  const int64_t even_blocks = blocks + blocks % 2;  // with the padding block above
  char* const words = static_cast<char*>(row.words);
  int64_t w = 0;
  int64_t b = 0;
  for (; b + 4 <= even_blocks; b += 4, ++w) {
    const uint64_t word = pair_bits(b) | uint64_t{pair_bits(b + 2)} << 32;
    std::memcpy(words + w * sizeof word, &word, sizeof word);
  }
  if (b < even_blocks) {
    const uint64_t word = pair_bits(b);
    std::memcpy(words + w++ * sizeof word, &word, sizeof word);
  }
  row.word_count = w;
}

// How far ahead the key rows ask for their input, in elements (rows `stride`
// apart): whole groups of kRows rows (the rows passed through together), as
// many as fit in kPrefetchBytes, and at least the next group. Each group asks for one
// group further on, so that on large batches the input arrives from memory
// while the groups before it are computed (asking for only the next group
// leaves the first pass waiting for memory). Past the end of the input the
// prefetches are harmless: a prefetch never faults.
constexpr int64_t kPrefetchBytes = 3072;

template <int kRows, class T>
constexpr int64_t prefetch_ahead(int64_t e, int64_t stride) {
  const int64_t groups = kPrefetchBytes / (kRows * e * static_cast<int64_t>(sizeof(T)));
  return (groups > 1 ? groups : 1) * kRows * stride;
}

// The sums of e^(logit - max) of kRows rows at once (independent chains for
// the out-of-order core to overlap), each in the lanes and order of
// row_stats: lane l (mod 16) in one sum, the last, partial block only where
// it holds logits, and the same pairwise tree at the end. Meanwhile the
// input further on is asked for (prefetch_ahead).
template <int kRows, class T>
KD_AVX2 inline void sum_of_exps(KeyRow* const (&rows)[kRows], int64_t e, int64_t stride) {
  const int64_t full = e - e % kReductionLanes;
  const int64_t ahead = prefetch_ahead<kRows, T>(e, stride);
  __m256 minus_scaled_max[kRows];
  __m256 sum_first[kRows];
  __m256 sum_second[kRows];
  for (int r = 0; r < kRows; ++r) {
    minus_scaled_max[r] = _mm256_set1_ps(-(rows[r]->st.max * kLog2e));
    sum_first[r] = _mm256_setzero_ps();
    sum_second[r] = _mm256_setzero_ps();
  }
#pragma GCC unroll 2
  for (int64_t j = 0; j < full; j += kReductionLanes) {
    for (int r = 0; r < kRows; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(rows[r]->bits + ahead + j), _MM_HINT_T0);
      const Widened x = widen_block<T>(rows[r]->bits + j);
      sum_first[r] = exp_plus8(x.first, minus_scaled_max[r], sum_first[r]);
      sum_second[r] = exp_plus8(x.second, minus_scaled_max[r], sum_second[r]);
    }
  }
  if (const int64_t rest = e - full; rest > 0) {
    const Widened lane = block_lanes<T>();
    const __m256 n = _mm256_set1_ps(static_cast<float>(rest));
    const __m256 in_first = _mm256_cmp_ps(lane.first, n, _CMP_LT_OQ);
    const __m256 in_second = _mm256_cmp_ps(lane.second, n, _CMP_LT_OQ);
    for (int r = 0; r < kRows; ++r) {
      const Widened x = widen_block<T>(rows[r]->tail);
      sum_first[r] = _mm256_blendv_ps(
          sum_first[r], exp_plus8(x.first, minus_scaled_max[r], sum_first[r]), in_first);
      sum_second[r] = _mm256_blendv_ps(
          sum_second[r], exp_plus8(x.second, minus_scaled_max[r], sum_second[r]),
          in_second);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    if constexpr (std::is_same_v<T, BFloat16>) {
      // Logits 0-7 and 8-15 in order, as the tree starts from.
      rows[r]->st.sum =
          reduce_sum_avx2(_mm256_permute2f128_ps(sum_first[r], sum_second[r], 0x20),
                          _mm256_permute2f128_ps(sum_first[r], sum_second[r], 0x31));
    } else {
      rows[r]->st.sum = reduce_sum_avx2(sum_first[r], sum_second[r]);
    }
    rows[r]->st.full_sum = true;
  }
}

// The sums, or for renormalized rows only the next rows asked for.
template <int kRows, class T>
[[gnu::always_inline]] KD_AVX2 inline void sums_or_prefetch(KeyRow* const (&rows)[kRows],
                                                            const RowArgs& a, int64_t e) {
  if (!a.renormalize) {
    sum_of_exps<kRows, T>(rows, e, a.stride);
    return;
  }
  const int64_t ahead = prefetch_ahead<kRows, T>(e, a.stride);
  for (int r = 0; r < kRows; ++r) {
    for (int64_t j = 0; j < e; j += 64 / sizeof(T)) {
      _mm_prefetch(reinterpret_cast<const char*>(rows[r]->bits + ahead + j), _MM_HINT_T0);
    }
  }
}

// The last passes: the selection ...
[[gnu::always_inline]] KD_AVX2 inline TopComposites select_keys(const KeyRow& row) {
  // The empty lanes hold INT32_MIN, below every composite (a key is at
  // least -0x7fff, so a composite is above -0x7fff * 65536 - 65536).
  const int16_t* const keys = row.keys;
  TopComposites best{_mm_set1_epi32(INT32_MIN), _mm_set1_epi32(INT32_MIN)};
  for_each_candidate(row.words, row.word_count, [&](int64_t j) KD_AVX2 {
    const uint32_t composite = (static_cast<uint32_t>(keys[j]) << 16) - static_cast<uint32_t>(j);
    insert(best, static_cast<int32_t>(composite));
  });
  return best;
}

// ... and the weights.
template <class T>
[[gnu::always_inline]] KD_AVX2 inline void write_keys(const RowArgs& a, const KeyRow& row,
                                                      const TopComposites& best, float* weights,
                                                      int32_t* ids) {
  const __m256i top = _mm256_set_m128i(best.second, best.first);
  // key = (composite + 0xffff) >> 16 (arithmetic), j = -composite mod 65536.
  const __m256i top_keys = _mm256_srai_epi32(_mm256_add_epi32(top, _mm256_set1_epi32(0xffff)), 16);
  const __m256i top_ids =
      _mm256_and_si256(_mm256_sub_epi32(_mm256_setzero_si256(), top), _mm256_set1_epi32(0xffff));
  store_first_k(top_ids,
                weights_in_registers(key_values<T>(top_keys), row.st, a.k, a.renormalize), a.k,
                weights, ids);
}

// The scratch of the key rows: two rows' keys in a.row (which holds
// e + k + 2 * kReductionLanes floats), each padded to an even number of
// blocks, their candidate bits in a.order.
inline int64_t key_row_stride(int64_t e) {
  return (e + 2 * kReductionLanes - 1) / (2 * kReductionLanes) * (2 * kReductionLanes);
}

inline KeyRow key_row(const RowArgs& a, int64_t e, const void* src, int slot) {
  KeyRow row;
  row.bits = static_cast<const uint16_t*>(src);
  row.keys = reinterpret_cast<int16_t*>(a.row) + slot * key_row_stride(e);
  // At most key_row_stride / 64 + 1 words a row (key_candidates), 8-byte
  // aligned like a.order.
  row.words = reinterpret_cast<char*>(a.order) + slot * (key_row_stride(e) / 64 + 1) * 8;
  return row;
}

// One row in keys; a row with a NaN goes to the float row.
template <class T>
KD_AVX2 void key_row_alone(const T* src, const RowArgs& a, float* weights, int32_t* ids) {
  KeyRow row = key_row(a, a.e, src, 0);
  __m256i below_threshold;
  if (!key_threshold<T>(a, scan_keys<T>(a.e, row), row, below_threshold)) {
    float_row_avx2(src, a, weights, ids);
    return;
  }
  key_candidates(a.e, row, below_threshold);
  KeyRow* const rows[] = {&row};
  sums_or_prefetch<1, T>(rows, a, a.e);
  write_keys<T>(a, row, select_keys(row), weights, ids);
}

// The 16-bit rows in keys, two at a time, pass by pass, so that each pass's
// dependency chains (the reductions, the threshold, the insertions, the
// weights) have a second row's independent work beside them: rows 0 to
// rows - 1 but the last of an odd count (src, weights and ids at row 0).
// Returns the number of rows done. kE, when not 0, is the row length (a.e)
// as a constant, which leaves the passes' loops without remainders and lets
// the compiler unroll them.
template <class T, int64_t kE>
KD_AVX2 int64_t key_row_pairs(const T* src, int64_t rows, const RowArgs& a, float* weights,
                              int32_t* ids) {
  const int64_t e = kE != 0 ? kE : a.e;
  const int64_t k = a.k;
  int64_t r = 0;
  for (; r + 2 <= rows; r += 2) {
    KeyRow first = key_row(a, e, src + r * a.stride, 0);
    KeyRow second = key_row(a, e, src + (r + 1) * a.stride, 1);
    const KeyScan first_scan = scan_keys<T>(e, first);
    const KeyScan second_scan = scan_keys<T>(e, second);
    __m256i first_below;
    __m256i second_below;
    // Both thresholds whatever the first row, so that they go side by side.
    const bool first_ok = key_threshold<T>(a, first_scan, first, first_below);
    const bool second_ok = key_threshold<T>(a, second_scan, second, second_below);
    if (first_ok && second_ok) {
      key_candidates(e, first, first_below);
      key_candidates(e, second, second_below);
      KeyRow* const pair[] = {&first, &second};
      sums_or_prefetch<2, T>(pair, a, e);
      const TopComposites first_best = select_keys(first);
      const TopComposites second_best = select_keys(second);
      write_keys<T>(a, first, first_best, weights + r * k, ids + r * k);
      write_keys<T>(a, second, second_best, weights + (r + 1) * k, ids + (r + 1) * k);
    } else {
      // A NaN: each row on its own (the float row uses the scratch too).
      key_row_alone(src + r * a.stride, a, weights + r * k, ids + r * k);
      key_row_alone(src + (r + 1) * a.stride, a, weights + (r + 1) * k, ids + (r + 1) * k);
    }
  }
  return r;
}

}  // namespace

// The rows by pairs, the experts of common MoE routers (128, 256) as
// constants, and the last of an odd count alone.
template <class T>
KD_AVX2 void key_rows_avx2(const T* src, int64_t rows, const RowArgs& a, float* weights,
                           int32_t* ids) {
  int64_t r = 0;
  switch (a.e) {
    case 128: r = key_row_pairs<T, 128>(src, rows, a, weights, ids); break;
    case 256: r = key_row_pairs<T, 256>(src, rows, a, weights, ids); break;
    default: r = key_row_pairs<T, 0>(src, rows, a, weights, ids); break;
  }
  if (r < rows) key_row_alone(src + r * a.stride, a, weights + r * a.k, ids + r * a.k);
}

template void key_rows_avx2<Float16>(const Float16*, int64_t, const RowArgs&, float*, int32_t*);
template void key_rows_avx2<BFloat16>(const BFloat16*, int64_t, const RowArgs&, float*, int32_t*);

}  // namespace kdispatch::cpu::topk

#endif  // KD_TOPK_AVX2
