// quantization.per_tensor_quant_fp8, quantization.per_token_quant_fp8 and
// quantization.per_token_group_quant_fp8: output_q = fp8(x / s) with s a
// float32 scale, absmax / fp8_max where the op computes it (a float32
// division, exactly the float64 quotient rounded once, as the reference
// stores it).
//
// The quotient is rounded once to fp8, as the reference does: q = x / s in
// float32, within one ulp (x times the rounded reciprocal of s, corrected
// once by the remainder), its exact remainder x - q * s (one fma) tells
// which side of q the true quotient lies, and q is moved to the odd
// neighbour on that side when inexact and even (rounding to odd: 24 bits,
// at least the fp8 mantissa's 4 + 2, so converting to fp8 after it is not
// a double rounding). from_float then rounds to nearest even and saturates. A scale
// of 0 gives 0.
//
// All three are memory bound. Rows are addressed through kd_plugin::RowLayout
// (any stride before the last dim); where the rows' length and starts allow,
// x is read in 16-byte vectors and output_q written in vectors of as many
// fp8 values. Per token: one block a row, its absmax reduced across the
// block, the row read a second time (from L1/L2) to quantise it. Per group:
// one block a row, a group to as many lanes of a warp as it has vectors
// (up to the warp). Per tensor: rows and chunks of rows over the grid;
// dynamic: a one-thread kernel zeroes output_s, a grid of blocks takes
// each block's absmax / fp8_max into it with an atomic max on its bits (the
// values are >= 0, so the bits order as the floats; dividing by fp8_max
// commutes with the max), and the quantising grid reads it; all three on
// the call's stream, no host synchronisation, so the call can be captured
// in a graph.
#include "device_utils.cuh"
#include "launch_utils.hpp"
#include "ops.hpp"

