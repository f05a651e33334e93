// quantization.per_tensor_quant_fp8, quantization.per_token_quant_fp8 and
// quantization.per_token_group_quant_fp8: output_q = fp8(x * inv) with s a
// float32 scale, absmax / fp8_max where the op computes it (a float32
// division, exactly the float64 quotient rounded once, as the reference
// stores it), and inv = 1 / s rounded to nearest in float32 (__frcp_rn, once
// per scale; 0 for s == 0).
//
// The product x * inv is rounded once to fp8, as the reference does: it is
// first rounded to odd in float32 (24 bits, at least the fp8 mantissa's 4 +
// 2, so converting to fp8 after it, from_float: nearest even, saturating,
// NaN kept, is not a double rounding). On CUDA that is the product truncated
// with its last bit set when inexact (the product rounded down and up
// differ); on HIP, p = x * inv with its exact residual e = fma(x, inv, -p),
// p moved one ulp towards the exact product when e is nonzero (and finite:
// with x or p infinite, e is NaN or infinite and p is left as it is) and p
// even. Branch-free, no division per value.
//
// All three are memory bound. Rows are addressed through kd_plugin::RowLayout
// (any stride before the last dim); where the rows' length (the group's,
// per group) and starts allow, and the rows are one stride apart, x is read
// in 16-byte vectors and output_q written in vectors of as many fp8 values,
// the rows addressed as kd_plugin::LinearRows (8 bytes of kernel arguments
// each, not 144: a graph copies them at every launch); dense tensors are
// taken as one row. Other views take one value at a time.
//
// Per token: one block a row, which holds its share of the row in
// registers (up to kMaxVecPerThread vectors a thread) across the block's
// absmax, so the row is read once: two vectors a thread with many rows;
// with rows fewer than a few times the SM count one, up to 1024 threads a
// row, so that a single row finishes fast.
// Longer rows, and rows without 16-byte vectors, read the row a second time
// (from L1/L2) to quantise it.
//
// Per group: the grid runs over the flat (row, group) pairs, a group to each
// `lanes` lanes of a warp (the least power of two, up to the warp, that
// gives a lane one vector, or four when the groups fill the device many
// times over; at most kMaxVecPerThread), so a warp takes several
// short groups at once and one row of many groups spreads over blocks. Each
// lane holds its vectors of the group in registers, the group's absmax is
// reduced by shuffles, and the group quantised from the registers. Groups too
// long for that, or without 16-byte vectors, are read twice instead.
//
// The kernels that hold values in registers issue all their loads before
// the first use of a loaded value: a use between two loads keeps the second
// from being issued until the first has arrived.
//
// Each value is converted as x * inv rounded to odd, two at a time (one
// instruction on CUDA).
//
// Per tensor: a grid-stride elementwise kernel over rows and chunks of rows,
// kAhead vectors in flight a thread. Dynamic, small tensors (up to
// kMaxVecPerThread vectors for each of 1024 threads: 65536 16-bit values):
// one block holds the tensor in registers, takes the absmax, writes the
// scale and quantises, one launch. Larger ones: a one-thread kernel zeroes
// output_s, a grid of blocks takes each block's absmax / fp8_max into it with
// an atomic max on its bits (the values are >= 0, so the bits order as the
// floats; dividing by fp8_max commutes with the max), and the quantising grid
// reads it. All on the call's stream, no host synchronisation, so the call
// can be captured in a graph.
#include "device_utils.cuh"
#include "launch_utils.hpp"
#include "ops.hpp"

