// layernorm.rmsnorm, layernorm.gemma_rmsnorm, layernorm.fused_add_rmsnorm
// and layernorm.gemma_fused_add_rmsnorm, the last two also as _out, and
// layernorm.rmsnorm_quant_fp8 and layernorm.fused_add_rmsnorm_quant_fp8.
//
//   rmsnorm:            out = T(x * inv_rms(x) * (offset + weight))
//   fused_add_rmsnorm:  s = x + residual (float32); residual = T(s)
//                       x = T(s * inv_rms(s) * (offset + weight))
//   ..._out:            the same into residual_out and out, x and residual
//                       only read
//   ..._quant_fp8:      rmsnorm, or fused_add_rmsnorm with x only read and
//                       the result in out, multiplied by 1 / scale[0] (read
//                       on the device) and rounded once to out's fp8 type O,
//                       saturating, as vLLM and FlashInfer do
// with inv_rms(v) = rsqrt(mean(v^2) + eps), all arithmetic in float32, the
// fused op normalising the unrounded sum (as FlashInfer and SGLang do), and
// offset 1 for the Gemma variants, 0 otherwise (FlashInfer's weight_bias).
// The weight is float32 or T (template W). Rows are addressed through
// kd_plugin::RowLayout, so every leading dim may have any stride; the
// 16-byte paths need every row start and the weight 16-byte aligned. Rows
// one stride apart (contiguous, a column slice) go to the register-held
// kernels with their layouts as kd_plugin::LinearRows (a graph copies a
// kernel's arguments at each launch, so they are kept small); other views
// take the two-pass kernel.
//
// Both ops are memory bound, so the row is read from memory once. Many
// rows too long for a warp, of up to 2048 16-byte vectors and a multiple
// of two warps' worth, whose row starts are one stride apart, take
// torch.compile's layout: one block a row, exactly two vectors a thread
// (of x, and of the residual for the fused op), held in registers across
// the reduction (norm_whole_row). Of the other rows, those of 16-bit values,
// when many, take two passes in blocks of 256 threads: the first sums the
// squares and keeps the row (x and residual) in L1 and L2, the second reads
// it back from there, lets it go, and streams the output (and the residual);
// few registers, so many rows are in flight. float32 rows, and 16-bit rows
// when few (as in decode), are held in registers instead: each thread keeps
// its share of the row, as stored (16-byte vectors, up to 8 per thread),
// across the reduction. With many rows it reads the weight only after the
// reduction (fewer registers, more blocks per SM) and streams the row and
// the outputs (touched once); with few it reads the weight with the row (one
// wait on memory) and takes one vector a thread, up to 1024 threads, so
// that a row's wait is as short as it can be. Short rows (up to 4 vectors per lane) get one warp each,
// several rows per block and no barrier; longer ones one block each. The
// grid covers every row: more loads are in flight than when a resident grid
// loops over rows. With many rows a block takes its row and exits, its loads
// issued back to back; the few-rows kernel and the others loop over rows
// past 2^31-1 blocks, which suits decode sizes better. Rows longer than
// the registers hold, or whose length or row starts do not allow 16-byte
// accesses, take the two-pass kernel too.
#include "device_utils.cuh"
#include "launch_utils.hpp"
#include "ops.hpp"

