// The storage dtypes of the op set, modelled in float64: rounding a value to
// a dtype and encoding it to (or decoding it from) its bits.
//
// Written arithmetically (ilogb, ldexp, nearbyint) rather than with bit
// tricks, so that it checks the backends' own conversions instead of
// repeating them.
#pragma once

#include <cstdint>

namespace kdispatch::reference {

enum class Dtype { kFloat32, kFloat16, kBFloat16 };

const char* dtype_name(Dtype dtype);

// Bytes per element.
int dtype_size(Dtype dtype);

// `value` rounded to the nearest value of `dtype` (ties to even), with
// overflow to infinity; NaN and infinities pass through.
double round_to(Dtype dtype, double value);

// The bits of round_to(dtype, value), in the low dtype_size bytes. NaN
// encodes as the canonical quiet NaN.
uint32_t encode(Dtype dtype, double value);

// The value held by `bits`.
double decode(Dtype dtype, uint32_t bits);

}  // namespace kdispatch::reference
