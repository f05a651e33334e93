// moe.topk_softmax: x = gating row (rows at any strides), softcapped
// (tanh(x / c) c, rounded to float32) when moe_softcapping c > 0, plus
// correction_bias in float32 when given; p = softmax(x) in float32; the K
// largest p in descending order (ties: lower expert index first), as
// float32 weights and int32 or int64 expert ids; weights divided by their
// sum when renormalize; token_expert_indices[t, r] = r T + t when asked for.
// A row whose x holds NaN or +inf has no softmax: its weights are NaN, as
// the reference's are, and its ids 0 to K-1. With a softcap or a bias the
// keys are those of the float32 x, whatever the input dtype.
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
#include <kdispatch/plugin_rows.hpp>

#include <type_traits>

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
template <bool kFloatKeys, uint32_t kIndexMask, class T>
__device__ __forceinline__ uint32_t rank_key(T stored, float value, int expert) {
  if constexpr (!kFloatKeys) {
    uint16_t bits;
    memcpy(&bits, &stored, sizeof(bits));
    return ordered_bits16(bits) << 16 | (0xffffu - static_cast<uint32_t>(expert));
  } else {
    return (ordered_bits(value) & ~kIndexMask) | (kIndexMask - static_cast<uint32_t>(expert));
  }
}

template <bool kFloatKeys, int V>
inline constexpr uint32_t kIndexMaskOf = kFloatKeys ? uint32_t{kWarpSize * V - 1} : 0xffffu;

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

// What a kernel needs beside the gating rows: the outputs (token_expert
// NULL when not asked for), the shape, and the transform of a logit before
// the softmax (bias NULL without correction_bias, cap 0 without
// moe_softcapping).
template <class IdT>
struct TopkOut {
  float* weights;
  IdT* ids;
  int32_t* token_expert;
  int64_t rows;
  int experts;
  int k;
  bool renormalize;
  const float* bias;
  double cap;
};

// The logit the softmax sees, in float32: tanh(x / cap) cap when cap > 0
// (in double, rounded once, so that every backend gets the same float), plus
// the correction bias when there is one. kTransform: either is present.
template <bool kTransform, class IdT>
__device__ __forceinline__ float transformed(float x, int expert, const TopkOut<IdT>& o) {
  if constexpr (kTransform) {
    const double cap = o.cap;
    float t = cap > 0.0 ? static_cast<float>(tanh(x / cap) * cap) : x;
    if (o.bias != nullptr) t += o.bias[expert];
    return t;
  } else {
    return x;
  }
}

// Writes token_expert_indices[row, r] = r * rows + row, when asked for.
template <class IdT>
__device__ __forceinline__ void write_token_expert(const TopkOut<IdT>& o, int64_t row, int r) {
  if (o.token_expert != nullptr) {
    o.token_expert[row * o.k + r] = static_cast<int32_t>(int64_t{r} * o.rows + row);
  }
}

