// The vendor switch of the GPU kernels. The sources of plugins/gpu are written
// against the CUDA runtime; nvcc compiles them as CUDA (plugins/cuda) and
// hipcc compiles the same text as HIP (plugins/hip). This header is the only
// place that knows which: runtime names, warp shuffles, the warp size and the
// 16-bit float types.
#pragma once

#include <cstdint>
#include <type_traits>

#if defined(__HIP__)
#include <hip/hip_fp16.h>
#include <hip/hip_runtime.h>

#define KD_GPU_BACKEND "hip"

// The CUDA runtime names the sources use, mapped to their HIP equivalents.
#define cudaDevAttrComputeCapabilityMajor hipDeviceAttributeComputeCapabilityMajor
#define cudaDevAttrMultiProcessorCount hipDeviceAttributeMultiprocessorCount
#define cudaDevAttrWarpSize hipDeviceAttributeWarpSize
#define cudaDeviceGetAttribute hipDeviceGetAttribute
#define cudaDeviceProp hipDeviceProp_t
#define cudaErrorInsufficientDriver hipErrorInsufficientDriver
#define cudaErrorNoDevice hipErrorNoDevice
#define cudaError_t hipError_t
#define cudaGetDevice hipGetDevice
#define cudaGetDeviceCount hipGetDeviceCount
#define cudaDriverGetVersion hipDriverGetVersion
#define cudaRuntimeGetVersion hipRuntimeGetVersion
#define cudaGetDeviceProperties hipGetDeviceProperties
#define cudaGetErrorString hipGetErrorString
#define cudaGetLastError hipGetLastError
#define cudaPeekAtLastError hipPeekAtLastError
#define cudaOccupancyMaxActiveBlocksPerMultiprocessor hipOccupancyMaxActiveBlocksPerMultiprocessor
#define cudaSetDevice hipSetDevice
#define cudaStream_t hipStream_t
#define cudaSuccess hipSuccess
#define cudaMalloc hipMalloc
#define cudaFree hipFree
#define cudaMemcpy hipMemcpy
#define cudaMemcpyKind hipMemcpyKind
#define cudaMemcpyHostToDevice hipMemcpyHostToDevice
#define cudaMemcpyDeviceToHost hipMemcpyDeviceToHost
#define cudaDeviceSynchronize hipDeviceSynchronize
#define cudaEventCreate hipEventCreate
#define cudaEventDestroy hipEventDestroy
#define cudaEventElapsedTime hipEventElapsedTime
#define cudaEventRecord hipEventRecord
#define cudaEventSynchronize hipEventSynchronize
#define cudaEvent_t hipEvent_t
#define cudaGraphDestroy hipGraphDestroy
#define cudaGraphExecDestroy hipGraphExecDestroy
#define cudaGraphExec_t hipGraphExec_t
#define cudaGraphInstantiateWithFlags hipGraphInstantiateWithFlags
#define cudaGraphLaunch hipGraphLaunch
#define cudaGraph_t hipGraph_t
#define cudaStreamBeginCapture hipStreamBeginCapture
#define cudaStreamCaptureModeThreadLocal hipStreamCaptureModeThreadLocal
#define cudaStreamCreateWithFlags hipStreamCreateWithFlags
#define cudaStreamDestroy hipStreamDestroy
#define cudaStreamEndCapture hipStreamEndCapture
#define cudaStreamNonBlocking hipStreamNonBlocking
#define cudaStreamSynchronize hipStreamSynchronize
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#define KD_GPU_BACKEND "cuda"
#endif

namespace kd_gpu {

// Threads per warp (wavefront) in device code: 32 on NVIDIA, 64 on CDNA
// (gfx9, e.g. gfx90a), 32 on RDNA (gfx10 and later, e.g. gfx1030). hipcc
// compiles device code once per --offload-arch with __AMDGCN_WAVEFRONT_SIZE
// set for that target, so every reduction is unrolled for the right width.
// The host pass also sees a value (64) that says nothing about the device:
// host code asks the device instead (Launch::warp_size).
#if defined(__HIP__)
#if defined(__AMDGCN_WAVEFRONT_SIZE)
inline constexpr int kWarpSize = __AMDGCN_WAVEFRONT_SIZE;
#else
inline constexpr int kWarpSize = 64;
#endif
#else
inline constexpr int kWarpSize = 32;
#endif

// Warp shuffles of an int, unsigned or float v: lane (lane ^ lane_mask)'s,
// lane src's, and lane (lane - delta)'s (the lanes below delta get their
// own).
template <class V>
__device__ __forceinline__ V shfl_xor(V v, int lane_mask) {
#if defined(__HIP__)
  return __shfl_xor(v, lane_mask);
#else
  return __shfl_xor_sync(0xffffffffu, v, lane_mask);
#endif
}

template <class V>
__device__ __forceinline__ V shfl(V v, int src) {
#if defined(__HIP__)
  return __shfl(v, src);
#else
  return __shfl_sync(0xffffffffu, v, src);
#endif
}

template <class V>
__device__ __forceinline__ V shfl_up(V v, int delta) {
#if defined(__HIP__)
  return __shfl_up(v, delta);
#else
  return __shfl_up_sync(0xffffffffu, v, delta);
#endif
}

// Loads and stores of data that a kernel touches once: on CUDA, the
// streaming cache hint (ld/st.global.cs), so that the lines go first and the
// data that other blocks reuse (a weight, a row read twice) stays in the
// caches; HIP gets plain accesses.
template <class Raw>
__device__ __forceinline__ Raw load_streaming(const Raw* p) {
#if defined(__HIP__)
  return *p;
#else
  return __ldcs(p);
#endif
}

template <class Raw>
__device__ __forceinline__ void store_streaming(Raw* p, Raw v) {
#if defined(__HIP__)
  *p = v;
#else
  __stcs(p, v);
#endif
}

// 16-byte loads of a row that a kernel reads twice, with L1 and L2 eviction
// priorities on CUDA: the first read keeps the lines (evict_last) for the
// second, which lets them go first (evict_first). The two L2 policies are
// made once per kernel (row_policies()) rather than once per load. HIP gets
// plain loads.
struct RowPolicies {
  uint64_t keep = 0;
  uint64_t last_read = 0;
};

__device__ __forceinline__ RowPolicies row_policies() {
  RowPolicies p;
#if !defined(__HIP__)
  asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(p.keep));
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p.last_read));
#endif
  return p;
}

