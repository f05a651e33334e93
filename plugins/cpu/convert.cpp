#include "convert.hpp"

#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KD_CPU_X86_CONVERT 1
#include <immintrin.h>
#endif

namespace kdispatch::cpu {
namespace {

// --- Portable conversions: any CPU, element by element -----------------------

template <class T>
void widen_portable(const T* src, float* dst, int64_t n) noexcept {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

template <class T>
void narrow_portable(const float* src, T* dst, int64_t n, Store) noexcept {
  for (int64_t i = 0; i < n; ++i) dst[i] = from_float<T>(src[i]);
}

void copy_floats(const float* src, float* dst, int64_t n, Store) noexcept {
  if (src != dst) std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
}

#if KD_CPU_X86_CONVERT
// --- AVX2 + F16C: 8 or 16 elements per step, the remainder element by element
// with the portable code (which rounds identically). -------------------------

#define KD_AVX2 __attribute__((target("avx2,fma,f16c")))

// Streaming stores need 32-byte aligned destinations: the first elements up
// to that boundary are written the ordinary way. Returns how many; all of n
// (no streaming at all) when the destination is not even element aligned.
template <class T>
int64_t unaligned_head(const T* dst, int64_t n) {
  const auto address = reinterpret_cast<uintptr_t>(dst);
  if (address % sizeof(T) != 0) return n;
  const int64_t head = static_cast<int64_t>((32 - address % 32) % 32 / sizeof(T));
  return head < n ? head : n;
}

KD_AVX2 void widen_half_avx2(const Float16* src, float* dst, int64_t n) noexcept {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
  widen_portable(src + i, dst + i, n - i);
}

struct NarrowHalfx16 {
  KD_AVX2 static __m256i apply(const float* src) {
  constexpr int kNearestEven = _MM_FROUND_TO_NEAREST_INT;
  const __m128i lo = _mm256_cvtps_ph(_mm256_loadu_ps(src), kNearestEven);
  const __m128i hi = _mm256_cvtps_ph(_mm256_loadu_ps(src + 8), kNearestEven);
  return _mm256_set_m128i(hi, lo);
  }
};

KD_AVX2 void widen_bf16_avx2(const BFloat16* src, float* dst, int64_t n) noexcept {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m256i u = _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(u));
  }
  widen_portable(src + i, dst + i, n - i);
}

// from_float<BFloat16> of 8 floats, as 8 32-bit lanes holding the 16 bits.
KD_AVX2 inline __m256i narrow8_bf16(const float* src) {
  const __m256i u = _mm256_castps_si256(_mm256_loadu_ps(src));
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
  const __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd);
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
  const __m256i quiet_nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  // |u| > Inf as integers (both sides are non-negative int32).
  const __m256i magnitude = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
  const __m256i is_nan = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7f800000));
  return _mm256_blendv_epi8(rounded, quiet_nan, is_nan);
}

struct NarrowBf16x16 {
  KD_AVX2 static __m256i apply(const float* src) {
    // packus interleaves the 128-bit lanes of its operands; the permute puts
    // the 16 results back in order.
    const __m256i packed = _mm256_packus_epi32(narrow8_bf16(src), narrow8_bf16(src + 8));
    return _mm256_permute4x64_epi64(packed, 0xd8);
  }
};

// Narrow16::apply converts 16 floats to 16 T, as one 256-bit vector.
template <class T, class Narrow16>
KD_AVX2 inline void narrow16_loop(const float* src, T* dst, int64_t n, Store store) {
  int64_t i = 0;
  if (store == Store::kStreaming) {
    i = unaligned_head(dst, n);
    narrow_portable(src, dst, i, store);
    for (; i + 16 <= n; i += 16) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), Narrow16::apply(src + i));
    }
  } else {
    for (; i + 16 <= n; i += 16) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), Narrow16::apply(src + i));
    }
  }
  narrow_portable(src + i, dst + i, n - i, store);
}

KD_AVX2 void narrow_half_avx2(const float* src, Float16* dst, int64_t n, Store store) noexcept {
  narrow16_loop<Float16, NarrowHalfx16>(src, dst, n, store);
}

KD_AVX2 void narrow_bf16_avx2(const float* src, BFloat16* dst, int64_t n, Store store) noexcept {
  narrow16_loop<BFloat16, NarrowBf16x16>(src, dst, n, store);
}

KD_AVX2 void copy_floats_avx2(const float* src, float* dst, int64_t n, Store store) noexcept {
  if (store != Store::kStreaming) return copy_floats(src, dst, n, store);
  int64_t i = unaligned_head(dst, n);
  copy_floats(src, dst, i, store);
  for (; i + 8 <= n; i += 8) _mm256_stream_ps(dst + i, _mm256_loadu_ps(src + i));
  copy_floats(src + i, dst + i, n - i, store);
}

#undef KD_AVX2
#endif  // KD_CPU_X86_CONVERT

struct Converters {
  void (*widen_half)(const Float16*, float*, int64_t) noexcept;
  void (*widen_bf16)(const BFloat16*, float*, int64_t) noexcept;
  void (*narrow_half)(const float*, Float16*, int64_t, Store) noexcept;
  void (*narrow_bf16)(const float*, BFloat16*, int64_t, Store) noexcept;
  void (*narrow_float)(const float*, float*, int64_t, Store) noexcept;
};

Converters pick_converters() {
#if KD_CPU_X86_CONVERT
  __builtin_cpu_init();  // may run before the ifunc resolvers have
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") &&
      __builtin_cpu_supports("fma")) {
    return {widen_half_avx2, widen_bf16_avx2, narrow_half_avx2, narrow_bf16_avx2,
            copy_floats_avx2};
  }
#endif
  return {widen_portable<Float16>, widen_portable<BFloat16>, narrow_portable<Float16>,
          narrow_portable<BFloat16>, copy_floats};
}

// Chosen once, when the plugin is loaded.
const Converters kConverters = pick_converters();

}  // namespace

void widen(const Float16* src, float* dst, int64_t n) noexcept { kConverters.widen_half(src, dst, n); }

void widen(const BFloat16* src, float* dst, int64_t n) noexcept {
  kConverters.widen_bf16(src, dst, n);
}

void narrow(const float* src, Float16* dst, int64_t n, Store store) noexcept {
  kConverters.narrow_half(src, dst, n, store);
}

void narrow(const float* src, BFloat16* dst, int64_t n, Store store) noexcept {
  kConverters.narrow_bf16(src, dst, n, store);
}

void narrow(const float* src, float* dst, int64_t n, Store store) noexcept {
  kConverters.narrow_float(src, dst, n, store);
}

void store_fence() noexcept {
#if KD_CPU_X86_CONVERT
  _mm_sfence();
#endif
}

}  // namespace kdispatch::cpu