namespace kd_gpu {
namespace {

using kd_plugin::RowLayout;

constexpr int kThreads = 256;

// fp8(x / s), rounded once; inv is 1 / s rounded to nearest (__frcp_rn).
template <class Q>
__device__ __forceinline__ Q quantise_exact(float x, float s, float inv) {
  if (s == 0.f) return from_float<Q>(0.f);
  float q = x * inv;  // within 1.5 ulps of x / s
  if (isfinite(q)) {
    q = __fmaf_rn(__fmaf_rn(-q, s, x), inv, q);  // one correction: within one ulp
  } else {
    q = __fdiv_rn(x, s);  // x / s beyond float's range, or 1 / s not finite
  }
  if (isfinite(q)) {
    const float r = __fmaf_rn(-q, s, x);
    unsigned bits = __float_as_uint(q);
    if (r != 0.f && (bits & 1u) == 0) {
      const bool above = (r > 0.f) == (s > 0.f);           // the exact quotient lies above q
      const bool away = above != static_cast<bool>(signbit(q));  // ... and so further from zero
      q = __uint_as_float(away ? bits + 1 : bits - 1);
    }
  }
  return from_float<Q>(q);
}

// fp8(x / s), rounded once, usually from p = x * inv alone: p is within
// 1.5 ulps of x / s, so where p lies more than 4 ulps from the midpoint
// between two fp8 values, in fp8's normal range, the exact quotient rounds
// to the fp8 value p rounds to. Otherwise (about 1 value in 10^5 of random
// inputs, and fp8's subnormals) quantise_exact.
template <class Q>
__device__ __forceinline__ Q quantise(float x, float s, float inv) {
  constexpr bool kE4M3 = fp8_max<Q> == 448.0f;
  constexpr int kDropped = 23 - (kE4M3 ? 3 : 2);      // float mantissa bits below fp8's
  constexpr float kLeastNormal = kE4M3 ? 0x1p-6f : 0x1p-14f;
  const float p = x * inv;
  const unsigned dropped = __float_as_uint(p) & ((1u << kDropped) - 1);
  constexpr unsigned kHalf = 1u << (kDropped - 1);
  const unsigned from_tie = dropped > kHalf ? dropped - kHalf : kHalf - dropped;
  if (from_tie > 4u && fabsf(p) >= kLeastNormal && fabsf(p) <= 3.0e38f) return from_float<Q>(p);
  return quantise_exact<Q>(x, s, inv);
}

// The arguments of one call.
template <class T, class Q>
struct QuantArgs {
  const T* x;
  Q* q;
  float* scale;
  RowLayout x_rows;
  RowLayout q_rows;
  RowLayout s_rows;  // per group: the leading dims of output_s
  int64_t rows;
  int64_t n;
  int64_t group_size;  // per group
  int64_t groups;      // per group: G
  int64_t s_col;       // per group: the stride of output_s's last dim
  float min_absmax;    // per group: eps
  bool pow2;           // per group: scale_ue8m0
};

// Vectors loaded ahead of their use by each thread of the span loops, so
// that several loads are in flight at once.
constexpr int kAhead = 4;

// max |x[i]| over [first, n) of the row in steps of `step` vectors of N.
template <class T, int N>
__device__ __forceinline__ float partial_absmax(const T* x, int64_t n, int64_t first, int64_t step) {
  float m = 0.f;
  const int64_t units = n / N;
  int64_t i = first;
  for (; i + (kAhead - 1) * step < units; i += kAhead * step) {
    Vec<T, N> v[kAhead];
#pragma unroll
    for (int k = 0; k < kAhead; ++k) v[k] = load_vec<T, N, (N > 1)>(x + (i + k * step) * N);
#pragma unroll
    for (int k = 0; k < kAhead; ++k) {
#pragma unroll
      for (int e = 0; e < N; ++e) m = fmaxf(m, fabsf(to_float(v[k].v[e])));
    }
  }
  for (; i < units; i += step) {
    const Vec<T, N> v = load_vec<T, N, (N > 1)>(x + i * N);
#pragma unroll
    for (int e = 0; e < N; ++e) m = fmaxf(m, fabsf(to_float(v.v[e])));
  }
  return m;
}

template <class T, class Q, int N>
__device__ __forceinline__ void quantise_vec(Q* q, const Vec<T, N>& v, float s, float inv) {
  Vec<Q, N> o;
#pragma unroll
  for (int e = 0; e < N; ++e) o.v[e] = quantise<Q>(to_float(v.v[e]), s, inv);
  store_vec<Q, N, (N > 1)>(q, o);
}

template <class T, class Q, int N>
__device__ __forceinline__ void quantise_span(Q* q, const T* x, int64_t n, float s, int64_t first, int64_t step) {
  const float inv = __frcp_rn(s);
  const int64_t units = n / N;
  int64_t i = first;
  for (; i + (kAhead - 1) * step < units; i += kAhead * step) {
    Vec<T, N> v[kAhead];
#pragma unroll
    for (int k = 0; k < kAhead; ++k) v[k] = load_vec<T, N, (N > 1)>(x + (i + k * step) * N);
#pragma unroll
    for (int k = 0; k < kAhead; ++k) quantise_vec<T, Q, N>(q + (i + k * step) * N, v[k], s, inv);
  }
  for (; i < units; i += step) quantise_vec<T, Q, N>(q + i * N, load_vec<T, N, (N > 1)>(x + i * N), s, inv);
}

__global__ void zero_scale_kernel(float* scale) {
  start_after_previous_kernel();
  *scale = 0.f;
}

// Per tensor, dynamic: the blocks' absmax / fp8_max, maxed into *scale.
template <class T, class Q, int N>
__global__ void __launch_bounds__(kThreads) tensor_absmax_kernel(QuantArgs<T, Q> a) {
  start_after_previous_kernel();
  float m = 0.f;
  const int64_t first = int64_t{blockIdx.y} * blockDim.x + threadIdx.x;
  const int64_t step = int64_t{gridDim.y} * blockDim.x;
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    m = fmaxf(m, partial_absmax<T, N>(a.x + a.x_rows.offset(row), a.n, first, step));
  }
  m = block_max(m);
  if (threadIdx.x == 0) atomicMax(reinterpret_cast<unsigned*>(a.scale), __float_as_uint(m / fp8_max<Q>));
}

// Per tensor: every row quantised with *scale.
template <class T, class Q, int N>
__global__ void __launch_bounds__(kThreads) tensor_quant_kernel(QuantArgs<T, Q> a) {
  start_after_previous_kernel();
  const float s = *a.scale;
  const int64_t first = int64_t{blockIdx.y} * blockDim.x + threadIdx.x;
  const int64_t step = int64_t{gridDim.y} * blockDim.x;
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    quantise_span<T, Q, N>(a.q + a.q_rows.offset(row), a.x + a.x_rows.offset(row), a.n, s, first, step);
  }
}

