// Host-side helpers shared by the kernel entry points: argument checks, the
// dtype switch, the device of a call and its limits, launch error reporting.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <type_traits>
#include <utility>

#include <kdispatch/plugin_helpers.hpp>
#include <kdispatch/plugin_rows.hpp>

#include "gpu_compat.hpp"

namespace kd_gpu {

// The tensor helpers every plugin's host code shares (<kdispatch/plugin_helpers.hpp>).
using kd_plugin::data_as;
using kd_plugin::dim;
using kd_plugin::is_dtype;
using kd_plugin::leading_rows;
using kd_plugin::same_dtype;

inline bool all_aligned(size_t bytes, std::initializer_list<const void*> pointers) {
  for (const void* p : pointers) {
    if (reinterpret_cast<uintptr_t>(p) % bytes != 0) return false;
  }
  return true;
}

// True when every row of `rows` (kd_plugin::row_layout()), of elements of
// `element_size` bytes from `base`, starts at a multiple of `bytes`.
inline bool rows_aligned(size_t bytes, const void* base, const kd_plugin::RowLayout& rows, size_t element_size) {
  if (reinterpret_cast<uintptr_t>(base) % bytes != 0) return false;
  for (int d = 0; d < rows.ndim; ++d) {
    if (static_cast<uint64_t>(rows.stride[d]) * element_size % bytes != 0) return false;
  }
  return true;
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int round_up(int a, int multiple) { return (a + multiple - 1) / multiple * multiple; }

// Blocks that hold a row in registers (rmsnorm, layernorm): each thread
// keeps up to kRowMaxVecPerThread 16-byte vectors of the row, usually
// kRowVecPerThread so that several blocks share an SM; kRowMinThreads to
// kRowMaxThreads threads a block.
constexpr int kRowMinThreads = 256;
constexpr int kRowMaxThreads = 1024;
constexpr int kRowMaxVecPerThread = 8;
constexpr int kRowVecPerThread = 4;

// Threads per block for rows of `nvec` vectors: kRowVecPerThread vectors
// each, a whole number of warps, within [kRowMinThreads, kRowMaxThreads].
inline int row_block_threads(int64_t nvec, int warp_size) {
  const int64_t wanted = ceil_div(ceil_div(nvec, kRowVecPerThread), warp_size) * warp_size;
  return static_cast<int>(std::min<int64_t>(kRowMaxThreads, std::max<int64_t>(kRowMinThreads, wanted)));
}

// Calls f(std::integral_constant<int, V>{}) for V the least power of two
// from 1 to kMax that is at least n, or kMax: the numbers of vectors per
// thread (or lane) the register-held kernels are compiled for.
template <int kMax, class F>
void with_vectors_per_thread(int64_t n, F&& f) {
  if constexpr (kMax > 1) {
    if (n <= kMax / 2) return with_vectors_per_thread<kMax / 2>(n, std::forward<F>(f));
  }
  f(std::integral_constant<int, kMax>{});
}

// Where and how a call launches its kernels.
struct Launch {
  cudaStream_t stream = nullptr;
  int sm_count = 1;
  int warp_size = 32;
  // Programmatic dependent launch (launch_kernel): CUDA devices of compute
  // capability 9.0 on, unless KDISPATCH_CUDA_PDL=0.
  bool overlap = false;
};

// A grid of `blocks` blocks, at most the grid's limit (2^31-1): kernels
// loop over the blocks' worth of work beyond it.
inline unsigned row_grid(int64_t blocks) {
  return static_cast<unsigned>(std::min<int64_t>(blocks, INT32_MAX));
}

// A grid of at least `blocks` blocks for kernels that take one row each and
// do not loop (block_row() in device_utils.cuh): up to 2^31-1 blocks in x,
// and past that as many groups of 2^31-1 in y as it takes (y's limit of
// 65535 groups would take 2^46 rows, more than a tensor can have).
inline dim3 one_block_per_row(int64_t blocks) {
  const unsigned x = row_grid(blocks);
  return dim3(x, static_cast<unsigned>(ceil_div(blocks, x)));
}

// Makes a device current for the rest of a call and restores the caller's on
// exit, so a stream of the tensors' device can be used whatever device the
// calling thread had selected.
class DeviceScope {
 public:
  DeviceScope() = default;
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  ~DeviceScope() {
    if (previous_ >= 0) (void)cudaSetDevice(previous_);
  }

  cudaError_t enter(int device) {
    int current = 0;
    cudaError_t err = cudaGetDevice(&current);
    if (err != cudaSuccess || current == device) return err;
    err = cudaSetDevice(device);
    if (err == cudaSuccess) previous_ = current;
    return err;
  }

 private:
  int previous_ = -1;
};

// KDISPATCH_CUDA_PDL=0 launches every kernel only after the previous one on
// its stream has completed, as a plain launch does; unset, empty or 1 lets
// kernels overlap their launch with the previous kernel's tail. Another
// value is ignored with a warning (kd_plugin::warn). Read once.
inline bool overlap_from_environment() {
  const char* env = secure_getenv("KDISPATCH_CUDA_PDL");
  if (env == nullptr || *env == '\0' || std::strcmp(env, "1") == 0) return true;
  if (std::strcmp(env, "0") == 0) return false;
  kd_plugin::warn("KDISPATCH_CUDA_PDL='%s' is neither 0 nor 1; using 1", env);
  return true;
}

// SM count, warp size and whether launches may overlap (Launch) of a device,
// asked once per device.
inline cudaError_t device_limits(int device, Launch* launch) {
  constexpr int kCachedDevices = 64;
  // (sm_count << 32) | (overlap << 16) | warp_size; 0 while not asked
  static std::atomic<uint64_t> cache[kCachedDevices];
  const bool cacheable = device >= 0 && device < kCachedDevices;
  if (cacheable) {
    const uint64_t packed = cache[device].load(std::memory_order_relaxed);
    if (packed != 0) {
      launch->sm_count = static_cast<int>(packed >> 32);
      launch->overlap = (packed >> 16 & 1u) != 0;
      launch->warp_size = static_cast<int>(packed & 0xffffu);
      return cudaSuccess;
    }
  }
  int sm_count = 0;
  int warp_size = 0;
  int major = 0;
  cudaError_t err = cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&warp_size, cudaDevAttrWarpSize, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (err != cudaSuccess) return err;
#if defined(__HIP__)
  const bool overlap = false;
#else
  static const bool allowed = overlap_from_environment();
  const bool overlap = allowed && major >= 9;
#endif
  launch->sm_count = sm_count;
  launch->warp_size = warp_size;
  launch->overlap = overlap;
  if (cacheable) {
    cache[device].store(uint64_t(uint32_t(sm_count)) << 32 | uint64_t{overlap} << 16 | (uint32_t(warp_size) & 0xffffu),
                        std::memory_order_relaxed);
  }
  return cudaSuccess;
}

// Launches kernel<<<grid, block, 0, launch.stream>>>(args...), with
// programmatic dependent launch where launch.overlap: the kernel must call
// start_after_previous_kernel() before touching global memory.
template <class... Params, class... Args>
void launch_kernel(const Launch& launch, void (*kernel)(Params...), dim3 grid, dim3 block,
                   Args&&... args) {
#if defined(__HIP__)
  kernel<<<grid, block, 0, launch.stream>>>(std::forward<Args>(args)...);
#else
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.stream = launch.stream;
  config.attrs = &attribute;
  config.numAttrs = launch.overlap ? 1 : 0;
  (void)cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);  // launched() reports
#endif
}

inline bool on_this_backend(const DLDevice& d) {
#if defined(__HIP__)
  return d.device_type == kDLROCM;
#else
  return d.device_type == kDLCUDA || d.device_type == kDLCUDAManaged;
#endif
}

// Reports an error of the kernel launches made since `pending` was read.
// The runtime's last error belongs to the calling thread (and, with a shared
// HIP runtime, to the rest of the process), so it is cleared only when it is
// this call's launch error; an error pending from before is left where it
// is, and reported, since a launch after it cannot be told to have run.
inline kd_status launched(const kd_call_args* args, const char* op, cudaError_t pending) {
  const cudaError_t err = cudaPeekAtLastError();
  if (err == cudaSuccess) return KD_STATUS_OK;
  if (pending != cudaSuccess) {
    return kd_plugin::fail(args, KD_STATUS_DEVICE_ERROR,
                           "%s: the runtime reported an error from before this call (%s); the "
                           "kernel may not have run",
                           op, cudaGetErrorString(err));
  }
  (void)cudaGetLastError();
  return kd_plugin::fail(args, KD_STATUS_DEVICE_ERROR, "%s: kernel launch failed: %s", op,
                         cudaGetErrorString(err));
}

// Checks the counts of tensors and attributes and that every tensor lives on
// one device of this backend. Touches no device.
inline kd_status check_call(const kd_call_args* args, const char* op, int num_tensors,
                            int num_attrs) {
  if (args == nullptr) return KD_STATUS_INVALID_ARGUMENT;
  if (args->tensors == nullptr || args->num_tensors != num_tensors) {
    return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT, "%s: expected %d tensors, got %d",
                           op, num_tensors, args->num_tensors);
  }
  if (args->num_attrs < num_attrs || (num_attrs > 0 && args->attrs == nullptr)) {
    return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT,
                           "%s: expected %d attributes, got %d", op, num_attrs, args->num_attrs);
  }
  const DLDevice device = args->tensors[0].device;
  for (int i = 0; i < num_tensors; ++i) {
    const DLDevice d = args->tensors[i].device;
    if (!on_this_backend(d) || d.device_id != device.device_id) {
      return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT,
                             "%s: tensor %d is on device type %d id %d, expected one %s device "
                             "for all tensors",
                             op, i, static_cast<int>(d.device_type), d.device_id,
                             KD_GPU_BACKEND);
    }
  }
  return KD_STATUS_OK;
}

