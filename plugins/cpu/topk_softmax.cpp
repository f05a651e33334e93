// moe.topk_softmax: x = gating_output row, softcapped (tanh(x / c) c,
// rounded to float32) when moe_softcapping c > 0, plus correction_bias in
// float32 when given; p = softmax(x) in float32; topk_ids are the indices of
// the K largest p, descending, ties to the lower index; topk_weights their
// p, divided by their sum when renormalize (leaving the weights as they are
// when the sum is 0); token_expert_indices[t, i] = i T + t over the T rows,
// when given.
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <new>
#include <type_traits>

#include <kdispatch/plugin_helpers.hpp>
#include <kdispatch/plugin_rows.hpp>

#include "convert.hpp"
#include "kd_plugin_kernels.hpp"
#include "multiversion.hpp"
#include "tensor_access.hpp"
#include "topk_softmax_avx2.hpp"
#include "topk_softmax_rows.hpp"

namespace kdispatch::cpu {
namespace topk {
namespace {

// The portable row: the lanes of RowStats (topk_softmax_rows.hpp) in arrays,
// finished by the helpers below; the AVX2 rows do the same in registers, in
// the same order.

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
    topk_row_portable(src + r * a.stride, a, weights + r * a.k, ids + r * a.k);
  }
}

// The rows of a range: (src, rows, args, weights, ids), all at its first row.
template <class T>
using RowsFn = void (*)(const T*, int64_t, const RowArgs&, float*, int32_t*);

struct RowKernels {
  RowsFn<float> f32;
  RowsFn<Float16> f16;
  RowsFn<BFloat16> bf16;

  template <class T>
  RowsFn<T> get() const {
    if constexpr (std::is_same_v<T, float>) return f32;
    if constexpr (std::is_same_v<T, Float16>) return f16;
    if constexpr (std::is_same_v<T, BFloat16>) return bf16;
  }
};

RowKernels pick_row_kernels() {
#if KD_TOPK_AVX2
  __builtin_cpu_init();  // a static initialiser may run before anything else called it
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") &&
      __builtin_cpu_supports("fma")) {
    return {topk_rows_avx2<float>, topk_rows_avx2<Float16>, topk_rows_avx2<BFloat16>};
  }
#endif
  return {topk_rows_portable<float>, topk_rows_portable<Float16>, topk_rows_portable<BFloat16>};
}

// Chosen once, when the plugin is loaded.
const RowKernels kRowKernels = pick_row_kernels();

// The rows [first, first + n) of the gating input, at any row strides:
// rows a single stride apart go to the row kernel together, others one by
// one.
template <class T>
void run_rows(const T* g, const kd_plugin::RowLayout& layout, int64_t first, int64_t n,
              RowArgs a, float* weights, int32_t* ids) {
  if (layout.ndim <= 1) {
    a.stride = layout.ndim == 0 ? a.e : layout.stride[0];
    kRowKernels.get<T>()(g + first * a.stride, n, a, weights, ids);
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    kRowKernels.get<T>()(g + layout.offset(first + i), 1, a, weights + i * a.k, ids + i * a.k);
  }
}

// The gating row before its softmax, in float32: tanh(x / cap) cap when
// cap > 0 (in double, rounded once, so that every backend gets the same
// float), plus the correction bias when there is one (always, without a
// cap).
template <class T>
void transform_row(const T* src, int64_t e, double cap, const float* bias, float* out) {
  if (cap > 0.0) {
    for (int64_t j = 0; j < e; ++j) {
      out[j] = static_cast<float>(std::tanh(to_float(src[j]) / cap) * cap);
    }
    if (bias != nullptr) {
      for (int64_t j = 0; j < e; ++j) out[j] += bias[j];
    }
  } else {
    // One pass, which vectorises.
    for (int64_t j = 0; j < e; ++j) out[j] = to_float(src[j]) + bias[j];
  }
}

// Rows a parallel range takes in one step: bounds the scratch of the
// transformed rows and of int64 ids.
inline int64_t chunk_rows(int64_t e) {
  const int64_t n = 4096 / (e > 0 ? e : 1);
  return n < 1 ? 1 : n > 64 ? 64 : n;
}

// Scratch of one parallel range (see RowArgs), plus the transformed rows of
// a chunk and its int32 ids (for int64 topk_ids).
struct Scratch {
  std::unique_ptr<float[]> floats;
  std::unique_ptr<int32_t[]> indices;
  std::unique_ptr<float[]> transformed;
  std::unique_ptr<int32_t[]> ids;
};

// An optional tensor the caller left out (ABI 1.1).
inline bool absent(const DLTensor& t) { return t.data == nullptr && t.ndim == 0; }

}  // namespace
}  // namespace topk

constexpr const char* kOp = "moe.topk_softmax";

