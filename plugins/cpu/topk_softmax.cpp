// moe.topk_softmax: p = softmax(gating_output row) in float32; topk_ids are
// the indices of the K largest p, descending, ties to the lower index;
// topk_weights their p, divided by their sum when renormalize (vLLM
// semantics, including leaving the weights as they are when the sum is 0).

#include <algorithm>
#include <atomic>
#include <cstdint>
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
// rest only count towards the sum, where quick_exp's 6e-7 relative error
// (for logits within 10 of the max; the terms further down are below 5e-5)
// stays well inside the weights' tolerance and costs half as much.
//
// Max and sum use kReductionLanes partial results so that they vectorise and
// round the same in every clone; the lane maxima also give the threshold: the K-th largest of them is reached by at least K logits (one
// per lane), so nothing below it can be among the K largest. (-Inf, no
// filtering, when e < kReductionLanes or k > kReductionLanes.)
KD_CPU_MULTIVERSION RowStats row_stats(const float* logits, int64_t e, int64_t k) {
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
    for (int l = 0; l < kReductionLanes; ++l) sums[l] += quick_exp<Precision::kFloat32>(logits[j + l] - max);
  }
  for (int l = 0; j < e; ++j, ++l) sums[l] += quick_exp<Precision::kFloat32>(logits[j] - max);
  for (int width = kReductionLanes / 2; width > 0; width /= 2) {
    for (int l = 0; l < width; ++l) sums[l] += sums[l + width];
  }

  if (e < kReductionLanes || k > kReductionLanes) return {max, sums[0], kNegInf};
  // K-th largest lane maximum: a partial selection sort of 16 values.
  for (int64_t i = 0; i < k; ++i) {
    for (int l = static_cast<int>(i) + 1; l < kReductionLanes; ++l) {
      if (lane_max[l] > lane_max[i]) std::swap(lane_max[l], lane_max[i]);
    }
  }
  return {max, sums[0], lane_max[k - 1]};
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

// Writes the indices of the k largest logits[0, e) to ids: descending, ties
// to the lower index, NaN as -Inf. Only logits >= threshold are considered (all
// of them when fewer than k reach it, as with NaN in the row). `keys` is
// scratch for k floats, `candidates` for e indices.
void select_top_k(const float* logits, int64_t e, int64_t k, float threshold, float* keys,
                  int32_t* candidates, int32_t* ids) {
  // Branch-free compaction of the indices that reach the threshold.
  int64_t count = 0;
  for (int64_t j = 0; j < e; ++j) {
    candidates[count] = static_cast<int32_t>(j);
    count += logits[j] >= threshold ? 1 : 0;
  }
  if (count < k) {
    for (int64_t j = 0; j < e; ++j) candidates[j] = static_cast<int32_t>(j);
    count = e;
  }
  // Insertion into a sorted list of the best k, in index order.
  constexpr float kNegInf = -__builtin_inff();
  int64_t filled = 0;
  for (int64_t c = 0; c < count; ++c) {
    const int32_t j = candidates[c];
    // NaN ranks as -Inf.
    const float v = logits[j] != logits[j] ? kNegInf : logits[j];
    int64_t pos = 0;
    if (filled == k) {
      // Strictly greater: an equal, later element never displaces.
      if (!(v > keys[k - 1])) continue;
      pos = k - 1;
    } else {
      pos = filled++;
    }
    // Equal keys stay in front: ties go to the lower index.
    while (pos > 0 && keys[pos - 1] < v) {
      keys[pos] = keys[pos - 1];
      ids[pos] = ids[pos - 1];
      --pos;
    }
    keys[pos] = v;
    ids[pos] = j;
  }
}

// Scratch of one parallel range: the widened row (e floats, 16-bit types
// only) then the selection keys (k floats); candidate indices (e) then the
// selected ids (k).
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
                  std::unique_ptr<int32_t[]>(new (std::nothrow) int32_t[e + k])};
        if (!s.floats || !s.indices) {
          out_of_memory.store(true, std::memory_order_relaxed);
          return;
        }
        float* keys = s.floats.get() + e;
        int32_t* order = s.indices.get();
        int32_t* selected = order + e;
        for (int64_t r = begin; r < end; ++r) {
          const float* logits = as_float(g + r * e, s.floats.get(), e);
          const RowStats st = row_stats(logits, e, k);
          if (k <= kInsertionMaxK) {
            select_top_k(logits, e, k, st.threshold, keys, order, selected);
          } else {
            for (int64_t j = 0; j < e; ++j) order[j] = static_cast<int32_t>(j);
            std::partial_sort(order, order + k, order + e, HigherLogit{logits});
            std::copy(order, order + k, selected);
          }
          // Only the winners are exponentiated, each as the full softmax
          // would.
          const float inv_sum = 1.0f / st.sum;
          float* wr = w + r * k;
          int32_t* idr = id + r * k;
          float selected_sum = 0.0f;
          for (int64_t i = 0; i < k; ++i) {
            idr[i] = selected[i];
            wr[i] = fast_exp(logits[selected[i]] - st.max) * inv_sum;
            selected_sum += wr[i];
          }
          if (renormalize && selected_sum > 0.0f) {
            for (int64_t i = 0; i < k; ++i) wr[i] /= selected_sum;
          }
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
