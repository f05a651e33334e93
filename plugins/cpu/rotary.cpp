// embeddings.rotary_embedding: rotates query and key in place by the angle of
// each token's position. cos_sin_cache[p] holds cos (R values) then sin (R).
// neox style pairs element i with i + R; GPT-J style pairs 2i with 2i + 1,
// both within the first 2R values of a head (the rest is left as it is).
// (a, b) -> (a cos - b sin, b cos + a sin), in float, rounded to T once.
//
// query and key are "rows" tensors: each head's values are contiguous, the
// heads and the tokens may have any strides (views into a fused QKV output).
// key may be absent. The cache is float32 or T, the positions int32 or int64.

#include <algorithm>
#include <atomic>
#include <cinttypes>
#include <cstdint>
#include <memory>
#include <new>
#include <type_traits>

#include <kdispatch/plugin_helpers.hpp>
#include <kdispatch/plugin_rows.hpp>

#include "convert.hpp"
#include "kd_plugin_kernels.hpp"
#include "multiversion.hpp"
#include "tensor_access.hpp"

namespace kdispatch::cpu {
namespace {

constexpr const char* kOp = "embeddings.rotary_embedding";

// One of query and key: its data, the element offset of each token's first
// head, the element stride between heads.
template <class T>
struct Heads {
  T* data = nullptr;
  kd_plugin::RowLayout tokens;
  int64_t head_stride = 0;
  int64_t count = 0;  // heads per token; 0 for an absent key
};

template <class T>
Heads<T> heads_of(const DLTensor& t) {
  Heads<T> h;
  if (t.data == nullptr && t.ndim == 0) return h;
  h.data = data_as<T>(t);
  h.tokens = kd_plugin::row_layout(t, 2);
  h.head_stride = kd_plugin::element_stride(t, t.ndim - 2);
  h.count = dim(t, -2);
  return h;
}

// Rotates the first 2 * half floats of a head, in place.
template <bool kNeox>
[[gnu::always_inline]] inline void rotate_head(float* head, const float* cos, const float* sin,
                                               int64_t half) {
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

// Rotates every head of token t: float data where it is, 16-bit data
// widened into `scratch`, rotated and narrowed back: all heads at once when
// they lie back to back and are rotated whole, else head by head.
template <bool kNeox, class T>
[[gnu::always_inline]] inline void rotate_token(const Heads<T>& x, int64_t t, const float* cos,
                                                const float* sin, int64_t half, float* scratch) {
  T* token = x.data + x.tokens.offset(t);
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t h = 0; h < x.count; ++h) rotate_head<kNeox>(token + h * x.head_stride, cos, sin, half);
  } else if (x.head_stride == 2 * half || x.count == 1) {
    widen(token, scratch, x.count * 2 * half);
    for (int64_t h = 0; h < x.count; ++h) rotate_head<kNeox>(scratch + h * 2 * half, cos, sin, half);
    narrow(scratch, token, x.count * 2 * half, Store::kCached);
  } else {
    for (int64_t h = 0; h < x.count; ++h) {
      T* head = token + h * x.head_stride;
      widen(head, scratch, 2 * half);
      rotate_head<kNeox>(scratch, cos, sin, half);
      narrow(scratch, head, 2 * half, Store::kCached);
    }
  }
}

// `scratch` holds 2 * half floats for the token's cos and sin (a 16-bit
// cache only), then room for the heads of query or key of one token (16-bit
// data only).
template <bool kNeox, class T, class C, class P>
KD_CPU_MULTIVERSION void rotary_tokens(const P* positions, Heads<T> query, Heads<T> key,
                                       const C* cache, int64_t half, float* scratch,
                                       int64_t begin, int64_t end) {
  const int64_t width = 2 * half;
  float* head_scratch = scratch + (std::is_same_v<C, float> ? 0 : width);
  for (int64_t t = begin; t < end; ++t) {
    const float* cos_sin = as_float(cache + static_cast<int64_t>(positions[t]) * width, scratch, width);
    const float* cos = cos_sin;
    const float* sin = cos_sin + half;
    rotate_token<kNeox>(query, t, cos, sin, half, head_scratch);
    if (key.count > 0) rotate_token<kNeox>(key, t, cos, sin, half, head_scratch);
  }
}

// Every position is checked before anything is written, so a bad call
// leaves query and key untouched.
template <class P>
kd_status check_positions(const kd_call_args* args, const P* pos, int64_t tokens, int64_t cache_positions) {
  for (int64_t t = 0; t < tokens; ++t) {
    if (pos[t] < 0 || pos[t] >= cache_positions) {
      return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT,
                             "%s: position %" PRId64 " of token %" PRId64
                             " is outside the cos_sin_cache [0, %" PRId64 ")",
                             kOp, static_cast<int64_t>(pos[t]), t, cache_positions);
    }
  }
  return KD_STATUS_OK;
}

