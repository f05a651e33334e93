// layernorm.rmsnorm and layernorm.fused_add_rmsnorm.
//
//   rmsnorm:            out = T(x * inv_rms(x) * weight)
//   fused_add_rmsnorm:  residual = T(x + residual)
//                       x = T(residual * inv_rms(residual) * weight)
// with inv_rms(v) = rsqrt(mean(v^2) + eps), all arithmetic in float32, and
// inv_rms of the fused op taken from the residual as stored (rounded to T).
//
// Both ops are memory bound, so the row is read from memory once. Many
// rmsnorm rows too long for a warp, of up to 2048 16-byte vectors and a
// multiple of two warps' worth, take torch.compile's layout: one block a
// row, exactly two vectors a thread, which reads the row, keeps it in L1
// and L2 across the reduction and reads it again from there
// (norm_whole_row_two_pass). Of the other rows, those of 16-bit values,
// when many, take two passes in blocks of 256 threads: the first sums the
// squares (and writes the residual) and keeps the row in L1 and L2, the second
// reads it back from there, lets it go, and streams the output; few
// registers, so many rows are in flight. float32 rows, and 16-bit rows when
// few (as in decode), are held in registers instead: each thread keeps its
// share of the row, as stored (16-byte vectors, up to 8 per thread), across
// the reduction. With many rows it reads the weight only after the
// reduction (fewer registers, more blocks per SM) and streams the row and
// the outputs (touched once); with few it reads the weight with the row (one
// wait on memory). Short rows (up to 4 vectors per lane) get one warp each,
// several rows per block and no barrier; longer ones one block each. The
// grid covers every row: more loads are in flight than when a resident grid
// loops over rows. With many rows a block takes its row and exits, its loads
// issued back to back; the few-rows kernel and the others loop over rows
// past 2^31-1 blocks, which suits decode sizes better. Rows longer than
// the registers hold, or whose length or pointers do not allow 16-byte
// accesses, take the two-pass kernel too.
#include "device_utils.cuh"
#include "launch_utils.hpp"
#include "ops.hpp"

namespace kd_gpu {
namespace {

constexpr int kThreads = 256;      // threads per block of the warp-per-row and two-pass kernels
constexpr int kMaxVecPerLane = 4;  // register budget of a warp-per-row lane

struct WarpSum {
  __device__ float operator()(float v) const { return warp_sum(v); }
};
struct BlockSum {
  __device__ float operator()(float v) const { return block_sum(v); }
};

// One row held in registers: element vectors first, first + stride, ...
// `residual` is null for rmsnorm. `out` may alias `x`. kManyRows: the
// weight is read after the reduction (fewer registers, more blocks per SM)
// rather than with the row (one round trip to memory less, for few rows),
// and the row and outputs are streamed.
template <class T, int N, int VPT, bool kFused, bool kManyRows, class Reduce>
__device__ __forceinline__ void norm_row_in_registers(T* out, T* residual, const T* x,
                                                      const T* weight, int hidden, float eps,
                                                      int first, int stride, Reduce reduce) {
  constexpr Access kRow = kManyRows ? Access::kStreaming : Access::kCached;
  const int nvec = hidden / N;
  Vec<T, N> xv[VPT];
  Vec<T, N> rv[kFused ? VPT : 1];
  Vec<T, N> wv[kManyRows ? 1 : VPT];
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int i = first + k * stride;
    if (i < nvec) {
      xv[k] = load_vec<T, N, true, kRow>(x + static_cast<size_t>(i) * N);
      if constexpr (kFused) rv[k] = load_vec<T, N, true, kRow>(residual + static_cast<size_t>(i) * N);
      if constexpr (!kManyRows) wv[k] = load_vec<T, N>(weight + static_cast<size_t>(i) * N);
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
      if constexpr (kFused) store_vec<T, N, true, kRow>(residual + static_cast<size_t>(i) * N, xv[k]);
    }
  }
  const float inv_rms = rsqrtf(reduce(sum_sq) / static_cast<float>(hidden) + eps);
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int i = first + k * stride;
    if (i < nvec) {
      Vec<T, N> w;
      if constexpr (kManyRows) {
        w = load_vec<T, N>(weight + static_cast<size_t>(i) * N);
      } else {
        w = wv[k];
      }
      Vec<T, N> o;
#pragma unroll
      for (int e = 0; e < N; ++e) {
        o.v[e] = from_float<T>(to_float(xv[k].v[e]) * inv_rms * to_float(w.v[e]));
      }
      store_vec<T, N, true, kRow>(out + static_cast<size_t>(i) * N, o);
    }
  }
}

