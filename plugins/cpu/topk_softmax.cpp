// moe.topk_softmax: p = softmax(gating_output row) in float32; topk_ids are
// the indices of the K largest p, descending, ties to the lower index;
// topk_weights their p, divided by their sum when renormalize (vLLM
// semantics, including leaving the weights as they are when the sum is 0).

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <type_traits>
#include <utility>

#include "convert.hpp"
#include "fast_math.hpp"
#include "half_float.hpp"
#include "kd_plugin.hpp"
#include "kd_plugin_kernels.hpp"
#include "multiversion.hpp"
#include "parallel_for.hpp"
#include "tensor_access.hpp"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KD_TOPK_AVX2 1
#include <immintrin.h>
#endif

namespace kdispatch::cpu {
namespace {

constexpr const char* kOp = "moe.topk_softmax";

// What one row's selection needs from its logits: the max, the sum of
// e^(logit - max), and a threshold that at least K logits reach.
//
// With renormalize the sum cancels out of every weight (p_i / sum of the
// winners' p is e_i / sum of the winners' e), so it is not computed: the
// exp of every logit is most of a row's arithmetic. It is still needed for a
// row with a NaN logit, whose weights are then all NaN, as without
// renormalize; `full_sum` says whether `sum` holds it.
struct RowStats {
  float max;
  float sum;
  float threshold;
  bool full_sum;
};

// Softmax is monotonic, so the K most probable experts are the K largest
// logits: only the K winners need their probability; the rest only count
// towards the sum. Both use one exp at 16-bit precision (exp_plus, as
// exp_bounded<kHalf>: 3.4e-6 relative for logits within 10 of the max; the
// terms further down are below 5e-5 of the largest), so a weight is within
// 5e-6 of the true probability (relative, measured against float64 for rows
// centred anywhere from -3e7 to 1e6), well inside its 1e-4 tolerance, for a
// third of a float32 exp's work.
//
// Max and sum use kReductionLanes partial results (lane l takes the logits
// j = l mod kReductionLanes, the last partial block in lanes 0, 1, ...) so
// that the portable and the AVX2 row round alike; the lane maxima also give
// the threshold: the K-th largest of them is reached by at least K logits
// (one per lane), so nothing below it can be among the K largest. For
// E = 256 and K = 8, about 10 logits reach it. (-Inf, no filtering, when
// k > kReductionLanes.) The helpers below finish the lane results of the
// portable row; the AVX2 row does the same in registers, in the same order.

// The lanes joined pairwise, lane l with l + width for halving widths.
[[gnu::always_inline]] inline float reduce_max(float (&lane_max)[kReductionLanes]) {
  for (int width = kReductionLanes / 2; width > 0; width /= 2) {
    for (int l = 0; l < width; ++l) {
      const float v = lane_max[l + width];
      lane_max[l] = v > lane_max[l] ? v : lane_max[l];
    }
  }
  return lane_max[0];
}

[[gnu::always_inline]] inline float reduce_sum(float (&sums)[kReductionLanes]) {
  for (int width = kReductionLanes / 2; width > 0; width /= 2) {
    for (int l = 0; l < width; ++l) sums[l] += sums[l + width];
  }
  return sums[0];
}

[[gnu::always_inline]] inline float threshold_of(const float (&lane_max)[kReductionLanes],
                                                 int64_t k) {
  if (k > kReductionLanes) return -__builtin_inff();
  // The K-th largest lane maximum is the smallest of those that fewer than K
  // others exceed. Counting, for every lane at once, how many lanes exceed it
  // vectorises and does not branch, unlike a partial sort.
  int32_t exceeded_by[kReductionLanes] = {};
  for (int other = 0; other < kReductionLanes; ++other) {
    for (int l = 0; l < kReductionLanes; ++l) {
      exceeded_by[l] += lane_max[other] > lane_max[l] ? 1 : 0;
    }
  }
  // The smallest of the lanes in the top K, again lane-parallel (a tree).
  float in_top_k[kReductionLanes];
  for (int l = 0; l < kReductionLanes; ++l) {
    in_top_k[l] = exceeded_by[l] < k ? lane_max[l] : __builtin_inff();
  }
  for (int width = kReductionLanes / 2; width > 0; width /= 2) {
    for (int l = 0; l < width; ++l) {
      const float v = in_top_k[l + width];
      in_top_k[l] = v < in_top_k[l] ? v : in_top_k[l];
    }
  }
  return in_top_k[0];
}

// e^(logit - max) + addend, with scaled_max = max log2(e): the argument is
// never positive (or NaN), and only needed to 16-bit precision (see above).
// exp_bounded<Precision::kHalf> (fast_math.hpp) with a clamp, written with
// fewer operations since this is most of the row's arithmetic: the exponent
// in base 2 as one fused multiply-add, logit log2(e) - scaled_max (rounding
// scaled_max scales every exp of the row alike, which cancels out of the
// weights); the polynomial for 2^f by Horner's rule in fused multiply-adds;
// the scaling by 2^n fused with the addition (a running sum, or 0); and 127
// folded into the rounding constant, so that the low bits of `shifted` are
// n + 127 outright. Within 3.8e-6 of e^x on [-20, 0], as exp_bounded. The
// AVX2 rows have the same operations in exp_plus8.
//
// The fused operations are __builtin_fmaf, rounded once as IEEE 754 defines
// it on every host: an FMA instruction where the code is built for one (the
// AVX2 rows; aarch64), else libm's fmaf, slower but with the same results.
// Here they take a quarter of the row's operations off its longest part.
constexpr float kLog2e = 1.44269504088896341f;
// 1.5 * 2^23 + 127: adding it rounds to an integer (ties to odd rather than
// even, which is as good), leaving n + 127 in the low mantissa bits.
constexpr float kShiftBiased = 12583039.0f;
// exp_bounded<kHalf>'s polynomial for 2^f.
constexpr float kExpSumC1 = kExp2Half[1];
constexpr float kExpSumC2 = kExp2Half[2];
constexpr float kExpSumC3 = kExp2Half[3];
constexpr float kExpSumC4 = kExp2Half[4];

[[gnu::always_inline]] inline float exp_plus(float logit, float scaled_max, float addend) {
  const float t0 = __builtin_fmaf(logit, kLog2e, -scaled_max);
  // The clamp keeps 2^n a normal float; NaN passes unchanged.
  const float t = -126.0f > t0 ? -126.0f : t0;
  const float shifted = t + kShiftBiased;
  const float f = t - (shifted - kShiftBiased);  // in [-0.5, 0.5]
  const float scale = std::bit_cast<float>(std::bit_cast<uint32_t>(shifted) << 23);
  float p = kExpSumC4;
  p = __builtin_fmaf(p, f, kExpSumC3);
  p = __builtin_fmaf(p, f, kExpSumC2);
  p = __builtin_fmaf(p, f, kExpSumC1);
  p = __builtin_fmaf(p, f, 1.0f);
  return __builtin_fmaf(p, scale, addend);
}

// sums[l] += e^(block[l] - max) for the lanes of one block of logits ...
[[gnu::always_inline]] inline void add_exps(const float* block, float scaled_max,
                                            float (&sums)[kReductionLanes]) {
  for (int l = 0; l < kReductionLanes; ++l) {
    sums[l] = exp_plus(block[l], scaled_max, sums[l]);
  }
}

// ... and for the first n lanes of the last, partial one.
[[gnu::always_inline]] inline void add_exps(const float* block, int64_t n, float scaled_max,
                                            float (&sums)[kReductionLanes]) {
  for (int64_t l = 0; l < n; ++l) sums[l] = exp_plus(block[l], scaled_max, sums[l]);
}

[[gnu::always_inline]] inline bool any_nan(const float* logits, int64_t e) {
  bool nan = false;
  for (int64_t j = 0; j < e; ++j) nan = nan || logits[j] != logits[j];
  return nan;
}

[[gnu::always_inline]] inline RowStats row_stats(const float* logits, int64_t e, int64_t k,
                                                 bool renormalize) {
  constexpr float kNegInf = -__builtin_inff();
  float lane_max[kReductionLanes];
  for (float& v : lane_max) v = kNegInf;
  int64_t j = 0;
  for (; j + kReductionLanes <= e; j += kReductionLanes) {
    for (int l = 0; l < kReductionLanes; ++l) {
      const float v = logits[j + l];
      lane_max[l] = v > lane_max[l] ? v : lane_max[l];
    }
  }
  for (int l = 0; j < e; ++j, ++l) {
    const float v = logits[j];
    lane_max[l] = v > lane_max[l] ? v : lane_max[l];
  }
  const float threshold = threshold_of(lane_max, k);
  const float max = reduce_max(lane_max);
  if (renormalize && !any_nan(logits, e)) return {max, 0.0f, threshold, false};

  float sums[kReductionLanes] = {};
  j = 0;
  const float scaled_max = max * kLog2e;
  for (; j + kReductionLanes <= e; j += kReductionLanes) add_exps(logits + j, scaled_max, sums);
  add_exps(logits + j, e - j, scaled_max, sums);
  return {max, reduce_sum(sums), threshold, true};
}

// Up to this K, selection keeps a sorted list of the best K: after the first
// few candidates almost every one fails a single compare against the K-th
// best, which beats a heap (partial_sort) by a wide margin.
constexpr int64_t kInsertionMaxK = 32;

// Descending logit, ties to the lower index, NaN last: the order of the
// partial_sort used for larger K (a strict weak ordering whatever the input).
struct HigherLogit {
  const float* logits;
  bool operator()(int32_t a, int32_t b) const {
    const float la = logits[a];
    const float lb = logits[b];
    const bool a_nan = la != la;
    const bool b_nan = lb != lb;
    if (a_nan != b_nan) return b_nan;
    if (!a_nan && la != lb) return la > lb;
    return a < b;
  }
};

// The k largest logits as a sorted list (descending, ties to the lower
// index, NaN as -Inf), built by insertion in index order.
class TopList {
 public:
  TopList(int64_t k, float* keys, int32_t* ids) : k_(k), keys_(keys), ids_(ids) {}

