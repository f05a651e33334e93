// kvcache.reshape_and_cache_flash: token t with slot s >= 0 has its H rows
// of D values written to rows (s / BS, s % BS, h) of the caches [NB, BS, H,
// D]; a slot s < 0 is skipped, and so is one at or beyond NB * BS (the host
// backends refuse it; here it is data, so nothing is written out of
// bounds).
//
// Rows are addressed by their dims' strides (key and value may be views of
// a fused QKV output, the caches views of a joint KV cache): a few int64
// arguments, not a general row layout, since a graph copies a kernel's
// arguments at every launch. Blocks of kThreads threads take blockDim.y
// tokens each, a token's units across blockDim.x threads (looping when there
// are more tokens than a grid holds); each thread moves its unit of the key
// and of the value, loaded before the token's slot is known to be written,
// so that those loads wait on memory together with the slot's instead of
// after it (a skipped token's rows are read for nothing). With both caches
// in the activation dtype the units are 16, 8, 4, 2 or 1 bytes: the widest
// that divides a row and every row's start (a copy is exact whatever the
// dtype, so the kernel moves bytes).
// With fp8 caches a unit is N values (16 bytes of the activations where the
// rows allow), each divided by its cache's scale in float32 and converted
// once, saturating, as vLLM does; caches of two different dtypes take a
// launch each.
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

// Element offsets of the rows of key or value [T, H, D].
struct TokenRows {
  int64_t token, head;
  __device__ int64_t offset(int64_t t, int64_t h) const { return t * token + h * head; }
};

// Element offsets of the rows of a cache [NB, BS, H, D], by slot.
struct SlotRows {
  int64_t block, slot, head, block_size;
  bool merged;  // block == BS * slot: slot s at s * slot
  __device__ int64_t offset(int64_t s, int64_t h) const {
    const int64_t at = merged ? s * slot : (s / block_size) * block + (s % block_size) * slot;
    return at + h * head;
  }
};

// The stride of dim d, 0 for a dim of size 1 (its index is always 0).
int64_t stride_of(const DLTensor& t, int d) { return t.shape[d] > 1 ? kd_plugin::element_stride(t, d) : 0; }

TokenRows token_rows(const DLTensor& t) { return TokenRows{stride_of(t, 0), stride_of(t, 1)}; }

SlotRows slot_rows(const DLTensor& c) {
  SlotRows r{stride_of(c, 0), stride_of(c, 1), stride_of(c, 2), dim(c, 1), false};
  r.merged = dim(c, 0) == 1 || r.block == r.block_size * r.slot;
  return r;
}

// True when every row of `t` (of its last dim) starts at a multiple of
// `bytes`.
bool rows_start_aligned(size_t bytes, const DLTensor& t) {
  return rows_aligned(bytes, data_as<const char>(t), kd_plugin::row_layout(t, 1), t.dtype.bits / 8);
}

// One launch's tensors: key and value (src), their caches (dst), each cache's
// scale (device float32 [1], or null for 1). `caches`: 2, or 1 for the key's
// pair alone.
struct CacheWrite {
  const char* src[2];
  char* dst[2];
  TokenRows src_rows[2];
  SlotRows dst_rows[2];
  const float* scale[2];
  int64_t tokens, heads, cache_slots;
  int64_t row_units;  // units in one row of D values
  int caches;
};

// The block for tokens of `units` units of work each: blockDim.x threads a
// token, a whole number of warps up to kThreads, and as many tokens as fill
// kThreads.
dim3 token_block(int64_t units, int warp_size) {
  const int x = static_cast<int>(std::min<int64_t>(kThreads, ceil_div(units, warp_size) * warp_size));
  return dim3(x, kThreads / x);
}

dim3 token_grid(int64_t tokens, const dim3& block) { return dim3(row_grid(ceil_div(tokens, block.y))); }

// Both caches in the activation dtype: units U of bytes.
template <class U, class Slot>
__global__ void __launch_bounds__(kThreads) copy_kernel(CacheWrite c, const Slot* __restrict__ slots) {
  start_after_previous_kernel();
  for (int64_t t = int64_t{blockIdx.x} * blockDim.y + threadIdx.y; t < c.tokens; t += int64_t{gridDim.x} * blockDim.y) {
    const auto s = static_cast<int64_t>(slots[t]);
    for (int64_t k = threadIdx.x; k < c.heads * c.row_units; k += blockDim.x) {
      const int64_t h = k / c.row_units;
      const int64_t u = k % c.row_units;
      U v[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) v[i] = load_streaming(reinterpret_cast<const U*>(c.src[i]) + c.src_rows[i].offset(t, h) + u);
      if (s < 0 || s >= c.cache_slots) continue;
#pragma unroll
      for (int i = 0; i < 2; ++i) reinterpret_cast<U*>(c.dst[i])[c.dst_rows[i].offset(s, h) + u] = v[i];
    }
  }
}

