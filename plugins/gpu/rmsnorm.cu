// layernorm.rmsnorm and layernorm.fused_add_rmsnorm.
//
//   rmsnorm:            out = T(x * inv_rms(x) * weight)
//   fused_add_rmsnorm:  residual = T(x + residual)
//                       x = T(residual * inv_rms(residual) * weight)
// with inv_rms(v) = rsqrt(mean(v^2) + eps), all arithmetic in float32, and
// inv_rms of the fused op taken from the residual as stored (rounded to T).
//
// Both ops are memory bound, so a row is read once: each thread keeps its
// share of the row in registers across the reduction, as stored (16-byte
// vectors, up to 8 per thread), and reads the weight only after it, which
// keeps registers few and blocks per SM many (few rows, as in decode, read
// it with the row instead: one wait on memory). Short rows (up to 4 vectors
// per lane) get one warp each, several rows per block and no barrier;
// longer ones one block each. The grid covers every row (blocks loop only
// past 2^31-1 of them): more loads are in flight than when a resident grid
// loops over rows. Rows that are longer still, or whose length or pointers
// do not allow 16-byte accesses, take a two-pass kernel that reads the row
// again (mostly from L2).
#include "device_utils.cuh"
#include "launch_utils.hpp"
#include "ops.hpp"

namespace kd_gpu {
namespace {

constexpr int kThreads = 256;        // threads per block of the warp-per-row kernel, and of
                                     // the block-per-row ones when rows are many
constexpr int kMaxThreads = 1024;    // threads per block of a block-per-row kernel
constexpr int kMaxVecPerThread = 8;  // register budget of a block-per-row thread
constexpr int kManyRowsVecPerThread = 4;  // the usual share, so that blocks share an SM
constexpr int kMaxVecPerLane = 4;    // register budget of a warp-per-row lane

struct WarpSum {
  __device__ float operator()(float v) const { return warp_sum(v); }
};
struct BlockSum {
  __device__ float operator()(float v) const { return block_sum(v); }
};

// One row held in registers: element vectors first, first + stride, ...
// `residual` is null for rmsnorm. `out` may alias `x`. kLateWeight: the
// weight is read after the reduction (fewer registers, more blocks per SM)
// rather than with the row (one round trip to memory less, for few rows).
template <class T, int N, int VPT, bool kFused, bool kLateWeight, class Reduce>
__device__ __forceinline__ void norm_row_in_registers(T* out, T* residual, const T* x,
                                                      const T* weight, int hidden, float eps,
                                                      int first, int stride, Reduce reduce) {
  const int nvec = hidden / N;
  Vec<T, N> xv[VPT];
  Vec<T, N> rv[kFused ? VPT : 1];
  Vec<T, N> wv[kLateWeight ? 1 : VPT];
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int i = first + k * stride;
    if (i < nvec) {
      xv[k] = load_vec<T, N>(x + static_cast<size_t>(i) * N);
      if constexpr (kFused) rv[k] = load_vec<T, N>(residual + static_cast<size_t>(i) * N);
      if constexpr (!kLateWeight) wv[k] = load_vec<T, N>(weight + static_cast<size_t>(i) * N);
    }
  }
  float sum_sq = 0.f;
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int i = first + k * stride;
    if (i < nvec) {
#pragma unroll
      for (int e = 0; e < N; ++e) {
        float v = to_float(xv[k].v[e]);
        if constexpr (kFused) {
          xv[k].v[e] = from_float<T>(v + to_float(rv[k].v[e]));
          v = to_float(xv[k].v[e]);
        }
        sum_sq += v * v;
      }
      if constexpr (kFused) store_vec<T, N>(residual + static_cast<size_t>(i) * N, xv[k]);
    }
  }
  const float inv_rms = rsqrtf(reduce(sum_sq) / static_cast<float>(hidden) + eps);
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int i = first + k * stride;
    if (i < nvec) {
      Vec<T, N> w;
      if constexpr (kLateWeight) {
        w = load_vec<T, N>(weight + static_cast<size_t>(i) * N);
      } else {
        w = wv[k];
      }
      Vec<T, N> o;
#pragma unroll
      for (int e = 0; e < N; ++e) {
        o.v[e] = from_float<T>(to_float(xv[k].v[e]) * inv_rms * to_float(w.v[e]));
      }
      store_vec<T, N>(out + static_cast<size_t>(i) * N, o);
    }
  }
}