template <class T, int N, int VPT, bool kFused>
__global__ void __launch_bounds__(kThreads)
    norm_warp_per_row(T* out, T* residual, const T* x, const T* weight, int64_t rows,
                      int hidden, float eps) {
  start_after_previous_kernel();
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

template <class T, int N, int VPT, bool kFused, bool kManyRows>
__global__ void __launch_bounds__(kRowMaxThreads)
    norm_block_per_row(T* out, T* residual, const T* x, const T* weight, int64_t rows,
                       int hidden, float eps) {
  start_after_previous_kernel();
  const auto one_row = [&](int64_t row) {
    const int64_t offset = row * hidden;
    norm_row_in_registers<T, N, VPT, kFused, kManyRows>(
        out + offset, kFused ? residual + offset : nullptr, x + offset, weight, hidden, eps,
        static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x), BlockSum{});
  };
  if constexpr (kManyRows) {  // a one_block_per_row() grid
    const int64_t row = block_row();
    if (row < rows) one_row(row);
  } else {
    for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) one_row(row);
  }
}

// rmsnorm over many rows of exactly blockDim.x * VPT vectors, in the layout
// of torch.compile's kernel for them: each block takes its row and exits;
// pass 1 loads the thread's vectors, asking L1 and L2 to keep them, pass 2
// reloads them from there (letting them go) with the weight and stores the
// output. Nothing of the row is held across the reduction and nothing is
// bounds checked, so the blocks have few registers and fill the SMs with
// loads.
template <class T, int N, int VPT>
__global__ void __launch_bounds__(kRowMaxThreads)
    norm_whole_row_two_pass(T* out, const T* x, const T* weight, int hidden, float eps) {
  start_after_previous_kernel();
  const RowPolicies policies = row_policies();
  using V = Vec<T, N>;
  const size_t offset = size_t{blockIdx.x} * static_cast<unsigned>(hidden);
  const V* xr = reinterpret_cast<const V*>(x + offset);
  const V* wr = reinterpret_cast<const V*>(weight);
  V* outr = reinterpret_cast<V*>(out + offset);
  const int first = static_cast<int>(threadIdx.x);
  const int stride = static_cast<int>(blockDim.x);
  V v[VPT];
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    v[k] = load_row_vec<RowRead::kFirst, T, N>(xr[first + k * stride].v, policies);
  }
  float sum_sq = 0.f;
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
#pragma unroll
    for (int e = 0; e < N; ++e) sum_sq += to_float(v[k].v[e]) * to_float(v[k].v[e]);
  }
  const float inv_rms = rsqrtf(block_sum(sum_sq) / static_cast<float>(hidden) + eps);
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int i = first + k * stride;
    const V xv = load_row_vec<RowRead::kLast, T, N>(xr[i].v, policies);
    const V w = load_row_vec<RowRead::kFirst, T, N>(wr[i].v, policies);
    V o;
#pragma unroll
    for (int e = 0; e < N; ++e) o.v[e] = from_float<T>(to_float(xv.v[e]) * inv_rms * to_float(w.v[e]));
    store_vec<T, N>(outr[i].v, o);
  }
}

// Any row length, blocks of kThreads: pass 1 sums the squares (and writes
// the residual) and keeps the row in L1 and L2, pass 2 reads it again from there
// and streams the output.
// Each thread reads back only what it wrote itself.
template <class T, int N, bool kFused>
__global__ void __launch_bounds__(kThreads, 1)
    norm_two_pass(T* out, T* residual, const T* x, const T* weight, int64_t rows, int hidden,
                  float eps) {
  start_after_previous_kernel();
  const RowPolicies policies = row_policies();
  const int nvec = hidden / N;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t offset = row * hidden;
    float sum_sq = 0.f;
    for (int i = threadIdx.x; i < nvec; i += kThreads) {
      const size_t at = offset + static_cast<size_t>(i) * N;
      Vec<T, N> v = load_row_vec<RowRead::kFirst, T, N, N != 1>(x + at, policies);
      if constexpr (kFused) {
        const Vec<T, N> r = load_row_vec<RowRead::kFirst, T, N, N != 1>(residual + at, policies);
#pragma unroll
        for (int e = 0; e < N; ++e) v.v[e] = from_float<T>(to_float(v.v[e]) + to_float(r.v[e]));
        store_vec<T, N>(residual + at, v);
      }
#pragma unroll
      for (int e = 0; e < N; ++e) sum_sq += to_float(v.v[e]) * to_float(v.v[e]);
    }
    const float inv_rms = rsqrtf(block_sum(sum_sq) / static_cast<float>(hidden) + eps);
    const T* normed = kFused ? residual : x;
    for (int i = threadIdx.x; i < nvec; i += kThreads) {
      const size_t at = offset + static_cast<size_t>(i) * N;
      const Vec<T, N> v = load_row_vec<RowRead::kLast, T, N, N != 1>(normed + at, policies);
      const Vec<T, N> w = load_vec<T, N>(weight + static_cast<size_t>(i) * N);
      Vec<T, N> o;
#pragma unroll
      for (int e = 0; e < N; ++e) {
        o.v[e] = from_float<T>(to_float(v.v[e]) * inv_rms * to_float(w.v[e]));
      }
      store_vec<T, N, true, Access::kStreaming>(out + at, o);
    }
  }
}

