// moe.topk_softmax: p = softmax(gating_output row) in float32; topk_ids are
// the indices of the K largest p, descending, ties to the lower index;
// topk_weights their p, divided by their sum when renormalize (vLLM
// semantics, including leaving the weights as they are when the sum is 0).

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <utility>

#include "convert.hpp"
#include "fast_math.hpp"
#include "half_float.hpp"
#include "kd_plugin.hpp"
#include "kernels.hpp"
#include "multiversion.hpp"
#include "parallel_for.hpp"
#include "tensor_access.hpp"

namespace kdispatch::cpu {
namespace {

constexpr const char* kOp = "moe.topk_softmax";

// What one row's selection needs from its logits: the max, the sum of
// e^(logit - max), and a threshold that at least K logits reach.
struct RowStats {
  float max;
  float sum;
  float threshold;
};

// Softmax is monotonic, so the K most probable experts are the K largest
// logits: only the K winners need their probability (fast_exp, 1.3 ulp), the
// rest only count towards the sum, which enters every weight as one factor:
// quick_exp at 16-bit precision (3.4e-6 relative for logits within 10 of the
// max; the terms further down are below 5e-5 of the largest) keeps the
// weights well inside their 1e-4 tolerance for a third of fast_exp's work.
//
// Max and sum use kReductionLanes partial results so that they vectorise and
// round the same in every clone; the lane maxima also give the threshold: the
// K-th largest of them is reached by at least K logits (one per lane), so
// nothing below it can be among the K largest. For E = 256 and K = 8, about
// 10 logits reach it. (-Inf, no filtering, when k > kReductionLanes.)
[[gnu::always_inline]] inline RowStats row_stats(const float* logits, int64_t e, int64_t k) {
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
  float max = kNegInf;
  for (float v : lane_max) max = v > max ? v : max;

  float sums[kReductionLanes] = {};
  j = 0;
  for (; j + kReductionLanes <= e; j += kReductionLanes) {
    for (int l = 0; l < kReductionLanes; ++l) {
      sums[l] += quick_exp<Precision::kHalf>(logits[j + l] - max);
    }
  }
  for (int l = 0; j < e; ++j, ++l) sums[l] += quick_exp<Precision::kHalf>(logits[j] - max);
  for (int width = kReductionLanes / 2; width > 0; width /= 2) {
    for (int l = 0; l < width; ++l) sums[l] += sums[l + width];
  }

  if (k > kReductionLanes) return {max, sums[0], kNegInf};
  // The K-th largest lane maximum is the smallest of those that fewer than K
  // others exceed. Counting, for every lane at once, how many lanes exceed it
  // vectorises and does not branch, unlike a partial sort.
  int32_t exceeded_by[kReductionLanes] = {};
  for (int other = 0; other < kReductionLanes; ++other) {
    for (int l = 0; l < kReductionLanes; ++l) {
      exceeded_by[l] += lane_max[other] > lane_max[l] ? 1 : 0;
    }
  }
  float threshold = __builtin_inff();
  for (int l = 0; l < kReductionLanes; ++l) {
    const bool in_top_k = exceeded_by[l] < k;
    threshold = in_top_k && lane_max[l] < threshold ? lane_max[l] : threshold;
  }
  return {max, sums[0], threshold};
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

// Inserts the logits that reach the threshold, in index order; when fewer
// than k do (NaN in the row), all of them. The compare is one vectorised pass
// into a byte per logit (`flags`, scratch for e bytes); the scan then tests
// 8 flags at a time and branches only per candidate, about 10 in 256.
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
  if (!top.full()) {
    top.clear();
    for (int64_t j = 0; j < e; ++j) top.insert(logits[j], static_cast<int32_t>(j));
  }
}

// One row: ids and weights of the k most probable experts. `keys` is scratch
// for k floats, `order` for e indices (k > kInsertionMaxK) or e flag bytes.
KD_CPU_MULTIVERSION void topk_row(const float* logits, int64_t e, int64_t k, bool renormalize,
                                  float* keys, int32_t* order, float* weights, int32_t* ids) {
  const RowStats st = row_stats(logits, e, k);
  if (k <= kInsertionMaxK) {
    TopList top(k, keys, ids);
    select_top_k(logits, e, st.threshold, reinterpret_cast<uint8_t*>(order), top);
  } else {
    for (int64_t j = 0; j < e; ++j) order[j] = static_cast<int32_t>(j);
    std::partial_sort(order, order + k, order + e, HigherLogit{logits});
    std::copy(order, order + k, ids);
  }
  // Only the winners are exponentiated, each as the full softmax would.
  const float inv_sum = 1.0f / st.sum;
  for (int64_t i = 0; i < k; ++i) keys[i] = logits[ids[i]];
  float selected_sum = 0.0f;
  for (int64_t i = 0; i < k; ++i) {
    weights[i] = fast_exp(keys[i] - st.max) * inv_sum;
    selected_sum += weights[i];
  }
  if (renormalize && selected_sum > 0.0f) {
    for (int64_t i = 0; i < k; ++i) weights[i] /= selected_sum;
  }
}

// Scratch of one parallel range: the widened row (e floats, 16-bit types
// only) then the selection keys (k floats), and e sort indices.
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
      parallel_for(rows, e, [&](int64_t begin, int64_t end) noexcept {
        Scratch s{std::unique_ptr<float[]>(new (std::nothrow) float[e + k]),
                  std::unique_ptr<int32_t[]>(new (std::nothrow) int32_t[e])};
        if (!s.floats || !s.indices) {
          out_of_memory.store(true, std::memory_order_relaxed);
          return;
        }
        float* keys = s.floats.get() + e;
        for (int64_t r = begin; r < end; ++r) {
          const float* logits = as_float(g + r * e, s.floats.get(), e);
          topk_row(logits, e, k, renormalize, keys, s.indices.get(), w + r * k, id + r * k);
        }
      });
      if (out_of_memory.load()) {
        return kd_plugin::fail(args, KD_STATUS_INTERNAL, "%s: out of host memory", kOp);
      }
      return KD_STATUS_OK;
    });
  });
}

}  // namespace kdispatch::cpu