// Lane `lane` holds experts [lane * V, lane * V + V). kVector: 16-byte loads
// (E a multiple of V, every row 16-byte aligned), else one element at a
// time. kFull: E is the warp's V * kWarpSize (every lane's values present),
// known when compiling. kTransform: a softcap or a bias transforms the
// logits, which then rank in float32 keys whatever T.
template <class T, class IdT, int V, bool kVector, bool kFull, bool kTransform>
__global__ void __launch_bounds__(kWarpRowsThreads)
    topk_softmax_warp(TopkOut<IdT> o, const T* gating, kd_plugin::RowLayout layout) {
  start_after_previous_kernel();
  constexpr bool kFloatKeys = sizeof(T) == 4 || kTransform;
  constexpr uint32_t kIndexMask = kIndexMaskOf<kFloatKeys, V>;
  const int experts = kFull ? kWarpSize * V : o.experts;
  const int k = o.k;
  constexpr int kPerLoad = 16 / sizeof(T);
  const int warps = blockDim.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int first = lane * V;
  for (int64_t row = int64_t{blockIdx.x} * warps + threadIdx.x / kWarpSize; row < o.rows;
       row += int64_t{gridDim.x} * warps) {
    const T* g = gating + layout.offset(row);
    float value[V];  // the logits the softmax sees (transformed)
    uint32_t key[V];
    bool special = false;  // this lane's softmax logits hold NaN or +inf (padding is -inf)
    if constexpr (kVector) {
      const bool present = kFull || first < experts;  // the whole vector, as V divides E
#pragma unroll
      for (int j = 0; j < V / kPerLoad; ++j) {
        Vec<T, kPerLoad> v;
        if (present) v = load_once<T, kPerLoad>(g + first + j * kPerLoad);
#pragma unroll
        for (int c = 0; c < kPerLoad; ++c) {
          const int i = j * kPerLoad + c;
          value[i] = present ? transformed<kTransform>(to_float(v.v[c]), first + i, o) : -INFINITY;
          special |= present && !(value[i] < INFINITY);
          key[i] = present ? rank_key<kFloatKeys, kIndexMask>(v.v[c], value[i], first + i) : 0u;
        }
      }
    } else {
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const bool present = first + i < experts;
        const T stored = present ? g[first + i] : T{};
        value[i] = present ? transformed<kTransform>(to_float(stored), first + i, o) : -INFINITY;
        special |= present && !(value[i] < INFINITY);
        key[i] = present ? rank_key<kFloatKeys, kIndexMask>(stored, value[i], first + i) : 0u;
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
    if constexpr (kFloatKeys) {
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
    const float logit = lane < k ? transformed<kTransform>(to_float(g[my_id]), my_id, o) : -INFINITY;
    const float max_logit = shfl(logit, 0);
    const float e = lane < k ? __expf(logit - max_logit) : 0.f;
    float denominator;
    if (o.renormalize) {
      denominator = warp_sum(e);
    } else {
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < V; ++i) {
        if (kFull || first + i < experts) sum += __expf(value[i] - max_logit);
      }
      denominator = warp_sum(sum);
    }
    // NaN or +inf anywhere in the row: no softmax.
    special = warp_any(special);
    if (lane < k) {
      o.weights[row * k + lane] = special ? NAN : e / denominator;
      o.ids[row * k + lane] = static_cast<IdT>(special ? lane : my_id);
      write_token_expert(o, row, lane);
    }
  }
}

// One block per row; every round rescans the row for the best selection
// value ranking after the previous winner.
template <class T, class IdT, bool kTransform>
__global__ void __launch_bounds__(kThreads)
    topk_softmax_block(TopkOut<IdT> o, const T* gating, kd_plugin::RowLayout layout) {
  start_after_previous_kernel();
  const int experts = o.experts;
  for (int64_t row = blockIdx.x; row < o.rows; row += gridDim.x) {
    const T* g = gating + layout.offset(row);
    float max_logit = -INFINITY;
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
      max_logit = fmaxf(max_logit, transformed<kTransform>(to_float(g[e]), e, o));
    }
    max_logit = block_max(max_logit);
    float sum = 0.f;
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
      sum += __expf(transformed<kTransform>(to_float(g[e]), e, o) - max_logit);
    }
    const float inv_sum = 1.f / block_sum(sum);
    // NaN in the row, or +inf (then max_logit is +inf and inf - inf is NaN),
    // makes the sum NaN, and the row has no softmax.
    const bool special = !(inv_sum == inv_sum);
    float prev = INFINITY;  // the previous round's winner
    int prev_id = -1;
    float selected_sum = 0.f;
    for (int r = 0; r < o.k; ++r) {
      float best = -INFINITY;
      int best_id = INT_MAX;
      for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        const float s = transformed<kTransform>(to_float(g[e]), e, o);
        if (ranks_before(prev, prev_id, s, e) && ranks_before(s, e, best, best_id)) {
          best = s;
          best_id = e;
        }
      }
      block_argmax(best, best_id);
      // A row of NaN or -inf selection values leaves best_id unset.
      const bool found = best_id < experts;
      const float p = found ? __expf(best - max_logit) * inv_sum : 0.f;
      if (threadIdx.x == 0) {
        o.weights[row * o.k + r] = special ? NAN : p;
        o.ids[row * o.k + r] = static_cast<IdT>(special || !found ? r : best_id);
        write_token_expert(o, row, r);
      }
      selected_sum += p;
      prev = best;
      prev_id = best_id;
    }
    if (o.renormalize && !special && threadIdx.x == 0) {
      const float scale = 1.f / selected_sum;
      for (int r = 0; r < o.k; ++r) o.weights[row * o.k + r] *= scale;  // thread 0 wrote these
    }
  }
}

