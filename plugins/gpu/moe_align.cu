// moe.align_block_size: the N pairs of topk_ids, flat index i, grouped by
// expert in order of i, each group padded with N to a multiple of
// block_size B; ids outside [0, E) skipped; the rest of sorted_token_ids N,
// of expert_ids -1.
//
// One block of kThreads threads does it all, so that no scratch memory is
// needed between kernels. Its warps split topk_ids into contiguous chunks,
// one a warp, and count each chunk's pairs per expert in shared memory
// (cnt[w][e]); the counts give each expert's padded offset and, summed over
// the chunks before w, where chunk w's pairs of expert e start. Each warp
// then walks its chunk kWarpSize pairs at a time: a lane's position is its
// chunk's next position for its expert plus the number of lower lanes with
// the same expert (one match instruction on CUDA), which keeps the order of
// i within every expert without atomics. Both walks load kAhead steps of
// ids at once: a step waits on the one before it through the counters, not
// on memory. Shared memory holds (E + 1) + warps * E counters; fewer warps
// count and place when E is large, and an E beyond kSharedBytes for one
// warp is refused.
#include <cstdint>
#include <type_traits>

#include "device_utils.cuh"
#include "launch_utils.hpp"
#include "ops.hpp"

namespace kd_gpu {
namespace {

constexpr const char* kOp = "moe.align_block_size";
constexpr int kThreads = 1024;
constexpr int kSharedBytes = 48 * 1024;  // the dynamic shared memory a launch may take without opting in

constexpr int kAhead = 8;  // steps of a warp's walk whose ids are loaded at once

__device__ __forceinline__ void sync_warp() {
#if defined(__HIP__)
  __builtin_amdgcn_wave_barrier();
#else
  __syncwarp();
#endif
}

// The lanes of the warp whose key equals this lane's, as a bit mask.
__device__ __forceinline__ uint64_t lanes_with_key(int key) {
#if defined(__HIP__)
  uint64_t same = 0;
  for (int src = 0; src < kWarpSize; ++src) {
    if (shfl(key, src) == key) same |= uint64_t{1} << src;
  }
  return same;
#else
  return __match_any_sync(0xffffffffu, key);
#endif
}

// ids[i] where it names an expert, else -1.
template <class IdT>
__device__ __forceinline__ int expert_at(const IdT* ids, int64_t i, int64_t end, int32_t experts) {
  const int64_t id = i < end ? static_cast<int64_t>(ids[i]) : -1;
  return id >= 0 && id < experts ? static_cast<int>(id) : -1;
}

template <class IdT>
__global__ void __launch_bounds__(kThreads)
    align_kernel(const IdT* __restrict__ ids, int32_t n, int32_t experts, int32_t block, int32_t* __restrict__ sorted,
                 int32_t sorted_size, int32_t* __restrict__ expert_ids, int32_t expert_ids_size,
                 int32_t* __restrict__ post_pad, int warps) {
  extern __shared__ int32_t shared[];
  int32_t* offset = shared;                // [E + 1]: the experts' padded starts
  int32_t* cnt = shared + experts + 1;     // [warps][E]: counts, then next positions
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int64_t chunk = (static_cast<int64_t>(n) + warps - 1) / warps;
  const int64_t begin = static_cast<int64_t>(warp) * chunk;
  const int64_t end = warp < warps ? (begin + chunk < n ? begin + chunk : n) : begin;
  start_after_previous_kernel();

  for (int64_t k = threadIdx.x; k < static_cast<int64_t>(warps) * experts; k += blockDim.x) cnt[k] = 0;
  __syncthreads();
  for (int64_t base = begin; base < end; base += kAhead * kWarpSize) {
    int key[kAhead];
#pragma unroll
    for (int k = 0; k < kAhead; ++k) key[k] = expert_at(ids, base + k * kWarpSize + lane, end, experts);
#pragma unroll
    for (int k = 0; k < kAhead; ++k) {
      if (key[k] >= 0) atomicAdd(&cnt[static_cast<int64_t>(warp) * experts + key[k]], 1);
    }
  }
  __syncthreads();
  // Each expert's count, and each chunk's start relative to the expert's.
  for (int e = threadIdx.x; e < experts; e += blockDim.x) {
    int32_t running = 0;
    for (int w = 0; w < warps; ++w) {
      const int32_t c = cnt[static_cast<int64_t>(w) * experts + e];
      cnt[static_cast<int64_t>(w) * experts + e] = running;
      running += c;
    }
    offset[e] = (running + block - 1) / block * block;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t total = 0;
    for (int e = 0; e < experts; ++e) {
      const int32_t padded = offset[e];
      offset[e] = total;
      total += padded;
    }
    offset[experts] = total;
    *post_pad = total;
  }
  __syncthreads();
  const int32_t total = offset[experts];
  for (int64_t k = threadIdx.x; k < static_cast<int64_t>(warps) * experts; k += blockDim.x) {
    cnt[k] += offset[k % experts];
  }
  // Block j belongs to the last expert whose start is at most j B (the
  // experts before it with no pairs start at the same place).
  for (int32_t j = threadIdx.x; j < expert_ids_size; j += blockDim.x) {
    int32_t value = -1;
    if (static_cast<int64_t>(j) * block < total) {
      int lo = 0, hi = experts - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (offset[mid] <= static_cast<int64_t>(j) * block) {
          lo = mid;
        } else {
          hi = mid - 1;
        }
      }
      value = lo;
    }
    expert_ids[j] = value;
  }
  for (int32_t p = threadIdx.x; p < sorted_size; p += blockDim.x) sorted[p] = n;
  __syncthreads();  // the padding is written before the pairs overwrite part of it
  if (warp >= warps) return;
  for (int64_t base = begin; base < end; base += kAhead * kWarpSize) {
    int key[kAhead];
#pragma unroll
    for (int k = 0; k < kAhead; ++k) key[k] = expert_at(ids, base + k * kWarpSize + lane, end, experts);
#pragma unroll
    for (int k = 0; k < kAhead; ++k) {
      const uint64_t same = lanes_with_key(key[k]);
      const int below = __popcll(same & ((uint64_t{1} << lane) - 1));
      int32_t* next = key[k] >= 0 ? &cnt[static_cast<int64_t>(warp) * experts + key[k]] : nullptr;
      if (next != nullptr) sorted[*next + below] = static_cast<int32_t>(base + k * kWarpSize + lane);
      sync_warp();
      if (next != nullptr && below == 0) *next += __popcll(same);
      sync_warp();
    }
  }
}

kd_status run_align(const kd_call_args* args) {
  if (kd_status s = check_call(args, kOp, 4, 2); s != KD_STATUS_OK) return s;
  const DLTensor& ids = args->tensors[0];
  const DLTensor& sorted = args->tensors[1];
  const DLTensor& experts = args->tensors[2];
  const DLTensor& post_pad = args->tensors[3];
  const bool ids64 = is_dtype(ids, kDLInt, 64);
  if (ids.ndim < 1 || !(ids64 || is_dtype(ids, kDLInt, 32)) || !is_dtype(sorted, kDLInt, 32) ||
      !is_dtype(experts, kDLInt, 32) || !is_dtype(post_pad, kDLInt, 32) || sorted.ndim != 1 || experts.ndim != 1 ||
      post_pad.ndim != 1 || dim(post_pad, 0) != 1) {
    return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT,
                           "%s: expected topk_ids [*, K] int32 or int64, sorted_token_ids [P], expert_ids [M] "
                           "and num_tokens_post_pad [1] int32",
                           kOp);
  }
  const kd_attr* num_experts_attr = kd_plugin::find_attr(args, "num_experts", KD_ATTR_TYPE_INT);
  const kd_attr* block_attr = kd_plugin::find_attr(args, "block_size", KD_ATTR_TYPE_INT);
  if (num_experts_attr == nullptr || block_attr == nullptr) {
    return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT, "%s: expected int attributes num_experts and block_size",
                           kOp);
  }
  const int64_t num_experts = num_experts_attr->value.i;
  const int64_t block = block_attr->value.i;
  if (num_experts < 1 || block < 1 || num_experts > INT32_MAX || block > INT32_MAX) {
    return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT,
                           "%s: num_experts = %lld and block_size = %lld must be in [1, 2^31)", kOp,
                           static_cast<long long>(num_experts), static_cast<long long>(block));
  }
  const int64_t n = leading_rows(ids, 0);
  const int64_t worst = n + num_experts * (block - 1);
  const int64_t p = dim(sorted, 0);
  const int64_t m = dim(experts, 0);
  if (worst > INT32_MAX || p < worst || m < worst / block || p > INT32_MAX || m > INT32_MAX) {
    return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT,
                           "%s: sorted_token_ids has %lld elements and expert_ids %lld; N + num_experts * "
                           "(block_size - 1) = %lld needs at least that many and %lld (and at most 2^31 - 1)",
                           kOp, static_cast<long long>(p), static_cast<long long>(m), static_cast<long long>(worst),
                           static_cast<long long>(worst / block));
  }
  DeviceScope scope;
  Launch launch;
  const int device = ids.device.device_id;
  cudaError_t err = scope.enter(device);
  if (err == cudaSuccess) err = device_limits(device, &launch);
  if (err != cudaSuccess) {
    return kd_plugin::fail(args, KD_STATUS_DEVICE_ERROR, "%s: device %d: %s", kOp, device, cudaGetErrorString(err));
  }
  const int64_t counters = kSharedBytes / static_cast<int64_t>(sizeof(int32_t)) - (num_experts + 1);
  const int64_t fit = counters > 0 ? counters / num_experts : 0;
  const int warps = static_cast<int>(fit < kThreads / launch.warp_size ? fit : kThreads / launch.warp_size);
  if (warps < 1) {
    return kd_plugin::fail(args, KD_STATUS_UNSUPPORTED, "%s: num_experts = %lld: its counters exceed %d bytes of shared memory",
                           kOp, static_cast<long long>(num_experts), kSharedBytes);
  }
  const size_t shared_bytes = static_cast<size_t>(num_experts + 1 + warps * num_experts) * sizeof(int32_t);
  const auto stream = static_cast<cudaStream_t>(args->stream);
  const cudaError_t pending = cudaPeekAtLastError();
  const auto launch_for = [&](auto* id_data) {
    using IdT = std::remove_const_t<std::remove_pointer_t<decltype(id_data)>>;
    align_kernel<IdT><<<1, kThreads, shared_bytes, stream>>>(
        id_data, static_cast<int32_t>(n), static_cast<int32_t>(num_experts), static_cast<int32_t>(block),
        data_as<int32_t>(sorted), static_cast<int32_t>(p), data_as<int32_t>(experts), static_cast<int32_t>(m),
        data_as<int32_t>(post_pad), warps);
  };
  if (ids64) {
    launch_for(data_as<const int64_t>(ids));
  } else {
    launch_for(data_as<const int32_t>(ids));
  }
  return launched(args, kOp, pending);
}

}  // namespace

kd_status moe_align_block_size(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(args, [&] { return run_align(args); });
}

}  // namespace kd_gpu
