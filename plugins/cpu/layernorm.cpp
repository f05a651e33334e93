// layernorm.rmsnorm, layernorm.gemma_rmsnorm, layernorm.fused_add_rmsnorm,
// layernorm.gemma_fused_add_rmsnorm (each also _out: the same into separate
// outputs) and layernorm.layernorm.
//
// out = T(float(x) * inv_rms * float(weight)), inv_rms = 1 / sqrt(mean(x^2) +
// eps) with the mean accumulated in float32 (FlashInfer/SGLang rounding: one
// rounding to T, at the end). fused_add_rmsnorm stores residual =
// T(x + residual) and normalises the float32 sum before that rounding, as
// FlashInfer and SGLang do. The Gemma variants use 1 + weight, added in
// float32. layernorm takes the row's mean and then its (biased) variance
// about that mean in two float32 passes over the widened row, and rounds
// (x - mean) * inv_std * weight + bias once.
//
// Rows are addressed through kd_plugin::RowLayout (any stride before the
// last dim, 64-bit offsets). The weight and bias, float32 or T, are
// converted to float once per call, 1 added for the Gemma variants.

#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <new>
#include <type_traits>
#include <vector>

#include <kdispatch/plugin_helpers.hpp>
#include <kdispatch/plugin_rows.hpp>

#include "convert.hpp"
#include "kd_plugin_kernels.hpp"
#include "multiversion.hpp"
#include "tensor_access.hpp"