// Per token: one block a row.
template <class T, class Q, int N>
__global__ void __launch_bounds__(kThreads) token_quant_kernel(QuantArgs<T, Q> a) {
  start_after_previous_kernel();
  const int64_t row = block_row();
  if (row >= a.rows) return;
  const T* x = a.x + a.x_rows.offset(row);
  const float m = block_max(partial_absmax<T, N>(x, a.n, threadIdx.x, blockDim.x));
  const float s = m / fp8_max<Q>;
  if (threadIdx.x == 0) a.scale[row] = s;
  quantise_span<T, Q, N>(a.q + a.q_rows.offset(row), x, a.n, s, threadIdx.x, blockDim.x);
}

// Per group: one block a row; a group to each `lanes` lanes of a warp, the
// group's vectors up to a warp's width (a power of two), so that a warp
// takes several short groups at once.
template <class T, class Q, int N>
__global__ void __launch_bounds__(kThreads) group_quant_kernel(QuantArgs<T, Q> a, int lanes) {
  start_after_previous_kernel();
  const int64_t row = block_row();
  if (row >= a.rows) return;
  const T* x = a.x + a.x_rows.offset(row);
  Q* q = a.q + a.q_rows.offset(row);
  float* scale = a.scale + a.s_rows.offset(row);
  const int lane = threadIdx.x % kWarpSize;
  const int per_warp = kWarpSize / lanes;
  const int64_t step = int64_t{blockDim.x / kWarpSize} * per_warp;
  // Every lane of a warp runs the same iterations: the shuffles need them.
  for (int64_t g0 = int64_t{threadIdx.x / kWarpSize} * per_warp; g0 < a.groups; g0 += step) {
    const int64_t g = g0 + lane / lanes;
    const bool in = g < a.groups;
    const T* xg = x + g * a.group_size;
    float m = in ? partial_absmax<T, N>(xg, a.group_size, lane % lanes, lanes) : 0.f;
    for (int d = lanes / 2; d > 0; d >>= 1) m = fmaxf(m, shfl_xor(m, d));
    float s = fmaxf(m, a.min_absmax) / fp8_max<Q>;
    if (a.pow2 && s > 0.f && isfinite(s)) {
      // 2^ceil(log2 s): the exponent, one up unless the mantissa is zero.
      const unsigned bits = __float_as_uint(s);
      const int e = static_cast<int>(bits >> 23) - 127 + ((bits & 0x7fffffu) != 0 ? 1 : 0);
      s = ldexpf(1.f, e);
    }
    if (!in) continue;
    if (lane % lanes == 0) scale[g * a.s_col] = s;
    quantise_span<T, Q, N>(q + g * a.group_size, xg, a.group_size, s, lane % lanes, lanes);
  }
}

enum class Kind { kTensor, kToken, kGroup };

// Threads a block for rows of `units` vectors: a whole number of warps, up
// to kThreads.
int threads_for(int64_t units, int warp_size) {
  return static_cast<int>(std::min<int64_t>(kThreads, std::max<int64_t>(warp_size, ceil_div(units, warp_size) * warp_size)));
}

