#include "dtype_codec.hpp"

#include <algorithm>
#include <array>
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

// Finite non-zero v rounded to the nearest multiple of the format's spacing
// at |v|, 2^(exponent - precision + 1), the exponent held at its minimum for
// subnormals (ties to even): v ~ units * 2^scale.
struct Rounded {
  double units;  // an integer, |units| <= 2^precision
  int exponent;
  int scale;
};

Rounded round_units(const Format& f, double v) {
  const int exponent = std::max(std::ilogb(v), f.min_exponent);
  const int scale = exponent - f.precision + 1;
  return {std::nearbyint(std::ldexp(v, -scale)), exponent, scale};
}

double round_to_format(const Format& f, double v) {
  if (std::isnan(v) || v == 0.0) return v;
  if (std::isinf(v)) return f.saturate ? std::copysign(f.largest_finite, v) : v;
  const Rounded q = round_units(f, v);
  const double r = std::ldexp(q.units, q.scale);
  if (std::fabs(r) > f.largest_finite) return std::copysign(f.saturate ? f.largest_finite : HUGE_VAL, v);
  return r;
}

uint32_t encode_format(const Format& f, double v) {
  const int mantissa_bits = f.precision - 1;
  const uint32_t exponent_mask = (1u << f.exponent_bits) - 1;
  const uint32_t sign = std::signbit(v) ? 1u << (f.exponent_bits + mantissa_bits) : 0u;
  const uint32_t infinity = exponent_mask << mantissa_bits;
  if (std::isnan(v)) return infinity | (f.ieee_specials ? 1u << (mantissa_bits - 1) : (1u << mantissa_bits) - 1);
  if (v == 0.0) return sign;
  const Rounded q = std::isinf(v) ? Rounded{} : round_units(f, std::fabs(v));
  if (std::isinf(v) || std::ldexp(q.units, q.scale) > f.largest_finite) {
    return sign | (f.saturate ? encode_format(f, f.largest_finite) : infinity);
  }
  // units * 2^scale with units in [2^m, 2^(m+1)] is the normal number of
  // biased exponent (exponent + bias) and fraction units - 2^m; adding the
  // units to (exponent + bias - 1) << m gives both, a carry into the next
  // binade (units == 2^(m+1)) included. A subnormal's exponent is the
  // minimum, where exponent + bias == 1: its code is its units.
  return sign | ((static_cast<uint32_t>(q.exponent + f.bias - 1) << mantissa_bits) +
                 static_cast<uint32_t>(q.units));
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

// decode_format of every code of F (a sign bit, the exponent and the
// fraction), computed once.
template <const Format& F>
const auto& decoded() {
  constexpr size_t kCodes = size_t{1} << (1 + F.exponent_bits + F.precision - 1);
  static const std::array<double, kCodes> table = [] {
    std::array<double, kCodes> t{};
    for (uint32_t code = 0; code < kCodes; ++code) t[code] = decode_format(F, code);
    return t;
  }();
  return table;
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
    case Dtype::kFloat16: return decoded<kHalf>()[bits & 0xffffu];
    case Dtype::kBFloat16: return decoded<kBFloat16>()[bits & 0xffffu];
    case Dtype::kFloat8E4M3FN: return decoded<kFloat8E4M3FN>()[bits & 0xffu];
    case Dtype::kFloat8E5M2: return decoded<kFloat8E5M2>()[bits & 0xffu];
  }
  return 0.0;
}

}  // namespace kdispatch::reference
