// embeddings.rotary_embedding: rotates query and key in place by the angle of
// each token's position; cos_sin_cache[p] = (cos[0..R), sin[0..R)).
//   neox:  pairs (i, i + R)     for i < R, angle i
//   GPT-J: pairs (2i, 2i + 1)   for i < R, angle i
//   (a, b) -> (a cos - b sin, b cos + a sin), in float32, rounded once.
// Only the first 2R values of each head are touched (partial rotary: the
// head size D may exceed 2R).
//
// query and key are "rows" tensors: each head's D values are contiguous,
// heads and tokens have any strides (views into a fused QKV output), with
// 64-bit offsets. key may be absent (no data, no dims). The cache is float32
// or the dtype of query; positions are int32 or int64.
//
// A position outside [0, P) is a caller error that the host cannot check
// without reading device memory. Such a token is skipped: its query and key
// keep their values and nothing outside the cache is read.
//
// One block per token (the kernel loops only past 2^31-1 tokens); a thread takes one unit
// of a head at a time: N rotated pairs of neox (two 16-byte vectors of the
// head plus N values each of cos and sin) or a 16-byte vector of N/2 GPT-J
// pairs. The cache row of a token is shared by all its heads and stays in L1.
// Blocks of at most 256 threads, a thread taking units in as many rounds as
// the token needs.
#include <kdispatch/plugin_rows.hpp>

#include "device_utils.cuh"
#include "launch_utils.hpp"
#include "ops.hpp"

