// Element types of tensors, by the names op schemas use (docs/op-schema.md).
#pragma once

#include <kdispatch/export.h>

#include <dlpack/dlpack.h>

#include <cstdint>
#include <optional>
#include <string_view>

namespace kdispatch KDISPATCH_API {

enum class Dtype : uint8_t { float32, float16, bfloat16, float64, int32, int64, uint8, bool_ };

inline constexpr Dtype kAllDtypes[] = {Dtype::float32, Dtype::float16, Dtype::bfloat16,
                                       Dtype::float64, Dtype::int32,   Dtype::int64,
                                       Dtype::uint8,   Dtype::bool_};

std::string_view dtype_name(Dtype dtype);  // "float32", ..., "bool"
std::optional<Dtype> parse_dtype(std::string_view name);
size_t dtype_size(Dtype dtype);  // bytes per element
DLDataType to_dlpack(Dtype dtype);
std::optional<Dtype> from_dlpack(DLDataType type);  // lanes must be 1

}  // namespace kdispatch
