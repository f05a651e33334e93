// embeddings.rotary_embedding: rotates query and key in place by the angle of
// each token's position. cos_sin_cache[p] holds cos (R values) then sin (R).
// neox style pairs element i with i + R; GPT-J style pairs 2i with 2i + 1.
// (a, b) -> (a cos - b sin, b cos + a sin), in float, rounded to T once.

#include <algorithm>
#include <atomic>
#include <cinttypes>
#include <cstdint>
#include <memory>
#include <new>
#include <type_traits>

#include <kdispatch/plugin_helpers.hpp>

#include "convert.hpp"
#include "kd_plugin_kernels.hpp"
#include "multiversion.hpp"
#include "tensor_access.hpp"

namespace kdispatch::cpu {
namespace {

constexpr const char* kOp = "embeddings.rotary_embedding";

struct RotaryShape {
  int64_t heads_q;
  int64_t heads_k;
  int64_t half;  // R: pairs per head
};

// Rotates `heads` heads of 2 * half floats each, in place.
template <bool kNeox>
[[gnu::always_inline]] inline void rotate_heads(float* v, const float* cos, const float* sin,
                                                int64_t heads, int64_t half) {
  for (int64_t h = 0; h < heads; ++h) {
    float* head = v + h * 2 * half;
    if constexpr (kNeox) {
      float* a = head;
      float* b = head + half;
      for (int64_t i = 0; i < half; ++i) {
        const float x = a[i];
        const float y = b[i];
        a[i] = x * cos[i] - y * sin[i];
        b[i] = y * cos[i] + x * sin[i];
      }
    } else {
      for (int64_t i = 0; i < half; ++i) {
        const float x = head[2 * i];
        const float y = head[2 * i + 1];
        head[2 * i] = x * cos[i] - y * sin[i];
        head[2 * i + 1] = y * cos[i] + x * sin[i];
      }
    }
  }
}

// All heads of one token are contiguous: float data is rotated where it is,
// 16-bit data is widened into `scratch` (room for the larger of q and k of one
// token), rotated, and narrowed back.
template <bool kNeox, class T>
[[gnu::always_inline]] inline void rotate_token(T* v, const float* cos, const float* sin,
                                                int64_t heads, int64_t half, float* scratch) {
  if constexpr (std::is_same_v<T, float>) {
    rotate_heads<kNeox>(v, cos, sin, heads, half);
  } else {
    const int64_t n = heads * 2 * half;
    widen(v, scratch, n);
    rotate_heads<kNeox>(scratch, cos, sin, heads, half);
    narrow(scratch, v, n, Store::kCached);
  }
}

// `scratch` holds 2 * half floats for the token's cos and sin, then room for
// the token's query or key heads (16-bit types only).
template <bool kNeox, class T>
KD_CPU_MULTIVERSION void rotary_tokens(const int64_t* positions, T* query, T* key,
                                       const T* cache, RotaryShape s, float* scratch,
                                       int64_t begin, int64_t end) {
  const int64_t width = 2 * s.half;
  for (int64_t t = begin; t < end; ++t) {
    const float* cos_sin = as_float(cache + positions[t] * width, scratch, width);
    const float* cos = cos_sin;
    const float* sin = cos_sin + s.half;
    // Float data needs no scratch (and gets none).
    float* heads = std::is_same_v<T, float> ? nullptr : scratch + width;
    rotate_token<kNeox>(query + t * s.heads_q * width, cos, sin, s.heads_q, s.half, heads);
    rotate_token<kNeox>(key + t * s.heads_k * width, cos, sin, s.heads_k, s.half, heads);
  }
}

}  // namespace

// kd_cpu_rotary_embedding
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
    const kd_attr* is_neox = find_attr(args, "is_neox", KD_ATTR_TYPE_BOOL);
    if (is_neox == nullptr) {
      return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT,
                             "%s: attribute is_neox is missing or not a bool", kOp);
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
      const int64_t scratch_floats =
          std::is_same_v<T, float> ? 0 : (1 + std::max(shape.heads_q, shape.heads_k)) * width;
      std::atomic<bool> out_of_memory{false};
      kd_plugin::parallel_for(tokens, work_per_token, [&](int64_t begin, int64_t end) noexcept {
        std::unique_ptr<float[]> scratch;
        if (scratch_floats > 0) {
          scratch.reset(new (std::nothrow) float[scratch_floats]);
          if (!scratch) {
            out_of_memory.store(true, std::memory_order_relaxed);
            return;
          }
        }
        if (neox) {
          rotary_tokens<true, T>(pos, q, k, c, shape, scratch.get(), begin, end);
        } else {
          rotary_tokens<false, T>(pos, q, k, c, shape, scratch.get(), begin, end);
        }
      });
      if (out_of_memory.load()) {
        return kd_plugin::fail(args, KD_STATUS_INTERNAL, "%s: out of host memory", kOp);
      }
      return KD_STATUS_OK;
    });
  });
}

}  // namespace kdispatch::cpu