namespace kd_gpu {
namespace {

using kd_plugin::LinearRows;
using kd_plugin::RowLayout;

constexpr int kThreads = 256;      // threads per block of the warp-per-row and two-pass kernels
constexpr int kMaxVecPerLane = 4;  // register budget of a warp-per-row lane

struct WarpSum {
  __device__ float operator()(float v) const { return warp_sum(v); }
};
struct BlockSum {
  __device__ float operator()(float v) const { return block_sum(v); }
};

// The arguments of one call, passed to every kernel by value. For
// fused_add_rmsnorm out is x and residual_out is residual (updated in
// place); for rmsnorm both residuals are null. Every element is read before
// the thread that read it writes the same position, so outputs may be
// their inputs. O is T, or the fp8 type of a _quant_fp8 op's out, whose
// scale is then a device pointer (else null). Rows: RowLayout, or
// LinearRows where every tensor's rows are one stride apart.
template <class T, class W, class O = T, class Rows = RowLayout>
struct NormArgs {
  O* out;
  T* residual_out;
  const T* x;
  const T* residual;
  const W* weight;
  Rows out_rows;
  Rows residual_out_rows;
  Rows x_rows;
  Rows residual_rows;
  int64_t rows;
  int hidden;
  float eps;
  float weight_offset;  // 1 for the Gemma variants, else 0
  const float* scale;
};

// What a normalised value is multiplied by before its rounding to O: 1 /
// scale[0] for an fp8 out, else nothing (1).
template <class T, class W, class O, class Rows>
__device__ __forceinline__ float out_multiplier(const NormArgs<T, W, O, Rows>& a) {
  if constexpr (std::is_same_v<T, O>) {
    return 1.f;
  } else {
    return 1.f / *a.scale;
  }
}

// The value normalised, element e of vectors x and r: x, or x + r for the
// fused op.
template <bool kFused, class T, int N>
__device__ __forceinline__ float normed_value(const Vec<T, N>& x, const Vec<T, N>& r, int e) {
  if constexpr (kFused) {
    return to_float(x.v[e]) + to_float(r.v[e]);
  } else {
    return to_float(x.v[e]);
  }
}

// One row held in registers: element vectors first, first + stride, ...
// kManyRows: the weight is read after the reduction (fewer registers, more
// blocks per SM) rather than with the row (one round trip to memory less,
// for few rows), and the row and outputs are streamed. The fused op keeps x
// and the residual as loaded and adds them again for the output, so the sum
// is normalised unrounded at no register cost.
template <class T, class W, class O, int N, int VPT, bool kFused, bool kManyRows, class Reduce>
__device__ __forceinline__ void norm_row_in_registers(const NormArgs<T, W, O, LinearRows>& a, int64_t row, int first,
                                                      int stride, Reduce reduce) {
  constexpr Access kRow = kManyRows ? Access::kStreaming : Access::kCached;
  const T* x = a.x + a.x_rows.offset(row);
  O* out = a.out + a.out_rows.offset(row);
  const T* residual = kFused ? a.residual + a.residual_rows.offset(row) : nullptr;
  T* residual_out = kFused ? a.residual_out + a.residual_out_rows.offset(row) : nullptr;
  const int nvec = a.hidden / N;
  Vec<T, N> xv[VPT];
  Vec<T, N> rv[kFused ? VPT : 1];
  Vec<W, N> wv[kManyRows ? 1 : VPT];
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int i = first + k * stride;
    if (i < nvec) {
      xv[k] = load_vec<T, N, true, kRow>(x + static_cast<size_t>(i) * N);
      if constexpr (kFused) rv[k] = load_vec<T, N, true, kRow>(residual + static_cast<size_t>(i) * N);
      if constexpr (!kManyRows) wv[k] = load_vec<W, N>(a.weight + static_cast<size_t>(i) * N);
    }
  }
  float sum_sq = 0.f;
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int i = first + k * stride;
    if (i < nvec) {
      [[maybe_unused]] Vec<T, N> stored;
#pragma unroll
      for (int e = 0; e < N; ++e) {
        const float v = normed_value<kFused>(xv[k], rv[kFused ? k : 0], e);
        if constexpr (kFused) stored.v[e] = from_float<T>(v);
        sum_sq += v * v;
      }
      if constexpr (kFused) store_vec<T, N, true, kRow>(residual_out + static_cast<size_t>(i) * N, stored);
    }
  }
  const float inv_rms = rsqrtf(reduce(sum_sq) / static_cast<float>(a.hidden) + a.eps);
  const float multiplier = out_multiplier(a);
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int i = first + k * stride;
    if (i < nvec) {
      Vec<W, N> w;
      if constexpr (kManyRows) {
        w = load_vec<W, N>(a.weight + static_cast<size_t>(i) * N);
      } else {
        w = wv[k];
      }
      Vec<O, N> o;
#pragma unroll
      for (int e = 0; e < N; ++e) {
        o.v[e] = from_float<O>(normed_value<kFused>(xv[k], rv[kFused ? k : 0], e) * inv_rms *
                               (a.weight_offset + to_float(w.v[e])) * multiplier);
      }
      store_vec<O, N, true, kRow>(out + static_cast<size_t>(i) * N, o);
    }
  }
}