template <class T, class C, class P>
kd_status run(const kd_call_args* args, const P* pos, const DLTensor& query, const DLTensor& key,
              const DLTensor& cache, int64_t tokens, bool neox) {
  const Heads<T> q = heads_of<T>(query);
  const Heads<T> k = heads_of<T>(key);
  const C* c = data_as<const C>(cache);
  const int64_t half = dim(cache, -1) / 2;
  const int64_t cache_floats = std::is_same_v<C, float> ? 0 : 2 * half;
  const int64_t head_floats = std::is_same_v<T, float> ? 0 : std::max(q.count, k.count) * 2 * half;
  const int64_t scratch_floats = cache_floats + head_floats;
  const int64_t work_per_token = (q.count + k.count) * 2 * half;
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
      rotary_tokens<true, T, C, P>(pos, q, k, c, half, scratch.get(), begin, end);
    } else {
      rotary_tokens<false, T, C, P>(pos, q, k, c, half, scratch.get(), begin, end);
    }
  });
  if (out_of_memory.load()) {
    return kd_plugin::fail(args, KD_STATUS_INTERNAL, "%s: out of host memory", kOp);
  }
  return KD_STATUS_OK;
}

}  // namespace

// kd_cpu_rotary_embedding
// Tensors (positions [*] int32 or int64, query [*, HQ, D], key [*, HK, D] or
// absent, cos_sin_cache [P, 2*R] float32 or T, 2*R <= D), attributes is_neox
// and head_size (the core has split flattened query and key already).
kd_status rotary_embedding(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(args, [&]() -> kd_status {
    constexpr int kMinNdim[] = {1, 3, 0, 2};  // key: optional
    if (kd_status s = check_arguments(args, kOp, 2, kMinNdim); s != KD_STATUS_OK) return s;
    const DLTensor& positions = args->tensors[0];
    const DLTensor& query = args->tensors[1];
    const DLTensor& key = args->tensors[2];
    const DLTensor& cache = args->tensors[3];
    const bool has_key = !(key.data == nullptr && key.ndim == 0);
    const int64_t tokens = leading_rows(positions, 0);
    const int64_t width = dim(cache, -1);
    const int64_t head_size = dim(query, -1);
    const int64_t cache_positions = dim(cache, 0);
    if (width % 2 != 0 || cache.ndim != 2 || width > head_size || leading_rows(query, 2) != tokens ||
        (has_key && (key.ndim < 3 || dim(key, -1) != head_size || leading_rows(key, 2) != tokens))) {
      return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT,
                             "%s: expected positions [*], query [*, HQ, D], key [*, HK, D], "
                             "cos_sin_cache [P, 2*R] with 2*R <= D",
                             kOp);
    }
    const bool pos32 = is_dtype(positions, kDLInt, 32);
    if (!pos32 && !is_dtype(positions, kDLInt, 64)) {
      return kd_plugin::fail(args, KD_STATUS_UNSUPPORTED, "%s: positions must be int32 or int64", kOp);
    }
    const bool cache32 = is_dtype(cache, kDLFloat, 32);
    if ((has_key && !same_dtype(query, key)) || (!cache32 && !same_dtype(query, cache))) {
      return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT,
                             "%s: key must have the dtype of query, cos_sin_cache that or float32", kOp);
    }
    const kd_attr* is_neox = find_attr(args, "is_neox", KD_ATTR_TYPE_BOOL);
    if (is_neox == nullptr) {
      return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT,
                             "%s: attribute is_neox is missing or not a bool", kOp);
    }
    const bool neox = is_neox->value.b != 0;
    auto with_positions = [&](auto pos_tag) -> kd_status {
      using P = typename decltype(pos_tag)::type;
      const P* pos = data_as<const P>(positions);
      if (kd_status s = check_positions(args, pos, tokens, cache_positions); s != KD_STATUS_OK) return s;
      if (tokens == 0 || width == 0) return KD_STATUS_OK;
      return dispatch_float_dtype(args, kOp, query, [&](auto tag) {
        using T = typename decltype(tag)::type;
        if (cache32) return run<T, float, P>(args, pos, query, key, cache, tokens, neox);
        return run<T, T, P>(args, pos, query, key, cache, tokens, neox);
      });
    };
    if (pos32) return with_positions(TypeTag<int32_t>{});
    return with_positions(TypeTag<int64_t>{});
  });
}

}  // namespace kdispatch::cpu
