// moe.topk_softmax: p = softmax(gating row) in float32; the K largest p in
// descending order (ties: lower expert index first), as float32 weights and
// int32 expert ids; weights divided by their sum when renormalize. A row
// holding NaN or +inf has no softmax: its weights are NaN, as the
// reference's are, and its ids 0 to K-1.
//
// Softmax is monotonic, so the K winners are the K largest logits and only
// their exponentials are needed (plus the row's sum when not renormalizing).
// Up to 16 values per lane (E <= 512 on 32-wide warps, 1024 on 64-wide
// wavefronts) and K up to the warp width, a row is one warp's: each lane
// holds V consecutive experts and turns each logit into one 32-bit key
// that orders (value descending, index ascending) -- for 16-bit logits the
// value's own bits above the index, which is exact; for float32 the value's
// bits with the low ones replaced by the index -- sorts its V keys, and
// each of the K rounds is one warp max of the lanes' leading keys, after
// which the winning lane shifts its list. When two float32 keys of the
// winners (or the best loser) agree above the index bits, the row's values
// are too close for the truncated keys to order, and it is ranked again
// exactly by (value, index) warp argmaxes. Wider rows, or K above the warp
// width, take one block per row that rescans the row every round for the
// best value ranking after the previous winner, which needs no scratch
// memory.
#include "device_utils.cuh"
#include "launch_utils.hpp"
#include "ops.hpp"