namespace kd_gpu {
namespace {

using kd_plugin::LinearRows;
using kd_plugin::RowLayout;

constexpr int kThreads = 256;
constexpr int kMaxThreads = 1024;
constexpr int kMaxVecPerThread = 8;    // vectors a thread (lane) holds in registers

// The float32 reciprocal of a scale, rounded to nearest; 0 for s == 0.
__device__ __forceinline__ float reciprocal_of(float s) { return s == 0.f ? 0.f : __frcp_rn(s); }

// x * inv rounded to odd in float32 (see the top of the file): converting
// it to fp8 rounds the exact product once.
__device__ __forceinline__ float product_to_odd(float x, float inv) {
#if defined(__HIP__)
  const float p = __fmul_rn(x, inv);
  const float e = __fmaf_rn(x, inv, -p);  // x * inv - p, exactly
  const unsigned pb = __float_as_uint(p);
  const unsigned eb = __float_as_uint(e);
  const bool inexact = (eb & 0x7fffffffu) != 0u && (eb & 0x7f800000u) != 0x7f800000u;
  // +1 (away from zero) when e has p's sign, else -1 (towards zero).
  const unsigned step = 1u | static_cast<unsigned>(static_cast<int>(eb ^ pb) >> 31);
  return __uint_as_float(pb + (inexact && (pb & 1u) == 0u ? step : 0u));
#else
  // Truncated, with the last bit set when the product is inexact (its
  // roundings down and up differ): three multiplies, no residual. An
  // infinite x stays infinite; an overflowing product truncates to the
  // largest float, which saturates as the exact product does.
  const unsigned truncated = __float_as_uint(__fmul_rz(x, inv));
  return __uint_as_float(truncated | (__fmul_rd(x, inv) != __fmul_ru(x, inv) ? 1u : 0u));
#endif
}

// The arguments of one call.
template <class T, class Q, class Rows = RowLayout>
struct QuantArgs {
  const T* x;
  Q* q;
  float* scale;
  Rows x_rows;
  Rows q_rows;
  Rows s_rows;  // per group: the leading dims of output_s
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

template <class T, int N>
__device__ __forceinline__ float vec_absmax(float m, const Vec<T, N>& v) {
#pragma unroll
  for (int e = 0; e < N; ++e) m = fmaxf(m, fabsf(to_float(v.v[e])));
  return m;
}

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
    for (int k = 0; k < kAhead; ++k) m = vec_absmax(m, v[k]);
  }
  for (; i < units; i += step) m = vec_absmax(m, load_vec<T, N, (N > 1)>(x + i * N));
  return m;
}

// fp8(x * inv) of each value, converted two at a time.
template <class T, class Q, int N>
__device__ __forceinline__ void quantise_vec(Q* q, const Vec<T, N>& v, float inv) {
  Vec<Q, N> o;
  if constexpr (N % 2 == 0) {
#pragma unroll
    for (int e = 0; e < N; e += 2) {
      from_float2(product_to_odd(to_float(v.v[e]), inv), product_to_odd(to_float(v.v[e + 1]), inv), &o.v[e]);
    }
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) o.v[e] = from_float<Q>(product_to_odd(to_float(v.v[e]), inv));
  }
  store_vec<Q, N, (N > 1)>(q, o);
}

// The reciprocal of a scale in device memory, read when first asked for:
// after the caller has issued its first loads of x, so that the scale's
// load and reciprocal overlap them instead of coming before them.
struct LazyReciprocal {
  const float* scale;
  float inv = 0.f;
  bool ready = false;
  __device__ __forceinline__ float get() {
    if (!ready) {
      inv = reciprocal_of(*scale);
      ready = true;
    }
    return inv;
  }
};

__device__ __forceinline__ float reciprocal_value(float inv) { return inv; }
__device__ __forceinline__ float reciprocal_value(LazyReciprocal& inv) { return inv.get(); }

// fp8(x * inv) of [first, n) of a row in steps of `step` vectors of N; inv
// a float or a LazyReciprocal.
template <class T, class Q, int N, class Inv>
__device__ __forceinline__ void quantise_span(Q* q, const T* x, int64_t n, Inv&& inv, int64_t first, int64_t step) {
  const int64_t units = n / N;
  int64_t i = first;
  for (; i + (kAhead - 1) * step < units; i += kAhead * step) {
    Vec<T, N> v[kAhead];
#pragma unroll
    for (int k = 0; k < kAhead; ++k) v[k] = load_vec<T, N, (N > 1)>(x + (i + k * step) * N);
    const float f = reciprocal_value(inv);
#pragma unroll
    for (int k = 0; k < kAhead; ++k) quantise_vec<T, Q, N>(q + (i + k * step) * N, v[k], f);
  }
  for (; i < units; i += step) {
    const Vec<T, N> v = load_vec<T, N, (N > 1)>(x + i * N);
    quantise_vec<T, Q, N>(q + i * N, v, reciprocal_value(inv));
  }
}

