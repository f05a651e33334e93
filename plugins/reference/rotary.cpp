// embeddings.rotary_embedding in float64, neox and GPT-J styles, with
// partial rotary (the first 2*R values of each head rotated, the rest kept).
#include <string>

#include <kdispatch/plugin_helpers.hpp>

#include "kd_plugin_kernels.hpp"
#include "tensor.hpp"

namespace kdispatch::reference {
namespace {

// Rotates the first 2*r values of head `h` of token `t` of `x` [tokens,
// heads, D] by the angles whose cos and sin are `cos_sin[p, :r]` and
// `cos_sin[p, r:]`. Indices are logical row-major ones; Tensor maps them
// through the strides.
void rotate(const Tensor& x, int64_t t, int64_t h, const Tensor& cos_sin, int64_t p, int64_t r, bool is_neox) {
  const int64_t heads = x.dim(-2);
  const int64_t base = (t * heads + h) * x.dim(-1);
  for (int64_t i = 0; i < r; ++i) {
    const int64_t ia = base + (is_neox ? i : 2 * i);
    const int64_t ib = base + (is_neox ? i + r : 2 * i + 1);
    const double cos = cos_sin.get(p * 2 * r + i);
    const double sin = cos_sin.get(p * 2 * r + r + i);
    const double a = x.get(ia);
    const double b = x.get(ib);
    x.set(ia, a * cos - b * sin);
    x.set(ib, b * cos + a * sin);
  }
}

}  // namespace

// kd_ref_rotary_embedding
// Tensors (positions [*] int32 or int64, query [*, HQ, D], key [*, HK, D] or
// absent, cos_sin_cache [P, 2*R] float32 or the dtype of query), attributes
// is_neox and head_size (the core has split flattened query and key
// already). A position outside [0, P) is refused before anything is written.
kd_status rotary_embedding(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(args, [&] {
    expect_arity(args, 4, 2, "embeddings.rotary_embedding");
    const DLTensor& key_arg = args->tensors[2];
    const bool has_key = !(key_arg.data == nullptr && key_arg.ndim == 0);
    const Tensor positions(args->tensors[0]), query(args->tensors[1]), cache(args->tensors[3]);
    const bool is_neox = kd_plugin::bool_attr(args, "is_neox");
    const int64_t r = cache.dim(-1) / 2;
    const int64_t cache_rows = cache.dim(0);
    for (int64_t t = 0; t < positions.numel(); ++t) {
      const double p = positions.get(t);
      if (p < 0 || p >= static_cast<double>(cache_rows)) {
        throw std::invalid_argument("embeddings.rotary_embedding: token " + std::to_string(t) + " has position " +
                                    std::to_string(static_cast<int64_t>(p)) + ", outside the cache [0, " +
                                    std::to_string(cache_rows) + ")");
      }
    }
    for (int64_t t = 0; t < positions.numel(); ++t) {
      const auto p = static_cast<int64_t>(positions.get(t));
      for (int64_t h = 0; h < query.dim(-2); ++h) rotate(query, t, h, cache, p, r, is_neox);
    }
    if (!has_key) return;
    const Tensor key(key_arg);
    for (int64_t t = 0; t < positions.numel(); ++t) {
      const auto p = static_cast<int64_t>(positions.get(t));
      for (int64_t h = 0; h < key.dim(-2); ++h) rotate(key, t, h, cache, p, r, is_neox);
    }
  });
}

}  // namespace kdispatch::reference
