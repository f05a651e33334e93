// Element types of tensors, by the names op schemas use (docs/op-schema.md).
#pragma once

#include <kdispatch/export.h>

#include <kdispatch/plugin_api.h>  // dlpack.h and the DLPack 1.1 float8 codes

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace kdispatch KDISPATCH_API {

// New dtypes go at the end: a dtype's place in kAllDtypes is stored in the
// registry cache (manifest_record.cpp).
enum class Dtype : uint8_t {
  float32, float16, bfloat16, float64, int32, int64, uint8, bool_,
  float8_e4m3fn,  // 4 exponent bits (bias 7), 3 mantissa bits, no inf, NaN 0x7f/0xff, max 448
  float8_e5m2,    // 5 exponent bits (bias 15), 2 mantissa bits, IEEE-like, max 57344
};

inline constexpr Dtype kAllDtypes[] = {Dtype::float32, Dtype::float16,       Dtype::bfloat16,
                                       Dtype::float64, Dtype::int32,         Dtype::int64,
                                       Dtype::uint8,   Dtype::bool_,         Dtype::float8_e4m3fn,
                                       Dtype::float8_e5m2};

// A floating-point dtype (compared in ulps); the others compare exactly.
constexpr bool is_floating(Dtype dtype) {
  return dtype == Dtype::float32 || dtype == Dtype::float16 || dtype == Dtype::bfloat16 || dtype == Dtype::float64 ||
         dtype == Dtype::float8_e4m3fn || dtype == Dtype::float8_e5m2;
}

std::string_view dtype_name(Dtype dtype);  // "float32", ..., "bool"
std::optional<Dtype> parse_dtype(std::string_view name);
size_t dtype_size(Dtype dtype);  // bytes per element
DLDataType to_dlpack(Dtype dtype);
std::optional<Dtype> from_dlpack(DLDataType type);  // lanes must be 1
// Why `type` is no dtype kdispatch handles, in words for an error message
// ("a DLPack 1.1 8-, 6- or 4-bit float kdispatch does not handle (code 11,
// 8 bits, 1 lanes); ..."); empty when from_dlpack accepts it.
std::string describe_unknown_dlpack(DLDataType type);

}  // namespace kdispatch