namespace kd_gpu {
namespace {

constexpr int kMaxThreads = 256;

// Where one of query and key lies: the token rows, the stride between heads.
template <class T>
struct HeadsArg {
  T* data;
  kd_plugin::RowLayout tokens;
  int64_t head_stride;
  int heads;  // 0 for an absent key
};

// N values of the cache as float, in 16-byte loads at most.
template <class C, int N, bool kAligned>
__device__ __forceinline__ void load_floats(const C* p, float (&out)[N]) {
  constexpr int kChunk = sizeof(C) * N > 16 ? static_cast<int>(16 / sizeof(C)) : N;
#pragma unroll
  for (int c = 0; c < N; c += kChunk) {
    const Vec<C, kChunk> v = load_vec<C, kChunk, kAligned>(p + c);
#pragma unroll
    for (int i = 0; i < kChunk; ++i) out[c + i] = to_float(v.v[i]);
  }
}

template <class T, class C, int N, bool kNeox, bool kAligned>
__global__ void __launch_bounds__(kMaxThreads)
    rotary(const void* positions, bool positions32, HeadsArg<T> query, HeadsArg<T> key,
           const C* cache, int64_t tokens, int64_t max_position, int rot) {
  start_after_previous_kernel();
  const int dim = 2 * rot;
  const int units_per_head = kNeox ? rot / N : dim / N;
  const int units = (query.heads + key.heads) * units_per_head;
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    // A token out of range reads cache row 0 (max_position > 0) and writes
    // its values back unchanged: no branch, so the head loads are issued
    // without waiting for the position.
    const int64_t pos = positions32 ? static_cast<int64_t>(static_cast<const int32_t*>(positions)[t])
                                    : static_cast<const int64_t*>(positions)[t];
    const bool in_range = pos >= 0 && pos < max_position;
    const C* cos_row = cache + (in_range ? pos : 0) * dim;
    const C* sin_row = cos_row + rot;
    T* q = query.data + query.tokens.offset(t);
    T* k = key.heads > 0 ? key.data + key.tokens.offset(t) : nullptr;
    for (int u = threadIdx.x; u < units; u += blockDim.x) {
      const int head = u / units_per_head;
      const int e = (u - head * units_per_head) * N;
      T* h = head < query.heads ? q + head * query.head_stride : k + (head - query.heads) * key.head_stride;
      if constexpr (kNeox) {
        const Vec<T, N> x1 = load_vec<T, N, kAligned>(h + e);
        const Vec<T, N> x2 = load_vec<T, N, kAligned>(h + rot + e);
        float c[N];
        float s[N];
        load_floats<C, N, kAligned>(cos_row + e, c);
        load_floats<C, N, kAligned>(sin_row + e, s);
        Vec<T, N> y1;
        Vec<T, N> y2;
#pragma unroll
        for (int i = 0; i < N; ++i) {
          const float a = to_float(x1.v[i]);
          const float b = to_float(x2.v[i]);
          y1.v[i] = in_range ? from_float<T>(a * c[i] - b * s[i]) : x1.v[i];
          y2.v[i] = in_range ? from_float<T>(b * c[i] + a * s[i]) : x2.v[i];
        }
        store_vec<T, N, kAligned>(h + e, y1);
        store_vec<T, N, kAligned>(h + rot + e, y2);
      } else {
        constexpr int kPairs = N / 2;
        const Vec<T, N> x = load_vec<T, N, kAligned>(h + e);
        float c[kPairs];
        float s[kPairs];
        load_floats<C, kPairs, kAligned>(cos_row + e / 2, c);
        load_floats<C, kPairs, kAligned>(sin_row + e / 2, s);
        Vec<T, N> y;
#pragma unroll
        for (int i = 0; i < kPairs; ++i) {
          const float a = to_float(x.v[2 * i]);
          const float b = to_float(x.v[2 * i + 1]);
          y.v[2 * i] = in_range ? from_float<T>(a * c[i] - b * s[i]) : x.v[2 * i];
          y.v[2 * i + 1] = in_range ? from_float<T>(b * c[i] + a * s[i]) : x.v[2 * i + 1];
        }
        store_vec<T, N, kAligned>(h + e, y);
      }
    }
  }
}

template <class T>
HeadsArg<T> heads_arg(const DLTensor& t) {
  HeadsArg<T> h{nullptr, {}, 0, 0};
  if (t.data == nullptr && t.ndim == 0) return h;
  h.data = data_as<T>(t);
  h.tokens = kd_plugin::row_layout(t, 2);
  h.head_stride = kd_plugin::element_stride(t, t.ndim - 2);
  h.heads = static_cast<int>(t.shape[t.ndim - 2]);
  return h;
}

// Whether every head of `h` starts on a multiple of `elems` elements from an
// address aligned to `bytes`.
template <class T>
bool heads_aligned(const HeadsArg<T>& h, size_t bytes, int64_t elems) {
  if (h.heads == 0) return true;
  if (!all_aligned(bytes, {h.data})) return false;
  if (h.heads > 1 && h.head_stride % elems != 0) return false;
  for (int d = 0; d < h.tokens.ndim; ++d) {
    if (h.tokens.stride[d] % elems != 0) return false;
  }
  return true;
}

template <class T, class C>
void launch_rotary(const Launch& launch, const void* positions, bool positions32, const HeadsArg<T>& query,
                   const HeadsArg<T>& key, const C* cache, int64_t tokens, int64_t max_position,
                   int rot, bool neox) {
  constexpr int kVec = 16 / sizeof(T);
  // 16-byte head vectors; the cache read by N (neox) or N/2 (GPT-J) values.
  const size_t cache_bytes = std::min<size_t>(16, sizeof(C) * (neox ? kVec : kVec / 2));
  const bool vectorized = rot % (neox ? kVec : kVec / 2) == 0 && heads_aligned(query, 16, kVec) &&
                          heads_aligned(key, 16, kVec) && all_aligned(cache_bytes, {cache});
  // Without vectors: neox moves single elements, GPT-J single pairs.
  const int n = vectorized ? kVec : (neox ? 1 : 2);
  const int units = (query.heads + key.heads) * (neox ? rot / n : 2 * rot / n);
  // As many rounds as needed, each thread taking the same number of units
  // (neox with 40 heads of 128 has 320 units: 2 x 160 threads, not 256 + 64).
  const int rounds = (units + kMaxThreads - 1) / kMaxThreads;
  const int threads = std::min(kMaxThreads, round_up((units + rounds - 1) / rounds, launch.warp_size));
  const int64_t grid = std::min<int64_t>(tokens, INT32_MAX);
  auto run = [&](auto kernel) {
    launch_kernel(launch, kernel, static_cast<unsigned>(grid), threads, positions, positions32, query, key,
                  cache, tokens, max_position, rot);
  };
  if (neox) {
    if (vectorized) {
      run(rotary<T, C, kVec, true, true>);
    } else {
      run(rotary<T, C, 1, true, true>);
    }
  } else {
    if (vectorized) {
      run(rotary<T, C, kVec, false, true>);
    } else {
      run(rotary<T, C, 2, false, false>);
    }
  }
}

// Tensors: positions [*] int32 or int64, query [*, HQ, D], key [*, HK, D]
// or absent, cos_sin_cache [P, 2R] float32 or the dtype of query, 2R <= D;
// attribute is_neox.
kd_status run_rotary(const kd_call_args* args) {
  constexpr const char* op = "rotary_embedding";
  if (kd_status s = check_call(args, op, 4, 1); s != KD_STATUS_OK) return s;
  const DLTensor& positions = args->tensors[0];
  const DLTensor& query = args->tensors[1];
  const DLTensor& key = args->tensors[2];
  const DLTensor& cache = args->tensors[3];
  const bool has_key = !(key.data == nullptr && key.ndim == 0);
  if (positions.ndim < 1 || query.ndim != positions.ndim + 2 || (has_key && key.ndim != query.ndim) ||
      cache.ndim != 2) {
    return invalid_shapes(args, op);
  }
  const int64_t tokens = leading_rows(positions, 0);
  const int64_t head_size = dim(query, -1);
  const int64_t width = cache.shape[1];
  const int64_t q_heads = query.shape[query.ndim - 2];
  const int64_t k_heads = has_key ? key.shape[key.ndim - 2] : 0;
  if (width % 2 != 0 || width > head_size || leading_rows(query, 2) != tokens ||
      (has_key && (dim(key, -1) != head_size || leading_rows(key, 2) != tokens))) {
    return invalid_shapes(args, op);
  }
  const bool positions32 = is_dtype(positions, kDLInt, 32);
  if (!positions32 && !is_dtype(positions, kDLInt, 64)) {
    return kd_plugin::fail(args, KD_STATUS_UNSUPPORTED, "%s: positions are not int32 or int64", op);
  }
  const bool cache32 = is_dtype(cache, kDLFloat, 32);
  if ((has_key && !same_dtype(query, key)) || (!cache32 && !same_dtype(query, cache))) {
    return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT,
                           "%s: key differs from query in dtype, or cos_sin_cache is neither float32 "
                           "nor the dtype of query",
                           op);
  }
  if ((q_heads + k_heads) * width > INT32_MAX) {
    return kd_plugin::fail(args, KD_STATUS_UNSUPPORTED, "%s: more than 2^31-1 rotated values per token",
                           op);
  }
  bool neox = true;
  if (kd_status s = attr_bool(args, op, 0, &neox); s != KD_STATUS_OK) return s;
  // No cache rows: every position is out of range, every token is skipped.
  if (tokens == 0 || width == 0 || q_heads + k_heads == 0 || cache.shape[0] == 0) {
    return KD_STATUS_OK;
  }
  return launch_for_dtype(args, op, query, [&](auto tag, const Launch& launch) {
    using T = typename decltype(tag)::type;
    const HeadsArg<T> q = heads_arg<T>(query);
    const HeadsArg<T> k = heads_arg<T>(key);
    const int rot = static_cast<int>(width / 2);
    const void* pos = positions32 ? static_cast<const void*>(data_as<const int32_t>(positions))
                                  : static_cast<const void*>(data_as<const int64_t>(positions));
    if (cache32) {
      launch_rotary<T, float>(launch, pos, positions32, q, k, data_as<const float>(cache), tokens,
                              cache.shape[0], rot, neox);
    } else {
      launch_rotary<T, T>(launch, pos, positions32, q, k, data_as<const T>(cache), tokens,
                          cache.shape[0], rot, neox);
    }
  });
}

}  // namespace

// kd_cuda_rotary_embedding, kd_hip_rotary_embedding
kd_status rotary_embedding(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(args, [&] { return run_rotary(args); });
}

}  // namespace kd_gpu