// 2^ceil(log2 s) for a finite s > 0: the exponent, one up unless the
// mantissa is zero.
__device__ __forceinline__ float pow2_ceil(float s) {
  const unsigned bits = __float_as_uint(s);
  const int e = static_cast<int>(bits >> 23) - 127 + ((bits & 0x7fffffu) != 0 ? 1 : 0);
  return ldexpf(1.f, e);
}

__global__ void zero_scale_kernel(float* scale) {
  start_after_previous_kernel();
  *scale = 0.f;
}

// Per tensor, dynamic, small: one block holds the tensor in registers (V
// vectors of N a thread, over the flat (row, vector) index), takes its
// absmax, writes absmax / fp8_max and quantises from the registers: one
// launch, the tensor read once.
template <class T, class Q, int N, int V, class Rows>
__global__ void __launch_bounds__(kMaxThreads) tensor_small_kernel(QuantArgs<T, Q, Rows> a) {
  start_after_previous_kernel();
  const int units = static_cast<int>(a.n / N);
  const int total = static_cast<int>(a.rows) * units;
  Vec<T, N> v[V];
  float m = 0.f;
#pragma unroll
  for (int k = 0; k < V; ++k) {
    const int i = static_cast<int>(threadIdx.x) + k * static_cast<int>(blockDim.x);
    if (i < total) {
      const int row = i / units;
      v[k] = load_once<T, N>(a.x + a.x_rows.offset(row) + int64_t{i - row * units} * N);
    }
  }
#pragma unroll
  for (int k = 0; k < V; ++k) {
    if (static_cast<int>(threadIdx.x) + k * static_cast<int>(blockDim.x) < total) m = vec_absmax(m, v[k]);
  }
  const float s = block_max(m) / fp8_max<Q>;
  if (threadIdx.x == 0) *a.scale = s;
  const float inv = reciprocal_of(s);
#pragma unroll
  for (int k = 0; k < V; ++k) {
    const int i = static_cast<int>(threadIdx.x) + k * static_cast<int>(blockDim.x);
    if (i < total) {
      const int row = i / units;
      quantise_vec<T, Q, N>(a.q + a.q_rows.offset(row) + int64_t{i - row * units} * N, v[k], inv);
    }
  }
}

// Per tensor, dynamic: the blocks' absmax / fp8_max, maxed into *scale
// (zeroed before).
template <class T, class Q, int N, class Rows>
__global__ void __launch_bounds__(kThreads) tensor_absmax_kernel(QuantArgs<T, Q, Rows> a) {
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

// Per tensor: every row quantised with *scale, rows in x, each row's
// vectors over the blocks in y.
template <class T, class Q, int N, class Rows>
__global__ void __launch_bounds__(kThreads) tensor_quant_kernel(QuantArgs<T, Q, Rows> a) {
  start_after_previous_kernel();
  LazyReciprocal inv{a.scale};
  const int64_t first = int64_t{blockIdx.y} * blockDim.x + threadIdx.x;
  const int64_t step = int64_t{gridDim.y} * blockDim.x;
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    quantise_span<T, Q, N>(a.q + a.q_rows.offset(row), a.x + a.x_rows.offset(row), a.n, inv, first, step);
  }
}

