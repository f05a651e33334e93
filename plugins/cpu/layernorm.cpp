// layernorm.rmsnorm, layernorm.gemma_rmsnorm, layernorm.fused_add_rmsnorm,
// layernorm.gemma_fused_add_rmsnorm (each also _out: the same into separate
// outputs), layernorm.rmsnorm_quant_fp8, layernorm.fused_add_rmsnorm_quant_fp8
// and layernorm.layernorm.
//
// out = T(float(x) * inv_rms * float(weight)), inv_rms = 1 / sqrt(mean(x^2) +
// eps) with the mean accumulated in float32 (FlashInfer/SGLang rounding: one
// rounding to T, at the end). fused_add_rmsnorm stores residual =
// T(x + residual) and normalises the float32 sum before that rounding, as
// FlashInfer and SGLang do. The Gemma variants use 1 + weight, added in
// float32. The _quant_fp8 ops are rmsnorm and fused_add_rmsnorm with an fp8
// out (type O), the float32 result multiplied by 1 / scale before its one
// rounding, as vLLM and FlashInfer do. layernorm takes the row's mean and then its (biased) variance
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

// A normalised value bound for an output of type O from inputs of type T:
// for an fp8 output (the _quant_fp8 ops) times `multiplier`, 1 / scale.
template <class T, class O>
[[gnu::always_inline]] inline float for_output(float v, float multiplier) {
  if constexpr (std::is_same_v<T, O>) {
    return v;
  } else {
    return v * multiplier;
  }
}

// `weight` is already float: converted once per call rather than once per
// row. `row` is scratch for h floats: the widened input row, read twice.
// O is T, or the fp8 type of a _quant_fp8 op's out.
template <class T, class O>
KD_CPU_MULTIVERSION void rmsnorm_rows(O* out, const RowLayout& out_rows, const T* x, const RowLayout& x_rows,
                                      const float* weight, int64_t h, float eps, float multiplier, float* row,
                                      Store store, int64_t begin, int64_t end) {
  float result[kBlock];
  for (int64_t r = begin; r < end; ++r) {
    const float* xr = as_float(x + x_rows.offset(r), row, h);
    O* outr = out + out_rows.offset(r);
    const float inv = inverse_rms(sum_of_squares(xr, h), h, eps);
    for (int64_t j0 = 0; j0 < h; j0 += kBlock) {
      const int64_t n = h - j0 < kBlock ? h - j0 : kBlock;
      for (int64_t j = 0; j < n; ++j) result[j] = for_output<T, O>(xr[j0 + j] * inv * weight[j0 + j], multiplier);
      narrow(result, outr + j0, n, store);
    }
  }
  if (store == Store::kStreaming) store_fence();
}

// The rows of a fused add + rmsnorm: residual_out = T(x + residual), out =
// T(rmsnorm of the float32 sum). out and residual_out may be x and residual
// (the in-place op): each block of a row is read before it is written. O is
// T, or the fp8 type of fused_add_rmsnorm_quant_fp8's out.
template <class T, class O>
struct FusedRows {
  O* out;
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
template <class T, class O>
KD_CPU_MULTIVERSION void fused_add_rmsnorm_rows(const FusedRows<T, O>& t, const float* weight, int64_t h, float eps,
                                                float multiplier, float* row, int64_t begin, int64_t end) {
  float x_block[kBlock];
  float r_block[kBlock];
  for (int64_t r = begin; r < end; ++r) {
    const T* xr = t.x + t.x_rows.offset(r);
    const T* rr = t.residual + t.residual_rows.offset(r);
    T* rout = t.residual_out + t.residual_out_rows.offset(r);
    O* out = t.out + t.out_rows.offset(r);
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
      for (int64_t j = 0; j < n; ++j) x_block[j] = for_output<T, O>(row[j0 + j] * inv * weight[j0 + j], multiplier);
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

// Checks shared by the rmsnorm ops: kTensors tensors, the weight [H] last,
// or before the scale when kQuant; those before the weight [*, H] with the
// same rows and dtype, but for a kQuant op's out (tensor 0), whose fp8 dtype
// run_norm() dispatches on; the scale a float32 tensor of one element, its
// reciprocal in *multiplier (else 1); eps a float attribute.
template <int kTensors, bool kQuant>
kd_status check_norm_arguments(const kd_call_args* args, const char* op, float* eps, float* multiplier) {
  constexpr int kWeightAt = kQuant ? kTensors - 2 : kTensors - 1;
  int min_ndim[kTensors];
  for (int& n : min_ndim) n = 1;
  if (kd_status s = check_arguments(args, op, 1, min_ndim); s != KD_STATUS_OK) return s;
  const DLTensor* t = args->tensors;
  const DLTensor& weight = t[kWeightAt];
  const DLTensor& x = t[kQuant ? 1 : 0];  // of the dtype the others share
  const int64_t h = dim(t[0], -1);
  if (dim(weight, -1) != h || weight.ndim != 1) {
    return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT, "%s: tensor shapes disagree", op);
  }
  for (int i = 1; i < kWeightAt; ++i) {
    if (dim(t[i], -1) != h || leading_rows(t[i], 1) != leading_rows(t[0], 1)) {
      return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT, "%s: tensor shapes disagree", op);
    }
    if (!same_dtype(t[i], x)) {
      return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT, "%s: tensor dtypes differ", op);
    }
  }
  if (!weight_dtype_allowed(weight, x)) {
    return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT, "%s: tensor dtypes differ", op);
  }
  *multiplier = 1.0f;
  if constexpr (kQuant) {
    const DLTensor& scale = t[kTensors - 1];
    if (!is_dtype<float>(scale) || leading_rows(scale, 0) != 1) {
      return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT, "%s: scale must be one float32 element", op);
    }
    *multiplier = 1.0f / *data_as<float>(scale);
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
  float multiplier;  // 1 / scale for the _quant_fp8 ops, else 1
};

