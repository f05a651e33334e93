// quantization.per_tensor_quant_fp8, quantization.per_token_quant_fp8 and
// quantization.per_token_group_quant_fp8: output_q = fp8(x * inv) with s a
// float32 scale, computed as absmax / fp8_max in float32 (exactly the
// float64 quotient rounded to float32) where the op computes it, and inv =
// 1.0f / s, the float32 reciprocal rounded to nearest (0 for s == 0).
//
// The product x * inv is rounded once to fp8, as the reference does: it is
// exact in double (24 bits times 24 bits), rounded to odd in float (24
// bits, at least the fp8 mantissa's 4 + 2, so the next rounding is not a
// double one) and converted with from_float (nearest even, saturating,
// NaN kept). No division per value.
//
// Rows are addressed through kd_plugin::RowLayout (any stride before the
// last dim); per-group scales through their strides (SGLang's column-major
// scales). Rows are split across threads.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <kdispatch/plugin_helpers.hpp>
#include <kdispatch/plugin_rows.hpp>

#include "convert.hpp"
#include "kd_plugin_kernels.hpp"
#include "tensor_access.hpp"

namespace kdispatch::cpu {
namespace {

using kd_plugin::RowLayout;

// The float32 reciprocal of a scale, 0 for s == 0.
inline float reciprocal_of(float s) { return s == 0.0f ? 0.0f : 1.0f / s; }

// x * inv rounded to odd in float: the float nearest the exact product,
// moved one ulp towards it when inexact and even (finite only: an
// overflow to infinity, or a NaN, stays as it is).
inline float product_to_odd(float x, float inv) {
  const double d = static_cast<double>(x) * static_cast<double>(inv);  // exact
  const float p = static_cast<float>(d);
  uint32_t bits = 0;
  std::memcpy(&bits, &p, sizeof bits);
  const double pd = static_cast<double>(p);
  const bool inexact = pd != d && (bits & 0x7f800000u) != 0x7f800000u;
  const uint32_t step = std::fabs(d) > std::fabs(pd) ? 1u : ~0u;  // away from zero, or towards it
  bits += (inexact && (bits & 1u) == 0) ? step : 0u;
  float f = 0.0f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Values widened to float at a time (convert.hpp's block conversions).
constexpr int64_t kBlock = 256;

template <class T>
inline float absmax(const T* x, int64_t n) {
  float buf[kBlock];
  float m = 0.0f;
  for (int64_t j0 = 0; j0 < n; j0 += kBlock) {
    const int64_t len = std::min(kBlock, n - j0);
    const float* xf = as_float(x + j0, buf, len);
    for (int64_t k = 0; k < len; ++k) m = std::max(m, std::fabs(xf[k]));
  }
  return m;
}

// q = fp8(x * (1 / s)), rounded once.
template <class T, class Q>
inline void quantise(Q* q, const T* x, int64_t n, float s) {
  const float inv = reciprocal_of(s);
  float buf[kBlock];
  for (int64_t j0 = 0; j0 < n; j0 += kBlock) {
    const int64_t len = std::min(kBlock, n - j0);
    const float* xf = as_float(x + j0, buf, len);
    for (int64_t k = 0; k < len; ++k) q[j0 + k] = from_float<Q>(product_to_odd(xf[k], inv));
  }
}

// Calls fn(TypeTag<T>, TypeTag<Q>) for the dtypes of input and output_q.
template <class Fn>
kd_status dispatch_quant(const kd_call_args* args, const char* op, Fn&& fn) {
  return dispatch_float_dtype(args, op, args->tensors[0], [&](auto t) {
    return kd_plugin::dispatch_fp8_dtype(args, op, args->tensors[1], [&](auto q) { return fn(t, q); });
  });
}

struct Rows {
  RowLayout x, q;
  int64_t count, n;
};

Rows rows_of(const kd_call_args* args) {
  const DLTensor& x = args->tensors[0];
  const DLTensor& q = args->tensors[1];
  return Rows{kd_plugin::row_layout(x, 1), kd_plugin::row_layout(q, 1), leading_rows(x, 1), dim(x, -1)};
}

}  // namespace

// kd_cpu_per_tensor_quant_fp8
kd_status per_tensor_quant_fp8(const kd_call_args* args) noexcept {
  constexpr const char* kOp = "quantization.per_tensor_quant_fp8";
  if (const kd_status s = check_arguments<3>(args, kOp, 1, {1, 1, 1}); s != KD_STATUS_OK) return s;
  const kd_attr* is_static = find_attr(args, "is_static", KD_ATTR_TYPE_BOOL);
  if (is_static == nullptr) return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT, "%s: is_static must be a bool", kOp);
  if (!is_dtype<float>(args->tensors[2]) || leading_rows(args->tensors[2], 0) != 1) {
    return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT, "%s: output_s must be one float32", kOp);
  }
  return dispatch_quant(args, kOp, [&](auto ttag, auto qtag) {
    using T = typename decltype(ttag)::type;
    using Q = typename decltype(qtag)::type;
    const Rows r = rows_of(args);
    const T* x = data_as<const T>(args->tensors[0]);
    Q* q = data_as<Q>(args->tensors[1]);
    float* scale = data_as<float>(args->tensors[2]);
    if (is_static->value.b == 0) {
      std::vector<float> row_max(static_cast<size_t>(r.count), 0.0f);
      kd_plugin::parallel_for(r.count, r.n, [&](int64_t begin, int64_t end) noexcept {
        for (int64_t i = begin; i < end; ++i) row_max[static_cast<size_t>(i)] = absmax(x + r.x.offset(i), r.n);
      });
      float m = 0.0f;
      for (const float v : row_max) m = std::max(m, v);
      *scale = m / kd_plugin::fp8_max<Q>;
    }
    const float s = *scale;
    kd_plugin::parallel_for(r.count, r.n, [&](int64_t begin, int64_t end) noexcept {
      for (int64_t i = begin; i < end; ++i) quantise(q + r.q.offset(i), x + r.x.offset(i), r.n, s);
    });
    return KD_STATUS_OK;
  });
}

// kd_cpu_per_token_quant_fp8
kd_status per_token_quant_fp8(const kd_call_args* args) noexcept {
  constexpr const char* kOp = "quantization.per_token_quant_fp8";
  if (const kd_status s = check_arguments<3>(args, kOp, 0, {1, 1, 0}); s != KD_STATUS_OK) return s;
  const DLTensor& out_s = args->tensors[2];
  if (!is_dtype<float>(out_s) || leading_rows(out_s, 0) != leading_rows(args->tensors[0], 1) ||
      dim(args->tensors[1], -1) != dim(args->tensors[0], -1)) {
    return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT, "%s: output_s must be float32, one per row", kOp);
  }
  return dispatch_quant(args, kOp, [&](auto ttag, auto qtag) {
    using T = typename decltype(ttag)::type;
    using Q = typename decltype(qtag)::type;
    const Rows r = rows_of(args);
    const T* x = data_as<const T>(args->tensors[0]);
    Q* q = data_as<Q>(args->tensors[1]);
    float* scale = data_as<float>(out_s);
    kd_plugin::parallel_for(r.count, r.n, [&](int64_t begin, int64_t end) noexcept {
      for (int64_t i = begin; i < end; ++i) {
        const T* xr = x + r.x.offset(i);
        const float s = absmax(xr, r.n) / kd_plugin::fp8_max<Q>;
        scale[i] = s;
        quantise(q + r.q.offset(i), xr, r.n, s);
      }
    });
    return KD_STATUS_OK;
  });
}