template <class T, int N, int VPT, bool kFused>
__global__ void __launch_bounds__(kThreads)
    norm_warp_per_row(T* out, T* residual, const T* x, const T* weight, int64_t rows,
                      int hidden, float eps) {
  const int warps = blockDim.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  for (int64_t row = int64_t{blockIdx.x} * warps + threadIdx.x / kWarpSize; row < rows;
       row += int64_t{gridDim.x} * warps) {
    const int64_t offset = row * hidden;
    norm_row_in_registers<T, N, VPT, kFused, false>(
        out + offset, kFused ? residual + offset : nullptr, x + offset, weight, hidden, eps, lane,
        kWarpSize, WarpSum{});
  }
}

template <class T, int N, int VPT, bool kFused, bool kLateWeight>
__global__ void __launch_bounds__(kMaxThreads)
    norm_block_per_row(T* out, T* residual, const T* x, const T* weight, int64_t rows,
                       int hidden, float eps) {
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t offset = row * hidden;
    norm_row_in_registers<T, N, VPT, kFused, kLateWeight>(
        out + offset, kFused ? residual + offset : nullptr, x + offset, weight, hidden, eps,
        static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x), BlockSum{});
  }
}

// Any row length: pass 1 sums the squares (and writes the residual), pass 2
// reads the row again. Each thread reads back only what it wrote itself.
template <class T, int N, bool kFused>
__global__ void __launch_bounds__(kMaxThreads)
    norm_two_pass(T* out, T* residual, const T* x, const T* weight, int64_t rows, int hidden,
                  float eps) {
  const int nvec = hidden / N;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t offset = row * hidden;
    float sum_sq = 0.f;
    for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
      const size_t at = offset + static_cast<size_t>(i) * N;
      Vec<T, N> v = load_vec<T, N>(x + at);
      if constexpr (kFused) {
        const Vec<T, N> r = load_vec<T, N>(residual + at);
#pragma unroll
        for (int e = 0; e < N; ++e) v.v[e] = from_float<T>(to_float(v.v[e]) + to_float(r.v[e]));
        store_vec<T, N>(residual + at, v);
      }
#pragma unroll
      for (int e = 0; e < N; ++e) sum_sq += to_float(v.v[e]) * to_float(v.v[e]);
    }
    const float inv_rms = rsqrtf(block_sum(sum_sq) / static_cast<float>(hidden) + eps);
    const T* normed = kFused ? residual : x;
    for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
      const size_t at = offset + static_cast<size_t>(i) * N;
      const Vec<T, N> v = load_vec<T, N>(normed + at);
      const Vec<T, N> w = load_vec<T, N>(weight + static_cast<size_t>(i) * N);
      Vec<T, N> o;
#pragma unroll
      for (int e = 0; e < N; ++e) {
        o.v[e] = from_float<T>(to_float(v.v[e]) * inv_rms * to_float(w.v[e]));
      }
      store_vec<T, N>(out + at, o);
    }
  }
}

template <class T, int N, bool kFused>
struct NormKernels {
  template <int VPT>
  static void block_per_row(const Launch& launch, bool few_rows, int threads, T* out,
                            T* residual, const T* x, const T* weight, int64_t rows, int hidden,
                            float eps) {
    if (few_rows) {
      norm_block_per_row<T, N, VPT, kFused, false><<<row_grid(rows), threads, 0, launch.stream>>>(
          out, residual, x, weight, rows, hidden, eps);
    } else {
      norm_block_per_row<T, N, VPT, kFused, true><<<row_grid(rows), threads, 0, launch.stream>>>(
          out, residual, x, weight, rows, hidden, eps);
    }
  }
  template <int VPL>
  static void warp_per_row(const Launch& launch, T* out, T* residual, const T* x, const T* weight,
                           int64_t rows, int hidden, float eps) {
    const int64_t blocks = ceil_div(rows, kThreads / launch.warp_size);
    norm_warp_per_row<T, N, VPL, kFused><<<row_grid(blocks), kThreads, 0, launch.stream>>>(
        out, residual, x, weight, rows, hidden, eps);
  }
};