namespace kdispatch::cpu {
namespace {

using kd_plugin::RowLayout;

// The sum of term(row[j]) over row[0, h), in kReductionLanes partial sums
// (element j in sum j % kReductionLanes) added pairwise at the end, so that
// the loop vectorises without reassociating anything.
template <class Term>
[[gnu::always_inline]] inline float lane_sum(const float* row, int64_t h, Term term) {
  float partial[kReductionLanes] = {};
  int64_t j = 0;
  for (; j + kReductionLanes <= h; j += kReductionLanes) {
    for (int l = 0; l < kReductionLanes; ++l) partial[l] += term(row[j + l]);
  }
  for (int l = 0; j < h; ++j, ++l) partial[l] += term(row[j]);
  for (int width = kReductionLanes / 2; width > 0; width /= 2) {
    for (int l = 0; l < width; ++l) partial[l] += partial[l + width];
  }
  return partial[0];
}

[[gnu::always_inline]] inline float sum_of_squares(const float* row, int64_t h) {
  return lane_sum(row, h, [](float v) { return v * v; });
}

[[gnu::always_inline]] inline float inverse_rms(float sum_sq, int64_t h, float eps) {
  return 1.0f / std::sqrt(sum_sq / static_cast<float>(h) + eps);
}

// Elements per block of results: they stay in L1 until narrowed.
constexpr int64_t kBlock = 512;

// `weight` is already float: converted once per call rather than once per
// row. `row` is scratch for h floats: the widened input row, read twice.
template <class T>
KD_CPU_MULTIVERSION void rmsnorm_rows(T* out, const RowLayout& out_rows, const T* x, const RowLayout& x_rows,
                                      const float* weight, int64_t h, float eps, float* row, Store store,
                                      int64_t begin, int64_t end) {
  float result[kBlock];
  for (int64_t r = begin; r < end; ++r) {
    const float* xr = as_float(x + x_rows.offset(r), row, h);
    T* outr = out + out_rows.offset(r);
    const float inv = inverse_rms(sum_of_squares(xr, h), h, eps);
    for (int64_t j0 = 0; j0 < h; j0 += kBlock) {
      const int64_t n = h - j0 < kBlock ? h - j0 : kBlock;
      for (int64_t j = 0; j < n; ++j) result[j] = xr[j0 + j] * inv * weight[j0 + j];
      narrow(result, outr + j0, n, store);
    }
  }
  if (store == Store::kStreaming) store_fence();
}

// The rows of a fused add + rmsnorm: residual_out = T(x + residual), out =
// T(rmsnorm of the float32 sum). out and residual_out may be x and residual
// (the in-place op): each block of a row is read before it is written.
template <class T>
struct FusedRows {
  T* out;
  RowLayout out_rows;
  T* residual_out;
  RowLayout residual_out_rows;
  const T* x;
  RowLayout x_rows;
  const T* residual;
  RowLayout residual_rows;
};

// `row` is scratch for h floats: the float32 sum x + residual, read back
// from cache by the second pass. In place, both outputs overwrite inputs
// that were just read, so they are in cache and stored the ordinary way.
template <class T>
KD_CPU_MULTIVERSION void fused_add_rmsnorm_rows(const FusedRows<T>& t, const float* weight, int64_t h, float eps,
                                                float* row, int64_t begin, int64_t end) {
  float x_block[kBlock];
  float r_block[kBlock];
  for (int64_t r = begin; r < end; ++r) {
    const T* xr = t.x + t.x_rows.offset(r);
    const T* rr = t.residual + t.residual_rows.offset(r);
    T* rout = t.residual_out + t.residual_out_rows.offset(r);
    T* out = t.out + t.out_rows.offset(r);
    for (int64_t j0 = 0; j0 < h; j0 += kBlock) {
      const int64_t n = h - j0 < kBlock ? h - j0 : kBlock;
      const float* xf = as_float(xr + j0, x_block, n);
      const float* rf = as_float(rr + j0, r_block, n);
      float* sum = row + j0;
      for (int64_t j = 0; j < n; ++j) sum[j] = xf[j] + rf[j];
      narrow(sum, rout + j0, n, Store::kCached);
    }
    const float inv = inverse_rms(sum_of_squares(row, h), h, eps);
    for (int64_t j0 = 0; j0 < h; j0 += kBlock) {
      const int64_t n = h - j0 < kBlock ? h - j0 : kBlock;
      for (int64_t j = 0; j < n; ++j) x_block[j] = row[j0 + j] * inv * weight[j0 + j];
      narrow(x_block, out + j0, n, Store::kCached);
    }
  }
}

// `row` is scratch for h floats, the widened input row, read three times.
template <class T>
KD_CPU_MULTIVERSION void layernorm_rows(T* out, const RowLayout& out_rows, const T* x, const RowLayout& x_rows,
                                        const float* weight, const float* bias, int64_t h, float eps,
                                        float* row, Store store, int64_t begin, int64_t end) {
  float result[kBlock];
  for (int64_t r = begin; r < end; ++r) {
    const float* xr = as_float(x + x_rows.offset(r), row, h);
    const float mean = lane_sum(xr, h, [](float v) { return v; }) / static_cast<float>(h);
    const float var = lane_sum(xr, h, [mean](float v) {
      const float d = v - mean;
      return d * d;
    });
    const float inv_std = 1.0f / std::sqrt(var / static_cast<float>(h) + eps);
    T* outr = out + out_rows.offset(r);
    for (int64_t j0 = 0; j0 < h; j0 += kBlock) {
      const int64_t n = h - j0 < kBlock ? h - j0 : kBlock;
      for (int64_t j = 0; j < n; ++j) result[j] = (xr[j0 + j] - mean) * inv_std * weight[j0 + j] + bias[j0 + j];
      narrow(result, outr + j0, n, store);
    }
  }
  if (store == Store::kStreaming) store_fence();
}

// A weight or bias of h elements (float32, float16 or bfloat16) as float,
// plus `offset`: the tensor itself for float32 and offset 0, else a
// converted copy in `storage`.
const float* weight_as_float(const DLTensor& weight, int64_t h, float offset, std::vector<float>& storage) {
  if (is_dtype<float>(weight) && offset == 0.0f) return data_as<float>(weight);
  storage.resize(static_cast<size_t>(h));
  float* w = storage.data();
  if (is_dtype<Float16>(weight)) {
    widen(data_as<Float16>(weight), w, h);
  } else if (is_dtype<BFloat16>(weight)) {
    widen(data_as<BFloat16>(weight), w, h);
  } else {
    const float* src = data_as<float>(weight);
    for (int64_t j = 0; j < h; ++j) w[j] = src[j];
  }
  if (offset != 0.0f) {
    for (int64_t j = 0; j < h; ++j) w[j] += offset;
  }
  return w;
}

// A weight or bias is float32 or of the activations' dtype.
bool weight_dtype_allowed(const DLTensor& weight, const DLTensor& x) {
  return same_dtype(weight, x) || is_dtype<float>(weight);
}

// Checks shared by the rmsnorm ops: kTensors tensors, every one but the
// last [*, H] with the same rows and dtype, the last the weight [H]; eps a
// float attribute.
template <int kTensors>
kd_status check_norm_arguments(const kd_call_args* args, const char* op, float* eps) {
  int min_ndim[kTensors];
  for (int& n : min_ndim) n = 1;
  if (kd_status s = check_arguments(args, op, 1, min_ndim); s != KD_STATUS_OK) return s;
  const DLTensor* t = args->tensors;
  const DLTensor& weight = t[kTensors - 1];
  const int64_t h = dim(t[0], -1);
  if (dim(weight, -1) != h || weight.ndim != 1) {
    return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT, "%s: tensor shapes disagree", op);
  }
  for (int i = 1; i < kTensors - 1; ++i) {
    if (dim(t[i], -1) != h || leading_rows(t[i], 1) != leading_rows(t[0], 1)) {
      return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT, "%s: tensor shapes disagree", op);
    }
    if (!same_dtype(t[i], t[0])) {
      return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT, "%s: tensor dtypes differ", op);
    }
  }
  if (!weight_dtype_allowed(weight, t[0])) {
    return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT, "%s: tensor dtypes differ", op);
  }
  const kd_attr* a = find_attr(args, "eps", KD_ATTR_TYPE_FLOAT);
  if (a == nullptr) {
    return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT, "%s: attribute eps is missing or not a float",
                           op);
  }
  *eps = static_cast<float>(a->value.f);
  return KD_STATUS_OK;
}