__device__ __forceinline__ uint4 load_keep(const uint4* p, const RowPolicies& policies) {
#if defined(__HIP__)
  (void)policies;
  return *p;
#else
  uint4 r;
  asm volatile("ld.global.L1::evict_last.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p), "l"(policies.keep));
  return r;
#endif
}

__device__ __forceinline__ uint4 load_last_read(const uint4* p, const RowPolicies& policies) {
#if defined(__HIP__)
  (void)policies;
  return *p;
#else
  uint4 r;
  asm volatile("ld.global.L1::evict_first.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p), "l"(policies.last_read));
  return r;
#endif
}

// Programmatic dependent launch (CUDA, sm_90 on). A kernel launched with
// Launch::overlap (launch_kernel) may be scheduled while the kernel before
// it on the stream is still finishing, so that its launch and block start
// overlap that kernel's tail. Every kernel calls this before its first
// access to global memory: it waits until the previous kernel has completed
// and its writes are visible (a no-op when there is none, or when the launch
// did not overlap), then lets the next kernel be scheduled in turn, which
// waits the same way for this one. HIP and older GPUs: nothing to do.
__device__ __forceinline__ void start_after_previous_kernel() {
#if !defined(__HIP__) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ unsigned warp_max(unsigned v) {
#if !defined(__HIP__) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return __reduce_max_sync(0xffffffffu, v);  // one instruction from sm_80 on
#else
#pragma unroll
  for (int m = kWarpSize / 2; m > 0; m >>= 1) {
    const unsigned o = shfl_xor(v, m);
    v = o > v ? o : v;
  }
  return v;
#endif
}

__device__ __forceinline__ bool warp_any(bool p) {
#if defined(__HIP__)
  return __any(p);
#else
  return __any_sync(0xffffffffu, p);
#endif
}

// 16-bit float storage types. ROCm 5.2 has no bfloat16 type with device
// conversion intrinsics (hip_bfloat16.h is a host/device class without
// them), so HIP gets a plain 16-bit struct converted by bit operations.
using half_t = __half;
#if defined(__HIP__)
struct bf16_t {
  uint16_t bits;
};
#else
using bf16_t = __nv_bfloat16;
#endif

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(half_t v) { return __half2float(v); }
__device__ __forceinline__ float to_float(bf16_t v) {
#if defined(__HIP__)
  return __uint_as_float(static_cast<uint32_t>(v.bits) << 16);
#else
  return __bfloat162float(v);
#endif
}

// 2^x and 1/x by one special-function instruction each, subnormal inputs
// and results flushed to zero (CUDA; HIP takes its library calls).
__device__ __forceinline__ float fast_exp2(float x) {
#if defined(__HIP__)
  return exp2f(x);
#else
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

__device__ __forceinline__ float fast_rcp(float x) {
#if defined(__HIP__)
  return __fdividef(1.f, x);
#else
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

// Round to nearest even, as PyTorch's .to(dtype) does.
template <class T>
__device__ T from_float(float v);

template <>
__device__ __forceinline__ float from_float<float>(float v) {
  return v;
}

template <>
__device__ __forceinline__ half_t from_float<half_t>(float v) {
  return __float2half_rn(v);
}

template <>
__device__ __forceinline__ bf16_t from_float<bf16_t>(float v) {
#if defined(__HIP__)
  uint32_t u = __float_as_uint(v);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    return bf16_t{static_cast<uint16_t>((u >> 16) | 0x0040u)};  // quiet NaN
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16_t{static_cast<uint16_t>(u >> 16)};
#else
  return __float2bfloat16_rn(v);
#endif
}

// 8-bit float storage types: float8_e4m3fn and float8_e5m2 (OCP). float ->
// 8 bits rounds to nearest even and saturates at the format's largest finite
// value (448, 57344), infinities included, keeping NaN: cuda_fp8.h's
// __NV_SATFINITE convert, a single instruction on sm_89 and later. ROCm 5.2
// has no OCP fp8 type, so HIP gets plain bytes converted by bit operations,
// the algorithm of <kdispatch/plugin_helpers.hpp>.
#if defined(__HIP__)
struct fp8_e4m3_t {
  uint8_t bits;
};
struct fp8_e5m2_t {
  uint8_t bits;
};

template <int kMantissa, int kBias, uint32_t kMaxFinite, uint32_t kNaN>
__device__ __forceinline__ uint8_t encode_fp8(float v) {
  const uint32_t u = __float_as_uint(v);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a = u & 0x7fffffffu;
  constexpr int kDropped = 23 - kMantissa;
  uint32_t normal = (a - (static_cast<uint32_t>(127 - kBias) << 23) + ((1u << (kDropped - 1)) - 1u) +
                     ((a >> kDropped) & 1u)) >> kDropped;
  normal = normal > kMaxFinite ? kMaxFinite : normal;
  constexpr uint32_t kAlignBits = static_cast<uint32_t>(127 + 1 - kBias - kMantissa + 23) << 23;
  const uint32_t subnormal = __float_as_uint(__uint_as_float(a) + __uint_as_float(kAlignBits)) - kAlignBits;
  uint32_t bits = a < (static_cast<uint32_t>(127 + 1 - kBias) << 23) ? subnormal : normal;
  bits = a > 0x7f800000u ? kNaN : bits;
  return static_cast<uint8_t>(bits | sign);
}

template <int kMantissa, int kBias>
__device__ __forceinline__ float decode_fp8(uint8_t b) {
  const uint32_t magnitude = b & 0x7fu;
  uint32_t bits = magnitude < (1u << kMantissa)
                      ? __float_as_uint(static_cast<float>(magnitude) *
                                        __uint_as_float(static_cast<uint32_t>(127 + 1 - kBias - kMantissa) << 23))
                      : (magnitude << (23 - kMantissa)) + (static_cast<uint32_t>(127 - kBias) << 23);
  if (kMantissa == 3) {
    bits = magnitude == 0x7fu ? 0x7fc00000u : bits;
  } else {
    bits = magnitude >= 0x7cu ? (magnitude == 0x7cu ? 0x7f800000u : 0x7fc00000u) : bits;
  }
  return __uint_as_float(bits | (static_cast<uint32_t>(b & 0x80u) << 24));
}

__device__ __forceinline__ float to_float(fp8_e4m3_t v) { return decode_fp8<3, 7>(v.bits); }
__device__ __forceinline__ float to_float(fp8_e5m2_t v) { return decode_fp8<2, 15>(v.bits); }

template <>
__device__ __forceinline__ fp8_e4m3_t from_float<fp8_e4m3_t>(float v) {
  return fp8_e4m3_t{encode_fp8<3, 7, 0x7eu, 0x7fu>(v)};
}

template <>
__device__ __forceinline__ fp8_e5m2_t from_float<fp8_e5m2_t>(float v) {
  return fp8_e5m2_t{encode_fp8<2, 15, 0x7bu, 0x7eu>(v)};
}
#else
using fp8_e4m3_t = __nv_fp8_e4m3;
using fp8_e5m2_t = __nv_fp8_e5m2;

__device__ __forceinline__ float to_float(fp8_e4m3_t v) { return static_cast<float>(v); }
__device__ __forceinline__ float to_float(fp8_e5m2_t v) { return static_cast<float>(v); }

template <>
__device__ __forceinline__ fp8_e4m3_t from_float<fp8_e4m3_t>(float v) {
  fp8_e4m3_t r;
  r.__x = __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
  return r;
}

template <>
__device__ __forceinline__ fp8_e5m2_t from_float<fp8_e5m2_t>(float v) {
  fp8_e5m2_t r;
  r.__x = __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E5M2);
  return r;
}
#endif

// from_float of a and b into out[0] and out[1]: on CUDA one instruction
// converts both to fp8.
template <class Q>
__device__ __forceinline__ void from_float2(float a, float b, Q* out) {
#if !defined(__HIP__)
  if constexpr (std::is_same_v<Q, fp8_e4m3_t> || std::is_same_v<Q, fp8_e5m2_t>) {
    const __nv_fp8x2_storage_t r = __nv_cvt_float2_to_fp8x2(
        make_float2(a, b), __NV_SATFINITE, std::is_same_v<Q, fp8_e4m3_t> ? __NV_E4M3 : __NV_E5M2);
    out[0].__x = static_cast<__nv_fp8_storage_t>(r & 0xffu);
    out[1].__x = static_cast<__nv_fp8_storage_t>(r >> 8);
    return;
  }
#endif
  out[0] = from_float<Q>(a);
  out[1] = from_float<Q>(b);
}

// The largest finite value of an fp8 storage type.
template <class T>
inline constexpr float fp8_max = 0.0f;
template <>
inline constexpr float fp8_max<fp8_e4m3_t> = 448.0f;
template <>
inline constexpr float fp8_max<fp8_e5m2_t> = 57344.0f;

}  // namespace kd_gpu