template <class T, class W, class O, int N, int VPT, bool kFused>
__global__ void __launch_bounds__(kThreads) norm_warp_per_row(const NormArgs<T, W, O, LinearRows> a) {
  start_after_previous_kernel();
  const int warps = blockDim.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  for (int64_t row = int64_t{blockIdx.x} * warps + threadIdx.x / kWarpSize; row < a.rows;
       row += int64_t{gridDim.x} * warps) {
    norm_row_in_registers<T, W, O, N, VPT, kFused, false>(a, row, lane, kWarpSize, WarpSum{});
  }
}

template <class T, class W, class O, int N, int VPT, bool kFused, bool kManyRows>
__global__ void __launch_bounds__(kRowMaxThreads) norm_block_per_row(const NormArgs<T, W, O, LinearRows> a) {
  start_after_previous_kernel();
  const auto one_row = [&](int64_t row) {
    norm_row_in_registers<T, W, O, N, VPT, kFused, kManyRows>(a, row, static_cast<int>(threadIdx.x),
                                                           static_cast<int>(blockDim.x), BlockSum{});
  };
  if constexpr (kManyRows) {  // a one_block_per_row() grid
    const int64_t row = block_row();
    if (row < a.rows) one_row(row);
  } else {
    for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) one_row(row);
  }
}

// Many rows of exactly blockDim.x * VPT vectors, in the layout of
// torch.compile's kernel for them: each block takes its row and exits. The
// thread's vectors (x, and the residual for the fused op) are loaded at
// once and held across the reduction, then the weight is loaded and the
// outputs stored (the residual's after it was read, so that in place it is
// read before it is overwritten). Nothing is bounds checked; rmsnorm's
// blocks take 32 registers a thread (four blocks of 512 threads an SM), the
// fused op's up to 50.
template <class T, class W, class O, int N, int VPT, bool kFused>
__global__ void __launch_bounds__(kRowMaxThreads) norm_whole_row(const NormArgs<T, W, O, LinearRows> a) {
  start_after_previous_kernel();
  const RowPolicies policies = row_policies();
  using V = Vec<T, N>;
  using WV = Vec<W, N>;
  using OV = Vec<O, N>;
  const V* xr = reinterpret_cast<const V*>(a.x + a.x_rows.offset(blockIdx.x));
  const V* rr = kFused ? reinterpret_cast<const V*>(a.residual + a.residual_rows.offset(blockIdx.x)) : nullptr;
  const int first = static_cast<int>(threadIdx.x);
  const int stride = static_cast<int>(blockDim.x);
  V x[VPT];
  V r[kFused ? VPT : 1];
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    x[k] = load_row_vec<RowRead::kFirst, T, N>(xr[first + k * stride].v, policies);
    if constexpr (kFused) r[k] = load_row_vec<RowRead::kFirst, T, N>(rr[first + k * stride].v, policies);
  }
  float sum_sq = 0.f;
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
#pragma unroll
    for (int e = 0; e < N; ++e) {
      const float s = normed_value<kFused>(x[k], r[kFused ? k : 0], e);
      sum_sq += s * s;
    }
  }
  const float inv_rms = rsqrtf(block_sum(sum_sq) / static_cast<float>(a.hidden) + a.eps);
  // Addressed after the reduction: nothing more is live across it.
  const float multiplier = out_multiplier(a);
  const WV* wr = reinterpret_cast<const WV*>(a.weight);
  OV* outr = reinterpret_cast<OV*>(a.out + a.out_rows.offset(blockIdx.x));
  V* residual_out =
      kFused ? reinterpret_cast<V*>(a.residual_out + a.residual_out_rows.offset(blockIdx.x)) : nullptr;
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int i = first + k * stride;
    const WV w = load_row_vec<RowRead::kFirst, W, N>(wr[i].v, policies);
    [[maybe_unused]] V stored;
    OV o;
