// The reference backend's codec of the 8-bit floats: every code decodes to
// the value its fields give, every finite value encodes back to its code,
// rounding is once to nearest-even (subnormals included), and overflow
// saturates at the format's largest finite value as the peers' fp8
// quantisers do.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <ios>
#include <limits>

#include "dtype_codec.hpp"

namespace ref = kdispatch::reference;

namespace {

struct Format {
  ref::Dtype dtype;
  int exponent_bits, mantissa_bits, bias;
  double largest;
  uint32_t largest_code;
  bool has_inf;  // e5m2: exponent all ones holds inf (fraction 0) and NaNs
};

constexpr Format kE4M3FN{ref::Dtype::kFloat8E4M3FN, 4, 3, 7, 448.0, 0x7e, false};
constexpr Format kE5M2{ref::Dtype::kFloat8E5M2, 5, 2, 15, 57344.0, 0x7b, true};

// The value of `code` from its sign, exponent and fraction fields, by the
// definition of the format: (-1)^s * 2^(e - bias) * (1 + f / 2^m), e > 0;
// (-1)^s * 2^(1 - bias) * f / 2^m, e == 0.
double value_of(const Format& f, uint32_t code) {
  const uint32_t e = (code >> f.mantissa_bits) & ((1u << f.exponent_bits) - 1);
  const uint32_t m = code & ((1u << f.mantissa_bits) - 1);
  const double sign = (code & 0x80u) != 0 ? -1.0 : 1.0;
  const uint32_t e_max = (1u << f.exponent_bits) - 1;
  const uint32_t m_max = (1u << f.mantissa_bits) - 1;
  if (f.has_inf && e == e_max) return m == 0 ? sign * INFINITY : NAN;
  if (!f.has_inf && e == e_max && m == m_max) return NAN;
  const double scale = std::pow(2.0, -f.mantissa_bits);
  if (e == 0) return sign * std::pow(2.0, 1 - f.bias) * m * scale;
  return sign * std::pow(2.0, static_cast<int>(e) - f.bias) * (1.0 + m * scale);
}

bool is_nan_code(const Format& f, uint32_t code) { return std::isnan(value_of(f, code)); }

void check_format(const Format& f) {
  INFO(ref::dtype_name(f.dtype));
  CHECK(ref::dtype_size(f.dtype) == 1);

  SUBCASE("decode: all 256 codes, exactly") {
    int nans = 0;
    for (uint32_t code = 0; code < 256; ++code) {
      INFO("code 0x" << std::hex << code);
      const double want = value_of(f, code);
      const double got = ref::decode(f.dtype, code);
      if (std::isnan(want)) {
        CHECK(std::isnan(got));
        ++nans;
      } else {
        CHECK(got == want);
        CHECK(std::signbit(got) == ((code & 0x80u) != 0));
      }
    }
    CHECK(nans == (f.has_inf ? 6 : 2));  // e5m2: 3 NaN fractions, each sign; e4m3fn: 0x7f, 0xff
    CHECK(ref::decode(f.dtype, f.largest_code) == f.largest);
    CHECK(ref::decode(f.dtype, f.largest_code | 0x80u) == -f.largest);
    CHECK(ref::decode(f.dtype, 0x01) == std::ldexp(1.0, 1 - f.bias - f.mantissa_bits));  // smallest subnormal
  }

  SUBCASE("encode: every finite code round-trips, negative zero included") {
    for (uint32_t code = 0; code < 256; ++code) {
      if (is_nan_code(f, code) || std::isinf(value_of(f, code))) continue;
      INFO("code 0x" << std::hex << code);
      CHECK(ref::encode(f.dtype, ref::decode(f.dtype, code)) == code);
      CHECK(ref::round_to(f.dtype, ref::decode(f.dtype, code)) == ref::decode(f.dtype, code));
    }
  }

  SUBCASE("encode: between neighbours, the nearer; on the midpoint, the even code") {
    // Each pair of adjacent non-negative finite codes, and their negatives.
    for (uint32_t code = 0; code + 1 < 256 && code + 1 <= f.largest_code; ++code) {
      for (uint32_t sign : {0u, 0x80u}) {
        const double lo = ref::decode(f.dtype, code | sign);
        const double hi = ref::decode(f.dtype, (code + 1) | sign);
        const double mid = (lo + hi) / 2;  // exact in float64
        INFO("codes 0x" << std::hex << (code | sign) << ", 0x" << ((code + 1) | sign));
        const uint32_t even = (code % 2 == 0 ? code : code + 1) | sign;
        const uint32_t want_mid = (code == 0 && sign != 0) ? 0x80u : even;  // -0 keeps its sign
        CHECK(ref::encode(f.dtype, mid) == want_mid);
        CHECK(ref::encode(f.dtype, std::nextafter(mid, lo)) == (code | sign));
        CHECK(ref::encode(f.dtype, std::nextafter(mid, hi)) == ((code + 1) | sign));
      }
    }
    // Below half the smallest subnormal: zero of the value's sign.
    const double tiny = std::ldexp(1.0, 1 - f.bias - f.mantissa_bits);
    CHECK(ref::encode(f.dtype, tiny / 2) == 0x00);
    CHECK(ref::encode(f.dtype, -tiny / 2) == 0x80);
    CHECK(ref::encode(f.dtype, 0.75 * tiny) == 0x01);
    CHECK(ref::encode(f.dtype, 1.5 * tiny) == 0x02);  // tie between 1 and 2: even
    CHECK(ref::encode(f.dtype, 2.5 * tiny) == 0x02);  // tie between 2 and 3: even
  }

  SUBCASE("encode: overflow saturates at the largest finite value, infinities included") {
    const double ulp_at_max = std::ldexp(1.0, std::ilogb(f.largest) - f.mantissa_bits);
    for (double v : {f.largest, f.largest + ulp_at_max / 2, f.largest + ulp_at_max, 2 * f.largest, 1e30,
                     std::numeric_limits<double>::max(), std::numeric_limits<double>::infinity()}) {
      INFO(v);
      CHECK(ref::encode(f.dtype, v) == f.largest_code);
      CHECK(ref::encode(f.dtype, -v) == (f.largest_code | 0x80u));
      CHECK(ref::round_to(f.dtype, v) == f.largest);
      CHECK(ref::round_to(f.dtype, -v) == -f.largest);
    }
    CHECK(std::isnan(ref::decode(f.dtype, ref::encode(f.dtype, NAN))));
    CHECK(std::isnan(ref::round_to(f.dtype, NAN)));
  }
}

}  // namespace