template <class T, bool kFused>
void launch_norm(const Launch& launch, T* out, T* residual, const T* x, const T* weight,
                 int64_t rows, int hidden, float eps) {
  constexpr int kVec = 16 / sizeof(T);
  using K = NormKernels<T, kVec, kFused>;
  const bool vectorized = hidden % kVec == 0 && all_aligned(16, {out, residual, x, weight});
  const int nvec = vectorized ? hidden / kVec : hidden;
  if (vectorized && nvec <= launch.warp_size * kMaxVecPerLane) {
    const int64_t vpl = ceil_div(nvec, launch.warp_size);
    if (vpl <= 1) {
      K::template warp_per_row<1>(launch, out, residual, x, weight, rows, hidden, eps);
    } else if (vpl <= 2) {
      K::template warp_per_row<2>(launch, out, residual, x, weight, rows, hidden, eps);
    } else {
      K::template warp_per_row<kMaxVecPerLane>(launch, out, residual, x, weight, rows, hidden,
                                               eps);
    }
    return;
  }
  if (vectorized && nvec <= kMaxThreads * kMaxVecPerThread) {
    // Blocks of kThreads (more when a row needs them), up to
    // kManyRowsVecPerThread vectors each, several blocks per SM. The weight
    // is read after the reduction when rows are many (fewer registers, more
    // blocks per SM), with the row when fewer rows than the SMs hold blocks
    // (each block then waits on memory once).
    const bool few_rows = rows < int64_t{launch.sm_count} * 4;
    const int threads = std::min(
        kMaxThreads,
        std::max(kThreads, round_up(static_cast<int>(ceil_div(nvec, kManyRowsVecPerThread)),
                                    launch.warp_size)));
    const int64_t vpt = ceil_div(nvec, threads);
    if (vpt <= 1) {
      K::template block_per_row<1>(launch, few_rows, threads, out, residual, x, weight, rows,
                                   hidden, eps);
    } else if (vpt <= 2) {
      K::template block_per_row<2>(launch, few_rows, threads, out, residual, x, weight, rows,
                                   hidden, eps);
    } else if (vpt <= 4) {
      K::template block_per_row<4>(launch, few_rows, threads, out, residual, x, weight, rows,
                                   hidden, eps);
    } else {
      K::template block_per_row<kMaxVecPerThread>(launch, few_rows, threads, out, residual, x,
                                                  weight, rows, hidden, eps);
    }
    return;
  }
  if (vectorized) {
    norm_two_pass<T, kVec, kFused><<<row_grid(rows), kMaxThreads / 2, 0, launch.stream>>>(
        out, residual, x, weight, rows, hidden, eps);
  } else {
    norm_two_pass<T, 1, kFused><<<row_grid(rows), kMaxThreads / 2, 0, launch.stream>>>(
        out, residual, x, weight, rows, hidden, eps);
  }
}

// Tensors: rmsnorm (out, x, weight); fused_add_rmsnorm (x, residual, weight).
template <bool kFused>
kd_status run_norm(const kd_call_args* args, const char* op) {
  if (kd_status s = check_call(args, op, 3, 1); s != KD_STATUS_OK) return s;
  const DLTensor& a = args->tensors[0];  // out | x
  const DLTensor& b = args->tensors[1];  // x | residual
  const DLTensor& weight = args->tensors[2];
  if (a.ndim < 1 || b.ndim != a.ndim || weight.ndim != 1) return invalid_shapes(args, op);
  const int64_t hidden = dim(a, -1);
  const int64_t rows = leading_rows(a, 1);
  if (dim(b, -1) != hidden || weight.shape[0] != hidden || leading_rows(b, 1) != rows) {
    return invalid_shapes(args, op);
  }
  if (!same_dtype(a, b) || !same_dtype(a, weight)) {
    return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT, "%s: tensors differ in dtype", op);
  }
  if (hidden > INT32_MAX) {
    return kd_plugin::fail(args, KD_STATUS_UNSUPPORTED, "%s: rows longer than 2^31-1", op);
  }
  float eps = 0.f;
  if (kd_status s = attr_float(args, op, 0, &eps); s != KD_STATUS_OK) return s;
  if (rows == 0 || hidden == 0) return KD_STATUS_OK;
  return launch_for_dtype(args, op, a, [&](auto tag, const Launch& launch) {
    using T = typename decltype(tag)::type;
    if constexpr (kFused) {
      T* x = data_as<T>(a);
      launch_norm<T, true>(launch, x, data_as<T>(b), x, data_as<T>(weight), rows,
                           static_cast<int>(hidden), eps);
    } else {
      launch_norm<T, false>(launch, data_as<T>(a), nullptr, data_as<T>(b), data_as<T>(weight),
                            rows, static_cast<int>(hidden), eps);
    }
  });
}

}  // namespace

kd_status rmsnorm(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(args, [&] { return run_norm<false>(args, "rmsnorm"); });
}

kd_status fused_add_rmsnorm(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(args, [&] { return run_norm<true>(args, "fused_add_rmsnorm"); });
}

}  // namespace kd_gpu