// Per token, the row held in registers: one block a row, V vectors of N a
// thread (thread t holds vectors t, t + blockDim.x, ...).
template <class T, class Q, int N, int V, class Rows>
__global__ void __launch_bounds__(kMaxThreads) token_quant_regs_kernel(QuantArgs<T, Q, Rows> a) {
  start_after_previous_kernel();
  const int64_t row = block_row();
  if (row >= a.rows) return;
  const T* x = a.x + a.x_rows.offset(row);
  const int units = static_cast<int>(a.n / N);
  Vec<T, N> v[V];
  float m = 0.f;
#pragma unroll
  for (int k = 0; k < V; ++k) {
    const int i = static_cast<int>(threadIdx.x) + k * static_cast<int>(blockDim.x);
    if (i < units) v[k] = load_once<T, N>(x + int64_t{i} * N);
  }
#pragma unroll
  for (int k = 0; k < V; ++k) {
    const int i = static_cast<int>(threadIdx.x) + k * static_cast<int>(blockDim.x);
    if (i < units) m = vec_absmax(m, v[k]);
  }
  const float s = block_max(m) / fp8_max<Q>;
  if (threadIdx.x == 0) a.scale[row] = s;
  const float inv = reciprocal_of(s);
  Q* q = a.q + a.q_rows.offset(row);
#pragma unroll
  for (int k = 0; k < V; ++k) {
    const int i = static_cast<int>(threadIdx.x) + k * static_cast<int>(blockDim.x);
    if (i < units) quantise_vec<T, Q, N>(q + int64_t{i} * N, v[k], inv);
  }
}

// Per token, rows too long for the registers (or without 16-byte vectors):
// one block a row, its absmax reduced across the block, the row read a
// second time to quantise it.
template <class T, class Q, int N, class Rows>
__global__ void __launch_bounds__(kMaxThreads) token_quant_kernel(QuantArgs<T, Q, Rows> a) {
  start_after_previous_kernel();
  const int64_t row = block_row();
  if (row >= a.rows) return;
  const T* x = a.x + a.x_rows.offset(row);
  const float s = block_max(partial_absmax<T, N>(x, a.n, threadIdx.x, blockDim.x)) / fp8_max<Q>;
  if (threadIdx.x == 0) a.scale[row] = s;
  quantise_span<T, Q, N>(a.q + a.q_rows.offset(row), x, a.n, reciprocal_of(s), threadIdx.x, blockDim.x);
}

// Per group: a group to each `lanes` lanes (a power of two dividing the
// warp), over the flat (row, group) pairs of the grid. V > 0: lane l holds
// the group's vectors l, l + lanes, ... (at most V) in registers; V == 0:
// any number, read twice. Every lane of a warp runs the shuffles, those past
// the last group too.
template <class T, class Q, int N, int V, class Rows>
__global__ void __launch_bounds__(kThreads) group_quant_kernel(QuantArgs<T, Q, Rows> a, int lane_shift) {
  start_after_previous_kernel();
  const int lanes = 1 << lane_shift;
  const int64_t pair = (block_row() * blockDim.x + threadIdx.x) >> lane_shift;
  const int lane = static_cast<int>(threadIdx.x) & (lanes - 1);
  const int64_t pairs = a.rows * a.groups;
  const bool in = pair < pairs;
  // A 32-bit division where the pairs allow (a 64-bit one costs several
  // times the instructions).
  const int64_t row = !in                        ? 0
                      : pairs <= int64_t{UINT32_MAX} ? static_cast<int64_t>(static_cast<uint32_t>(pair) /
                                                                          static_cast<uint32_t>(a.groups))
                                                 : pair / a.groups;
  const int64_t g = in ? pair - row * a.groups : 0;
  const T* xg = a.x + a.x_rows.offset(row) + g * a.group_size;
  const int units = static_cast<int>(a.group_size / N);
  Vec<T, N> v[V > 0 ? V : 1];
  float m = 0.f;
  if constexpr (V > 0) {
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const int i = lane + k * lanes;
      if (in && i < units) v[k] = load_vec<T, N>(xg + int64_t{i} * N);
    }
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const int i = lane + k * lanes;
      if (in && i < units) m = vec_absmax(m, v[k]);
    }
  } else {
    if (in) m = partial_absmax<T, N>(xg, a.group_size, lane, lanes);
  }
  for (int d = lanes / 2; d > 0; d >>= 1) m = fmaxf(m, shfl_xor(m, d));
  if (!in) return;
  float s = fmaxf(m, a.min_absmax) / fp8_max<Q>;
  if (a.pow2 && s > 0.f && isfinite(s)) s = pow2_ceil(s);
  if (lane == 0) a.scale[a.s_rows.offset(row) + g * a.s_col] = s;
  const float inv = reciprocal_of(s);
  Q* qg = a.q + a.q_rows.offset(row) + g * a.group_size;
  if constexpr (V > 0) {
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const int i = lane + k * lanes;
      if (i < units) quantise_vec<T, Q, N>(qg + int64_t{i} * N, v[k], inv);
    }
  } else {
    quantise_span<T, Q, N>(qg, xg, a.group_size, inv, lane, lanes);
  }
}