// What the row loops of one call get from run_norm().
struct NormCall {
  static constexpr int kMaxRowTensors = 4;
  const float* weight;                // as float, the weight offset added
  RowLayout rows_of[kMaxRowTensors];  // of each tensor before the weight
  int64_t rows;
  int64_t h;
  float eps;
};

// The frame the rmsnorm ops share, for kTensors tensors (the weight last):
// argument checks, eps, the weight as float plus `weight_offset`, and
// the rows split across threads, each range with `row`, scratch for h floats
// (for float32 inputs only when kFloatNeedsRow; else nullptr), reported as
// KD_STATUS_INTERNAL when it cannot be allocated. Calls
// do_rows(tag, call, row, begin, end), tag.type being the element type.
template <int kTensors, bool kFloatNeedsRow, class DoRows>
kd_status run_norm(const kd_call_args* args, const char* op, float weight_offset, DoRows&& do_rows) noexcept {
  static_assert(kTensors - 1 <= NormCall::kMaxRowTensors);
  return kd_plugin::guarded(args, [&]() -> kd_status {
    float eps = 0.0f;
    if (kd_status s = check_norm_arguments<kTensors>(args, op, &eps); s != KD_STATUS_OK) return s;
    // The tensors agree in shape and dtype (checked above): tensor 0 speaks for all.
    const DLTensor& x = args->tensors[0];
    const int64_t h = dim(x, -1);
    return dispatch_float_dtype(args, op, x, [&](auto tag) {
      using T = typename decltype(tag)::type;
      constexpr bool kNeedsRow = kFloatNeedsRow || !std::is_same_v<T, float>;
      std::vector<float> weight_storage;
      NormCall call{weight_as_float(args->tensors[kTensors - 1], h, weight_offset, weight_storage), {},
                    leading_rows(x, 1), h, eps};
      for (int i = 0; i < kTensors - 1; ++i) call.rows_of[i] = kd_plugin::row_layout(args->tensors[i], 1);
      std::atomic<bool> out_of_memory{false};
      kd_plugin::parallel_for(call.rows, h, [&](int64_t begin, int64_t end) noexcept {
        std::unique_ptr<float[]> row;
        if constexpr (kNeedsRow) {
          row.reset(new (std::nothrow) float[h]);
          if (!row) {
            out_of_memory.store(true, std::memory_order_relaxed);
            return;
          }
        }
        do_rows(tag, call, row.get(), begin, end);
      });
      if (out_of_memory.load()) {
        return kd_plugin::fail(args, KD_STATUS_INTERNAL, "%s: out of host memory", op);
      }
      return KD_STATUS_OK;
    });
  });
}

// rmsnorm: tensors (out, x, weight).
kd_status rms_normalise(const kd_call_args* args, const char* op, float weight_offset) noexcept {
  return run_norm<3, false>(
      args, op, weight_offset, [&](auto tag, const NormCall& c, float* row, int64_t begin, int64_t end) noexcept {
        using T = typename decltype(tag)::type;
        const Store store = store_for(c.rows * c.h * int64_t{sizeof(T)});
        const DLTensor* t = args->tensors;  // out, x, weight
        rmsnorm_rows<T>(data_as<T>(t[0]), c.rows_of[0], data_as<T>(t[1]), c.rows_of[1], c.weight, c.h, c.eps,
                        row, store, begin, end);
      });
}

// fused_add_rmsnorm: tensors (x, residual, weight), both of the first
// updated in place; kOut: tensors (out, residual_out, x, residual, weight).
template <bool kOut>
kd_status add_and_rms_normalise(const kd_call_args* args, const char* op, float weight_offset) noexcept {
  return run_norm<kOut ? 5 : 3, true>(
      args, op, weight_offset, [&](auto tag, const NormCall& c, float* row, int64_t begin, int64_t end) noexcept {
        using T = typename decltype(tag)::type;
        const DLTensor* t = args->tensors;
        const int x = kOut ? 2 : 0;  // x and residual, the outputs before them when separate
        const FusedRows<T> rows{data_as<T>(t[0]), c.rows_of[0], data_as<T>(t[1]), c.rows_of[1],
                                data_as<T>(t[x]), c.rows_of[x], data_as<T>(t[x + 1]), c.rows_of[x + 1]};
        fused_add_rmsnorm_rows<T>(rows, c.weight, c.h, c.eps, row, begin, end);
      });
}

}  // namespace

