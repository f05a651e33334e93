// moe.topk_softmax: what every row kernel of the op shares (the portable row
// in topk_softmax.cpp, the AVX2 rows in topk_softmax_avx2.cpp and
// topk_softmax_keys.cpp): the row's scratch, its statistics, the one exp,
// the sorted list of the best K, and the weights of the winners.
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>

#include "fast_math.hpp"
#include "multiversion.hpp"

namespace kdispatch::cpu::topk {

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
// that every row kernel rounds alike; the lane maxima also give the
// threshold: the K-th largest of them is reached by at least K logits (one
// per lane), so nothing below it can be among the K largest. For E = 256 and
// K = 8, about 10 logits reach it. (-Inf, no filtering, when
// k > kReductionLanes.)

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
// They make a quarter fewer operations of the row's longest part.
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

// Up to this K, selection keeps a sorted list of the best K: after the first
// few candidates almost every one fails a single compare against the K-th
// best, which costs less than a heap (partial_sort) does.
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
  int64_t stride;  // elements from the start of one row of the input to the next
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

}  // namespace kdispatch::cpu::topk
