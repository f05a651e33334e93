// moe.align_block_size: the N pairs of topk_ids, flat index i, grouped by
// expert in order of i, each group padded with N to a multiple of
// block_size B; ids outside [0, E) skipped; the rest of sorted_token_ids N,
// of expert_ids -1.
//
// One kernel, no scratch memory between kernels: a grid of blocks, each
// taking a contiguous chunk of the pairs to place. Every block counts all N
// pairs per expert in shared memory (those before its chunk apart from the
// rest), so each knows every expert's padded offset and where its own
// chunk's pairs of each expert start, without hearing from the others: the
// ids are read once from memory and then from L2 by each block. Within a
// block, warps split the chunk into contiguous parts and count each part's
// pairs per expert (cnt[w][e]); each warp then walks its part kWarpSize
// pairs at a time: a lane's position is its part's next position for its
// expert plus the number of lower lanes with the same expert (one match
// instruction on CUDA), which keeps the order of i within every expert
// without atomics. The walks load kAhead steps of ids at once. The padding
// (each expert's tail, and everything past the last expert) and expert_ids
// are written by the blocks in turn; the pairs' positions are never padding,
// so no write meets another. Shared memory holds 3 E + 1 + warps * E
// counters; fewer warps count and place when E is large, and an E beyond
// kSharedBytes for one warp is refused.
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

constexpr int kAhead = 8;          // steps of a walk whose ids are loaded at once
constexpr int64_t kMinChunk = 4096;  // pairs a block places, at least

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

// expert_at() of the kAhead pairs first, first + stride, ..., loaded at once.
template <class IdT>
__device__ __forceinline__ void experts_ahead(const IdT* ids, int64_t first, int64_t stride, int64_t end,
                                              int32_t experts, int (&key)[kAhead]) {
#pragma unroll
  for (int k = 0; k < kAhead; ++k) key[k] = expert_at(ids, first + k * stride, end, experts);
}