namespace kd_gpu {
namespace {

constexpr int kThreads = 256;          // the block kernel's block
constexpr int kWarpRowsThreads = 256;  // the warp kernel's block: 8 rows (4 on wavefronts)
constexpr int kMaxValuesPerLane = 16;

// The bits of a float as an unsigned that orders as the float does.
__device__ __forceinline__ uint32_t ordered_bits(float v) {
  const uint32_t u = __float_as_uint(v);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ uint32_t ordered_bits16(uint16_t b) {
  return (b & 0x8000u) ? (~b & 0xffffu) : (b | 0x8000u);
}

// The rank key of `value` (stored as `stored`) for `expert`: larger keys
// rank first; kIndexMask covers every expert index of the warp.
template <class T, uint32_t kIndexMask>
__device__ __forceinline__ uint32_t rank_key(T stored, float value, int expert) {
  if constexpr (sizeof(T) == 2) {
    uint16_t bits;
    memcpy(&bits, &stored, sizeof(bits));
    return ordered_bits16(bits) << 16 | (0xffffu - static_cast<uint32_t>(expert));
  } else {
    return (ordered_bits(value) & ~kIndexMask) | (kIndexMask - static_cast<uint32_t>(expert));
  }
}

template <class T, int V>
inline constexpr uint32_t kIndexMaskOf = sizeof(T) == 2 ? 0xffffu : uint32_t{kWarpSize * V - 1};

// Sorts V keys in descending order (a bitonic network: no branches, all in
// registers).
template <int V>
__device__ __forceinline__ void sort_descending(uint32_t (&a)[V]) {
#pragma unroll
  for (int size = 2; size <= V; size *= 2) {
#pragma unroll
    for (int stride = size / 2; stride > 0; stride /= 2) {
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const int j = i ^ stride;
        if (j > i) {
          const bool descending = (i & size) == 0;
          const uint32_t hi = a[i] > a[j] ? a[i] : a[j];
          const uint32_t lo = a[i] > a[j] ? a[j] : a[i];
          a[i] = descending ? hi : lo;
          a[j] = descending ? lo : hi;
        }
      }
    }
  }
}

// Lane `lane` holds experts [lane * V, lane * V + V). kVector: 16-byte loads
// (E a multiple of V, rows 16-byte aligned), else one element at a time.
// kFull: E is the warp's V * kWarpSize (every lane's values present), known
// when compiling.
template <class T, int V, bool kVector, bool kFull>
__global__ void __launch_bounds__(kWarpRowsThreads)
    topk_softmax_warp(float* weights, int32_t* ids, const T* gating, int64_t rows,
                      int experts_arg, int k, bool renormalize) {
  start_after_previous_kernel();
  constexpr uint32_t kIndexMask = kIndexMaskOf<T, V>;
  const int experts = kFull ? kWarpSize * V : experts_arg;
  constexpr int kPerLoad = 16 / sizeof(T);
  const int warps = blockDim.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int first = lane * V;
  for (int64_t row = int64_t{blockIdx.x} * warps + threadIdx.x / kWarpSize; row < rows;
       row += int64_t{gridDim.x} * warps) {
    const T* g = gating + row * experts;
    float value[V];
    uint32_t key[V];
    bool special = false;  // this lane holds NaN or +inf (padding is -inf)
    if constexpr (kVector) {
      const bool present = kFull || first < experts;  // the whole vector, as V divides E
#pragma unroll
      for (int j = 0; j < V / kPerLoad; ++j) {
        Vec<T, kPerLoad> v;
        if (present) v = load_once<T, kPerLoad>(g + first + j * kPerLoad);
#pragma unroll
        for (int c = 0; c < kPerLoad; ++c) {
          const int i = j * kPerLoad + c;
          value[i] = present ? to_float(v.v[c]) : -INFINITY;
          special |= !(value[i] < INFINITY);
          key[i] = present ? rank_key<T, kIndexMask>(v.v[c], value[i], first + i) : 0u;
        }
      }
    } else {
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const bool present = first + i < experts;
        const T stored = present ? g[first + i] : T{};
        value[i] = present ? to_float(stored) : -INFINITY;
        special |= !(value[i] < INFINITY);
        key[i] = present ? rank_key<T, kIndexMask>(stored, value[i], first + i) : 0u;
      }
    }
    sort_descending<V>(key);

    uint32_t my_key = 0;  // of round `lane`
    for (int r = 0; r < k; ++r) {
      const uint32_t winner = warp_max(key[0]);
      if (lane == r) my_key = winner;
      const bool won = key[0] == winner;  // keys are distinct: one lane
#pragma unroll
      for (int i = 0; i < V - 1; ++i) key[i] = won ? key[i + 1] : key[i];
      key[V - 1] = won ? 0u : key[V - 1];
    }
    int my_id = static_cast<int>(kIndexMask - (my_key & kIndexMask));
    if constexpr (sizeof(T) == 4) {
      // Keys come out in descending order, so a near tie is between winners
      // r - 1 and r (lanes r - 1 and r) or between the last winner and the
      // best loser (the largest key left in any lane).
      const uint32_t above = shfl_up(my_key, 1);
      const uint32_t last = shfl(my_key, k - 1);
      const bool near_tie = warp_any(
          (lane >= 1 && lane < k && (above | kIndexMask) == (my_key | kIndexMask)) ||
          (key[0] != 0u && (key[0] | kIndexMask) == (last | kIndexMask)));
      if (near_tie) {  // the same for every lane
        uint32_t taken = 0;
        for (int r = 0; r < k; ++r) {
          float best = -INFINITY;
          int best_id = INT_MAX;
#pragma unroll
          for (int i = 0; i < V; ++i) {
            if ((kFull || first + i < experts) && !(taken >> i & 1u) &&
                ranks_before(value[i], first + i, best, best_id)) {
              best = value[i];
              best_id = first + i;
            }
          }
          warp_argmax(best, best_id);
          if (best_id / V == lane) taken |= 1u << (best_id - first);
          if (lane == r) my_id = best_id;
        }
      }
    }

    // Lane r < K holds winner r. Its logit is read back (an L1 hit); lane
    // 0's, winner 0's, is the row's largest.
    const float logit = lane < k ? to_float(g[my_id]) : -INFINITY;
    const float max_logit = shfl(logit, 0);
    const float e = lane < k ? __expf(logit - max_logit) : 0.f;
    float denominator;
    if (renormalize) {
      denominator = warp_sum(e);
    } else {
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < V; ++i) sum += __expf(value[i] - max_logit);  // padding: exp(-inf) = 0
      denominator = warp_sum(sum);
    }
    // NaN or +inf anywhere in the row: no softmax.
    special = warp_any(special);
    if (lane < k) {
      weights[row * k + lane] = special ? NAN : e / denominator;
      ids[row * k + lane] = special ? lane : my_id;
    }
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    topk_softmax_block(float* weights, int32_t* ids, const T* gating, int64_t rows, int experts,
                       int k, bool renormalize) {
  start_after_previous_kernel();
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* g = gating + row * experts;
    float max_logit = -INFINITY;
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
      max_logit = fmaxf(max_logit, to_float(g[e]));
    }
    max_logit = block_max(max_logit);
    float sum = 0.f;
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
      sum += __expf(to_float(g[e]) - max_logit);
    }
    const float inv_sum = 1.f / block_sum(sum);
    // NaN in the row, or +inf (then max_logit is +inf and inf - inf is NaN),
    // makes the sum NaN, and the row has no softmax.
    const bool special = !(inv_sum == inv_sum);
    float prev = INFINITY;  // the previous round's winner
    int prev_id = -1;
    float selected_sum = 0.f;
    for (int r = 0; r < k; ++r) {
      float best = -INFINITY;
      int best_id = INT_MAX;
      for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        const float pe = __expf(to_float(g[e]) - max_logit) * inv_sum;
        if (ranks_before(prev, prev_id, pe, e) && ranks_before(pe, e, best, best_id)) {
          best = pe;
          best_id = e;
        }
      }
      block_argmax(best, best_id);
      if (threadIdx.x == 0) {
        weights[row * k + r] = special ? NAN : best;
        ids[row * k + r] = special ? r : best_id;
      }
      selected_sum += best;
      prev = best;
      prev_id = best_id;
    }
    if (renormalize && !special && threadIdx.x == 0) {
      const float scale = 1.f / selected_sum;
      for (int r = 0; r < k; ++r) weights[row * k + r] *= scale;  // thread 0 wrote these
    }
  }
}