// The frame the rmsnorm ops share, for kTensors tensors (the weight last,
// or before the scale when kQuant): argument checks, eps, 1 / scale, the
// weight as float plus `weight_offset`, and the rows split across threads,
// each range with `row`, scratch for h floats (for float32 inputs only when
// kFloatNeedsRow; else nullptr), reported as KD_STATUS_INTERNAL when it
// cannot be allocated. Calls do_rows(tag, out_tag, call, row, begin, end),
// tag.type being the element type and out_tag.type that of tensor 0: the
// same, or for kQuant its fp8 type.
template <int kTensors, bool kFloatNeedsRow, bool kQuant, class DoRows>
kd_status run_norm(const kd_call_args* args, const char* op, float weight_offset, DoRows&& do_rows) noexcept {
  constexpr int kWeightAt = kQuant ? kTensors - 2 : kTensors - 1;
  static_assert(kWeightAt <= NormCall::kMaxRowTensors);
  return kd_plugin::guarded(args, [&]() -> kd_status {
    float eps = 0.0f;
    float multiplier = 1.0f;
    if (kd_status s = check_norm_arguments<kTensors, kQuant>(args, op, &eps, &multiplier); s != KD_STATUS_OK) {
      return s;
    }
    // The tensors agree in shape and, but for a kQuant out, in dtype
    // (checked above): x speaks for all.
    const DLTensor& x = args->tensors[kQuant ? 1 : 0];
    const int64_t h = dim(x, -1);
    return dispatch_float_dtype(args, op, x, [&](auto tag) {
      using T = typename decltype(tag)::type;
      constexpr bool kNeedsRow = kFloatNeedsRow || !std::is_same_v<T, float>;
      const auto run_rows = [&](auto out_tag) -> kd_status {
        std::vector<float> weight_storage;
        NormCall call{weight_as_float(args->tensors[kWeightAt], h, weight_offset, weight_storage), {},
                      leading_rows(x, 1), h, eps, multiplier};
        for (int i = 0; i < kWeightAt; ++i) call.rows_of[i] = kd_plugin::row_layout(args->tensors[i], 1);
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
          do_rows(tag, out_tag, call, row.get(), begin, end);
        });
        if (out_of_memory.load()) {
          return kd_plugin::fail(args, KD_STATUS_INTERNAL, "%s: out of host memory", op);
        }
        return KD_STATUS_OK;
      };
      if constexpr (kQuant) {
        return kd_plugin::dispatch_fp8_dtype(args, op, args->tensors[0], run_rows);
      } else {
        return run_rows(tag);
      }
    });
  });
}