template <class IdT>
__global__ void __launch_bounds__(kThreads)
    align_kernel(const IdT* __restrict__ ids, int32_t n, int32_t experts, int32_t block, int32_t* __restrict__ sorted,
                 int32_t sorted_size, int32_t* __restrict__ expert_ids, int32_t expert_ids_size,
                 int32_t* __restrict__ post_pad, int warps, int32_t chunk) {
  extern __shared__ int32_t shared[];
  int32_t* offset = shared;              // [E + 1]: the experts' padded starts
  int32_t* before = offset + experts + 1;  // [E]: pairs ahead of this block's chunk
  int32_t* count = before + experts;     // [E]: the rest, then all pairs
  int32_t* cnt = count + experts;        // [warps][E]: counts, then next positions
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int64_t chunk_begin = static_cast<int64_t>(blockIdx.x) * chunk;
  const int64_t chunk_end = chunk_begin + chunk < n ? chunk_begin + chunk : n;
  const int64_t part = (chunk_end - chunk_begin + warps - 1) / warps;
  const int64_t begin = warp < warps && chunk_begin + warp * part < chunk_end ? chunk_begin + warp * part : chunk_end;
  const int64_t end = warp < warps && begin + part < chunk_end ? begin + part : chunk_end;
  start_after_previous_kernel();

  for (int64_t k = threadIdx.x; k < static_cast<int64_t>(warps + 2) * experts; k += blockDim.x) before[k] = 0;
  __syncthreads();
  for (int64_t base = threadIdx.x; base < n; base += int64_t{kAhead} * blockDim.x) {
    int key[kAhead];
    experts_ahead(ids, base, blockDim.x, n, experts, key);
#pragma unroll
    for (int k = 0; k < kAhead; ++k) {
      if (key[k] >= 0) atomicAdd(base + int64_t{k} * blockDim.x < chunk_begin ? &before[key[k]] : &count[key[k]], 1);
    }
  }
  for (int64_t base = begin; base < end; base += kAhead * kWarpSize) {
    int key[kAhead];
    experts_ahead(ids, base + lane, kWarpSize, end, experts, key);
#pragma unroll
    for (int k = 0; k < kAhead; ++k) {
      if (key[k] >= 0) atomicAdd(&cnt[static_cast<int64_t>(warp) * experts + key[k]], 1);
    }
  }
  __syncthreads();
  // Each expert's count, and where each part's pairs of it start relative
  // to the expert's start.
  for (int e = threadIdx.x; e < experts; e += blockDim.x) {
    int32_t running = before[e];
    for (int w = 0; w < warps; ++w) {
      const int32_t c = cnt[static_cast<int64_t>(w) * experts + e];
      cnt[static_cast<int64_t>(w) * experts + e] = running;
      running += c;
    }
    count[e] += before[e];
    offset[e] = (count[e] + block - 1) / block * block;
  }
  __syncthreads();
  // The padded counts' exclusive sum, by the first warp.
  if (warp == 0) {
    int32_t carry = 0;
    for (int base = 0; base < experts; base += kWarpSize) {
      const int32_t padded = base + lane < experts ? offset[base + lane] : 0;
      int32_t sum = padded;
      for (int d = 1; d < kWarpSize; d *= 2) {
        const int32_t up = shfl_up(sum, d);
        if (lane >= d) sum += up;
      }
      if (base + lane < experts) offset[base + lane] = carry + sum - padded;
      carry += shfl(sum, kWarpSize - 1);
    }
    if (lane == 0) {
      offset[experts] = carry;
      if (blockIdx.x == 0) *post_pad = carry;
    }
  }
  __syncthreads();
  const int32_t total = offset[experts];
  for (int64_t k = threadIdx.x; k < static_cast<int64_t>(warps) * experts; k += blockDim.x) {
    cnt[k] += offset[k % experts];
  }
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  // Block j belongs to the last expert whose start is at most j B (the
  // experts before it with no pairs start at the same place).
  for (int64_t j = first; j < expert_ids_size; j += step) {
    int32_t value = -1;
    if (j * block < total) {
      int lo = 0, hi = experts - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (offset[mid] <= j * block) {
          lo = mid;
        } else {
          hi = mid - 1;
        }
      }
      value = lo;
    }
    expert_ids[j] = value;
  }
  // Padding: each expert's positions past its pairs, then the rest.
  for (int64_t k = first; k < static_cast<int64_t>(experts) * block; k += step) {
    const int64_t e = k / block;
    const int64_t q = offset[e] + count[e] + k % block;
    if (q < offset[e + 1]) sorted[q] = n;
  }
  for (int64_t q = total + first; q < sorted_size; q += step) sorted[q] = n;
  __syncthreads();  // every counter final before the walks move them
  if (warp >= warps) return;
  for (int64_t base = begin; base < end; base += kAhead * kWarpSize) {
    int key[kAhead];
    experts_ahead(ids, base + lane, kWarpSize, end, experts, key);
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
  const int64_t counters = kSharedBytes / static_cast<int64_t>(sizeof(int32_t)) - (3 * num_experts + 1);
  const int64_t fit = counters > 0 ? counters / num_experts : 0;
  const int warps = static_cast<int>(fit < kThreads / launch.warp_size ? fit : kThreads / launch.warp_size);
  if (warps < 1) {
    return kd_plugin::fail(args, KD_STATUS_UNSUPPORTED, "%s: num_experts = %lld: its counters exceed %d bytes of shared memory",
                           kOp, static_cast<long long>(num_experts), kSharedBytes);
  }
  const size_t shared_bytes = static_cast<size_t>(3 * num_experts + 1 + warps * num_experts) * sizeof(int32_t);
  // Chunks of at least kMinChunk pairs, at most a block an SM: each block
  // reads all N ids to count them.
  const int64_t chunk = std::max<int64_t>(kMinChunk, ceil_div(n, launch.sm_count));
  const auto blocks = static_cast<unsigned>(std::max<int64_t>(1, ceil_div(n, chunk)));
  const auto stream = static_cast<cudaStream_t>(args->stream);
  const cudaError_t pending = cudaPeekAtLastError();
  const auto launch_for = [&](auto* id_data) {
    using IdT = std::remove_const_t<std::remove_pointer_t<decltype(id_data)>>;
    align_kernel<IdT><<<blocks, kThreads, shared_bytes, stream>>>(
        id_data, static_cast<int32_t>(n), static_cast<int32_t>(num_experts), static_cast<int32_t>(block),
        data_as<int32_t>(sorted), static_cast<int32_t>(p), data_as<int32_t>(experts), static_cast<int32_t>(m),
        data_as<int32_t>(post_pad), warps, static_cast<int32_t>(chunk));
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
