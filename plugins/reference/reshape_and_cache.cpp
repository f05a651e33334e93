// kvcache.reshape_and_cache_flash with the cache in the activation dtype.
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include <kdispatch/plugin_helpers.hpp>

#include "kd_plugin_kernels.hpp"
#include "tensor.hpp"

namespace kdispatch::reference {

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
    const char* cache_dtype = kd_plugin::string_attr(args, "kv_cache_dtype");
    if (std::strcmp(cache_dtype, "auto") != 0) {
      throw std::invalid_argument(std::string("kvcache.reshape_and_cache_flash: kv_cache_dtype '") + cache_dtype +
                                  "': only \"auto\" (the caches in the activation dtype) is supported");
    }
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
        key_cache.set(slot * per_token + j, key.get(t * per_token + j));
        value_cache.set(slot * per_token + j, value.get(t * per_token + j));
      }
    }
  });
}

}  // namespace kdispatch::reference