// Whether every row of `layout` starting at 16-byte aligned `gating` is
// 16-byte aligned too.
inline bool rows_aligned(const kd_plugin::RowLayout& layout, size_t element_bytes) {
  for (int d = 0; d < layout.ndim; ++d) {
    if ((layout.stride[d] * static_cast<int64_t>(element_bytes)) % 16 != 0) return false;
  }
  return true;
}

// Launches the warp kernel with the fewest values per lane (V, a power of
// two) that cover a row; false when a lane would need more than
// kMaxValuesPerLane values or K exceeds the warp.
template <class T, class IdT, bool kTransform, int V = 1>
bool launch_warp_rows(const Launch& launch, const TopkOut<IdT>& o, const T* gating,
                      const kd_plugin::RowLayout& layout) {
  if constexpr (V > kMaxValuesPerLane) {
    return false;
  } else {
    if (o.k > launch.warp_size) return false;
    if (int64_t{launch.warp_size} * V < o.experts) {
      return launch_warp_rows<T, IdT, kTransform, 2 * V>(launch, o, gating, layout);
    }
    const int64_t blocks = ceil_div(o.rows, kWarpRowsThreads / launch.warp_size);
    const unsigned grid = row_grid(blocks);
    constexpr int kPerLoad = 16 / sizeof(T);
    if constexpr (V % kPerLoad == 0) {
      if (o.experts % V == 0 && o.experts % kPerLoad == 0 && all_aligned(16, {gating}) &&
          rows_aligned(layout, sizeof(T))) {
        if (o.experts == int64_t{launch.warp_size} * V) {
          launch_kernel(launch, topk_softmax_warp<T, IdT, V, true, true, kTransform>, grid,
                        kWarpRowsThreads, o, gating, layout);
        } else {
          launch_kernel(launch, topk_softmax_warp<T, IdT, V, true, false, kTransform>, grid,
                        kWarpRowsThreads, o, gating, layout);
        }
        return true;
      }
    }
    launch_kernel(launch, topk_softmax_warp<T, IdT, V, false, false, kTransform>, grid,
                  kWarpRowsThreads, o, gating, layout);
    return true;
  }
}

template <class T, class IdT, bool kTransform>
void launch_topk(const Launch& launch, const TopkOut<IdT>& o, const T* gating,
                 const kd_plugin::RowLayout& layout) {
  if (launch_warp_rows<T, IdT, kTransform>(launch, o, gating, layout)) return;
  launch_kernel(launch, topk_softmax_block<T, IdT, kTransform>, row_grid(o.rows), kThreads, o, gating,
                layout);
}

// An optional tensor the caller left out (ABI 1.1).
inline bool absent(const DLTensor& t) { return t.data == nullptr && t.ndim == 0; }