#pragma unroll
    for (int e = 0; e < N; ++e) {
      const float s = normed_value<kFused>(x[k], r[kFused ? k : 0], e);
      if constexpr (kFused) stored.v[e] = from_float<T>(s);
      o.v[e] = from_float<O>(s * inv_rms * (a.weight_offset + to_float(w.v[e])) * multiplier);
    }
    if constexpr (kFused) store_vec<T, N>(residual_out[i].v, stored);
    store_vec<O, N>(outr[i].v, o);
  }
}

// Any row length, blocks of kThreads: pass 1 sums the squares and keeps the
// row in L1 and L2, pass 2 reads it again from there (x and residual for
// the fused op, which adds them again, so that the unrounded sum is
// normalised), writes the residual and streams the output. Each thread
// reads back only what it wrote itself.
template <class T, class W, class O, int N, bool kFused>
__global__ void __launch_bounds__(kThreads, 1) norm_two_pass(const NormArgs<T, W, O> a) {
  start_after_previous_kernel();
  const RowPolicies policies = row_policies();
  const int nvec = a.hidden / N;
  const float multiplier = out_multiplier(a);
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const T* x = a.x + a.x_rows.offset(row);
    O* out = a.out + a.out_rows.offset(row);
    const T* residual = kFused ? a.residual + a.residual_rows.offset(row) : nullptr;
    T* residual_out = kFused ? a.residual_out + a.residual_out_rows.offset(row) : nullptr;
    Vec<T, N> r{};
    float sum_sq = 0.f;
    for (int i = threadIdx.x; i < nvec; i += kThreads) {
      const size_t at = static_cast<size_t>(i) * N;
      const Vec<T, N> v = load_row_vec<RowRead::kFirst, T, N, N != 1>(x + at, policies);
      if constexpr (kFused) r = load_row_vec<RowRead::kFirst, T, N, N != 1>(residual + at, policies);
#pragma unroll
      for (int e = 0; e < N; ++e) {
        const float s = normed_value<kFused>(v, r, e);
        sum_sq += s * s;
      }
    }
    const float inv_rms = rsqrtf(block_sum(sum_sq) / static_cast<float>(a.hidden) + a.eps);
    for (int i = threadIdx.x; i < nvec; i += kThreads) {
      const size_t at = static_cast<size_t>(i) * N;
      const Vec<T, N> v = load_row_vec<RowRead::kLast, T, N, N != 1>(x + at, policies);
      if constexpr (kFused) r = load_row_vec<RowRead::kLast, T, N, N != 1>(residual + at, policies);
      const Vec<W, N> w = load_vec<W, N, N != 1>(a.weight + at);
      [[maybe_unused]] Vec<T, N> stored;
      Vec<O, N> o;
#pragma unroll
      for (int e = 0; e < N; ++e) {
        const float s = normed_value<kFused>(v, r, e);
        if constexpr (kFused) stored.v[e] = from_float<T>(s);
        o.v[e] = from_float<O>(s * inv_rms * (a.weight_offset + to_float(w.v[e])) * multiplier);
      }
      if constexpr (kFused) store_vec<T, N, N != 1>(residual_out + at, stored);
      store_vec<O, N, N != 1, Access::kStreaming>(out + at, o);
    }
  }
}

template <class T, class W, class O, int N, bool kFused>
struct NormKernels {
  using Linear = NormArgs<T, W, O, LinearRows>;
  template <int VPT>
  static void block_per_row(const Launch& launch, bool few_rows, int threads, const Linear& a) {
    if constexpr (sizeof(T) == 4) {  // many 16-bit rows take the two-pass kernel
      if (!few_rows) {
        launch_kernel(launch, norm_block_per_row<T, W, O, N, VPT, kFused, true>, one_block_per_row(a.rows),
                      threads, a);
        return;
      }
    }
    launch_kernel(launch, norm_block_per_row<T, W, O, N, VPT, kFused, false>, row_grid(a.rows), threads, a);
  }
  template <int VPL>
  static void warp_per_row(const Launch& launch, const Linear& a) {
    const int64_t blocks = ceil_div(a.rows, kThreads / launch.warp_size);
    launch_kernel(launch, norm_warp_per_row<T, W, O, N, VPL, kFused>, row_grid(blocks), kThreads, a);
  }
};

