// kvcache.reshape_and_cache_flash with the cache in the activation dtype:
// token t with slot s >= 0 has its H rows of D values copied to rows
// s * H .. s * H + H - 1 of the caches seen as [NB * BS * H, D]; a slot
// s < 0 is skipped. Rows at any strides (row_layout), copied with memcpy
// (a copy is exact in every dtype); tokens in order.
#include <cstdint>
#include <cstring>

#include <kdispatch/plugin_helpers.hpp>
#include <kdispatch/plugin_rows.hpp>

#include "kd_plugin_kernels.hpp"
#include "tensor_access.hpp"

namespace kdispatch::cpu {
namespace {

constexpr const char* kOp = "kvcache.reshape_and_cache_flash";

template <class Slot>
kd_status copy_tokens(const kd_call_args* args, const Slot* slots, int64_t tokens, int64_t heads, int64_t cache_slots) {
  const DLTensor& key = args->tensors[0];
  const DLTensor& value = args->tensors[1];
  const DLTensor& key_cache = args->tensors[2];
  const DLTensor& value_cache = args->tensors[3];
  const kd_plugin::RowLayout key_rows = kd_plugin::row_layout(key, 1);
  const kd_plugin::RowLayout value_rows = kd_plugin::row_layout(value, 1);
  const kd_plugin::RowLayout key_cache_rows = kd_plugin::row_layout(key_cache, 1);
  const kd_plugin::RowLayout value_cache_rows = kd_plugin::row_layout(value_cache, 1);
  const size_t elem = key.dtype.bits / 8;
  const size_t row_bytes = static_cast<size_t>(dim(key, -1)) * elem;
  const char* k = data_as<const char>(key);
  const char* v = data_as<const char>(value);
  char* kc = data_as<char>(key_cache);
  char* vc = data_as<char>(value_cache);
  for (int64_t t = 0; t < tokens; ++t) {
    const auto s = static_cast<int64_t>(slots[t]);
    if (s < 0) continue;
    if (s >= cache_slots) {
      return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT,
                             "%s: slot_mapping[%lld] = %lld is beyond the caches' %lld slots", kOp,
                             static_cast<long long>(t), static_cast<long long>(s),
                             static_cast<long long>(cache_slots));
    }
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t src = t * heads + h;
      const int64_t dst = s * heads + h;
      std::memcpy(kc + key_cache_rows.offset(dst) * static_cast<int64_t>(elem),
                  k + key_rows.offset(src) * static_cast<int64_t>(elem), row_bytes);
      std::memcpy(vc + value_cache_rows.offset(dst) * static_cast<int64_t>(elem),
                  v + value_rows.offset(src) * static_cast<int64_t>(elem), row_bytes);
    }
  }
  return KD_STATUS_OK;
}

}  // namespace

kd_status reshape_and_cache_flash(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(args, [&]() -> kd_status {
    constexpr int kMinNdim[] = {3, 3, 4, 4, 1, 0, 0};
    if (kd_status s = check_arguments(args, kOp, 1, kMinNdim); s != KD_STATUS_OK) return s;
    const DLTensor& key = args->tensors[0];
    const DLTensor& value = args->tensors[1];
    const DLTensor& key_cache = args->tensors[2];
    const DLTensor& value_cache = args->tensors[3];
    const DLTensor& slots = args->tensors[4];
    const char* cache_dtype = kd_plugin::string_attr(args, "kv_cache_dtype");
    if (std::strcmp(cache_dtype, "auto") != 0) {
      return kd_plugin::fail(args, KD_STATUS_UNSUPPORTED,
                             "%s: kv_cache_dtype '%s': only \"auto\" (the caches in the activation dtype) is "
                             "supported",
                             kOp, cache_dtype);
    }
    const int64_t tokens = dim(key, 0);
    const int64_t heads = dim(key, 1);
    const int64_t d = dim(key, 2);
    const bool same_dims = key.ndim == 3 && value.ndim == 3 && key_cache.ndim == 4 && value_cache.ndim == 4 &&
                           slots.ndim == 1 && dim(slots, 0) == tokens && dim(value, 0) == tokens &&
                           dim(value, 1) == heads && dim(value, 2) == d && dim(key_cache, 2) == heads &&
                           dim(key_cache, 3) == d && dim(value_cache, 0) == dim(key_cache, 0) &&
                           dim(value_cache, 1) == dim(key_cache, 1) && dim(value_cache, 2) == heads &&
                           dim(value_cache, 3) == d;
    const bool slots64 = is_dtype(slots, kDLInt, 64);
    // The dtypes of its manifest entry: the copy itself would move any.
    const bool served = is_dtype(key, kDLFloat, 32) || is_dtype(key, kDLFloat, 16) || is_dtype(key, kDLBfloat, 16);
    if (!same_dims || !served || !(slots64 || is_dtype(slots, kDLInt, 32)) || !same_dtype(key, value) ||
        !same_dtype(key, key_cache) || !same_dtype(key, value_cache)) {
      return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT,
                             "%s: expected key and value [N, H, D], key_cache and value_cache [NB, BS, H, D] of "
                             "one dtype (float32, float16 or bfloat16), slot_mapping [N] int64 or int32",
                             kOp);
    }
    const int64_t cache_slots = dim(key_cache, 0) * dim(key_cache, 1);
    if (slots64) return copy_tokens(args, data_as<const int64_t>(slots), tokens, heads, cache_slots);
    return copy_tokens(args, data_as<const int32_t>(slots), tokens, heads, cache_slots);
  });
}

}  // namespace kdispatch::cpu