struct TopkArgs {
  float* weights;
  int32_t* ids;
  int64_t rows;
  int experts;
  int k;
  bool renormalize;
};

// Launches the warp kernel with the fewest values per lane (V, a power of
// two) that cover a row; false when a lane would need more than
// kMaxValuesPerLane values or K exceeds the warp.
template <class T, int V = 1>
bool launch_warp_rows(const Launch& launch, const TopkArgs& a, const T* gating) {
  if constexpr (V > kMaxValuesPerLane) {
    return false;
  } else {
    if (a.k > launch.warp_size) return false;
    if (int64_t{launch.warp_size} * V < a.experts) {
      return launch_warp_rows<T, 2 * V>(launch, a, gating);
    }
    const int64_t blocks = ceil_div(a.rows, kWarpRowsThreads / launch.warp_size);
    const unsigned grid = row_grid(blocks);
    constexpr int kPerLoad = 16 / sizeof(T);
    if constexpr (V % kPerLoad == 0) {
      if (a.experts % V == 0 && a.experts % kPerLoad == 0 && all_aligned(16, {gating})) {
        if (a.experts == int64_t{launch.warp_size} * V) {
          launch_kernel(launch, topk_softmax_warp<T, V, true, true>, grid, kWarpRowsThreads, a.weights,
                        a.ids, gating, a.rows, a.experts, a.k, a.renormalize);
        } else {
          launch_kernel(launch, topk_softmax_warp<T, V, true, false>, grid, kWarpRowsThreads, a.weights,
                        a.ids, gating, a.rows, a.experts, a.k, a.renormalize);
        }
        return true;
      }
    }
    launch_kernel(launch, topk_softmax_warp<T, V, false, false>, grid, kWarpRowsThreads, a.weights, a.ids,
                  gating, a.rows, a.experts, a.k, a.renormalize);
    return true;
  }
}

template <class T>
void launch_topk(const Launch& launch, const TopkArgs& a, const T* gating) {
  if (launch_warp_rows<T>(launch, a, gating)) return;
  launch_kernel(launch, topk_softmax_block<T>, row_grid(a.rows), kThreads, a.weights, a.ids, gating, a.rows,
                a.experts, a.k, a.renormalize);
}

// Tensors: topk_weights [*, K] float32, topk_ids [*, K] int32, gating_output
// [*, E]; attribute renormalize.
kd_status run_topk(const kd_call_args* args) {
  constexpr const char* op = "topk_softmax";
  if (kd_status s = check_call(args, op, 3, 1); s != KD_STATUS_OK) return s;
  const DLTensor& weights = args->tensors[0];
  const DLTensor& ids = args->tensors[1];
  const DLTensor& gating = args->tensors[2];
  if (gating.ndim < 1 || weights.ndim != gating.ndim || ids.ndim != gating.ndim) {
    return invalid_shapes(args, op);
  }
  const int64_t rows = leading_rows(gating, 1);
  const int64_t experts = dim(gating, -1);
  const int64_t k = dim(weights, -1);
  if (dim(ids, -1) != k || leading_rows(weights, 1) != rows ||
      leading_rows(ids, 1) != rows) {
    return invalid_shapes(args, op);
  }
  if (!is_dtype(weights, kDLFloat, 32) || !is_dtype(ids, kDLInt, 32)) {
    return kd_plugin::fail(args, KD_STATUS_UNSUPPORTED,
                           "%s: topk_weights must be float32 and topk_ids int32", op);
  }
  if (k > experts) {
    return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT,
                           "%s: k = %lld exceeds the number of experts E = %lld", op,
                           static_cast<long long>(k), static_cast<long long>(experts));
  }
  if (experts > INT32_MAX) {
    return kd_plugin::fail(args, KD_STATUS_UNSUPPORTED, "%s: more than 2^31-1 experts", op);
  }
  bool renormalize = false;
  if (kd_status s = attr_bool(args, op, 0, &renormalize); s != KD_STATUS_OK) return s;
  if (rows == 0 || k == 0) return KD_STATUS_OK;
  return launch_for_dtype(args, op, gating, [&](auto tag, const Launch& launch) {
    using T = typename decltype(tag)::type;
    const TopkArgs a{data_as<float>(weights), data_as<int32_t>(ids), rows,
                     static_cast<int>(experts), static_cast<int>(k), renormalize};
    launch_topk<T>(launch, a, data_as<const T>(gating));
  });
}

}  // namespace

// kd_cuda_topk_softmax, kd_hip_topk_softmax
kd_status topk_softmax(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(args, [&] { return run_topk(args); });
}

}  // namespace kd_gpu
