// kvcache.reshape_and_cache_flash: token t with slot s >= 0 has its H rows
// of D values written to rows s * H .. s * H + H - 1 of the caches seen as
// [NB * BS * H, D]; a slot s < 0 is skipped, and so is one at or beyond
// NB * BS (the host backends refuse it; here it is data, so nothing is
// written out of bounds).
//
// Blocks of kThreads threads take blockDim.y tokens each, a token's units
// across blockDim.x threads (looping when there are more tokens than a grid
// holds). With both caches in the activation dtype, its threads copy the
// token's key and value rows in units of 16, 8, 4, 2 or 1 bytes: the widest
// that divides a row and every row's start (a copy is exact whatever the
// dtype, so the kernel moves bytes). A cache in fp8 is written by a second
// kernel, one launch per cache, N values a thread (16 bytes of the
// activations where the rows allow): each value divided by the cache's
// scale in float32 and converted once, saturating, as vLLM does.
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "device_utils.cuh"
#include "launch_utils.hpp"
#include "ops.hpp"

namespace kd_gpu {
namespace {

constexpr const char* kOp = "kvcache.reshape_and_cache_flash";
constexpr int kThreads = 256;

struct CacheCopy {
  const char* key;
  const char* value;
  char* key_cache;
  char* value_cache;
  kd_plugin::RowLayout key_rows, value_rows, key_cache_rows, value_cache_rows;
  int64_t tokens, heads, cache_slots;
  int64_t row_units;   // units of the copy in one row of D values
  int64_t elem_bytes;  // bytes of one value
};

// The block for tokens of `units` units of work each: blockDim.x threads a
// token, a whole number of warps up to kThreads, and as many tokens as fill
// kThreads.
dim3 token_block(int64_t units, int warp_size) {
  const int x = static_cast<int>(std::min<int64_t>(kThreads, ceil_div(units, warp_size) * warp_size));
  return dim3(x, kThreads / x);
}

dim3 token_grid(int64_t tokens, const dim3& block) { return dim3(row_grid(ceil_div(tokens, block.y))); }

template <class U, class Slot>
__global__ void __launch_bounds__(kThreads) copy_kernel(CacheCopy c, const Slot* __restrict__ slots) {
  start_after_previous_kernel();
  for (int64_t t = int64_t{blockIdx.x} * blockDim.y + threadIdx.y; t < c.tokens; t += int64_t{gridDim.x} * blockDim.y) {
    const auto s = static_cast<int64_t>(slots[t]);
    if (s < 0 || s >= c.cache_slots) continue;
    for (int64_t k = threadIdx.x; k < c.heads * c.row_units; k += blockDim.x) {
      const int64_t h = k / c.row_units;
      const int64_t u = k % c.row_units;
      const int64_t src = t * c.heads + h;
      const int64_t dst = s * c.heads + h;
      const U kv = load_streaming(reinterpret_cast<const U*>(c.key + c.key_rows.offset(src) * c.elem_bytes) + u);
      const U vv = load_streaming(reinterpret_cast<const U*>(c.value + c.value_rows.offset(src) * c.elem_bytes) + u);
      reinterpret_cast<U*>(c.key_cache + c.key_cache_rows.offset(dst) * c.elem_bytes)[u] = kv;
      reinterpret_cast<U*>(c.value_cache + c.value_cache_rows.offset(dst) * c.elem_bytes)[u] = vv;
    }
  }
}

// One cache written N values at a time: `dst` = C(src / scale), or a plain
// copy when C is the activation dtype T.
struct CacheConvert {
  const char* src;
  char* dst;
  kd_plugin::RowLayout src_rows, dst_rows;
  const float* scale;  // device float32 [1], or nullptr for 1
  int64_t tokens, heads, d, cache_slots;
};

template <class T, class C, int N, class Slot>
__global__ void __launch_bounds__(kThreads) convert_kernel(CacheConvert c, const Slot* __restrict__ slots) {
  start_after_previous_kernel();
  const float scale = c.scale != nullptr ? *c.scale : 1.0f;
  const int64_t row_units = c.d / N;
  for (int64_t t = int64_t{blockIdx.x} * blockDim.y + threadIdx.y; t < c.tokens; t += int64_t{gridDim.x} * blockDim.y) {
    const auto s = static_cast<int64_t>(slots[t]);
    if (s < 0 || s >= c.cache_slots) continue;
    for (int64_t k = threadIdx.x; k < c.heads * row_units; k += blockDim.x) {
      const int64_t h = k / row_units;
      const int64_t i = (k % row_units) * N;
      const Vec<T, N> x = load_vec<T, N, (N > 1), Access::kStreaming>(
          reinterpret_cast<const T*>(c.src) + c.src_rows.offset(t * c.heads + h) + i);
      Vec<C, N> out;
#pragma unroll
      for (int e = 0; e < N; ++e) {
        if constexpr (std::is_same_v<T, C>) {
          out.v[e] = x.v[e];
        } else {
          out.v[e] = from_float<C>(to_float(x.v[e]) / scale);
        }
      }
      store_vec<C, N, (N > 1)>(reinterpret_cast<C*>(c.dst) + c.dst_rows.offset(s * c.heads + h) + i, out);
    }
  }
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

// Launches convert_kernel for one cache: tensors src, cache and scale of
// the call.
template <class Slot>
void launch_convert(const Launch& launch, const kd_call_args* args, int src, int cache, int scale, const Slot* slots) {
  const DLTensor& x = args->tensors[src];
  const DLTensor& c = args->tensors[cache];
  const DLTensor& k = args->tensors[scale];
  const CacheConvert conv{data_as<const char>(x), data_as<char>(c), kd_plugin::row_layout(x, 1),
                          kd_plugin::row_layout(c, 1), k.data == nullptr ? nullptr : data_as<const float>(k),
                          dim(x, 0), dim(x, 1), dim(x, 2), dim(c, 0) * dim(c, 1)};
  kd_plugin::dispatch_float_dtype<float, half_t, bf16_t>(args, kOp, x, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const auto go = [&](auto cache_tag) {
      using C = typename decltype(cache_tag)::type;
      constexpr int kVec = 16 / sizeof(T);
      const bool vec = conv.d % kVec == 0 && rows_aligned(16, conv.src, conv.src_rows, sizeof(T)) &&
                       rows_aligned(kVec * sizeof(C), conv.dst, conv.dst_rows, sizeof(C));
      const int n = vec ? kVec : 1;
      const dim3 block = token_block(conv.heads * (conv.d / n), launch.warp_size);
      const dim3 grid = token_grid(conv.tokens, block);
      if (vec) {
        launch_kernel(launch, convert_kernel<T, C, kVec, Slot>, grid, block, conv, slots);
      } else {
        launch_kernel(launch, convert_kernel<T, C, 1, Slot>, grid, block, conv, slots);
      }
    };
    if (is_dtype(c, KD_DLPACK_FLOAT8_E4M3FN, 8)) {
      go(kd_plugin::TypeTag<fp8_e4m3_t>{});
    } else if (is_dtype(c, KD_DLPACK_FLOAT8_E5M2, 8)) {
      go(kd_plugin::TypeTag<fp8_e5m2_t>{});
    } else {
      go(kd_plugin::TypeTag<T>{});
    }
    return KD_STATUS_OK;
  });
}

kd_status run_cache(const kd_call_args* args) {
  if (kd_status s = check_call(args, kOp, 7, 1); s != KD_STATUS_OK) return s;
  const DLTensor& key = args->tensors[0];
  const DLTensor& value = args->tensors[1];
  const DLTensor& key_cache = args->tensors[2];
  const DLTensor& value_cache = args->tensors[3];
  const DLTensor& slots = args->tensors[4];
  const kd_attr* cache_dtype = kd_plugin::find_attr(args, "kv_cache_dtype", KD_ATTR_TYPE_STRING);
  const char* cache_dtype_name = cache_dtype != nullptr && cache_dtype->value.s != nullptr ? cache_dtype->value.s : "";
  if (key.ndim != 3 || value.ndim != 3 || key_cache.ndim != 4 || value_cache.ndim != 4 || slots.ndim != 1) {
    return invalid_shapes(args, kOp);
  }
  const int64_t tokens = dim(key, 0);
  const int64_t heads = dim(key, 1);
  const int64_t d = dim(key, 2);
  if (dim(slots, 0) != tokens || dim(value, 0) != tokens || dim(value, 1) != heads || dim(value, 2) != d ||
      dim(key_cache, 2) != heads || dim(key_cache, 3) != d || dim(value_cache, 0) != dim(key_cache, 0) ||
      dim(value_cache, 1) != dim(key_cache, 1) || dim(value_cache, 2) != heads || dim(value_cache, 3) != d) {
    return invalid_shapes(args, kOp);
  }
  const bool slots64 = is_dtype(slots, kDLInt, 64);
  // The dtypes of its manifest entry: the copy itself would move any.
  const bool served = is_dtype(key, kDLFloat, 32) || is_dtype(key, kDLFloat, 16) || is_dtype(key, kDLBfloat, 16);
  if (!served || !(slots64 || is_dtype(slots, kDLInt, 32)) || !same_dtype(key, value)) {
    return kd_plugin::fail(args, KD_STATUS_UNSUPPORTED,
                           "%s: key and value must share one dtype (float32, float16 or bfloat16), slot_mapping "
                           "int64 or int32",
                           kOp);
  }
  if (!cache_dtype_fits(cache_dtype_name, key, key_cache) || !cache_dtype_fits(cache_dtype_name, value, value_cache)) {
    return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT,
                           "%s: kv_cache_dtype '%s' with key_cache %s and value_cache %s: \"auto\" takes caches in "
                           "the activation dtype or fp8, \"fp8\" and \"fp8_e4m3\" float8_e4m3fn caches, "
                           "\"fp8_e5m2\" float8_e5m2 caches",
                           kOp, cache_dtype_name, kd_plugin::dtype_name(key_cache), kd_plugin::dtype_name(value_cache));
  }
  if (tokens == 0 || heads == 0 || d == 0) return KD_STATUS_OK;
  CacheCopy c{data_as<const char>(key), data_as<const char>(value), data_as<char>(key_cache),
              data_as<char>(value_cache), kd_plugin::row_layout(key, 1), kd_plugin::row_layout(value, 1),
              kd_plugin::row_layout(key_cache, 1), kd_plugin::row_layout(value_cache, 1), tokens, heads,
              dim(key_cache, 0) * dim(key_cache, 1), 0, key.dtype.bits / 8};
  const size_t elem = static_cast<size_t>(c.elem_bytes);
  const size_t row_bytes = static_cast<size_t>(d) * elem;
  const auto fits = [&](size_t unit) {
    return row_bytes % unit == 0 && rows_aligned(unit, c.key, c.key_rows, elem) &&
           rows_aligned(unit, c.value, c.value_rows, elem) && rows_aligned(unit, c.key_cache, c.key_cache_rows, elem) &&
           rows_aligned(unit, c.value_cache, c.value_cache_rows, elem);
  };
  DeviceScope scope;
  Launch launch;
  const int device = key.device.device_id;
  cudaError_t err = scope.enter(device);
  if (err == cudaSuccess) err = device_limits(device, &launch);
  if (err != cudaSuccess) {
    return kd_plugin::fail(args, KD_STATUS_DEVICE_ERROR, "%s: device %d: %s", kOp, device, cudaGetErrorString(err));
  }
  launch.stream = static_cast<cudaStream_t>(args->stream);
  const cudaError_t pending = cudaPeekAtLastError();
  if (!same_dtype(key, key_cache) || !same_dtype(value, value_cache)) {
    if (slots64) {
      launch_convert(launch, args, 0, 2, 5, data_as<const int64_t>(slots));
      launch_convert(launch, args, 1, 3, 6, data_as<const int64_t>(slots));
    } else {
      launch_convert(launch, args, 0, 2, 5, data_as<const int32_t>(slots));
      launch_convert(launch, args, 1, 3, 6, data_as<const int32_t>(slots));
    }
    return launched(args, kOp, pending);
  }
  const auto run = [&](auto unit_tag) {
    using U = typename decltype(unit_tag)::type;
    c.row_units = static_cast<int64_t>(row_bytes / sizeof(U));
    const dim3 block = token_block(heads * c.row_units, launch.warp_size);
    const dim3 grid = token_grid(tokens, block);
    if (slots64) {
      launch_kernel(launch, copy_kernel<U, int64_t>, grid, block, c, data_as<const int64_t>(slots));
    } else {
      launch_kernel(launch, copy_kernel<U, int32_t>, grid, block, c, data_as<const int32_t>(slots));
    }
  };
  if (fits(16)) {
    run(kd_plugin::TypeTag<uint4>{});
  } else if (fits(8)) {
    run(kd_plugin::TypeTag<uint2>{});
  } else if (fits(4)) {
    run(kd_plugin::TypeTag<uint32_t>{});
  } else if (fits(2)) {
    run(kd_plugin::TypeTag<uint16_t>{});
  } else {
    run(kd_plugin::TypeTag<uint8_t>{});
  }
  return launched(args, kOp, pending);
}

}  // namespace

kd_status reshape_and_cache_flash(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(args, [&] { return run_cache(args); });
}

}  // namespace kd_gpu