template <class T, int N, bool kFused>
struct NormKernels {
  template <int VPT>
  static void block_per_row(const Launch& launch, bool few_rows, int threads, T* out,
                            T* residual, const T* x, const T* weight, int64_t rows, int hidden,
                            float eps) {
    if constexpr (sizeof(T) == 4) {  // many 16-bit rows take the two-pass kernel
      if (!few_rows) {
        launch_kernel(launch, norm_block_per_row<T, N, VPT, kFused, true>, one_block_per_row(rows), threads,
                      out, residual, x, weight, rows, hidden, eps);
        return;
      }
    }
    launch_kernel(launch, norm_block_per_row<T, N, VPT, kFused, false>, row_grid(rows), threads, out,
                  residual, x, weight, rows, hidden, eps);
  }
  template <int VPL>
  static void warp_per_row(const Launch& launch, T* out, T* residual, const T* x, const T* weight,
                           int64_t rows, int hidden, float eps) {
    const int64_t blocks = ceil_div(rows, kThreads / launch.warp_size);
    launch_kernel(launch, norm_warp_per_row<T, N, VPL, kFused>, row_grid(blocks), kThreads, out,
                  residual, x, weight, rows, hidden, eps);
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
    with_vectors_per_thread<kMaxVecPerLane>(ceil_div(nvec, launch.warp_size), [&](auto vpl) {
      K::template warp_per_row<decltype(vpl)::value>(launch, out, residual, x, weight, rows, hidden, eps);
    });
    return;
  }
  // Fewer rows than the SMs hold blocks: each block had better wait on
  // memory once.
  const bool few_rows = rows < int64_t{launch.sm_count} * 4;
  if constexpr (!kFused) {
    constexpr int kWholeRowVecPerThread = 2;
    const int whole_row_threads = nvec / kWholeRowVecPerThread;
    if (vectorized && !few_rows && rows <= INT32_MAX && whole_row_threads <= kRowMaxThreads &&
        nvec % (kWholeRowVecPerThread * launch.warp_size) == 0) {
      launch_kernel(launch, norm_whole_row_two_pass<T, kVec, kWholeRowVecPerThread>,
                    static_cast<unsigned>(rows), whole_row_threads, out, x, weight, hidden, eps);
      return;
    }
  }
  if (vectorized && nvec <= kRowMaxThreads * kRowMaxVecPerThread && (sizeof(T) == 4 || few_rows)) {
    const int threads = row_block_threads(nvec, launch.warp_size);
    with_vectors_per_thread<kRowMaxVecPerThread>(ceil_div(nvec, threads), [&](auto vpt) {
      K::template block_per_row<decltype(vpt)::value>(launch, few_rows, threads, out, residual, x, weight, rows,
                                                      hidden, eps);
    });
    return;
  }
  if (vectorized) {
    launch_kernel(launch, norm_two_pass<T, kVec, kFused>, row_grid(rows), kThreads, out, residual, x,
                  weight, rows, hidden, eps);
  } else {
    launch_kernel(launch, norm_two_pass<T, 1, kFused>, row_grid(rows), kThreads, out, residual, x,
                  weight, rows, hidden, eps);
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

// kd_cuda_rmsnorm, kd_hip_rmsnorm
kd_status rmsnorm(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(args, [&] { return run_norm<false>(args, "rmsnorm"); });
}

// kd_cuda_fused_add_rmsnorm, kd_hip_fused_add_rmsnorm
kd_status fused_add_rmsnorm(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(args, [&] { return run_norm<true>(args, "fused_add_rmsnorm"); });
}

}  // namespace kd_gpu
