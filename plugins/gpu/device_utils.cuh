// Device-side building blocks of the kernels: vectors of N elements moved by
// one load or store, and warp and block reductions.
#pragma once

#include <climits>
#include <cmath>
#include <cstring>

#include "gpu_compat.hpp"

namespace kd_gpu {

// N elements that one memory instruction moves when aligned (16 bytes is the
// widest load of both vendors).
template <class T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <int Bytes>
struct RawBits;
template <>
struct RawBits<16> {
  using type = uint4;
};
template <>
struct RawBits<8> {
  using type = uint2;
};
template <>
struct RawBits<4> {
  using type = uint32_t;
};
template <>
struct RawBits<2> {
  using type = uint16_t;
};

// How a vector access uses the caches: kCached for data that is read again
// (a weight), kStreaming for data touched once (load_streaming).
enum class Access { kCached, kStreaming };

// Loads N elements at p: one instruction when kAligned (p aligned to the
// vector size), else element by element.
// Vectors wider than 16 bytes (N float32 weights beside N 16-bit
// activations) take one load per 16 bytes.
template <class T, int N, bool kAligned = true, Access kAccess = Access::kCached>
__device__ __forceinline__ Vec<T, N> load_vec(const T* p) {
  Vec<T, N> out;
  if constexpr (kAligned && sizeof(T) * N > 16) {
    constexpr int kChunk = 16 / sizeof(T);
#pragma unroll
    for (int c = 0; c < N; c += kChunk) {
      const Vec<T, kChunk> part = load_vec<T, kChunk, true, kAccess>(p + c);
#pragma unroll
      for (int e = 0; e < kChunk; ++e) out.v[c + e] = part.v[e];
    }
  } else if constexpr (kAligned) {
    using Raw = typename RawBits<sizeof(T) * N>::type;
    const Raw* at = reinterpret_cast<const Raw*>(p);
    Raw raw;
    if constexpr (kAccess == Access::kStreaming) {
      raw = load_streaming(at);
    } else {
      raw = *at;
    }
    static_assert(sizeof(raw) == sizeof(out));
    memcpy(&out, &raw, sizeof(out));
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) out.v[i] = p[i];
  }
  return out;
}

template <class T, int N, bool kAligned = true, Access kAccess = Access::kCached>
__device__ __forceinline__ void store_vec(T* p, const Vec<T, N>& in) {
  if constexpr (kAligned) {
    using Raw = typename RawBits<sizeof(T) * N>::type;
    Raw raw;
    static_assert(sizeof(raw) == sizeof(in));
    memcpy(&raw, &in, sizeof(raw));
    Raw* at = reinterpret_cast<Raw*>(p);
    if constexpr (kAccess == Access::kStreaming) {
      store_streaming(at, raw);
    } else {
      *at = raw;
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) p[i] = in.v[i];
  }
}

// Loads of a row that a kernel reads twice, with the priorities of
// `policies` (row_policies()): RowRead::kFirst for the first read (and for
// a weight that every block reads), RowRead::kLast for the second. 16-byte
// vectors (wider ones in 16-byte parts); narrower ones load as
// Access::kCached.
enum class RowRead { kFirst, kLast };

template <RowRead kRead, class T, int N, bool kAligned = true>
__device__ __forceinline__ Vec<T, N> load_row_vec(const T* p, const RowPolicies& policies) {
  if constexpr (kAligned && sizeof(T) * N > 16) {
    constexpr int kChunk = 16 / sizeof(T);
    Vec<T, N> out;
#pragma unroll
    for (int c = 0; c < N; c += kChunk) {
      const Vec<T, kChunk> part = load_row_vec<kRead, T, kChunk>(p + c, policies);
#pragma unroll
      for (int e = 0; e < kChunk; ++e) out.v[c + e] = part.v[e];
    }
    return out;
  } else if constexpr (kAligned && sizeof(T) * N == 16) {
    const uint4* at = reinterpret_cast<const uint4*>(p);
    const uint4 raw = kRead == RowRead::kFirst ? load_keep(at, policies) : load_last_read(at, policies);
    Vec<T, N> out;
    memcpy(&out, &raw, sizeof(out));
    return out;
  } else {
    return load_vec<T, N, kAligned>(p);
  }
}

// The same for data touched once.
template <class T, int N>
__device__ __forceinline__ Vec<T, N> load_once(const T* p) {
  return load_vec<T, N, true, Access::kStreaming>(p);
}

template <class T, int N>
__device__ __forceinline__ void store_once(T* p, const Vec<T, N>& in) {
  store_vec<T, N, true, Access::kStreaming>(p, in);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int m = kWarpSize / 2; m > 0; m >>= 1) v += shfl_xor(v, m);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int m = kWarpSize / 2; m > 0; m >>= 1) v = fmaxf(v, shfl_xor(v, m));
  return v;
}

// Order of (value, index) pairs for top-k: larger value first, then lower
// index. A strict total order on pairs with distinct indices, so a butterfly
// reduction leaves every lane with the same winner.
__device__ __forceinline__ bool ranks_before(float av, int ai, float bv, int bi) {
  return av > bv || (av == bv && ai < bi);
}

__device__ __forceinline__ void warp_argmax(float& v, int& i) {
#pragma unroll
  for (int m = kWarpSize / 2; m > 0; m >>= 1) {
    const float ov = shfl_xor(v, m);
    const int oi = shfl_xor(i, m);
    if (ranks_before(ov, oi, v, i)) {
      v = ov;
      i = oi;
    }
  }
}

// Block-wide reductions for blockDim.x a multiple of kWarpSize, at most 1024.
// Every thread gets the result. The leading barrier lets a kernel call them
// in a loop without racing on the shared scratch.
inline constexpr int kMaxWarpsPerBlock = 1024 / kWarpSize;

// The row of a block of a one_block_per_row() grid (launch_utils.hpp). A
// kernel that takes one row and exits is compiled with its row's loads issued
// back to back, which one that loops over rows is not.
__device__ __forceinline__ int64_t block_row() {
  return int64_t{blockIdx.y} * gridDim.x + blockIdx.x;
}

__device__ __forceinline__ float block_sum(float v) {
  __shared__ float partial[kMaxWarpsPerBlock];
  v = warp_sum(v);
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  __syncthreads();
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  return warp_sum(lane < static_cast<int>(blockDim.x / kWarpSize) ? partial[lane] : 0.f);
}

__device__ __forceinline__ float block_max(float v) {
  __shared__ float partial[kMaxWarpsPerBlock];
  v = warp_max(v);
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  __syncthreads();
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  return warp_max(lane < static_cast<int>(blockDim.x / kWarpSize) ? partial[lane] : -INFINITY);
}

__device__ __forceinline__ void block_argmax(float& v, int& i) {
  __shared__ float partial_v[kMaxWarpsPerBlock];
  __shared__ int partial_i[kMaxWarpsPerBlock];
  warp_argmax(v, i);
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  __syncthreads();
  if (lane == 0) {
    partial_v[warp] = v;
    partial_i[warp] = i;
  }
  __syncthreads();
  const bool present = lane < static_cast<int>(blockDim.x / kWarpSize);
  v = present ? partial_v[lane] : -INFINITY;
  i = present ? partial_i[lane] : INT_MAX;
  warp_argmax(v, i);
}

}  // namespace kd_gpu
