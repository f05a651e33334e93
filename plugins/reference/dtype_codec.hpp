// The storage dtypes of the op set, modelled in float64: rounding a value to
// a dtype and encoding it to (or decoding it from) its bits.
//
// Written arithmetically (ilogb, ldexp, nearbyint) rather than with bit
// tricks, so that it checks the backends' own conversions instead of
// repeating them. decode reads a table of every code's value, computed once.
#pragma once

#include <cstdint>

namespace kdispatch::reference {

// kFloat8E4M3FN: 4 exponent bits (bias 7), 3 mantissa bits, no infinity,
// NaN 0x7f/0xff, largest finite 448. kFloat8E5M2: 5 exponent bits (bias
// 15), 2 mantissa bits, IEEE-like (infinity, NaNs), largest finite 57344.
enum class Dtype { kFloat32, kFloat16, kBFloat16, kFloat8E4M3FN, kFloat8E5M2 };

const char* dtype_name(Dtype dtype);

// Bytes per element.
int dtype_size(Dtype dtype);

// `value` rounded to the nearest value of `dtype` (ties to even). Overflow
// goes to infinity, except for the 8-bit floats: they saturate at their
// largest finite value, infinities included, as the peers' fp8 quantisers
// (vLLM, SGLang) clamp to +-max before converting. NaN passes through.
double round_to(Dtype dtype, double value);

// The bits of round_to(dtype, value), in the low dtype_size bytes. NaN
// encodes as the canonical quiet NaN (float8_e4m3fn: 0x7f).
uint32_t encode(Dtype dtype, double value);

// The value held by `bits`.
double decode(Dtype dtype, uint32_t bits);

}  // namespace kdispatch::reference