// Launches a register-held kernel for rows of nvec 16-byte vectors one
// stride apart, or returns false when the rows are too long for registers.
template <class T, class W, class O, bool kFused>
bool launch_in_registers(const Launch& launch, const NormArgs<T, W, O, LinearRows>& a, int nvec) {
  constexpr int kVec = 16 / sizeof(T);
  using K = NormKernels<T, W, O, kVec, kFused>;
  const int64_t rows = a.rows;
  if (nvec <= launch.warp_size * kMaxVecPerLane) {
    with_vectors_per_thread<kMaxVecPerLane>(ceil_div(nvec, launch.warp_size), [&](auto vpl) {
      K::template warp_per_row<decltype(vpl)::value>(launch, a);
    });
    return true;
  }
  // Fewer rows than the SMs hold blocks: each block had better wait on
  // memory once, with one vector a thread where the block allows.
  const bool few_rows = rows < int64_t{launch.sm_count} * 4;
  constexpr int kWholeRowVecPerThread = 2;
  const int whole_row_threads = nvec / kWholeRowVecPerThread;
  if (!few_rows && rows <= INT32_MAX && whole_row_threads <= kRowMaxThreads &&
      nvec % (kWholeRowVecPerThread * launch.warp_size) == 0) {
    launch_kernel(launch, norm_whole_row<T, W, O, kVec, kWholeRowVecPerThread, kFused>,
                  static_cast<unsigned>(rows), whole_row_threads, a);
    return true;
  }
  if (nvec <= kRowMaxThreads * kRowMaxVecPerThread && (sizeof(T) == 4 || few_rows)) {
    const int threads = few_rows ? static_cast<int>(std::min<int64_t>(kRowMaxThreads,
                                                                      ceil_div(nvec, launch.warp_size) * launch.warp_size))
                                 : row_block_threads(nvec, launch.warp_size);
    with_vectors_per_thread<kRowMaxVecPerThread>(ceil_div(nvec, threads), [&](auto vpt) {
      K::template block_per_row<decltype(vpt)::value>(launch, few_rows, threads, a);
    });
    return true;
  }
  return false;
}

template <class T, class W, class O, bool kFused>
void launch_norm(const Launch& launch, const NormArgs<T, W, O>& a) {
  constexpr int kVec = 16 / sizeof(T);
  const int hidden = a.hidden;
  // An fp8 out moves kVec elements as a narrower vector.
  const bool vectorized = hidden % kVec == 0 && all_aligned(16, {a.weight}) &&
                          rows_aligned(kVec * sizeof(O), a.out, a.out_rows, sizeof(O)) &&
                          rows_aligned(16, a.x, a.x_rows, sizeof(T)) &&
                          (!kFused || (rows_aligned(16, a.residual, a.residual_rows, sizeof(T)) &&
                                       rows_aligned(16, a.residual_out, a.residual_out_rows, sizeof(T))));
  const bool linear = a.x_rows.linear() && a.out_rows.linear() &&
                      (!kFused || (a.residual_rows.linear() && a.residual_out_rows.linear()));
  if (vectorized && linear) {
    NormArgs<T, W, O, LinearRows> l{a.out,
                                    a.residual_out,
                                    a.x,
                                    a.residual,
                                    a.weight,
                                    kd_plugin::linear_rows(a.out_rows),
                                    kFused ? kd_plugin::linear_rows(a.residual_out_rows) : LinearRows{},
                                    kd_plugin::linear_rows(a.x_rows),
                                    kFused ? kd_plugin::linear_rows(a.residual_rows) : LinearRows{},
                                    a.rows,
                                    a.hidden,
                                    a.eps,
                                    a.weight_offset,
                                    a.scale};
    if (launch_in_registers<T, W, O, kFused>(launch, l, hidden / kVec)) return;
  }
  if (vectorized) {
    launch_kernel(launch, norm_two_pass<T, W, O, kVec, kFused>, row_grid(a.rows), kThreads, a);
  } else {
    launch_kernel(launch, norm_two_pass<T, W, O, 1, kFused>, row_grid(a.rows), kThreads, a);
  }
}