// For the element type T of `t` (float, half_t or bf16_t): makes the tensors'
// device current, calls launch_fn(TypeTag<T>{}, launch) to launch the
// kernels on the caller's stream, and reports a launch error.
template <class F>
kd_status launch_for_dtype(const kd_call_args* args, const char* op, const DLTensor& t,
                           F&& launch_fn) {
  return kd_plugin::dispatch_float_dtype<float, half_t, bf16_t>(args, op, t, [&](auto tag) {
    DeviceScope scope;
    Launch launch;
    const int device = args->tensors[0].device.device_id;
    cudaError_t err = scope.enter(device);
    if (err == cudaSuccess) err = device_limits(device, &launch);
    if (err != cudaSuccess) {
      return kd_plugin::fail(args, KD_STATUS_DEVICE_ERROR, "%s: device %d: %s", op, device,
                             cudaGetErrorString(err));
    }
    launch.stream = static_cast<cudaStream_t>(args->stream);
    const cudaError_t pending = cudaPeekAtLastError();
    launch_fn(tag, launch);
    return launched(args, op, pending);
  });
}

inline kd_status attr_float(const kd_call_args* args, const char* op, int index, float* out) {
  const kd_attr& a = args->attrs[index];
  if (a.type != KD_ATTR_TYPE_FLOAT) {
    return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT, "%s: attribute %d is not a float",
                           op, index);
  }
  *out = static_cast<float>(a.value.f);
  return KD_STATUS_OK;
}

inline kd_status attr_bool(const kd_call_args* args, const char* op, int index, bool* out) {
  const kd_attr& a = args->attrs[index];
  if (a.type != KD_ATTR_TYPE_BOOL) {
    return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT, "%s: attribute %d is not a bool",
                           op, index);
  }
  *out = a.value.b != 0;
  return KD_STATUS_OK;
}

inline kd_status invalid_shapes(const kd_call_args* args, const char* op) {
  return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT, "%s: tensor shapes do not match",
                         op);
}

}  // namespace kd_gpu