// kd_cpu_topk_softmax
// Tensors topk_weights [*, K] float32, topk_ids [*, K] int32 or int64,
// gating_output [*, E] (rows at any strides), correction_bias [E] float32
// (optional), token_expert_indices [*, K] int32 (optional); attributes
// renormalize, moe_softcapping. With a softcap or a bias, the rows are
// transformed into float32 a chunk at a time and go through the float32 row
// kernels.
kd_status topk_softmax(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(args, [&]() -> kd_status {
    constexpr int kMinNdim[] = {1, 1, 1, 0, 0};
    if (kd_status s = check_arguments(args, kOp, 2, kMinNdim); s != KD_STATUS_OK) return s;
    const DLTensor& weights = args->tensors[0];
    const DLTensor& ids = args->tensors[1];
    const DLTensor& gating = args->tensors[2];
    const DLTensor& bias = args->tensors[3];
    const DLTensor& token_expert = args->tensors[4];
    const bool has_bias = !topk::absent(bias);
    const bool has_token_expert = !topk::absent(token_expert);
    const int64_t rows = leading_rows(gating, 1);
    const int64_t e = dim(gating, -1);
    const int64_t k = dim(weights, -1);
    if (dim(ids, -1) != k || leading_rows(weights, 1) != rows || leading_rows(ids, 1) != rows ||
        (has_bias && (bias.ndim != 1 || dim(bias, 0) != e)) ||
        (has_token_expert && (token_expert.ndim < 1 || dim(token_expert, -1) != k ||
                              leading_rows(token_expert, 1) != rows))) {
      return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT,
                             "%s: expected topk_weights [*, K], topk_ids [*, K], "
                             "gating_output [*, E], correction_bias [E], "
                             "token_expert_indices [*, K]",
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
    if (has_token_expert && k > 0 && (k - 1) * rows + rows - 1 > INT32_MAX) {
      return kd_plugin::fail(args, KD_STATUS_UNSUPPORTED,
                             "%s: K x rows = %lld does not fit the int32 token_expert_indices",
                             kOp, static_cast<long long>(k * rows));
    }
    const bool ids64 = is_dtype(ids, kDLInt, 64);
    if (!is_dtype(weights, kDLFloat, 32) || !(ids64 || is_dtype(ids, kDLInt, 32)) ||
        (has_bias && !is_dtype(bias, kDLFloat, 32)) ||
        (has_token_expert && !is_dtype(token_expert, kDLInt, 32))) {
      return kd_plugin::fail(args, KD_STATUS_UNSUPPORTED,
                             "%s: topk_weights must be float32, topk_ids int32 or int64, "
                             "correction_bias float32 and token_expert_indices int32",
                             kOp);
    }
    const kd_attr* renormalize_attr = find_attr(args, "renormalize", KD_ATTR_TYPE_BOOL);
    const kd_attr* softcap_attr = find_attr(args, "moe_softcapping", KD_ATTR_TYPE_FLOAT);
    if (renormalize_attr == nullptr || softcap_attr == nullptr) {
      return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT,
                             "%s: attribute renormalize (bool) or moe_softcapping (float) is "
                             "missing or of another type",
                             kOp);
    }
    const bool renormalize = renormalize_attr->value.b != 0;
    const double cap = softcap_attr->value.f;
    if (k == 0 || rows == 0) return KD_STATUS_OK;
    const kd_plugin::RowLayout layout = kd_plugin::row_layout(gating, 1);
    const float* bias_data = has_bias ? data_as<float>(bias) : nullptr;
    const bool transform = has_bias || cap > 0.0;
    float* w = data_as<float>(weights);
    int32_t* token_expert_data = has_token_expert ? data_as<int32_t>(token_expert) : nullptr;
    return dispatch_float_dtype(args, kOp, gating, [&](auto tag) {
      using T = typename decltype(tag)::type;
      const T* g = data_as<T>(gating);
      std::atomic<bool> out_of_memory{false};
      const int64_t chunk = topk::chunk_rows(e);
      kd_plugin::parallel_for(rows, transform ? 4 * e : e, [&](int64_t begin, int64_t end) noexcept {
        topk::Scratch s{
            std::unique_ptr<float[]>(new (std::nothrow) float[e + k + 2 * kReductionLanes]),
            std::unique_ptr<int32_t[]>(new (std::nothrow) int32_t[e + kReductionLanes]),
            std::unique_ptr<float[]>(transform ? new (std::nothrow) float[chunk * e] : nullptr),
            std::unique_ptr<int32_t[]>(ids64 ? new (std::nothrow) int32_t[chunk * k] : nullptr)};
        if (!s.floats || !s.indices || (transform && !s.transformed) || (ids64 && !s.ids)) {
          out_of_memory.store(true, std::memory_order_relaxed);
          return;
        }
        const topk::RowArgs row_args{e, e, k, renormalize, s.floats.get(), s.floats.get() + e,
                                     s.indices.get()};
        for (int64_t first = begin; first < end; first += chunk) {
          const int64_t n = end - first < chunk ? end - first : chunk;
          float* const w_out = w + first * k;
          int32_t* const id_out = ids64 ? s.ids.get() : data_as<int32_t>(ids) + first * k;
          if (transform) {
            float* const t = s.transformed.get();
            for (int64_t i = 0; i < n; ++i) {
              topk::transform_row(g + layout.offset(first + i), e, cap, bias_data, t + i * e);
            }
            topk::kRowKernels.get<float>()(t, n, row_args, w_out, id_out);
          } else {
            topk::run_rows(g, layout, first, n, row_args, w_out, id_out);
          }
          if (ids64) {
            int64_t* const id64 = data_as<int64_t>(ids) + first * k;
            for (int64_t i = 0; i < n * k; ++i) id64[i] = id_out[i];
          }
          if (token_expert_data != nullptr) {
            for (int64_t r = first; r < first + n; ++r) {
              for (int64_t i = 0; i < k; ++i) {
                token_expert_data[r * k + i] = static_cast<int32_t>(i * rows + r);
              }
            }
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