  bool full() const { return filled_ == k_; }
  void clear() { filled_ = 0; }

  void insert(float logit, int32_t j) {
    constexpr float kNegInf = -__builtin_inff();
    const float v = logit != logit ? kNegInf : logit;
    int64_t pos = 0;
    if (filled_ == k_) {
      // Strictly greater: an equal, later element never displaces.
      if (!(v > keys_[k_ - 1])) return;
      pos = k_ - 1;
    } else {
      pos = filled_++;
    }
    // Equal keys stay in front: ties go to the lower index.
    while (pos > 0 && keys_[pos - 1] < v) {
      keys_[pos] = keys_[pos - 1];
      ids_[pos] = ids_[pos - 1];
      --pos;
    }
    keys_[pos] = v;
    ids_[pos] = j;
  }

 private:
  int64_t k_;
  float* keys_;
  int32_t* ids_;
  int64_t filled_ = 0;
};

// When fewer than k logits reached the threshold (NaN in the row), the
// selection starts over with all of them.
[[gnu::always_inline]] inline void insert_all_if_short(const float* logits, int64_t e,
                                                       TopList& top) {
  if (top.full()) return;
  top.clear();
  for (int64_t j = 0; j < e; ++j) top.insert(logits[j], static_cast<int32_t>(j));
}

// Inserts the logits that reach the threshold, in index order. The compare
// is one vectorised pass into a byte per logit (`flags`, scratch for e
// bytes); the scan then tests 8 flags at a time and branches only per
// candidate, about 10 in 256.
[[gnu::always_inline]] inline void select_top_k(const float* logits, int64_t e, float threshold,
                                                uint8_t* flags, TopList& top) {
  for (int64_t j = 0; j < e; ++j) flags[j] = logits[j] >= threshold ? 1 : 0;
  int64_t j0 = 0;
  for (; j0 + 8 <= e; j0 += 8) {
    uint64_t word = 0;
    std::memcpy(&word, flags + j0, sizeof word);
    for (; word != 0; word &= word - 1) {
      const int64_t j = j0 + __builtin_ctzll(word) / 8;
      top.insert(logits[j], static_cast<int32_t>(j));
    }
  }
  for (; j0 < e; ++j0) {
    if (flags[j0] != 0) top.insert(logits[j0], static_cast<int32_t>(j0));
  }
  insert_all_if_short(logits, e, top);
}

// The k largest for k > kInsertionMaxK. `order` is scratch for e indices.
[[gnu::always_inline]] inline void sort_top_k(const float* logits, int64_t e, int64_t k,
                                              int32_t* order, int32_t* ids) {
  for (int64_t j = 0; j < e; ++j) order[j] = static_cast<int32_t>(j);
  std::partial_sort(order, order + k, order + e, HigherLogit{logits});
  std::copy(order, order + k, ids);
}

// Scratch and shape of the rows of one parallel range.
struct RowArgs {
  int64_t e;
  int64_t k;
  bool renormalize;
  float* row;      // e floats, the widened row (16-bit types); or, with keys
                   // and 2 * kReductionLanes more floats, two rows' keys (key_row)
  float* keys;     // k floats, after row
  int32_t* order;  // e + kReductionLanes: sort indices, flag bytes or candidate bits
};

// w[0] + ... + w[k - 1], in that order: the sum that renormalizes the
// winners, rounded alike in the portable and the AVX2 rows.
[[gnu::always_inline]] inline float sum_of_first(const float* w, int64_t k) {
  float sum = 0.0f;
  for (int64_t i = 0; i < k; ++i) sum += w[i];
  return sum;
}

// visit(j) for every candidate j, in increasing order: the set bits of
// `words` 64-bit words at `bits`. The float rows write the bits in 16-bit
// pieces (the key rows in whole words) into int32 scratch, so the words are
// read with memcpy.
template <class Visit>
[[gnu::always_inline]] inline void for_each_candidate(const void* bits, int64_t words,
                                                      Visit&& visit) {
  for (int64_t w = 0; w < words; ++w) {
    uint64_t word = 0;
    std::memcpy(&word, static_cast<const char*>(bits) + w * sizeof word, sizeof word);
    for (; word != 0; word &= word - 1) visit(w * 64 + __builtin_ctzll(word));
  }
}

// The winners' probabilities from their logits, in place: only they are
// exponentiated, each as in the sum; with renormalize, divided by the sum of
// the first k. w holds n >= k logits (the AVX2 row computes all 8 lanes of
// its register at once and stores the first k).
[[gnu::always_inline]] inline void weights_from_logits(float* w, int64_t n, int64_t k,
                                                       const RowStats& st, bool renormalize) {
  if (!st.full_sum) {
    // renormalize without the full sum (see RowStats). The first winner is
    // the max, whose exp is about 1, so the sum is at least that (or NaN,
    // when the max is infinite, as the weights then are with the full sum
    // too).
    for (int64_t i = 0; i < n; ++i) w[i] = exp_plus(w[i], st.max * kLog2e, 0.0f);
    const float selected_sum = sum_of_first(w, k);
    for (int64_t i = 0; i < n; ++i) w[i] /= selected_sum;
    return;
  }
  const float inv_sum = 1.0f / st.sum;
  for (int64_t i = 0; i < n; ++i) w[i] = exp_plus(w[i], st.max * kLog2e, 0.0f) * inv_sum;
  if (!renormalize) return;
  const float selected_sum = sum_of_first(w, k);
  if (selected_sum > 0.0f) {
    for (int64_t i = 0; i < n; ++i) w[i] /= selected_sum;
  }
}

// Weights of the winners in `ids`.
[[gnu::always_inline]] inline void write_weights(const float* logits, const RowArgs& a,
                                                 const RowStats& st, float* weights,
                                                 const int32_t* ids) {
  for (int64_t i = 0; i < a.k; ++i) weights[i] = logits[ids[i]];
  weights_from_logits(weights, a.k, a.k, st, a.renormalize);
}

// One row, for any CPU: ids and weights of the k most probable experts.
template <class T>
void topk_row_portable(const T* src, const RowArgs& a, float* weights, int32_t* ids) {
  const float* logits = as_float(src, a.row, a.e);
  const RowStats st = row_stats(logits, a.e, a.k, a.renormalize);
  if (a.k <= kInsertionMaxK) {
    TopList top(a.k, a.keys, ids);
    select_top_k(logits, a.e, st.threshold, reinterpret_cast<uint8_t*>(a.order), top);
  } else {
    sort_top_k(logits, a.e, a.k, a.order, ids);
  }
  write_weights(logits, a, st, weights, ids);
}

template <class T>
void topk_rows_portable(const T* src, int64_t rows, const RowArgs& a, float* weights,
                        int32_t* ids) {
  for (int64_t r = 0; r < rows; ++r) {
    topk_row_portable(src + r * a.e, a, weights + r * a.k, ids + r * a.k);
  }
}

#if KD_TOPK_AVX2
// The same row with AVX2 and FMA (and F16C for float16), for the hosts that
// have them. GCC leaves much of the portable row scalar or branching (the
// lane maxima, a select it cannot prove to be maxps; the threshold compare, a
// byte per logit; the lane folds, through the stack; the insertion), so the
// AVX2 row is written with intrinsics: the same passes, operation for
// operation wherever the results depend on the order, and for K <= 8 the
// selection in registers. Every operation rounds as in the portable row (the
// fused ones too, see exp_plus), and both give the same ids and weights, bit
// for bit (but for which NaN a NaN weight is: x86 keeps an operand's NaN, and
// the rows order some operands differently).

#define KD_AVX2 __attribute__((target("avx2,f16c,fma")))

KD_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

KD_AVX2 inline __m256 load8(const Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

KD_AVX2 inline __m256 load8(const BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static_assert(kReductionLanes == 16, "the AVX2 row keeps the lanes in two 8-float registers");

// threshold_of for the lane maxima in lo (lanes 0-7) and hi (8-15), also
// stored in `lanes`: the same count of exceeding lanes and the same minimum,
// in registers. GCC's code for threshold_of took a sixth of the row, mostly
// in a scalar, branching minimum.
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

// reduce_max and reduce_sum in registers, lanes 0-7 in lo and 8-15 in hi:
// the same pairwise tree, lane l joined with l + width (maxps(v, m) is
// v > m ? v : m, the shared select with v the upper lane).
KD_AVX2 inline float reduce_max_avx2(__m256 lo, __m256 hi) {
  __m256 m = _mm256_max_ps(hi, lo);
  m = _mm256_max_ps(_mm256_permute2f128_ps(m, m, 1), m);
  m = _mm256_max_ps(_mm256_permute_ps(m, 0x4e), m);
  m = _mm256_max_ps(_mm256_permute_ps(m, 0xb1), m);
  return _mm256_cvtss_f32(m);
}

KD_AVX2 inline float reduce_sum_avx2(__m256 lo, __m256 hi) {
  __m256 m = _mm256_add_ps(lo, hi);
  m = _mm256_add_ps(m, _mm256_permute2f128_ps(m, m, 1));
  m = _mm256_add_ps(m, _mm256_permute_ps(m, 0x4e));
  m = _mm256_add_ps(m, _mm256_permute_ps(m, 0xb1));
  return _mm256_cvtss_f32(m);
}

// Up to this K, the AVX2 row keeps the best K in registers (TopInRegisters).
constexpr int64_t kRegisterMaxK = 8;

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
// random places, TopList's compares mispredict several times a row, which
// made up much of the row's time once the rows no longer fit the branch
// predictor's memory (large batches).
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

// exp_plus on 8 lanes, operation for operation. Without kClamp, for
// arguments known to be above -126 already (see KeyRow::unclamped), where
// the clamp changes nothing.
template <bool kClamp = true>
KD_AVX2 inline __m256 exp_plus8(__m256 logits, __m256 minus_scaled_max, __m256 addend) {
  const __m256 t0 = _mm256_fmadd_ps(logits, _mm256_set1_ps(kLog2e), minus_scaled_max);
  // maxps(a, b) is a > b ? a : b, so NaN passes as there.
  const __m256 t = kClamp ? _mm256_max_ps(_mm256_set1_ps(-126.0f), t0) : t0;
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
// row's input, `e` elements).
template <bool kSum, class T>
KD_AVX2 inline int64_t exp_sum_and_candidates(const float* logits, int64_t full,
                                              const float* tail, int64_t rest,
                                              const T* src, int64_t e, RowStats& st,
                                              uint16_t* candidates) {
  const __m256 minus_scaled_max = _mm256_set1_ps(-(st.max * kLog2e));
  const __m256 threshold = _mm256_set1_ps(st.threshold);
  __m256 sum_lo = _mm256_setzero_ps();
  __m256 sum_hi = _mm256_setzero_ps();
  __m256 nan = _mm256_setzero_ps();
  int64_t blocks = 0;
  // Two blocks an iteration: 4-5% off the row (loop overhead, and more
  // independent work between the loop's branches); four were slower.
#pragma GCC unroll 2
  for (int64_t j = 0; j < full; j += kReductionLanes) {
    // The same block of the next row: a cache line for float32, half of one
    // (asked for twice) for the 16-bit types. The hardware prefetcher alone
    // left the first pass waiting for memory on large batches. A prefetch
    // past the end of the input is harmless: it never faults.
    _mm_prefetch(reinterpret_cast<const char*>(src + e + j), _MM_HINT_T0);
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
// composite. Rows with a NaN (whose key is past infinity's), with fewer than
// 16 or more than 65536 logits, or with K > 8 take the float row.
template <class T>
struct Bits16;
template <>
struct Bits16<Half> {
  static constexpr int16_t kInfinity = 0x7c00;
  static constexpr int16_t kUnclampedMax = 0x5160;  // 43
};
template <>
struct Bits16<BFloat16> {
  static constexpr int16_t kInfinity = 0x7f80;
  static constexpr int16_t kUnclampedMax = 0x422c;  // 43
};

constexpr int64_t kKeyMaxExperts = 65536;

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
  // Whether every logit is within [-43, 43]: then no logit is more than 86
  // below the max, every exp's argument in base 2 is above -126, and the sum
  // can leave out exp_plus's clamp (one of its eleven operations), with the
  // same results.
  bool unclamped;
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
  row.unclamped = scan.largest_magnitude <= Bits16<T>::kUnclampedMax;
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

// How far ahead the key rows ask for their input, in elements: whole groups
// of kRows rows (the rows passed through together), as many as fit in
// kPrefetchBytes, and at least the next group. Each group asks for one
// group further on, so that on large batches the input arrives from memory
// while the groups before it are computed: the next group alone left the
// first pass waiting (3 KiB ahead took 5-9% off 65536 bfloat16 rows of 256
// on two threads, against the next pair). Past the end of the input the
// prefetches are harmless: a prefetch never faults.
constexpr int64_t kPrefetchBytes = 3072;

template <int kRows, class T>
constexpr int64_t prefetch_ahead(int64_t e) {
  const int64_t group = kRows * e;
  const int64_t groups = kPrefetchBytes / (group * static_cast<int64_t>(sizeof(T)));
  return (groups > 1 ? groups : 1) * group;
}

// The sums of e^(logit - max) of kRows rows at once (independent chains for
// the out-of-order core to overlap), each in the lanes and order of
// row_stats: lane l (mod 16) in one sum, the last, partial block only where
// it holds logits, and the same pairwise tree at the end. Meanwhile the
// input further on is asked for (prefetch_ahead).
template <int kRows, class T, bool kClamp>
KD_AVX2 inline void sum_of_exps(KeyRow* const (&rows)[kRows], int64_t e) {
  const int64_t full = e - e % kReductionLanes;
  const int64_t ahead = prefetch_ahead<kRows, T>(e);
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
      sum_first[r] = exp_plus8<kClamp>(x.first, minus_scaled_max[r], sum_first[r]);
      sum_second[r] = exp_plus8<kClamp>(x.second, minus_scaled_max[r], sum_second[r]);
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
          sum_first[r], exp_plus8<kClamp>(x.first, minus_scaled_max[r], sum_first[r]), in_first);
      sum_second[r] = _mm256_blendv_ps(
          sum_second[r], exp_plus8<kClamp>(x.second, minus_scaled_max[r], sum_second[r]),
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
    bool unclamped = true;
    for (int r = 0; r < kRows; ++r) unclamped = unclamped && rows[r]->unclamped;
    if (unclamped) {
      sum_of_exps<kRows, T, false>(rows, e);
    } else {
      sum_of_exps<kRows, T, true>(rows, e);
    }
    return;
  }
  const int64_t ahead = prefetch_ahead<kRows, T>(e);
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

// Whether the rows of this shape go through keys.
inline bool key_rows(const RowArgs& a) {
  return a.e >= kReductionLanes && a.e <= kKeyMaxExperts && a.k <= kRegisterMaxK;
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

// The same row with AVX2 (and F16C for float16): the passes of row_stats and
// the selection and weights, in registers.
template <class T>
KD_AVX2 void topk_row_avx2(const T* src, const RowArgs& a, float* weights, int32_t* ids) {
  if constexpr (!std::is_same_v<T, float>) {
    if (key_rows(a)) {
      KeyRow row = key_row(a, a.e, src, 0);
      __m256i below_threshold;
      if (key_threshold<T>(a, scan_keys<T>(a.e, row), row, below_threshold)) {
        key_candidates(a.e, row, below_threshold);
        KeyRow* const rows[] = {&row};
        sums_or_prefetch<1, T>(rows, a, a.e);
        write_keys<T>(a, row, select_keys(row), weights, ids);
        return;
      }
    }
  }
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
          ? exp_sum_and_candidates<false>(logits, full, tail, rest, src, e, st, candidates)
          : exp_sum_and_candidates<true>(logits, full, tail, rest, src, e, st, candidates);

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

// The 16-bit rows in keys, two at a time, pass by pass, so that each pass's
// dependency chains (the reductions, the threshold, the insertions, the
// weights) have a second row's independent work beside them: rows 0 to
// rows - 1 but the last of an odd count (src, weights and ids at row 0).
// Returns the number of rows done. kE, when not 0, is the row length (a.e)
// as a constant, which leaves the passes' loops without remainders and lets
// the compiler unroll them: 7% less time per row for E = 256 (in cache).
template <class T, int64_t kE>
KD_AVX2 int64_t key_row_pairs(const T* src, int64_t rows, const RowArgs& a, float* weights,
                              int32_t* ids) {
  const int64_t e = kE != 0 ? kE : a.e;
  const int64_t k = a.k;
  int64_t r = 0;
  for (; r + 2 <= rows; r += 2) {
    KeyRow first = key_row(a, e, src + r * e, 0);
    KeyRow second = key_row(a, e, src + (r + 1) * e, 1);
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
      topk_row_avx2(src + r * e, a, weights + r * k, ids + r * k);
      topk_row_avx2(src + (r + 1) * e, a, weights + (r + 1) * k, ids + (r + 1) * k);
    }
  }
  return r;
}

// Rows r to r + rows - 1 (src, weights and ids at row r): the 16-bit rows in
// keys by pairs, the experts of common MoE routers (128, 256) as constants.
template <class T>
KD_AVX2 void topk_rows_avx2(const T* src, int64_t rows, const RowArgs& a, float* weights,
                            int32_t* ids) {
  const int64_t e = a.e;
  const int64_t k = a.k;
  int64_t r = 0;
  if constexpr (!std::is_same_v<T, float>) {
    if (key_rows(a)) {
      switch (e) {
        case 128: r = key_row_pairs<T, 128>(src, rows, a, weights, ids); break;
        case 256: r = key_row_pairs<T, 256>(src, rows, a, weights, ids); break;
        default: r = key_row_pairs<T, 0>(src, rows, a, weights, ids); break;
      }
    }
  }
  for (; r < rows; ++r) topk_row_avx2(src + r * e, a, weights + r * k, ids + r * k);
}

#undef KD_AVX2
#endif  // KD_TOPK_AVX2

// The rows of a range: (src, rows, args, weights, ids), all at its first row.
template <class T>
using RowsFn = void (*)(const T*, int64_t, const RowArgs&, float*, int32_t*);

struct RowKernels {
  RowsFn<float> f32;
  RowsFn<Half> f16;
  RowsFn<BFloat16> bf16;

  template <class T>
  RowsFn<T> get() const {
    if constexpr (std::is_same_v<T, float>) return f32;
    if constexpr (std::is_same_v<T, Half>) return f16;
    if constexpr (std::is_same_v<T, BFloat16>) return bf16;
  }
};

RowKernels pick_row_kernels() {
#if KD_TOPK_AVX2
  __builtin_cpu_init();  // a static initialiser may run before anything else called it
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") &&
      __builtin_cpu_supports("fma")) {
    return {topk_rows_avx2<float>, topk_rows_avx2<Half>, topk_rows_avx2<BFloat16>};
  }
#endif
  return {topk_rows_portable<float>, topk_rows_portable<Half>, topk_rows_portable<BFloat16>};
}

// Chosen once, when the plugin is loaded.
const RowKernels kRowKernels = pick_row_kernels();

// Scratch of one parallel range (see RowArgs).
struct Scratch {
  std::unique_ptr<float[]> floats;
  std::unique_ptr<int32_t[]> indices;
};

}  // namespace

kd_status topk_softmax(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(args, [&]() -> kd_status {
    constexpr int kMinNdim[] = {1, 1, 1};
    if (kd_status s = check_arguments(args, kOp, 1, kMinNdim); s != KD_STATUS_OK) return s;
    const DLTensor& weights = args->tensors[0];
    const DLTensor& ids = args->tensors[1];
    const DLTensor& gating = args->tensors[2];
    const int64_t rows = leading_rows(gating, 1);
    const int64_t e = dim(gating, -1);
    const int64_t k = dim(weights, -1);
    if (dim(ids, -1) != k || leading_rows(weights, 1) != rows || leading_rows(ids, 1) != rows) {
      return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT,
                             "%s: expected topk_weights [*, K], topk_ids [*, K], "
                             "gating_output [*, E]",
                             kOp);
    }
    if (k > e) {
      return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT,
                             "%s: K = %lld exceeds the number of experts E = %lld", kOp,
                             static_cast<long long>(k), static_cast<long long>(e));
    }
    if (e > INT32_MAX) {
      return kd_plugin::fail(args, KD_STATUS_UNSUPPORTED,
                             "%s: E = %lld does not fit the int32 topk_ids", kOp,
                             static_cast<long long>(e));
    }
    if (!is_dtype(weights, kDLFloat, 32) || !is_dtype(ids, kDLInt, 32)) {
      return kd_plugin::fail(args, KD_STATUS_UNSUPPORTED,
                             "%s: topk_weights must be float32 and topk_ids int32", kOp);
    }
    const kd_attr* renormalize_attr = attr_of_type(args, 0, KD_ATTR_TYPE_BOOL);
    if (renormalize_attr == nullptr) {
      return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT,
                             "%s: attribute renormalize is not a bool", kOp);
    }
    const bool renormalize = renormalize_attr->value.b != 0;
    if (k == 0) return KD_STATUS_OK;
    float* w = data_as<float>(weights);
    int32_t* id = data_as<int32_t>(ids);
    return dispatch_float_dtype(args, kOp, gating, [&](auto tag) {
      using T = typename decltype(tag)::type;
      const T* g = data_as<T>(gating);
      std::atomic<bool> out_of_memory{false};
      const RowsFn<T> rows_kernel = kRowKernels.get<T>();
      parallel_for(rows, e, [&](int64_t begin, int64_t end) noexcept {
        Scratch s{std::unique_ptr<float[]>(new (std::nothrow) float[e + k + 2 * kReductionLanes]),
                  std::unique_ptr<int32_t[]>(new (std::nothrow) int32_t[e + kReductionLanes])};
        if (!s.floats || !s.indices) {
          out_of_memory.store(true, std::memory_order_relaxed);
          return;
        }
        const RowArgs row_args{e, k, renormalize, s.floats.get(), s.floats.get() + e,
                               s.indices.get()};
        rows_kernel(g + begin * e, end - begin, row_args, w + begin * k, id + begin * k);
      });
      if (out_of_memory.load()) {
        return kd_plugin::fail(args, KD_STATUS_INTERNAL, "%s: out of host memory", kOp);
      }
      return KD_STATUS_OK;
    });
  });
}

}  // namespace kdispatch::cpu