template <class T, class Q, int N>
void launch_quant(const Launch& launch, Kind kind, bool is_static, const QuantArgs<T, Q>& a) {
  switch (kind) {
    case Kind::kTensor: {
      // Rows in x; with fewer rows than fill the device, each row's vectors
      // cut into chunks of a block in y, so that a few rows still do.
      const int64_t units = std::max<int64_t>(1, a.n / N);
      const bool few = a.rows < int64_t{launch.sm_count} * 8;
      const int threads = threads_for(few ? std::min<int64_t>(units, 128) : units, launch.warp_size);
      const auto chunks = few ? static_cast<unsigned>(std::min<int64_t>(ceil_div(units, threads), 65535)) : 1u;
      const dim3 absmax_grid(row_grid(std::min<int64_t>(a.rows, int64_t{launch.sm_count} * 8)), chunks);
      if (!is_static) launch_kernel(launch, zero_scale_kernel, dim3(1), dim3(1), a.scale);
      if (a.rows == 0 || a.n == 0) break;
      if (!is_static) launch_kernel(launch, tensor_absmax_kernel<T, Q, N>, absmax_grid, dim3(threads), a);
      launch_kernel(launch, tensor_quant_kernel<T, Q, N>, dim3(row_grid(a.rows), chunks), dim3(threads), a);
      break;
    }
    case Kind::kToken:
      launch_kernel(launch, token_quant_kernel<T, Q, N>, one_block_per_row(a.rows),
                    dim3(threads_for(a.n / N, launch.warp_size)), a);
      break;
    case Kind::kGroup: {
      int lanes = launch.warp_size;  // a power of two
      while (lanes > 1 && lanes / 2 >= a.group_size / N) lanes /= 2;
      const int64_t warps = ceil_div(a.groups, launch.warp_size / lanes);
      launch_kernel(launch, group_quant_kernel<T, Q, N>, one_block_per_row(a.rows),
                    dim3(threads_for(warps * launch.warp_size, launch.warp_size)), a, lanes);
      break;
    }
  }
}

// Checks and launches one call of any of the three ops; output_s has been
// checked by the caller.
kd_status run_quant(const kd_call_args* args, const char* op, Kind kind, bool is_static, int64_t group_size,
                    float min_absmax, bool pow2) {
  const DLTensor& x = args->tensors[0];
  const DLTensor& q = args->tensors[1];
  const DLTensor& s = args->tensors[2];
  const bool e4m3 = is_dtype(q, KD_DLPACK_FLOAT8_E4M3FN, 8);
  if (!e4m3 && !is_dtype(q, KD_DLPACK_FLOAT8_E5M2, 8)) {
    return kd_plugin::fail(args, KD_STATUS_UNSUPPORTED, "%s: output_q must be float8_e4m3fn or float8_e5m2", op);
  }
  if (x.ndim < 1 || q.ndim != x.ndim || dim(q, -1) != dim(x, -1)) return invalid_shapes(args, op);
  const int64_t rows = leading_rows(x, 1);
  const int64_t n = dim(x, -1);
  // Empty rows still get their scales; the dynamic per-tensor scale is
  // written whatever the size.
  if (rows == 0 && (kind != Kind::kTensor || is_static)) return KD_STATUS_OK;
  if (n == 0 && kind == Kind::kTensor && is_static) return KD_STATUS_OK;
  return launch_for_dtype(args, op, x, [&](auto tag, const Launch& launch) {
    using T = typename decltype(tag)::type;
    const auto go = [&](auto qtag) {
      using Q = typename decltype(qtag)::type;
      QuantArgs<T, Q> a{data_as<const T>(x), data_as<Q>(q), data_as<float>(s),
                        kd_plugin::row_layout(x, 1), kd_plugin::row_layout(q, 1),
                        kind == Kind::kGroup ? kd_plugin::row_layout(s, 1) : RowLayout{},
                        rows, n, group_size, kind == Kind::kGroup ? dim(s, -1) : 0,
                        kind == Kind::kGroup ? kd_plugin::element_stride(s, s.ndim - 1) : 0,
                        min_absmax, pow2};
      constexpr int kVec = 16 / sizeof(T);
      const int64_t span = kind == Kind::kGroup ? group_size : n;  // 0 takes the vector path: no loads
      const bool vec = span % kVec == 0 && rows_aligned(16, a.x, a.x_rows, sizeof(T)) &&
                       rows_aligned(kVec, a.q, a.q_rows, 1);
      if (vec) {
        launch_quant<T, Q, kVec>(launch, kind, is_static, a);
      } else {
        launch_quant<T, Q, 1>(launch, kind, is_static, a);
      }
    };
    if (e4m3) {
      go(kd_plugin::TypeTag<fp8_e4m3_t>{});
    } else {
      go(kd_plugin::TypeTag<fp8_e5m2_t>{});
    }
  });
}

}  // namespace

