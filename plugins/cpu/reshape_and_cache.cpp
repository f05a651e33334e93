// kvcache.reshape_and_cache_flash: token t with slot s >= 0 has its H rows
// of D values written to rows s * H .. s * H + H - 1 of the caches seen as
// [NB * BS * H, D]; a slot s < 0 is skipped. A cache in the activation dtype
// takes a copy (memcpy: exact in every dtype); an fp8 cache takes each value
// divided by the cache's scale in float32 and rounded once, saturating, as
// vLLM does. Rows at any strides (row_layout); tokens in order.
#include <cstdint>
#include <cstring>

#include <kdispatch/plugin_helpers.hpp>
#include <kdispatch/plugin_rows.hpp>

#include "kd_plugin_kernels.hpp"
#include "tensor_access.hpp"

namespace kdispatch::cpu {
namespace {

constexpr const char* kOp = "kvcache.reshape_and_cache_flash";

// Writes one row of `d` values of the activation dtype at `src` into a
// cache row at `dst`, dividing by `scale`.
using RowWriter = void (*)(const char* src, char* dst, int64_t d, float scale);

template <class T, class C>
void convert_row(const char* src, char* dst, int64_t d, float scale) {
  const T* in = reinterpret_cast<const T*>(src);
  C* out = reinterpret_cast<C*>(dst);
  for (int64_t i = 0; i < d; ++i) out[i] = kd_plugin::from_float<C>(kd_plugin::to_float(in[i]) / scale);
}

template <class T>
RowWriter writer_to(const DLTensor& cache) {
  if (is_dtype(cache, KD_DLPACK_FLOAT8_E4M3FN, 8)) return convert_row<T, kd_plugin::Float8E4M3FN>;
  if (is_dtype(cache, KD_DLPACK_FLOAT8_E5M2, 8)) return convert_row<T, kd_plugin::Float8E5M2>;
  return nullptr;
}

// The writer from `src`'s dtype (float32, float16 or bfloat16) to
// `cache`'s: nullptr for a copy (one dtype), else a conversion to
// float8_e4m3fn or float8_e5m2.
RowWriter row_writer(const DLTensor& src, const DLTensor& cache) {
  if (same_dtype(src, cache)) return nullptr;
  if (is_dtype(src, kDLFloat, 16)) return writer_to<kd_plugin::Float16>(cache);
  if (is_dtype(src, kDLBfloat, 16)) return writer_to<kd_plugin::BFloat16>(cache);
  return writer_to<float>(cache);
}

// One of the two caches: where its token rows come from and go to.
struct CacheSide {
  const char* src;
  char* dst;
  kd_plugin::RowLayout src_rows, dst_rows;
  int64_t src_elem, dst_elem;
  RowWriter writer;  // nullptr: memcpy
  float scale;

  void write(int64_t src_row, int64_t dst_row, int64_t d) const {
    const char* from = src + src_rows.offset(src_row) * src_elem;
    char* to = dst + dst_rows.offset(dst_row) * dst_elem;
    if (writer == nullptr) {
      std::memcpy(to, from, static_cast<size_t>(d * src_elem));
    } else {
      writer(from, to, d, scale);
    }
  }
};

CacheSide cache_side(const kd_call_args* args, int src, int cache, int scale) {
  const DLTensor& s = args->tensors[src];
  const DLTensor& c = args->tensors[cache];
  const DLTensor& k = args->tensors[scale];
  return CacheSide{data_as<const char>(s), data_as<char>(c), kd_plugin::row_layout(s, 1), kd_plugin::row_layout(c, 1),
                   s.dtype.bits / 8, c.dtype.bits / 8, row_writer(s, c),
                   k.data == nullptr ? 1.0f : *data_as<const float>(k)};
}

template <class Slot>
kd_status write_tokens(const kd_call_args* args, const Slot* slots, int64_t tokens, int64_t heads, int64_t cache_slots) {
  const int64_t d = dim(args->tensors[0], -1);
  const CacheSide key = cache_side(args, 0, 2, 5);
  const CacheSide value = cache_side(args, 1, 3, 6);
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
      key.write(t * heads + h, s * heads + h, d);
      value.write(t * heads + h, s * heads + h, d);
    }
  }
  return KD_STATUS_OK;
}

// Whether `cache` may hold values of `src`'s dtype under kv_cache_dtype
// `name`: "auto" takes the cache's own dtype (the activation dtype or
// fp8); "fp8" and "fp8_e4m3" need float8_e4m3fn, "fp8_e5m2" float8_e5m2.
bool cache_dtype_fits(const char* name, const DLTensor& src, const DLTensor& cache) {
  const bool e4m3 = is_dtype(cache, KD_DLPACK_FLOAT8_E4M3FN, 8);
  const bool e5m2 = is_dtype(cache, KD_DLPACK_FLOAT8_E5M2, 8);
  if (std::strcmp(name, "auto") == 0) return same_dtype(src, cache) || e4m3 || e5m2;
  if (std::strcmp(name, "fp8") == 0 || std::strcmp(name, "fp8_e4m3") == 0) return e4m3;
  return std::strcmp(name, "fp8_e5m2") == 0 && e5m2;
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
    if (!same_dims || !served || !(slots64 || is_dtype(slots, kDLInt, 32)) || !same_dtype(key, value)) {
      return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT,
                             "%s: expected key and value [N, H, D] of one dtype (float32, float16 or bfloat16), "
                             "key_cache and value_cache [NB, BS, H, D], slot_mapping [N] int64 or int32",
                             kOp);
    }
    if (!cache_dtype_fits(cache_dtype, key, key_cache) || !cache_dtype_fits(cache_dtype, value, value_cache)) {
      return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT,
                             "%s: kv_cache_dtype '%s' with key_cache %s and value_cache %s: \"auto\" takes caches "
                             "in the activation dtype or fp8, \"fp8\" and \"fp8_e4m3\" float8_e4m3fn caches, "
                             "\"fp8_e5m2\" float8_e5m2 caches",
                             kOp, cache_dtype, kd_plugin::dtype_name(key_cache), kd_plugin::dtype_name(value_cache));
    }
    const int64_t cache_slots = dim(key_cache, 0) * dim(key_cache, 1);
    if (slots64) return write_tokens(args, data_as<const int64_t>(slots), tokens, heads, cache_slots);
    return write_tokens(args, data_as<const int32_t>(slots), tokens, heads, cache_slots);
  });
}

}  // namespace kdispatch::cpu
