#include "dtype_codec.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace kdispatch::reference {
namespace {

// A binary floating-point format narrower than float64.
struct Format {
  int precision;  // significand bits, the implicit one included
  int min_exponent;  // exponent of the smallest normal number
  int bias;  // exponent field of 2^0
  int exponent_bits;
  double largest_finite;
  // IEEE: an all-ones exponent field holds infinity and NaNs. Else (the
  // "fn" formats) only all-ones exponent and fraction is NaN, and there is
  // no infinity.
  bool ieee_specials;
  // Overflow (infinities included) gives +-largest_finite instead of
  // infinity.
  bool saturate;
};

constexpr Format kHalf{11, -14, 15, 5, 65504.0, true, false};
constexpr Format kBFloat16{8, -126, 127, 8, 0x1.fep127, true, false};
constexpr Format kFloat8E4M3FN{4, -6, 7, 4, 448.0, false, true};
constexpr Format kFloat8E5M2{3, -14, 15, 5, 57344.0, true, true};

double round_to_format(const Format& f, double v) {
  if (std::isnan(v) || v == 0.0) return v;
  if (std::isinf(v)) return f.saturate ? std::copysign(f.largest_finite, v) : v;
  // Spacing of the format at |v|: 2^(exponent - precision + 1), with the
  // exponent held at its minimum for subnormals.
  const int exponent = std::max(std::ilogb(v), f.min_exponent);
  const double quantum = std::ldexp(1.0, exponent - f.precision + 1);
  const double r = std::nearbyint(v / quantum) * quantum;  // ties to even
  if (std::fabs(r) > f.largest_finite) return std::copysign(f.saturate ? f.largest_finite : HUGE_VAL, v);
  return r;
}

uint32_t encode_format(const Format& f, double v) {
  const int mantissa_bits = f.precision - 1;
  const uint32_t exponent_mask = (1u << f.exponent_bits) - 1;
  const uint32_t sign = std::signbit(v) ? 1u << (f.exponent_bits + mantissa_bits) : 0u;
  if (std::isnan(v)) {
    return (exponent_mask << mantissa_bits) |
           (f.ieee_specials ? 1u << (mantissa_bits - 1) : (1u << mantissa_bits) - 1);
  }
  const double r = std::fabs(round_to_format(f, v));
  if (std::isinf(r)) return sign | (exponent_mask << mantissa_bits);
  if (r == 0.0) return sign;
  const int bias = f.bias;
  if (r < std::ldexp(1.0, f.min_exponent)) {
    const double units = r / std::ldexp(1.0, f.min_exponent - mantissa_bits);
    return sign | static_cast<uint32_t>(units);
  }
  const int e = std::ilogb(r);
  const double fraction = (r / std::ldexp(1.0, e) - 1.0) * std::ldexp(1.0, mantissa_bits);
  return sign | (static_cast<uint32_t>(e + bias) << mantissa_bits) |
         static_cast<uint32_t>(fraction);
}

double decode_format(const Format& f, uint32_t bits) {
  const int mantissa_bits = f.precision - 1;
  const uint32_t exponent_mask = (1u << f.exponent_bits) - 1;
  const bool negative = (bits >> (f.exponent_bits + mantissa_bits)) & 1u;
  const uint32_t exponent = (bits >> mantissa_bits) & exponent_mask;
  const uint32_t fraction = bits & ((1u << mantissa_bits) - 1);
  double v = 0.0;
  const uint32_t fraction_mask = (1u << mantissa_bits) - 1;
  if (exponent == exponent_mask && (f.ieee_specials || fraction == fraction_mask)) {
    v = fraction != 0 ? std::numeric_limits<double>::quiet_NaN() : HUGE_VAL;
  } else if (exponent == 0) {
    v = std::ldexp(static_cast<double>(fraction), f.min_exponent - mantissa_bits);
  } else {
    const int bias = f.bias;
    v = std::ldexp(1.0 + std::ldexp(static_cast<double>(fraction), -mantissa_bits),
                   static_cast<int>(exponent) - bias);
  }
  return negative ? -v : v;
}

}  // namespace

const char* dtype_name(Dtype dtype) {
  switch (dtype) {
    case Dtype::kFloat32: return "float32";
    case Dtype::kFloat16: return "float16";
    case Dtype::kBFloat16: return "bfloat16";
    case Dtype::kFloat8E4M3FN: return "float8_e4m3fn";
    case Dtype::kFloat8E5M2: return "float8_e5m2";
  }
  return "?";
}

int dtype_size(Dtype dtype) {
  switch (dtype) {
    case Dtype::kFloat32: return 4;
    case Dtype::kFloat16: case Dtype::kBFloat16: return 2;
    case Dtype::kFloat8E4M3FN: case Dtype::kFloat8E5M2: return 1;
  }
  return 0;
}

double round_to(Dtype dtype, double value) {
  switch (dtype) {
    case Dtype::kFloat32: return static_cast<double>(static_cast<float>(value));
    case Dtype::kFloat16: return round_to_format(kHalf, value);
    case Dtype::kBFloat16: return round_to_format(kBFloat16, value);
    case Dtype::kFloat8E4M3FN: return round_to_format(kFloat8E4M3FN, value);
    case Dtype::kFloat8E5M2: return round_to_format(kFloat8E5M2, value);
  }
  return value;
}

uint32_t encode(Dtype dtype, double value) {
  switch (dtype) {
    case Dtype::kFloat32: {
      const float f = static_cast<float>(value);
      uint32_t bits = 0;
      std::memcpy(&bits, &f, sizeof(bits));
      return bits;
    }
    case Dtype::kFloat16: return encode_format(kHalf, value);
    case Dtype::kBFloat16: return encode_format(kBFloat16, value);
    case Dtype::kFloat8E4M3FN: return encode_format(kFloat8E4M3FN, value);
    case Dtype::kFloat8E5M2: return encode_format(kFloat8E5M2, value);
  }
  return 0;
}

double decode(Dtype dtype, uint32_t bits) {
  switch (dtype) {
    case Dtype::kFloat32: {
      float f = 0.0f;
      std::memcpy(&f, &bits, sizeof(f));
      return static_cast<double>(f);
    }
    case Dtype::kFloat16: return decode_format(kHalf, bits);
    case Dtype::kBFloat16: return decode_format(kBFloat16, bits);
    case Dtype::kFloat8E4M3FN: return decode_format(kFloat8E4M3FN, bits);
    case Dtype::kFloat8E5M2: return decode_format(kFloat8E5M2, bits);
  }
  return 0.0;
}

}  // namespace kdispatch::reference