kd_status per_tensor_quant_fp8(const kd_call_args* args) noexcept {
  constexpr const char* kOp = "quantization.per_tensor_quant_fp8";
  return kd_plugin::guarded(args, [&] {
    if (const kd_status st = check_call(args, kOp, 3, 1); st != KD_STATUS_OK) return st;
    bool is_static = false;
    if (const kd_status st = attr_bool(args, kOp, 0, &is_static); st != KD_STATUS_OK) return st;
    const DLTensor& s = args->tensors[2];
    if (!is_dtype(s, kDLFloat, 32) || leading_rows(s, 0) != 1) {
      return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT, "%s: output_s must be one float32", kOp);
    }
    return run_quant(args, kOp, Kind::kTensor, is_static, 0, 0.f, false);
  });
}

kd_status per_token_quant_fp8(const kd_call_args* args) noexcept {
  constexpr const char* kOp = "quantization.per_token_quant_fp8";
  return kd_plugin::guarded(args, [&] {
    if (const kd_status st = check_call(args, kOp, 3, 0); st != KD_STATUS_OK) return st;
    const DLTensor& s = args->tensors[2];
    if (!is_dtype(s, kDLFloat, 32) || args->tensors[0].ndim < 1 ||
        leading_rows(s, 0) != leading_rows(args->tensors[0], 1)) {
      return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT, "%s: output_s must be float32, one per row", kOp);
    }
    return run_quant(args, kOp, Kind::kToken, false, 0, 0.f, false);
  });
}

kd_status per_token_group_quant_fp8(const kd_call_args* args) noexcept {
  constexpr const char* kOp = "quantization.per_token_group_quant_fp8";
  return kd_plugin::guarded(args, [&] {
    if (const kd_status st = check_call(args, kOp, 3, 3); st != KD_STATUS_OK) return st;
    const kd_attr* group_size = kd_plugin::find_attr(args, "group_size", KD_ATTR_TYPE_INT);
    const kd_attr* eps = kd_plugin::find_attr(args, "eps", KD_ATTR_TYPE_FLOAT);
    const kd_attr* ue8m0 = kd_plugin::find_attr(args, "scale_ue8m0", KD_ATTR_TYPE_BOOL);
    if (group_size == nullptr || eps == nullptr || ue8m0 == nullptr) {
      return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT,
                             "%s: expects group_size (int), eps (float), scale_ue8m0 (bool)", kOp);
    }
    const DLTensor& x = args->tensors[0];
    const DLTensor& s = args->tensors[2];
    if (!is_dtype(s, kDLFloat, 32) || x.ndim < 1 || s.ndim != x.ndim ||
        leading_rows(s, 1) != leading_rows(x, 1)) {
      return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT, "%s: output_s must be float32, [*, G]", kOp);
    }
    const int64_t n = dim(x, -1);
    const int64_t groups = dim(s, -1);
    if (groups <= 0 || n % groups != 0 || (group_size->value.i != 0 && group_size->value.i * groups != n)) {
      return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT,
                             "%s: group_size %lld does not cut rows of %lld values into %lld groups", kOp,
                             static_cast<long long>(group_size->value.i), static_cast<long long>(n),
                             static_cast<long long>(groups));
    }
    return run_quant(args, kOp, Kind::kGroup, false, n / groups, static_cast<float>(eps->value.f),
                     ue8m0->value.b != 0);
  });
}

}  // namespace kd_gpu