// kd_cpu_per_token_group_quant_fp8
kd_status per_token_group_quant_fp8(const kd_call_args* args) noexcept {
  constexpr const char* kOp = "quantization.per_token_group_quant_fp8";
  if (const kd_status s = check_arguments<3>(args, kOp, 3, {1, 1, 1}); s != KD_STATUS_OK) return s;
  const kd_attr* group_size = find_attr(args, "group_size", KD_ATTR_TYPE_INT);
  const kd_attr* eps = find_attr(args, "eps", KD_ATTR_TYPE_FLOAT);
  const kd_attr* ue8m0 = find_attr(args, "scale_ue8m0", KD_ATTR_TYPE_BOOL);
  if (group_size == nullptr || eps == nullptr || ue8m0 == nullptr) {
    return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT, "%s: expects group_size (int), eps (float), scale_ue8m0 (bool)",
                           kOp);
  }
  const DLTensor& out_s = args->tensors[2];
  const int64_t n = dim(args->tensors[0], -1);
  const int64_t groups = dim(out_s, -1);
  if (!is_dtype<float>(out_s) || leading_rows(out_s, 1) != leading_rows(args->tensors[0], 1)) {
    return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT, "%s: output_s must be float32, [*, G]", kOp);
  }
  if (groups <= 0 || n % groups != 0 || (group_size->value.i != 0 && group_size->value.i * groups != n)) {
    return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT,
                           "%s: group_size %lld does not cut rows of %lld values into %lld groups", kOp,
                           static_cast<long long>(group_size->value.i), static_cast<long long>(n),
                           static_cast<long long>(groups));
  }
  const int64_t size = n / groups;
  const float min_absmax = static_cast<float>(eps->value.f);
  const bool pow2 = ue8m0->value.b != 0;
  const RowLayout s_rows = kd_plugin::row_layout(out_s, 1);
  const int64_t s_col = kd_plugin::element_stride(out_s, out_s.ndim - 1);
  return dispatch_quant(args, kOp, [&](auto ttag, auto qtag) {
    using T = typename decltype(ttag)::type;
    using Q = typename decltype(qtag)::type;
    const Rows r = rows_of(args);
    const T* x = data_as<const T>(args->tensors[0]);
    Q* q = data_as<Q>(args->tensors[1]);
    float* scale = data_as<float>(out_s);
    kd_plugin::parallel_for(r.count, r.n, [&](int64_t begin, int64_t end) noexcept {
      for (int64_t i = begin; i < end; ++i) {
        const T* xr = x + r.x.offset(i);
        Q* qr = q + r.q.offset(i);
        float* sr = scale + s_rows.offset(i);
        for (int64_t g = 0; g < groups; ++g) {
          float s = std::max(absmax(xr + g * size, size), min_absmax) / kd_plugin::fp8_max<Q>;
          if (pow2 && s > 0.0f && std::isfinite(s)) {
            int e = 0;
            const float m = std::frexp(s, &e);  // s = m * 2^e, m in [0.5, 1)
            s = std::ldexp(1.0f, m == 0.5f ? e - 1 : e);
          }
          sr[g * s_col] = s;
          quantise(qr + g * size, xr + g * size, size, s);
        }
      }
    });
    return KD_STATUS_OK;
  });
}

}  // namespace kdispatch::cpu
