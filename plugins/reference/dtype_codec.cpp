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
  int max_exponent;  // exponent of the largest finite number
  int exponent_bits;
};

constexpr Format kHalf{11, -14, 15, 5};
constexpr Format kBFloat16{8, -126, 127, 8};

double largest_finite(const Format& f) {
  return std::ldexp(2.0 - std::ldexp(1.0, 1 - f.precision), f.max_exponent);
}

double round_to_format(const Format& f, double v) {
  if (!std::isfinite(v) || v == 0.0) return v;
  // Spacing of the format at |v|: 2^(exponent - precision + 1), with the
  // exponent held at its minimum for subnormals.
  const int exponent = std::max(std::ilogb(v), f.min_exponent);
  const double quantum = std::ldexp(1.0, exponent - f.precision + 1);
  const double r = std::nearbyint(v / quantum) * quantum;  // ties to even
  if (std::fabs(r) > largest_finite(f)) return std::copysign(HUGE_VAL, v);
  return r;
}

uint32_t encode_format(const Format& f, double v) {
  const int mantissa_bits = f.precision - 1;
  const uint32_t exponent_mask = (1u << f.exponent_bits) - 1;
  const uint32_t sign = std::signbit(v) ? 1u << (f.exponent_bits + mantissa_bits) : 0u;
  if (std::isnan(v)) {
    return (exponent_mask << mantissa_bits) | (1u << (mantissa_bits - 1));
  }
  const double r = std::fabs(round_to_format(f, v));
  if (std::isinf(r)) return sign | (exponent_mask << mantissa_bits);
  if (r == 0.0) return sign;
  const int bias = f.max_exponent;
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
  if (exponent == exponent_mask) {
    v = fraction != 0 ? std::numeric_limits<double>::quiet_NaN() : HUGE_VAL;
  } else if (exponent == 0) {
    v = std::ldexp(static_cast<double>(fraction), f.min_exponent - mantissa_bits);
  } else {
    const int bias = f.max_exponent;
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
  }
  return "?";
}

int dtype_size(Dtype dtype) { return dtype == Dtype::kFloat32 ? 4 : 2; }

double round_to(Dtype dtype, double value) {
  switch (dtype) {
    case Dtype::kFloat32: return static_cast<double>(static_cast<float>(value));
    case Dtype::kFloat16: return round_to_format(kHalf, value);
    case Dtype::kBFloat16: return round_to_format(kBFloat16, value);
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
  }
  return 0.0;
}

}  // namespace kdispatch::reference
