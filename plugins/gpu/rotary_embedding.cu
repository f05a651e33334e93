// embeddings.rotary_embedding: rotates query and key in place by the angle of
// each token's position; cos_sin_cache[p] = (cos[0..R), sin[0..R)).
//   neox:  pairs (i, i + R)     for i < R, angle i
//   GPT-J: pairs (2i, 2i + 1)   for i < R, angle i
//   (a, b) -> (a cos - b sin, b cos + a sin), in float32, rounded once.
//
// A position outside [0, P) is a caller error that the host cannot check
// without reading device memory. Such a token is skipped: its query and key
// keep their values and nothing outside the cache is read.
//
// One block per token (the kernel loops only past 2^31-1 tokens); a thread takes one unit
// of a head at a time: N rotated pairs of neox (two 16-byte vectors of the
// head plus one each of cos and sin) or a 16-byte vector of N/2 GPT-J pairs.
// The cache row of a token is shared by all its heads and stays in L1.
// Blocks of at most 256 threads, a thread taking units in as many rounds as
// the token needs.
#include "device_utils.cuh"
#include "launch_utils.hpp"
#include "ops.hpp"

namespace kd_gpu {
namespace {

constexpr int kMaxThreads = 256;

template <class T, int N, bool kNeox, bool kAligned>
__global__ void __launch_bounds__(kMaxThreads)
    rotary(const int64_t* positions, T* query, T* key, const T* cache, int64_t tokens,
           int64_t max_position, int q_heads, int k_heads, int rot) {
  start_after_previous_kernel();
  const int dim = 2 * rot;
  const int units_per_head = kNeox ? rot / N : dim / N;
  const int units = (q_heads + k_heads) * units_per_head;
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    // A token out of range reads cache row 0 (max_position > 0) and writes
    // its values back unchanged: no branch, so the head loads are issued
    // without waiting for the position.
    const int64_t pos = positions[t];
    const bool in_range = pos >= 0 && pos < max_position;
    const T* cos_row = cache + (in_range ? pos : 0) * dim;
    const T* sin_row = cos_row + rot;
    T* q = query + t * q_heads * dim;
    T* k = key + t * k_heads * dim;
    for (int u = threadIdx.x; u < units; u += blockDim.x) {
      const int head = u / units_per_head;
      const int e = (u - head * units_per_head) * N;
      T* h = head < q_heads ? q + static_cast<int64_t>(head) * dim
                            : k + static_cast<int64_t>(head - q_heads) * dim;
      if constexpr (kNeox) {
        const Vec<T, N> x1 = load_vec<T, N, kAligned>(h + e);
        const Vec<T, N> x2 = load_vec<T, N, kAligned>(h + rot + e);
        const Vec<T, N> c = load_vec<T, N, kAligned>(cos_row + e);
        const Vec<T, N> s = load_vec<T, N, kAligned>(sin_row + e);
        Vec<T, N> y1;
        Vec<T, N> y2;
#pragma unroll
        for (int i = 0; i < N; ++i) {
          const float a = to_float(x1.v[i]);
          const float b = to_float(x2.v[i]);
          const float cf = to_float(c.v[i]);
          const float sf = to_float(s.v[i]);
          y1.v[i] = in_range ? from_float<T>(a * cf - b * sf) : x1.v[i];
          y2.v[i] = in_range ? from_float<T>(b * cf + a * sf) : x2.v[i];
        }
        store_vec<T, N, kAligned>(h + e, y1);
        store_vec<T, N, kAligned>(h + rot + e, y2);
      } else {
        constexpr int kPairs = N / 2;
        const Vec<T, N> x = load_vec<T, N, kAligned>(h + e);
        const Vec<T, kPairs> c = load_vec<T, kPairs, kAligned>(cos_row + e / 2);
        const Vec<T, kPairs> s = load_vec<T, kPairs, kAligned>(sin_row + e / 2);
        Vec<T, N> y;
#pragma unroll
        for (int i = 0; i < kPairs; ++i) {
          const float a = to_float(x.v[2 * i]);
          const float b = to_float(x.v[2 * i + 1]);
          const float cf = to_float(c.v[i]);
          const float sf = to_float(s.v[i]);
          y.v[2 * i] = in_range ? from_float<T>(a * cf - b * sf) : x.v[2 * i];
          y.v[2 * i + 1] = in_range ? from_float<T>(b * cf + a * sf) : x.v[2 * i + 1];
        }
        store_vec<T, N, kAligned>(h + e, y);
      }
    }
  }
}

template <class T>
void launch_rotary(const Launch& launch, const int64_t* positions, T* query, T* key,
                   const T* cache, int64_t tokens, int64_t max_position, int q_heads,
                   int k_heads, int rot, bool neox) {
  constexpr int kVec = 16 / sizeof(T);
  // 16-byte head vectors; GPT-J reads cos and sin by halves (8 bytes).
  const bool vectorized =
      neox ? rot % kVec == 0 && all_aligned(16, {query, key, cache})
           : rot % (kVec / 2) == 0 && all_aligned(16, {query, key}) && all_aligned(8, {cache});
  // Without vectors: neox moves single elements, GPT-J single pairs.
  const int n = vectorized ? kVec : (neox ? 1 : 2);
  const int units = (q_heads + k_heads) * (neox ? rot / n : 2 * rot / n);
  // As many rounds as needed, each thread taking the same number of units
  // (neox with 40 heads of 128 has 320 units: 2 x 160 threads, not 256 + 64).
  const int rounds = (units + kMaxThreads - 1) / kMaxThreads;
  const int threads = std::min(kMaxThreads, round_up((units + rounds - 1) / rounds, launch.warp_size));
  const int64_t grid = std::min<int64_t>(tokens, INT32_MAX);
  auto run = [&](auto kernel) {
    launch_kernel(launch, kernel, static_cast<unsigned>(grid), threads, positions, query, key, cache,
                  tokens, max_position, q_heads, k_heads, rot);
  };
  if (neox) {
    if (vectorized) {
      run(rotary<T, kVec, true, true>);
    } else {
      run(rotary<T, 1, true, true>);
    }
  } else {
    if (vectorized) {
      run(rotary<T, kVec, false, true>);
    } else {
      run(rotary<T, 2, false, false>);
    }
  }
}

// Tensors: positions [*] int64, query [*, HQ, 2R], key [*, HK, 2R],
// cos_sin_cache [P, 2R]; attribute is_neox.
kd_status run_rotary(const kd_call_args* args) {
  constexpr const char* op = "rotary_embedding";
  if (kd_status s = check_call(args, op, 4, 1); s != KD_STATUS_OK) return s;
  const DLTensor& positions = args->tensors[0];
  const DLTensor& query = args->tensors[1];
  const DLTensor& key = args->tensors[2];
  const DLTensor& cache = args->tensors[3];
  if (positions.ndim < 1 || query.ndim != positions.ndim + 2 || key.ndim != query.ndim ||
      cache.ndim != 2) {
    return invalid_shapes(args, op);
  }
  const int64_t tokens = leading_rows(positions, 0);
  const int64_t head_dim = dim(query, -1);
  const int64_t q_heads = query.shape[query.ndim - 2];
  const int64_t k_heads = key.shape[key.ndim - 2];
  if (head_dim % 2 != 0 || dim(key, -1) != head_dim || cache.shape[1] != head_dim ||
      leading_rows(query, 2) != tokens || leading_rows(key, 2) != tokens) {
    return invalid_shapes(args, op);
  }
  if (!is_dtype(positions, kDLInt, 64)) {
    return kd_plugin::fail(args, KD_STATUS_UNSUPPORTED, "%s: positions are not int64", op);
  }
  if (!same_dtype(query, key) || !same_dtype(query, cache)) {
    return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT, "%s: tensors differ in dtype", op);
  }
  if ((q_heads + k_heads) * head_dim > INT32_MAX) {
    return kd_plugin::fail(args, KD_STATUS_UNSUPPORTED, "%s: more than 2^31-1 values per token",
                           op);
  }
  bool neox = true;
  if (kd_status s = attr_bool(args, op, 0, &neox); s != KD_STATUS_OK) return s;
  // No cache rows: every position is out of range, every token is skipped.
  if (tokens == 0 || head_dim == 0 || q_heads + k_heads == 0 || cache.shape[0] == 0) {
    return KD_STATUS_OK;
  }
  return launch_for_dtype(args, op, query, [&](auto tag, const Launch& launch) {
    using T = typename decltype(tag)::type;
    launch_rotary<T>(launch, data_as<const int64_t>(positions), data_as<T>(query),
                     data_as<T>(key), data_as<const T>(cache), tokens, cache.shape[0],
                     static_cast<int>(q_heads), static_cast<int>(k_heads),
                     static_cast<int>(head_dim / 2), neox);
  });
}

}  // namespace

// kd_cuda_rotary_embedding, kd_hip_rotary_embedding
kd_status rotary_embedding(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(args, [&] { return run_rotary(args); });
}

}  // namespace kd_gpu