// Tensors: topk_weights [*, K] float32, topk_ids [*, K] int32 or int64,
// gating_output [*, E] (rows at any strides), correction_bias [E] float32
// (optional), token_expert_indices [*, K] int32 (optional); attributes
// renormalize, moe_softcapping.
kd_status run_topk(const kd_call_args* args) {
  constexpr const char* op = "topk_softmax";
  if (kd_status s = check_call(args, op, 5, 2); s != KD_STATUS_OK) return s;
  const DLTensor& weights = args->tensors[0];
  const DLTensor& ids = args->tensors[1];
  const DLTensor& gating = args->tensors[2];
  const DLTensor& bias = args->tensors[3];
  const DLTensor& token_expert = args->tensors[4];
  const bool has_bias = !absent(bias);
  const bool has_token_expert = !absent(token_expert);
  if (gating.ndim < 1 || weights.ndim != gating.ndim || ids.ndim != gating.ndim ||
      (has_bias && bias.ndim != 1) || (has_token_expert && token_expert.ndim != gating.ndim)) {
    return invalid_shapes(args, op);
  }
  const int64_t rows = leading_rows(gating, 1);
  const int64_t experts = dim(gating, -1);
  const int64_t k = dim(weights, -1);
  if (dim(ids, -1) != k || leading_rows(weights, 1) != rows || leading_rows(ids, 1) != rows ||
      (has_bias && dim(bias, 0) != experts) ||
      (has_token_expert &&
       (dim(token_expert, -1) != k || leading_rows(token_expert, 1) != rows))) {
    return invalid_shapes(args, op);
  }
  const bool ids64 = is_dtype(ids, kDLInt, 64);
  if (!is_dtype(weights, kDLFloat, 32) || !(ids64 || is_dtype(ids, kDLInt, 32)) ||
      (has_bias && !is_dtype(bias, kDLFloat, 32)) ||
      (has_token_expert && !is_dtype(token_expert, kDLInt, 32))) {
    return kd_plugin::fail(args, KD_STATUS_UNSUPPORTED,
                           "%s: topk_weights must be float32, topk_ids int32 or int64, "
                           "correction_bias float32 and token_expert_indices int32",
                           op);
  }
  if (k > experts) {
    return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT,
                           "%s: k = %lld exceeds the number of experts E = %lld", op,
                           static_cast<long long>(k), static_cast<long long>(experts));
  }
  if (experts > INT32_MAX) {
    return kd_plugin::fail(args, KD_STATUS_UNSUPPORTED, "%s: more than 2^31-1 experts", op);
  }
  if (has_token_expert && k > 0 && (k - 1) * rows + rows - 1 > INT32_MAX) {
    return kd_plugin::fail(args, KD_STATUS_UNSUPPORTED,
                           "%s: K x rows does not fit the int32 token_expert_indices", op);
  }
  bool renormalize = false;
  if (kd_status s = attr_bool(args, op, 0, &renormalize); s != KD_STATUS_OK) return s;
  float cap_attr = 0.f;
  if (kd_status s = attr_float(args, op, 1, &cap_attr); s != KD_STATUS_OK) return s;
  const double cap = args->attrs[1].value.f;
  if (rows == 0 || k == 0) return KD_STATUS_OK;
  const kd_plugin::RowLayout layout = kd_plugin::row_layout(gating, 1);
  const float* bias_data = has_bias ? data_as<const float>(bias) : nullptr;
  int32_t* token_expert_data = has_token_expert ? data_as<int32_t>(token_expert) : nullptr;
  return launch_for_dtype(args, op, gating, [&](auto tag, const Launch& launch) {
    using T = typename decltype(tag)::type;
    const T* g = data_as<const T>(gating);
    const auto run = [&](auto* id_data) {
      using IdT = std::remove_pointer_t<decltype(id_data)>;
      const TopkOut<IdT> o{data_as<float>(weights), id_data, token_expert_data, rows,
                           static_cast<int>(experts), static_cast<int>(k), renormalize,
                           bias_data, cap};
      if (has_bias || cap > 0.0) {
        launch_topk<T, IdT, true>(launch, o, g, layout);
      } else {
        launch_topk<T, IdT, false>(launch, o, g, layout);
      }
    };
    if (ids64) {
      run(data_as<int64_t>(ids));
    } else {
      run(data_as<int32_t>(ids));
    }
  });
}

}  // namespace

// kd_cuda_topk_softmax, kd_hip_topk_softmax
kd_status topk_softmax(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(args, [&] { return run_topk(args); });
}

}  // namespace kd_gpu