enum class Kind { kTensor, kToken, kGroup };

// Threads a block for rows of `units` vectors: a whole number of warps, up
// to `most`.
int threads_for(int64_t units, int warp_size, int most = kThreads) {
  return static_cast<int>(std::min<int64_t>(most, std::max<int64_t>(warp_size, ceil_div(units, warp_size) * warp_size)));
}

template <class T, class Q, int N, class Rows>
void launch_tensor(const Launch& launch, bool is_static, const QuantArgs<T, Q, Rows>& a) {
  const int64_t total_units = a.rows * (a.n / N);
  if (!is_static && total_units <= int64_t{kMaxThreads} * kMaxVecPerThread) {
    const int threads = threads_for(total_units, launch.warp_size, kMaxThreads);
    with_vectors_per_thread<kMaxVecPerThread>(ceil_div(total_units, threads), [&](auto vpt) {
      launch_kernel(launch, tensor_small_kernel<T, Q, N, decltype(vpt)::value, Rows>, dim3(1), dim3(threads), a);
    });
    return;
  }
  if (!is_static) launch_kernel(launch, zero_scale_kernel, dim3(1), dim3(1), a.scale);
  if (a.rows == 0 || a.n == 0) return;
  // Rows in x; with fewer rows than fill the device, each row's vectors cut
  // into chunks in y, so that a few rows (a dense tensor is one) still do:
  // kAhead vectors a thread when there are many, else one, for more blocks.
  const int64_t units = std::max<int64_t>(1, a.n / N);
  const int64_t fill = int64_t{launch.sm_count} * 8;
  const bool few = a.rows < fill;
  const int threads = threads_for(units, launch.warp_size);
  const int per_thread = units * a.rows >= int64_t{threads} * kAhead * fill ? kAhead : 1;
  const auto chunks = few ? static_cast<unsigned>(std::min<int64_t>(ceil_div(units, int64_t{threads} * per_thread), 65535)) : 1u;
  if (!is_static) {
    const int64_t absmax_rows = std::min<int64_t>(a.rows, fill);
    const auto absmax_chunks = static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(chunks, fill / absmax_rows)));
    launch_kernel(launch, tensor_absmax_kernel<T, Q, N, Rows>, dim3(row_grid(absmax_rows), absmax_chunks), dim3(threads), a);
  }
  launch_kernel(launch, tensor_quant_kernel<T, Q, N, Rows>, dim3(row_grid(a.rows), chunks), dim3(threads), a);
}

template <class T, class Q, int N, class Rows>
void launch_token(const Launch& launch, const QuantArgs<T, Q, Rows>& a) {
  const int64_t units = a.n / N;
  // Many rows: two vectors a thread, as the norms' whole-row kernel; few:
  // one, up to kMaxThreads threads a row.
  const bool few = a.rows < int64_t{launch.sm_count} * 4;
  if constexpr (N > 1) {
    if (units <= int64_t{kMaxThreads} * kMaxVecPerThread) {
      const int threads = threads_for(few ? units : ceil_div(units, 2), launch.warp_size, kMaxThreads);
      with_vectors_per_thread<kMaxVecPerThread>(ceil_div(units, threads), [&](auto vpt) {
        launch_kernel(launch, token_quant_regs_kernel<T, Q, N, decltype(vpt)::value, Rows>, one_block_per_row(a.rows),
                      dim3(threads), a);
      });
      return;
    }
  }
  launch_kernel(launch, token_quant_kernel<T, Q, N, Rows>, one_block_per_row(a.rows),
                dim3(threads_for(units, launch.warp_size, few ? kMaxThreads : kThreads)), a);
}