// The tensors of each form of the op.
enum class Form {
  kNorm,          // rmsnorm: (out, x, weight)
  kFusedInPlace,  // fused_add_rmsnorm: (x, residual, weight)
  kFusedOut,      // fused_add_rmsnorm_out: (out, residual_out, x, residual, weight)
  kNormQuant,     // rmsnorm_quant_fp8: (out, x, weight, scale), out in fp8
  kFusedQuant,    // fused_add_rmsnorm_quant_fp8: (out, x, residual, weight, scale), residual in place
};

// The weight is float32 or of x's dtype, the scale one float32 element.
template <Form kForm>
kd_status run_norm(const kd_call_args* args, const char* op, float weight_offset) {
  constexpr bool kQuant = kForm == Form::kNormQuant || kForm == Form::kFusedQuant;
  constexpr bool kFused = kForm != Form::kNorm && kForm != Form::kNormQuant;
  constexpr int kTensors = kForm == Form::kNorm || kForm == Form::kFusedInPlace ? 3
                           : kForm == Form::kNormQuant                          ? 4
                                                                                 : 5;
  constexpr int kWeightAt = kQuant ? kTensors - 2 : kTensors - 1;
  // The positions of out, residual_out, x and residual (-1: none).
  constexpr int kOutAt = 0;
  constexpr int kResidualOutAt = kForm == Form::kFusedQuant ? 2 : (kFused ? 1 : -1);
  constexpr int kXAt = kForm == Form::kFusedOut ? 2 : (kForm == Form::kFusedInPlace ? 0 : 1);
  constexpr int kResidualAt = kForm == Form::kFusedOut ? 3 : (kFused ? kResidualOutAt : -1);
  if (kd_status s = check_call(args, op, kTensors, 1); s != KD_STATUS_OK) return s;
  const DLTensor* t = args->tensors;
  const DLTensor& first = t[0];
  const DLTensor& x = t[kXAt];
  const DLTensor& weight = t[kWeightAt];
  if (first.ndim < 1 || weight.ndim != 1) return invalid_shapes(args, op);
  const int64_t hidden = dim(first, -1);
  const int64_t rows = leading_rows(first, 1);
  if (weight.shape[0] != hidden) return invalid_shapes(args, op);
  for (int i = 1; i < kWeightAt; ++i) {
    if (t[i].ndim != first.ndim || dim(t[i], -1) != hidden || leading_rows(t[i], 1) != rows) {
      return invalid_shapes(args, op);
    }
  }
  for (int i = 0; i < kWeightAt; ++i) {
    if (!(kQuant && i == kOutAt) && !same_dtype(t[i], x)) {
      return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT, "%s: tensors differ in dtype", op);
    }
  }
  const bool float_weight = is_dtype<float>(weight);
  if (!(same_dtype(x, weight) || float_weight)) {
    return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT, "%s: tensors differ in dtype", op);
  }
  const float* scale = nullptr;
  if constexpr (kQuant) {
    const DLTensor& s = t[kTensors - 1];
    if (!is_dtype<float>(s) || leading_rows(s, 0) != 1) {
      return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT, "%s: scale must be one float32 element", op);
    }
    scale = data_as<float>(s);
  }
  if (hidden > INT32_MAX) {
    return kd_plugin::fail(args, KD_STATUS_UNSUPPORTED, "%s: rows longer than 2^31-1", op);
  }
  float eps = 0.f;
  if (kd_status s = attr_float(args, op, 0, &eps); s != KD_STATUS_OK) return s;
  // out_tag.type: the type of out, for kQuant its fp8 type, else void (x's).
  const auto launch_all = [&](auto out_tag) -> kd_status {
    if (rows == 0 || hidden == 0) return KD_STATUS_OK;
    return launch_for_dtype(args, op, x, [&](auto tag, const Launch& launch) {
      using T = typename decltype(tag)::type;
      using O = std::conditional_t<kQuant, typename decltype(out_tag)::type, T>;
      const auto launch_with = [&](auto weight_tag) {
        using W = typename decltype(weight_tag)::type;
        NormArgs<T, W, O> call{};
        call.out = data_as<O>(t[kOutAt]);
        call.out_rows = kd_plugin::row_layout(t[kOutAt], 1);
        call.x = data_as<T>(x);
        call.x_rows = kd_plugin::row_layout(x, 1);
        if constexpr (kFused) {
          call.residual_out = data_as<T>(t[kResidualOutAt]);
          call.residual_out_rows = kd_plugin::row_layout(t[kResidualOutAt], 1);
          call.residual = data_as<T>(t[kResidualAt]);
          call.residual_rows = kd_plugin::row_layout(t[kResidualAt], 1);
        }
        call.weight = data_as<W>(weight);
        call.rows = rows;
        call.hidden = static_cast<int>(hidden);
        call.eps = eps;
        call.weight_offset = weight_offset;
        call.scale = scale;
        launch_norm<T, W, O, kFused>(launch, call);
      };
      if (float_weight) {
        launch_with(kd_plugin::TypeTag<float>{});
      } else {
        launch_with(kd_plugin::TypeTag<T>{});
      }
    });
  };
  if constexpr (kQuant) {
    return kd_plugin::dispatch_fp8_dtype<fp8_e4m3_t, fp8_e5m2_t>(args, op, first, launch_all);
  } else {
    return launch_all(kd_plugin::TypeTag<void>{});
  }
}

}  // namespace