// x / s in float32, rounded to nearest as a division is, without one per
// value where the scale allows: q = x * r with r = 1 / s rounded to nearest,
// its residual e = x - q * s (exact), and q + e * r rounded once, which is the
// quotient correctly rounded (Markstein's theorem: r within half an ulp of
// 1 / s, q within one ulp of x / s). Scales in [2^-60, 2^60] keep e clear of
// underflow for every x whose quotient reaches the fp8 range; other scales
// divide. An exact or non-finite q is the quotient as it is (and keeps the
// sign of a zero).
struct Divisor {
  float s;
  float r;
  bool by_reciprocal;
};

__device__ __forceinline__ Divisor divisor_of(float s) {
  const float a = fabsf(s);
  const bool in_range = a >= 0x1p-60f && a <= 0x1p60f;
  return Divisor{s, in_range ? __frcp_rn(s) : 0.f, in_range};
}

__device__ __forceinline__ float divide(float x, const Divisor& d) {
  if (!d.by_reciprocal) return x / d.s;
  const float q = __fmul_rn(x, d.r);
  const float e = __fmaf_rn(-q, d.s, x);
  return e != 0.f && isfinite(q) ? __fmaf_rn(e, d.r, q) : q;
}

// Caches of type C (fp8, or T for a plain copy), N values a unit. Each
// thread takes one unit of a row (its head and offset worked out once, in 32
// bits) for every token of its block's stride, and converts two values at a
// time. Compiled for six blocks an SM, at most 40 registers a thread (left
// free, the compiler takes 64, and four blocks fit): the loads in flight
// bound the write, and a third more threads hold a third more of them.
template <class T, class C, int N, class Slot>
__global__ void __launch_bounds__(kThreads, 6) convert_kernel(CacheWrite c, const Slot* __restrict__ slots) {
  start_after_previous_kernel();
  Divisor scale[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) scale[i] = divisor_of(i < c.caches && c.scale[i] != nullptr ? *c.scale[i] : 1.0f);
  const int row_units = static_cast<int>(c.row_units);
  const int units = static_cast<int>(c.heads) * row_units;  // fits: run_cache() checks
  for (int k = threadIdx.x; k < units; k += blockDim.x) {
    const int h = k / row_units;
    const int at = (k - h * row_units) * N;
    for (int64_t t = int64_t{blockIdx.x} * blockDim.y + threadIdx.y; t < c.tokens; t += int64_t{gridDim.x} * blockDim.y) {
      const auto s = static_cast<int64_t>(slots[t]);
      Vec<T, N> x[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        if (i < c.caches) {
          x[i] = load_vec<T, N, (N > 1)>(reinterpret_cast<const T*>(c.src[i]) + c.src_rows[i].offset(t, h) + at);
        }
      }
      if (s < 0 || s >= c.cache_slots) continue;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        if (i >= c.caches) continue;
        Vec<C, N> out;
        if constexpr (std::is_same_v<T, C>) {
          out = x[i];
        } else if constexpr (N % 2 == 0) {
#pragma unroll
          for (int e = 0; e < N; e += 2) {
            from_float2(divide(to_float(x[i].v[e]), scale[i]), divide(to_float(x[i].v[e + 1]), scale[i]), &out.v[e]);
          }
        } else {
#pragma unroll
          for (int e = 0; e < N; ++e) out.v[e] = from_float<C>(divide(to_float(x[i].v[e]), scale[i]));
        }
        store_vec<C, N, (N > 1)>(reinterpret_cast<C*>(c.dst[i]) + c.dst_rows[i].offset(s, h) + at, out);
      }
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

// A CacheWrite of key and value into their caches (first: the key's
// tensors, 0 and 2, or the value's, 1 and 3; caches: 2 for both).
CacheWrite cache_write(const kd_call_args* args, int first, int caches) {
  const DLTensor* t = args->tensors;
  CacheWrite c{};
  for (int i = 0; i < caches; ++i) {
    const DLTensor& src = t[first + i];
    const DLTensor& dst = t[first + i + 2];
    const DLTensor& scale = t[first + i + 5];
    c.src[i] = data_as<const char>(src);
    c.dst[i] = data_as<char>(dst);
    c.src_rows[i] = token_rows(src);
    c.dst_rows[i] = slot_rows(dst);
    c.scale[i] = scale.data == nullptr ? nullptr : data_as<const float>(scale);
  }
  c.tokens = dim(t[0], 0);
  c.heads = dim(t[0], 1);
  c.cache_slots = dim(t[2], 0) * dim(t[2], 1);
  c.caches = caches;
  return c;
}

// Launches convert_kernel for `caches` caches from tensor `first` on, all
// of the dtype of cache `first + 2`.
template <class Slot>
void launch_convert(const Launch& launch, const kd_call_args* args, int first, int caches, const Slot* slots) {
  const DLTensor& x = args->tensors[first];
  const DLTensor& cache = args->tensors[first + 2];
  CacheWrite c = cache_write(args, first, caches);
  const int64_t d = dim(x, 2);
  kd_plugin::dispatch_float_dtype<float, half_t, bf16_t>(args, kOp, x, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const auto go = [&](auto cache_tag) {
      using C = typename decltype(cache_tag)::type;
      constexpr int kVec = 16 / sizeof(T);
      bool vec = d % kVec == 0;
      for (int i = 0; i < caches; ++i) {
        vec = vec && rows_start_aligned(16, args->tensors[first + i]) &&
              rows_start_aligned(kVec * sizeof(C), args->tensors[first + i + 2]);
      }
      c.row_units = vec ? d / kVec : d;
      const dim3 block = token_block(c.heads * c.row_units, launch.warp_size);
      const dim3 grid = token_grid(c.tokens, block);
      if (vec) {
        launch_kernel(launch, convert_kernel<T, C, kVec, Slot>, grid, block, c, slots);
      } else {
        launch_kernel(launch, convert_kernel<T, C, 1, Slot>, grid, block, c, slots);
      }
    };
    if (is_dtype(cache, KD_DLPACK_FLOAT8_E4M3FN, 8)) {
      go(kd_plugin::TypeTag<fp8_e4m3_t>{});
    } else if (is_dtype(cache, KD_DLPACK_FLOAT8_E5M2, 8)) {
      go(kd_plugin::TypeTag<fp8_e5m2_t>{});
    } else {
      go(kd_plugin::TypeTag<T>{});
    }
    return KD_STATUS_OK;
  });
}

template <class Slot>
void launch_write(const Launch& launch, const kd_call_args* args, const Slot* slots) {
  const DLTensor* t = args->tensors;
  const DLTensor& key = t[0];
  if (!same_dtype(key, t[2]) || !same_dtype(t[1], t[3])) {
    if (same_dtype(t[2], t[3])) {
      launch_convert(launch, args, 0, 2, slots);
    } else {
      launch_convert(launch, args, 0, 1, slots);
      launch_convert(launch, args, 1, 1, slots);
    }
    return;
  }
  CacheWrite c = cache_write(args, 0, 2);
  const size_t row_bytes = static_cast<size_t>(dim(key, 2)) * (key.dtype.bits / 8);
  const auto fits = [&](size_t unit) {
    return row_bytes % unit == 0 && rows_start_aligned(unit, t[0]) && rows_start_aligned(unit, t[1]) &&
           rows_start_aligned(unit, t[2]) && rows_start_aligned(unit, t[3]);
  };
  const auto run = [&](auto unit_tag) {
    using U = typename decltype(unit_tag)::type;
    // Offsets in units: every stride is a whole number of them (fits()).
    const int64_t per = static_cast<int64_t>(sizeof(U)) / (key.dtype.bits / 8);
    for (int i = 0; i < 2; ++i) {
      c.src_rows[i].token /= per;
      c.src_rows[i].head /= per;
      c.dst_rows[i].block /= per;
      c.dst_rows[i].slot /= per;
      c.dst_rows[i].head /= per;
    }
    c.row_units = static_cast<int64_t>(row_bytes / sizeof(U));
    const dim3 block = token_block(c.heads * c.row_units, launch.warp_size);
    launch_kernel(launch, copy_kernel<U, Slot>, token_grid(c.tokens, block), block, c, slots);
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
  // The converting kernel counts a token's values in 32 bits.
  if ((!same_dtype(key, key_cache) || !same_dtype(value, value_cache)) && heads * d > INT32_MAX) {
    return kd_plugin::fail(args, KD_STATUS_UNSUPPORTED, "%s: more than 2^31-1 values a token into an fp8 cache", kOp);
  }
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
  if (slots64) {
    launch_write(launch, args, data_as<const int64_t>(slots));
  } else {
    launch_write(launch, args, data_as<const int32_t>(slots));
  }
  return launched(args, kOp, pending);
}

}  // namespace

kd_status reshape_and_cache_flash(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(args, [&] { return run_cache(args); });
}

}  // namespace kd_gpu