// rmsnorm: tensors (out, x, weight); kQuant: (out, x, weight, scale), out
// in fp8.
template <bool kQuant>
kd_status rms_normalise(const kd_call_args* args, const char* op, float weight_offset) noexcept {
  return run_norm<kQuant ? 4 : 3, false, kQuant>(
      args, op, weight_offset,
      [&](auto tag, auto out_tag, const NormCall& c, float* row, int64_t begin, int64_t end) noexcept {
        using T = typename decltype(tag)::type;
        using O = typename decltype(out_tag)::type;
        const Store store = store_for(c.rows * c.h * int64_t{sizeof(O)});
        const DLTensor* t = args->tensors;  // out, x, weight
        rmsnorm_rows<T, O>(data_as<O>(t[0]), c.rows_of[0], data_as<T>(t[1]), c.rows_of[1], c.weight, c.h, c.eps,
                           c.multiplier, row, store, begin, end);
      });
}

// The tensors of the fused ops: kInPlace (x, residual, weight), both of the
// first updated in place; kOut (out, residual_out, x, residual, weight);
// kQuant (out, x, residual, weight, scale), out in fp8, residual updated in
// place.
enum class Fused { kInPlace, kOut, kQuant };

template <Fused kForm>
kd_status add_and_rms_normalise(const kd_call_args* args, const char* op, float weight_offset) noexcept {
  constexpr bool kQuant = kForm == Fused::kQuant;
  // The positions of residual_out, x and residual; out is tensor 0.
  constexpr int kResidualOutAt = kQuant ? 2 : 1;
  constexpr int kXAt = kForm == Fused::kOut ? 2 : (kQuant ? 1 : 0);
  constexpr int kResidualAt = kForm == Fused::kOut ? 3 : (kQuant ? 2 : 1);
  return run_norm<kForm == Fused::kInPlace ? 3 : 5, true, kQuant>(
      args, op, weight_offset,
      [&](auto tag, auto out_tag, const NormCall& c, float* row, int64_t begin, int64_t end) noexcept {
        using T = typename decltype(tag)::type;
        using O = typename decltype(out_tag)::type;
        const DLTensor* t = args->tensors;
        const FusedRows<T, O> rows{data_as<O>(t[0]),
                                   c.rows_of[0],
                                   data_as<T>(t[kResidualOutAt]),
                                   c.rows_of[kResidualOutAt],
                                   data_as<T>(t[kXAt]),
                                   c.rows_of[kXAt],
                                   data_as<T>(t[kResidualAt]),
                                   c.rows_of[kResidualAt]};
        fused_add_rmsnorm_rows<T, O>(rows, c.weight, c.h, c.eps, c.multiplier, row, begin, end);
      });
}

}  // namespace

// kd_cpu_rmsnorm
kd_status rmsnorm(const kd_call_args* args) noexcept {
  return rms_normalise<false>(args, "layernorm.rmsnorm", 0.0f);
}

// kd_cpu_gemma_rmsnorm
kd_status gemma_rmsnorm(const kd_call_args* args) noexcept {
  return rms_normalise<false>(args, "layernorm.gemma_rmsnorm", 1.0f);
}

// kd_cpu_fused_add_rmsnorm
kd_status fused_add_rmsnorm(const kd_call_args* args) noexcept {
  return add_and_rms_normalise<Fused::kInPlace>(args, "layernorm.fused_add_rmsnorm", 0.0f);
}

// kd_cpu_fused_add_rmsnorm_out
kd_status fused_add_rmsnorm_out(const kd_call_args* args) noexcept {
  return add_and_rms_normalise<Fused::kOut>(args, "layernorm.fused_add_rmsnorm_out", 0.0f);
}

// kd_cpu_gemma_fused_add_rmsnorm
kd_status gemma_fused_add_rmsnorm(const kd_call_args* args) noexcept {
  return add_and_rms_normalise<Fused::kInPlace>(args, "layernorm.gemma_fused_add_rmsnorm", 1.0f);
}

// kd_cpu_gemma_fused_add_rmsnorm_out
kd_status gemma_fused_add_rmsnorm_out(const kd_call_args* args) noexcept {
  return add_and_rms_normalise<Fused::kOut>(args, "layernorm.gemma_fused_add_rmsnorm_out", 1.0f);
}

// kd_cpu_rmsnorm_quant_fp8
kd_status rmsnorm_quant_fp8(const kd_call_args* args) noexcept {
  return rms_normalise<true>(args, "layernorm.rmsnorm_quant_fp8", 0.0f);
}

// kd_cpu_fused_add_rmsnorm_quant_fp8
kd_status fused_add_rmsnorm_quant_fp8(const kd_call_args* args) noexcept {
  return add_and_rms_normalise<Fused::kQuant>(args, "layernorm.fused_add_rmsnorm_quant_fp8", 0.0f);
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