TEST_CASE("reference codec: float8_e4m3fn") {
  check_format(kE4M3FN);
  CHECK(ref::encode(ref::Dtype::kFloat8E4M3FN, NAN) == 0x7f);
  CHECK(ref::encode(ref::Dtype::kFloat8E4M3FN, 1.0) == 0x38);
  CHECK(ref::encode(ref::Dtype::kFloat8E4M3FN, 464.0) == 0x7e);  // a tie with 480, which does not exist
  CHECK(ref::decode(ref::Dtype::kFloat8E4M3FN, 0x08) == std::ldexp(1.0, -6));  // smallest normal
}

TEST_CASE("reference codec: float8_e5m2") {
  check_format(kE5M2);
  CHECK(ref::encode(ref::Dtype::kFloat8E5M2, NAN) == 0x7e);
  CHECK(ref::encode(ref::Dtype::kFloat8E5M2, 1.0) == 0x3c);
  CHECK(ref::encode(ref::Dtype::kFloat8E5M2, 61440.0) == 0x7b);  // the tie with 65536 (inf) saturates
  CHECK(ref::decode(ref::Dtype::kFloat8E5M2, 0x7c) == INFINITY);
  CHECK(ref::decode(ref::Dtype::kFloat8E5M2, 0xfc) == -INFINITY);
}
