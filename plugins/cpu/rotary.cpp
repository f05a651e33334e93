// embeddings.rotary_embedding: rotates query and key in place by the angle of
// each token's position. cos_sin_cache[p] holds cos (R values) then sin (R).
// neox style pairs element i with i + R; GPT-J style pairs 2i with 2i + 1.
// (a, b) -> (a cos - b sin, b cos + a sin), in float, rounded to T once.

#include <algorithm>
#include <cinttypes>
#include <cstdint>

#include "half_float.hpp"
#include "kd_plugin.hpp"
#include "kernels.hpp"
#include "multiversion.hpp"
#include "parallel_for.hpp"
#include "tensor_access.hpp"

namespace kdispatch::cpu {
namespace {

constexpr const char* kOp = "embeddings.rotary_embedding";

// cos/sin are converted to float once per token and block of pairs, then
// reused for every head of that token.
constexpr int64_t kPairBlock = 256;

struct RotaryShape {
  int64_t heads_q;
  int64_t heads_k;
  int64_t half;  // R: pairs per head
};

template <bool kNeox, class T>
[[gnu::always_inline]] inline void rotate_head_block(T* head, const float* cos, const float* sin,
                                                     int64_t half, int64_t i0, int64_t n) {
  if constexpr (kNeox) {
    T* a = head + i0;
    T* b = head + half + i0;
    for (int64_t i = 0; i < n; ++i) {
      const float x = to_float(a[i]);
      const float y = to_float(b[i]);
      a[i] = from_float<T>(x * cos[i] - y * sin[i]);
      b[i] = from_float<T>(y * cos[i] + x * sin[i]);
    }
  } else {
    T* p = head + 2 * i0;
    for (int64_t i = 0; i < n; ++i) {
      const float x = to_float(p[2 * i]);
      const float y = to_float(p[2 * i + 1]);
      p[2 * i] = from_float<T>(x * cos[i] - y * sin[i]);
      p[2 * i + 1] = from_float<T>(y * cos[i] + x * sin[i]);
    }
  }
}

template <bool kNeox, class T>
KD_CPU_MULTIVERSION void rotary_tokens(const int64_t* positions, T* query, T* key,
                                       const T* cache, RotaryShape s, int64_t begin,
                                       int64_t end) {
  const int64_t width = 2 * s.half;
  float cos[kPairBlock];
  float sin[kPairBlock];
  for (int64_t t = begin; t < end; ++t) {
    const T* cs = cache + positions[t] * width;
    T* q = query + t * s.heads_q * width;
    T* k = key + t * s.heads_k * width;
    for (int64_t i0 = 0; i0 < s.half; i0 += kPairBlock) {
      const int64_t n = std::min(kPairBlock, s.half - i0);
      for (int64_t i = 0; i < n; ++i) {
        cos[i] = to_float(cs[i0 + i]);
        sin[i] = to_float(cs[s.half + i0 + i]);
      }
      for (int64_t h = 0; h < s.heads_q; ++h) {
        rotate_head_block<kNeox>(q + h * width, cos, sin, s.half, i0, n);
      }
      for (int64_t h = 0; h < s.heads_k; ++h) {
        rotate_head_block<kNeox>(k + h * width, cos, sin, s.half, i0, n);
      }
    }
  }
}

}  // namespace

kd_status rotary_embedding(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(args, [&]() -> kd_status {
    constexpr int kMinNdim[] = {1, 3, 3, 2};
    if (kd_status s = check_arguments(args, kOp, 1, kMinNdim); s != KD_STATUS_OK) return s;
    const DLTensor& positions = args->tensors[0];
    const DLTensor& query = args->tensors[1];
    const DLTensor& key = args->tensors[2];
    const DLTensor& cache = args->tensors[3];
    const int64_t tokens = leading_rows(positions, 0);
    const int64_t width = dim(cache, -1);
    const RotaryShape shape{dim(query, -2), dim(key, -2), width / 2};
    const int64_t cache_positions = dim(cache, 0);
    if (width % 2 != 0 || cache.ndim != 2 || dim(query, -1) != width || dim(key, -1) != width ||
        leading_rows(query, 2) != tokens || leading_rows(key, 2) != tokens) {
      return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT,
                             "%s: expected positions [*], query [*, HQ, 2*R], key [*, HK, 2*R], "
                             "cos_sin_cache [P, 2*R]",
                             kOp);
    }
    if (!is_dtype(positions, kDLInt, 64)) {
      return kd_plugin::fail(args, KD_STATUS_UNSUPPORTED, "%s: positions must be int64", kOp);
    }
    if (!same_dtype(query, key) || !same_dtype(query, cache)) {
      return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT, "%s: tensor dtypes differ", kOp);
    }
    const kd_attr* is_neox = attr_of_type(args, 0, KD_ATTR_TYPE_BOOL);
    if (is_neox == nullptr) {
      return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT,
                             "%s: attribute is_neox is not a bool", kOp);
    }
    // Every position is checked before anything is written, so a bad call
    // leaves query and key untouched.
    const int64_t* pos = data_as<const int64_t>(positions);
    for (int64_t t = 0; t < tokens; ++t) {
      if (pos[t] < 0 || pos[t] >= cache_positions) {
        return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT,
                               "%s: position %" PRId64 " of token %" PRId64
                               " is outside the cos_sin_cache [0, %" PRId64 ")",
                               kOp, pos[t], t, cache_positions);
      }
    }
    const bool neox = is_neox->value.b != 0;
    const int64_t work_per_token = (shape.heads_q + shape.heads_k) * width;
    return dispatch_float_dtype(args, kOp, query, [&](auto tag) {
      using T = typename decltype(tag)::type;
      T* q = data_as<T>(query);
      T* k = data_as<T>(key);
      const T* c = data_as<T>(cache);
      parallel_for(tokens, work_per_token, [&](int64_t begin, int64_t end) noexcept {
        if (neox) {
          rotary_tokens<true, T>(pos, q, k, c, shape, begin, end);
        } else {
          rotary_tokens<false, T>(pos, q, k, c, shape, begin, end);
        }
      });
      return KD_STATUS_OK;
    });
  });
}

}  // namespace kdispatch::cpu
