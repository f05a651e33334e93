// moe.topk_softmax: p = softmax(gating_output row) in float32; topk_ids are
// the indices of the K largest p, descending, ties to the lower index;
// topk_weights their p, divided by their sum when renormalize (vLLM
// semantics, including leaving the weights as they are when the sum is 0).

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <new>

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

// Writes softmax(row[0, e)) to p. Max and sum use kReductionLanes partial
// results so that they vectorise and round the same in every clone.
template <class T>
KD_CPU_MULTIVERSION void softmax_row(const T* row, int64_t e, float* p) {
  constexpr float kNegInf = -__builtin_inff();
  float partial[kReductionLanes];
  for (float& v : partial) v = kNegInf;
  int64_t j = 0;
  for (; j + kReductionLanes <= e; j += kReductionLanes) {
    for (int l = 0; l < kReductionLanes; ++l) {
      const float v = to_float(row[j + l]);
      p[j + l] = v;
      partial[l] = v > partial[l] ? v : partial[l];
    }
  }
  for (int l = 0; j < e; ++j, ++l) {
    const float v = to_float(row[j]);
    p[j] = v;
    partial[l] = v > partial[l] ? v : partial[l];
  }
  float max = kNegInf;
  for (float v : partial) max = v > max ? v : max;

  float sums[kReductionLanes] = {};
  j = 0;
  for (; j + kReductionLanes <= e; j += kReductionLanes) {
    for (int l = 0; l < kReductionLanes; ++l) {
      const float v = fast_exp(p[j + l] - max);
      p[j + l] = v;
      sums[l] += v;
    }
  }
  for (int l = 0; j < e; ++j, ++l) {
    const float v = fast_exp(p[j] - max);
    p[j] = v;
    sums[l] += v;
  }
  for (int width = kReductionLanes / 2; width > 0; width /= 2) {
    for (int l = 0; l < width; ++l) sums[l] += sums[l + width];
  }
  const float inv_sum = 1.0f / sums[0];
  for (j = 0; j < e; ++j) p[j] *= inv_sum;
}

// Descending by probability, ties to the lower index; NaN sorts last so that
// the order stays a strict weak ordering whatever the input holds.
struct HigherProbability {
  const float* p;
  bool operator()(int32_t a, int32_t b) const {
    const float pa = p[a];
    const float pb = p[b];
    const bool a_nan = pa != pa;
    const bool b_nan = pb != pb;
    if (a_nan != b_nan) return b_nan;
    if (!a_nan && pa != pb) return pa > pb;
    return a < b;
  }
};

// Up to this K, selection keeps a sorted list of the best K and scans the row
// once: after the first few elements almost every one fails a single compare
// against the K-th best, which beats a heap (partial_sort) by a wide margin.
constexpr int64_t kInsertionMaxK = 32;

// Writes the indices of the k largest p[0, e) to ids, in HigherProbability
// order. `keys` is scratch for k floats.
void select_top_k(const float* p, int64_t e, int64_t k, float* keys, int32_t* ids) {
  int64_t filled = 0;
  for (int64_t j = 0; j < e; ++j) {
    // Probabilities are in [0, 1]; NaN ranks below all of them.
    const float v = p[j] != p[j] ? -1.0f : p[j];
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
    ids[pos] = static_cast<int32_t>(j);
  }
}

// Scratch of one parallel range: the row's probabilities (e floats) then the
// selection keys (k floats), and an index array of e entries.
struct Scratch {
  std::unique_ptr<float[]> floats;
  std::unique_ptr<int32_t[]> order;
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
        if (!s.floats || !s.order) {
          out_of_memory.store(true, std::memory_order_relaxed);
          return;
        }
        for (int64_t r = begin; r < end; ++r) {
          float* p = s.floats.get();
          softmax_row(g + r * e, e, p);
          if (k <= kInsertionMaxK) {
            select_top_k(p, e, k, p + e, s.order.get());
          } else {
            for (int64_t j = 0; j < e; ++j) s.order[j] = static_cast<int32_t>(j);
            std::partial_sort(s.order.get(), s.order.get() + k, s.order.get() + e,
                              HigherProbability{p});
          }
          float* wr = w + r * k;
          int32_t* idr = id + r * k;
          float selected_sum = 0.0f;
          for (int64_t i = 0; i < k; ++i) {
            idr[i] = s.order[i];
            wr[i] = p[s.order[i]];
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