// kd_cpu_rmsnorm
kd_status rmsnorm(const kd_call_args* args) noexcept {
  return rms_normalise(args, "layernorm.rmsnorm", 0.0f);
}

// kd_cpu_gemma_rmsnorm
kd_status gemma_rmsnorm(const kd_call_args* args) noexcept {
  return rms_normalise(args, "layernorm.gemma_rmsnorm", 1.0f);
}

// kd_cpu_fused_add_rmsnorm
kd_status fused_add_rmsnorm(const kd_call_args* args) noexcept {
  return add_and_rms_normalise<false>(args, "layernorm.fused_add_rmsnorm", 0.0f);
}

// kd_cpu_fused_add_rmsnorm_out
kd_status fused_add_rmsnorm_out(const kd_call_args* args) noexcept {
  return add_and_rms_normalise<true>(args, "layernorm.fused_add_rmsnorm_out", 0.0f);
}

// kd_cpu_gemma_fused_add_rmsnorm
kd_status gemma_fused_add_rmsnorm(const kd_call_args* args) noexcept {
  return add_and_rms_normalise<false>(args, "layernorm.gemma_fused_add_rmsnorm", 1.0f);
}

// kd_cpu_gemma_fused_add_rmsnorm_out
kd_status gemma_fused_add_rmsnorm_out(const kd_call_args* args) noexcept {
  return add_and_rms_normalise<true>(args, "layernorm.gemma_fused_add_rmsnorm_out", 1.0f);
}

// kd_cpu_layernorm
// Tensors (out, x, weight, bias), attribute eps.
kd_status layernorm(const kd_call_args* args) noexcept {
  constexpr const char* kOp = "layernorm.layernorm";
  return kd_plugin::guarded(args, [&]() -> kd_status {
    constexpr int kMinNdim[] = {1, 1, 1, 1};
    if (kd_status s = check_arguments(args, kOp, 1, kMinNdim); s != KD_STATUS_OK) return s;
    const DLTensor* t = args->tensors;
    const int64_t h = dim(t[1], -1);
    if (dim(t[0], -1) != h || dim(t[2], -1) != h || dim(t[3], -1) != h || t[2].ndim != 1 || t[3].ndim != 1 ||
        leading_rows(t[0], 1) != leading_rows(t[1], 1)) {
      return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT, "%s: tensor shapes disagree", kOp);
    }
    if (!same_dtype(t[0], t[1]) || !weight_dtype_allowed(t[2], t[0]) || !weight_dtype_allowed(t[3], t[0])) {
      return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT, "%s: tensor dtypes differ", kOp);
    }
    const kd_attr* eps = find_attr(args, "eps", KD_ATTR_TYPE_FLOAT);
    if (eps == nullptr) return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT, "%s: attribute eps is missing or not a float", kOp);
    return dispatch_float_dtype(args, kOp, t[1], [&](auto tag) {
      using T = typename decltype(tag)::type;
      std::vector<float> weight_storage, bias_storage;
      const float* weight = weight_as_float(t[2], h, 0.0f, weight_storage);
      const float* bias = weight_as_float(t[3], h, 0.0f, bias_storage);
      const RowLayout out_rows = kd_plugin::row_layout(t[0], 1);
      const RowLayout x_rows = kd_plugin::row_layout(t[1], 1);
      const int64_t rows = leading_rows(t[1], 1);
      const Store store = store_for(rows * h * int64_t{sizeof(T)});
      std::atomic<bool> out_of_memory{false};
      kd_plugin::parallel_for(rows, h, [&](int64_t begin, int64_t end) noexcept {
        std::unique_ptr<float[]> row;
        if constexpr (!std::is_same_v<T, float>) {
          row.reset(new (std::nothrow) float[h]);
          if (!row) {
            out_of_memory.store(true, std::memory_order_relaxed);
            return;
          }
        }
        layernorm_rows<T>(data_as<T>(t[0]), out_rows, data_as<T>(t[1]), x_rows, weight, bias, h,
                          static_cast<float>(eps->value.f), row.get(), store, begin, end);
      });
      if (out_of_memory.load()) return kd_plugin::fail(args, KD_STATUS_INTERNAL, "%s: out of host memory", kOp);
      return KD_STATUS_OK;
    });
  });
}

}  // namespace kdispatch::cpu