// kd_cuda_rmsnorm, kd_hip_rmsnorm
kd_status rmsnorm(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(args, [&] { return run_norm<Form::kNorm>(args, "rmsnorm", 0.0f); });
}

// kd_cuda_gemma_rmsnorm, kd_hip_gemma_rmsnorm
kd_status gemma_rmsnorm(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(args, [&] { return run_norm<Form::kNorm>(args, "gemma_rmsnorm", 1.0f); });
}

// kd_cuda_fused_add_rmsnorm, kd_hip_fused_add_rmsnorm
kd_status fused_add_rmsnorm(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(args, [&] { return run_norm<Form::kFusedInPlace>(args, "fused_add_rmsnorm", 0.0f); });
}

// kd_cuda_gemma_fused_add_rmsnorm, kd_hip_gemma_fused_add_rmsnorm
kd_status gemma_fused_add_rmsnorm(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(args, [&] { return run_norm<Form::kFusedInPlace>(args, "gemma_fused_add_rmsnorm", 1.0f); });
}

// kd_cuda_fused_add_rmsnorm_out, kd_hip_fused_add_rmsnorm_out
kd_status fused_add_rmsnorm_out(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(args, [&] { return run_norm<Form::kFusedOut>(args, "fused_add_rmsnorm_out", 0.0f); });
}

// kd_cuda_gemma_fused_add_rmsnorm_out, kd_hip_gemma_fused_add_rmsnorm_out
kd_status gemma_fused_add_rmsnorm_out(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(args,
                            [&] { return run_norm<Form::kFusedOut>(args, "gemma_fused_add_rmsnorm_out", 1.0f); });
}

// kd_cuda_rmsnorm_quant_fp8, kd_hip_rmsnorm_quant_fp8
kd_status rmsnorm_quant_fp8(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(args, [&] { return run_norm<Form::kNormQuant>(args, "rmsnorm_quant_fp8", 0.0f); });
}

// kd_cuda_fused_add_rmsnorm_quant_fp8, kd_hip_fused_add_rmsnorm_quant_fp8
kd_status fused_add_rmsnorm_quant_fp8(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(
      args, [&] { return run_norm<Form::kFusedQuant>(args, "fused_add_rmsnorm_quant_fp8", 0.0f); });
}

}  // namespace kd_gpu
