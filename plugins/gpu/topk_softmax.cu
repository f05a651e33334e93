// moe.topk_softmax: p = softmax(gating row) in float32; the K largest p in
// descending order (ties: lower expert index first), as float32 weights and
// int32 expert ids; weights divided by their sum when renormalize.
//
// Up to 16 values per lane (E <= 512 on 32-wide warps, 1024 on 64-wide
// wavefronts) a row is one warp's: the row sits in registers, softmax takes
// two warp reductions and each of the K rounds one warp argmax, after which
// the owner of the winner drops it. Wider rows take one block each and
// rescan the row every round for the best value ranking after the previous
// winner, which needs no scratch memory.
#include "device_utils.cuh"
#include "launch_utils.hpp"
#include "ops.hpp"

namespace kd_gpu {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxValuesPerLane = 16;

// Lane `lane` holds vectors j * kWarpSize + lane (j < NV) of N experts each,
// so that each load instruction of a warp reads one contiguous span.
template <class T, int N, int NV>
__global__ void __launch_bounds__(kThreads)
    topk_softmax_warp(float* weights, int32_t* ids, const T* gating, int64_t rows, int experts,
                      int k, bool renormalize) {
  constexpr int kValues = N * NV;
  const int warps = blockDim.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  for (int64_t row = int64_t{blockIdx.x} * warps + threadIdx.x / kWarpSize; row < rows;
       row += int64_t{gridDim.x} * warps) {
    const T* g = gating + row * experts;
    float p[kValues];
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int first = (j * kWarpSize + lane) * N;
      if (first < experts) {  // N divides E when N > 1: a vector is all in or all out
        const Vec<T, N> v = load_vec<T, N>(g + first);
#pragma unroll
        for (int c = 0; c < N; ++c) p[j * N + c] = to_float(v.v[c]);
      } else {
#pragma unroll
        for (int c = 0; c < N; ++c) p[j * N + c] = -INFINITY;
      }
    }
    float max_logit = -INFINITY;
#pragma unroll
    for (int i = 0; i < kValues; ++i) max_logit = fmaxf(max_logit, p[i]);
    max_logit = warp_max(max_logit);
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < kValues; ++i) {
      p[i] = __expf(p[i] - max_logit);  // padding: exp(-inf) = 0
      sum += p[i];
    }
    const float inv_sum = 1.f / warp_sum(sum);
#pragma unroll
    for (int j = 0; j < NV; ++j) {
#pragma unroll
      for (int c = 0; c < N; ++c) {
        const int expert = (j * kWarpSize + lane) * N + c;
        p[j * N + c] = expert < experts ? p[j * N + c] * inv_sum : -INFINITY;
      }
    }

    float* w_row = weights + row * k;
    int32_t* id_row = ids + row * k;
    float my_weight = 0.f;  // of round `lane`
    int my_id = 0;
    float selected_sum = 0.f;
    for (int r = 0; r < k; ++r) {
      float best = -INFINITY;
      int best_id = INT_MAX;
#pragma unroll
      for (int j = 0; j < NV; ++j) {
#pragma unroll
        for (int c = 0; c < N; ++c) {
          if (p[j * N + c] > best) {  // experts ascend within a lane: ties keep the first
            best = p[j * N + c];
            best_id = (j * kWarpSize + lane) * N + c;
          }
        }
      }
      warp_argmax(best, best_id);
      selected_sum += best;
      if (r < kWarpSize) {
        if (lane == r) {
          my_weight = best;
          my_id = best_id;
        }
      } else if (lane == 0) {
        w_row[r] = best;
        id_row[r] = best_id;
      }
#pragma unroll
      for (int j = 0; j < NV; ++j) {
#pragma unroll
        for (int c = 0; c < N; ++c) {
          if ((j * kWarpSize + lane) * N + c == best_id) p[j * N + c] = -INFINITY;
        }
      }
    }
    const float scale = renormalize ? 1.f / selected_sum : 1.f;
    if (lane < k) {
      w_row[lane] = my_weight * scale;
      id_row[lane] = my_id;
    }
    if (renormalize && lane == 0) {
      for (int r = kWarpSize; r < k; ++r) w_row[r] *= scale;  // lane 0 wrote these
    }
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    topk_softmax_block(float* weights, int32_t* ids, const T* gating, int64_t rows, int experts,
                       int k, bool renormalize) {
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
        weights[row * k + r] = best;
        ids[row * k + r] = best_id;
      }
      selected_sum += best;
      prev = best;
      prev_id = best_id;
    }
    if (renormalize && threadIdx.x == 0) {
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

// Launches the warp kernel with the fewest loads per lane (NV, a power of
// two) of N experts each that cover a row; false when a lane would need more
// than kMaxValuesPerLane values.
template <class T, int N, int NV = 1>
bool launch_warp_rows(const Launch& launch, const TopkArgs& a, const T* gating) {
  if constexpr (N * NV > kMaxValuesPerLane) {
    return false;
  } else {
    if (ceil_div(ceil_div(a.experts, N), launch.warp_size) > NV) {
      return launch_warp_rows<T, N, 2 * NV>(launch, a, gating);
    }
    launch_resident<topk_softmax_warp<T, N, NV>, kThreads>(
        launch, ceil_div(a.rows, kThreads / launch.warp_size), a.weights, a.ids, gating, a.rows,
        a.experts, a.k, a.renormalize);
    return true;
  }
}

template <class T>
void launch_topk(const Launch& launch, const TopkArgs& a, const T* gating) {
  constexpr int kVec = 16 / sizeof(T);
  if (a.experts % kVec == 0 && all_aligned(16, {gating}) &&
      launch_warp_rows<T, kVec>(launch, a, gating)) {
    return;
  }
  if (launch_warp_rows<T, 1>(launch, a, gating)) return;
  launch_resident<topk_softmax_block<T>, kThreads>(launch, a.rows, a.weights, a.ids, gating,
                                                  a.rows, a.experts, a.k, a.renormalize);
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
  const int64_t rows = leading_count(gating, 1);
  const int64_t experts = last_dim(gating);
  const int64_t k = last_dim(weights);
  if (last_dim(ids) != k || leading_count(weights, 1) != rows ||
      leading_count(ids, 1) != rows) {
    return invalid_shapes(args, op);
  }
  if (!has_dtype(weights, kDLFloat, 32) || !has_dtype(ids, kDLInt, 32)) {
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
    const TopkArgs a{data_of<float>(weights), data_of<int32_t>(ids), rows,
                     static_cast<int>(experts), static_cast<int>(k), renormalize};
    launch_topk<T>(launch, a, data_of<const T>(gating));
  });
}

}  // namespace

kd_status topk_softmax(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(args, [&] { return run_topk(args); });
}

}  // namespace kd_gpu
