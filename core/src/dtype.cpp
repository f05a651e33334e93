#include "kdispatch/dtype.hpp"

#include <fmt/format.h>

// A dlpack.h that numbers the 8-bit floats (DLPack >= 1.1) must agree with
// the codes plugin_api.h gives them.
#if defined(DLPACK_MAJOR_VERSION) && (DLPACK_MAJOR_VERSION > 1 || (DLPACK_MAJOR_VERSION == 1 && DLPACK_MINOR_VERSION >= 1))
static_assert(kDLFloat8_e4m3fn == KD_DLPACK_FLOAT8_E4M3FN && kDLFloat8_e5m2 == KD_DLPACK_FLOAT8_E5M2,
              "DLPack 1.1 float8 codes");
#endif

namespace kdispatch {

std::string_view dtype_name(Dtype dtype) {
  switch (dtype) {
    case Dtype::float32: return "float32";
    case Dtype::float16: return "float16";
    case Dtype::bfloat16: return "bfloat16";
    case Dtype::float64: return "float64";
    case Dtype::int32: return "int32";
    case Dtype::int64: return "int64";
    case Dtype::uint8: return "uint8";
    case Dtype::bool_: return "bool";
    case Dtype::float8_e4m3fn: return "float8_e4m3fn";
    case Dtype::float8_e5m2: return "float8_e5m2";
  }
  return "?";
}

std::optional<Dtype> parse_dtype(std::string_view name) {
  for (Dtype d : kAllDtypes) {
    if (dtype_name(d) == name) return d;
  }
  return std::nullopt;
}

size_t dtype_size(Dtype dtype) {
  switch (dtype) {
    case Dtype::float32: case Dtype::int32: return 4;
    case Dtype::float16: case Dtype::bfloat16: return 2;
    case Dtype::float64: case Dtype::int64: return 8;
    case Dtype::uint8: case Dtype::bool_: case Dtype::float8_e4m3fn: case Dtype::float8_e5m2: return 1;
  }
  return 0;
}

DLDataType to_dlpack(Dtype dtype) {
  const auto bits = static_cast<uint8_t>(dtype_size(dtype) * 8);
  switch (dtype) {
    case Dtype::float32: case Dtype::float16: case Dtype::float64: return {kDLFloat, bits, 1};
    case Dtype::bfloat16: return {kDLBfloat, bits, 1};
    case Dtype::int32: case Dtype::int64: return {kDLInt, bits, 1};
    case Dtype::uint8: return {kDLUInt, bits, 1};
    // DLPack 0.6 has no kDLBool: a bool is one unsigned byte tagged by the schema.
    case Dtype::bool_: return {kDLUInt, 8, 1};
    case Dtype::float8_e4m3fn: return {KD_DLPACK_FLOAT8_E4M3FN, 8, 1};
    case Dtype::float8_e5m2: return {KD_DLPACK_FLOAT8_E5M2, 8, 1};
  }
  return {kDLOpaqueHandle, 0, 0};
}

std::optional<Dtype> from_dlpack(DLDataType type) {
  if (type.lanes != 1) return std::nullopt;
  switch (type.code) {
    case kDLFloat:
      if (type.bits == 32) return Dtype::float32;
      if (type.bits == 16) return Dtype::float16;
      if (type.bits == 64) return Dtype::float64;
      break;
    case kDLBfloat:
      if (type.bits == 16) return Dtype::bfloat16;
      break;
    case kDLInt:
      if (type.bits == 32) return Dtype::int32;
      if (type.bits == 64) return Dtype::int64;
      break;
    case kDLUInt:
      if (type.bits == 8) return Dtype::uint8;
      break;
    case KD_DLPACK_FLOAT8_E4M3FN:
      if (type.bits == 8) return Dtype::float8_e4m3fn;
      break;
    case KD_DLPACK_FLOAT8_E5M2:
      if (type.bits == 8) return Dtype::float8_e5m2;
      break;
    default:
      break;
  }
  return std::nullopt;
}

std::string describe_unknown_dlpack(DLDataType type) {
  if (from_dlpack(type)) return {};
  std::string what = fmt::format("code {}, {} bits, {} lanes", type.code, type.bits, type.lanes);
  if (type.lanes != 1) return fmt::format("a vector type ({}); kdispatch takes lanes == 1 only", what);
  if (type.code >= KD_DLPACK_FIRST_NARROW_FLOAT && type.code <= KD_DLPACK_LAST_NARROW_FLOAT &&
      type.code != KD_DLPACK_FLOAT8_E4M3FN && type.code != KD_DLPACK_FLOAT8_E5M2) {
    return fmt::format("a DLPack 1.1 8-, 6- or 4-bit float kdispatch does not handle ({}); of these it takes "
                       "float8_e4m3fn (code {}) and float8_e5m2 (code {}) only",
                       what, KD_DLPACK_FLOAT8_E4M3FN, KD_DLPACK_FLOAT8_E5M2);
  }
  return fmt::format("a DLPack type kdispatch does not handle ({})", what);
}

}  // namespace kdispatch
