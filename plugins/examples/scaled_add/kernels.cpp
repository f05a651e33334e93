// The example's kernels. kd_plugin_kernels.hpp, which kdispatch_add_plugin()
// generates from example_cpu.json, declares them: the symbol
// example_<name> is the function example::<name> (KERNEL_NAMESPACE example,
// SYMBOL_PREFIX example_). The core has checked every call against the op
// schema before a kernel runs (tensor count, dtypes, shapes, contiguity), so
// a kernel reads its tensors in schema order without checking them again.
#include "kd_plugin_kernels.hpp"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>

namespace example {
namespace {

// float16 and bfloat16 to and from float, rounding to nearest even.
float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
uint32_t float_to_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

float bf16_to_float(uint16_t h) { return bits_to_float(uint32_t{h} << 16); }
uint16_t float_to_bf16(float f) {
  const uint32_t bits = float_to_bits(f);
  if (std::isnan(f)) return static_cast<uint16_t>((bits >> 16) | 0x40);
  return static_cast<uint16_t>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

float f16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  const uint32_t exponent = (h >> 10) & 0x1f;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1f) return bits_to_float(sign | 0x7f800000u | (mantissa << 13));  // inf, nan
  if (exponent == 0) {                                                                 // zero, subnormal
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign != 0 ? -magnitude : magnitude;
  }
  return bits_to_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
}
uint16_t float_to_f16(float f) {
  const uint32_t bits = float_to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const float magnitude = std::fabs(f);
  if (std::isnan(f)) return static_cast<uint16_t>(sign | 0x7e00u);
  if (magnitude >= 65520.0f) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (magnitude < 6.103515625e-05f) {                                         // subnormal: steps of 2^-24
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(std::nearbyint(magnitude * 16777216.0f)));
  }
  const uint32_t m = float_to_bits(magnitude);
  const uint32_t rounded = m + 0xfffu + ((m >> 13) & 1);  // round the 13 dropped bits to even
  return static_cast<uint16_t>(sign | (((rounded >> 23) - 112) << 10) | ((rounded >> 13) & 0x3ffu));
}

// Element i of a tensor of float32, float16 or bfloat16, as float.
float load(const DLTensor& t, int64_t i) {
  const char* base = static_cast<const char*>(t.data) + t.byte_offset;
  if (t.dtype.code == kDLFloat && t.dtype.bits == 32) return reinterpret_cast<const float*>(base)[i];
  const uint16_t h = reinterpret_cast<const uint16_t*>(base)[i];
  return t.dtype.code == kDLBfloat ? bf16_to_float(h) : f16_to_float(h);
}
void store(const DLTensor& t, int64_t i, float v) {
  char* base = static_cast<char*>(t.data) + t.byte_offset;
  if (t.dtype.code == kDLFloat && t.dtype.bits == 32) {
    reinterpret_cast<float*>(base)[i] = v;
  } else {
    reinterpret_cast<uint16_t*>(base)[i] = t.dtype.code == kDLBfloat ? float_to_bf16(v) : float_to_f16(v);
  }
}

int64_t numel(const DLTensor& t) {
  int64_t n = 1;
  for (int32_t d = 0; d < t.ndim; ++d) n *= t.shape[d];
  return n;
}

kd_status fail(const kd_call_args* args, const char* message) {
  if (args->error != nullptr && args->error_capacity > 0) {
    std::snprintf(args->error, args->error_capacity, "%s", message);
  }
  return KD_STATUS_INVALID_ARGUMENT;
}

}  // namespace

kd_status scaled_add(const kd_call_args* args) noexcept {
  if (args->num_tensors != 3 || args->num_attrs != 1) return fail(args, "scaled_add: expected (out, a, b; alpha)");
  const DLTensor& out = args->tensors[0];
  const DLTensor& a = args->tensors[1];
  const DLTensor& b = args->tensors[2];
  const float alpha = static_cast<float>(args->attrs[0].value.f);
  const int64_t n = numel(out);
  for (int64_t i = 0; i < n; ++i) store(out, i, load(a, i) + alpha * load(b, i));
  return KD_STATUS_OK;
}

kd_status silu_and_mul(const kd_call_args* args) noexcept {
  if (args->num_tensors != 2) return fail(args, "silu_and_mul: expected (out, x)");
  const DLTensor& out = args->tensors[0];
  const DLTensor& x = args->tensors[1];
  const int64_t d = out.shape[out.ndim - 1];
  const int64_t rows = d == 0 ? 0 : numel(out) / d;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < d; ++j) {
      const float gate = load(x, r * 2 * d + j);
      const float up = load(x, r * 2 * d + d + j);
      store(out, r * d + j, gate / (1.0f + std::exp(-gate)) * up);
    }
  }
  return KD_STATUS_OK;
}

}  // namespace example
