// kvcache.reshape_and_cache_flash: the caches in the activation dtype (a
// copy) or in an fp8 dtype (each value divided by its cache's scale in
// float32, as vLLM computes it, and rounded once, saturating).
#include <cstdint>
#include <stdexcept>
#include <string>

#include <kdispatch/plugin_helpers.hpp>

#include "kd_plugin_kernels.hpp"
#include "tensor.hpp"

namespace kdispatch::reference {

namespace {

// The fp8 kind kv_cache_dtype names ("fp8" and "fp8_e4m3": float8_e4m3fn,
// "fp8_e5m2"), or "" for "auto"; anything else throws.
std::string named_fp8_cache_dtype(const char* cache_dtype) {
  const std::string name = cache_dtype;
  if (name == "auto") return "";
  if (name == "fp8" || name == "fp8_e4m3") return "float8_e4m3fn";
  if (name == "fp8_e5m2") return "float8_e5m2";
  throw std::invalid_argument("kvcache.reshape_and_cache_flash: kv_cache_dtype '" + name +
                              "': expected \"auto\", \"fp8\", \"fp8_e4m3\" or \"fp8_e5m2\"");
}

}  // namespace

// kd_ref_reshape_and_cache_flash
// Tensors (key [N, H, D], value [N, H, D], key_cache [NB, BS, H, D],
// value_cache [NB, BS, H, D], slot_mapping [N], k_scale [1] and v_scale [1]
// optional), attribute kv_cache_dtype. Token t with slot s >= 0: its H x D
// values go to element s of the caches seen as [NB * BS, H, D]; a slot
// s < 0 is skipped; tokens in order, so a later one overwrites an earlier
// one of the same slot.
kd_status reshape_and_cache_flash(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(args, [&] {
    expect_arity(args, 7, 1, "kvcache.reshape_and_cache_flash");
    const Tensor key(args->tensors[0]), value(args->tensors[1]), key_cache(args->tensors[2]),
        value_cache(args->tensors[3]), slots(args->tensors[4]);
    const std::string fp8 = named_fp8_cache_dtype(kd_plugin::string_attr(args, "kv_cache_dtype"));
    for (int i : {2, 3}) {
      if (!fp8.empty() && fp8 != kd_plugin::dtype_name(args->tensors[i])) {
        throw std::invalid_argument(std::string("kvcache.reshape_and_cache_flash: kv_cache_dtype '") +
                                    kd_plugin::string_attr(args, "kv_cache_dtype") + "' needs " + fp8 + " caches, " +
                                    (i == 2 ? "key_cache" : "value_cache") + " is " +
                                    kd_plugin::dtype_name(args->tensors[i]));
      }
    }
    // A cache in the activation dtype takes a copy; an fp8 one x / scale,
    // the quotient in float32, rounded once (set()) to the cache's dtype.
    const auto scale_of = [&](int i) {
      return args->tensors[i].data == nullptr ? 1.0f : static_cast<float>(Tensor(args->tensors[i]).get(0));
    };
    const bool key_copy = kd_plugin::same_dtype(args->tensors[0], args->tensors[2]);
    const bool value_copy = kd_plugin::same_dtype(args->tensors[1], args->tensors[3]);
    const float k_scale = scale_of(5), v_scale = scale_of(6);
    const auto stored = [](bool copy, double x, float scale) {
      return copy ? x : static_cast<double>(static_cast<float>(x) / scale);
    };
    const int64_t tokens = slots.numel();
    const int64_t per_token = key.numel() / (tokens > 0 ? tokens : 1);  // H x D
    const int64_t cache_slots = key_cache.numel() / (per_token > 0 ? per_token : 1);
    for (int64_t t = 0; t < tokens; ++t) {
      const double s = slots.get(t);
      if (s < 0) continue;
      if (s >= static_cast<double>(cache_slots)) {
        throw std::invalid_argument("kvcache.reshape_and_cache_flash: slot_mapping[" + std::to_string(t) + "] = " +
                                    std::to_string(static_cast<int64_t>(s)) + " is beyond the caches' " +
                                    std::to_string(cache_slots) + " slots");
      }
      const auto slot = static_cast<int64_t>(s);
      for (int64_t j = 0; j < per_token; ++j) {
        key_cache.set(slot * per_token + j, stored(key_copy, key.get(t * per_token + j), k_scale));
        value_cache.set(slot * per_token + j, stored(value_copy, value.get(t * per_token + j), v_scale));
      }
    }
  });
}

}  // namespace kdispatch::reference