template <class T, class Q, int N, class Rows>
void launch_group(const Launch& launch, const QuantArgs<T, Q, Rows>& a) {
  const int64_t units = a.group_size / N;
  // A lane a vector (four when the groups fill the device many times over):
  // the least power of two of lanes, up to the warp, that covers the group.
  const int per_lane = a.rows * a.groups * units >= int64_t{launch.sm_count} * kMaxThreads * 4 ? 4 : 1;
  int lanes = 1;
  int lane_shift = 0;
  while (lanes < launch.warp_size && lanes * per_lane < units) {
    lanes *= 2;
    ++lane_shift;
  }
  const int64_t threads_needed = a.rows * a.groups * lanes;
  // Blocks of kThreads, smaller (down to a warp) while they would not fill
  // the SMs.
  int threads = kThreads;
  while (threads > launch.warp_size && ceil_div(threads_needed, threads) < launch.sm_count) threads /= 2;
  const dim3 grid = one_block_per_row(ceil_div(threads_needed, threads));
  if constexpr (N > 1) {
    if (units <= int64_t{lanes} * kMaxVecPerThread) {
      with_vectors_per_thread<kMaxVecPerThread>(ceil_div(units, lanes), [&](auto vpl) {
        launch_kernel(launch, group_quant_kernel<T, Q, N, decltype(vpl)::value, Rows>, grid, dim3(threads), a,
                      lane_shift);
      });
      return;
    }
  }
  launch_kernel(launch, group_quant_kernel<T, Q, N, 0, Rows>, grid, dim3(threads), a, lane_shift);
}

template <class T, class Q, int N, class Rows>
void launch_quant(const Launch& launch, Kind kind, bool is_static, const QuantArgs<T, Q, Rows>& a) {
  switch (kind) {
    case Kind::kTensor: launch_tensor<T, Q, N, Rows>(launch, is_static, a); break;
    case Kind::kToken: launch_token<T, Q, N, Rows>(launch, a); break;
    case Kind::kGroup: launch_group<T, Q, N, Rows>(launch, a); break;
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
      if (kind == Kind::kTensor && rows > 0 && a.x_rows.dense(n) && a.q_rows.dense(n)) {
        a.rows = 1;  // a dense tensor is one row
        a.n = rows * n;
        a.x_rows = RowLayout{};
        a.q_rows = RowLayout{};
      }
      constexpr int kVec = 16 / sizeof(T);
      const int64_t span = kind == Kind::kGroup ? group_size : a.n;  // 0 takes the vector path: no loads
      const bool vec = span % kVec == 0 && rows_aligned(16, a.x, a.x_rows, sizeof(T)) &&
                       rows_aligned(kVec, a.q, a.q_rows, 1);
      const bool linear = a.x_rows.linear() && a.q_rows.linear() && (kind != Kind::kGroup || a.s_rows.linear());
      if (vec && linear) {
        const QuantArgs<T, Q, LinearRows> l{a.x, a.q, a.scale,
                                            kd_plugin::linear_rows(a.x_rows), kd_plugin::linear_rows(a.q_rows),
                                            kd_plugin::linear_rows(a.s_rows), a.rows, a.n, a.group_size, a.groups,
                                            a.s_col, a.min_absmax, a.pow2};
        launch_quant<T, Q, kVec, LinearRows>(launch, kind, is_static, l);
      } else {
        launch_quant<T, Q, 1, RowLayout>(launch, kind, is_static, a);
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
