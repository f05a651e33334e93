// Reading a kernel's DLTensor arguments, for the host code of any plugin
// (C++17, so that nvcc and hipcc compile it too): typed data pointers, dims
// and the rows of the schema's ["*", ...] shapes, dtype tests, and the switch
// from a float dtype to the plugin's own storage type.
#pragma once

#include <kdispatch/plugin_api.h>

#include <cstdint>
#include <utility>

#include "kd_plugin.hpp"

namespace kd_plugin {

// The tensor's elements as T, byte_offset applied.
template <class T>
T* data_as(const DLTensor& t) {
  return reinterpret_cast<T*>(static_cast<char*>(t.data) + t.byte_offset);
}

// Size of dimension `i`, counted from the end when negative.
inline int64_t dim(const DLTensor& t, int i) { return t.shape[i < 0 ? t.ndim + i : i]; }

// Product of all dimensions but the last `trailing`: the "*" of the schema
// flattened into rows.
inline int64_t leading_rows(const DLTensor& t, int trailing) {
  int64_t rows = 1;
  for (int i = 0; i < t.ndim - trailing; ++i) rows *= t.shape[i];
  return rows;
}

inline bool is_dtype(const DLTensor& t, uint8_t code, uint8_t bits) {
  return t.dtype.code == code && t.dtype.bits == bits && t.dtype.lanes == 1;
}

inline bool same_dtype(const DLTensor& a, const DLTensor& b) {
  return a.dtype.code == b.dtype.code && a.dtype.bits == b.dtype.bits &&
         a.dtype.lanes == b.dtype.lanes;
}

template <class T>
struct TypeTag {
  using type = T;
};

// Calls fn(TypeTag<S>{}) with S the plugin's storage type for the dtype of
// `t`: Float32, Float16 or BFloat16 for float32, float16 or bfloat16. Any
// other dtype is KD_STATUS_UNSUPPORTED, with a message naming `op`.
template <class Float32, class Float16, class BFloat16, class Fn>
kd_status dispatch_float_dtype(const kd_call_args* args, const char* op, const DLTensor& t,
                               Fn&& fn) {
  if (is_dtype(t, kDLFloat, 32)) return std::forward<Fn>(fn)(TypeTag<Float32>{});
  if (is_dtype(t, kDLFloat, 16)) return std::forward<Fn>(fn)(TypeTag<Float16>{});
  if (is_dtype(t, kDLBfloat, 16)) return std::forward<Fn>(fn)(TypeTag<BFloat16>{});
  return fail(args, KD_STATUS_UNSUPPORTED,
              "%s: unsupported dtype (code %u, %u bits, %u lanes); expected float32, float16 or "
              "bfloat16",
              op, static_cast<unsigned>(t.dtype.code), static_cast<unsigned>(t.dtype.bits),
              static_cast<unsigned>(t.dtype.lanes));
}

}  // namespace kd_plugin
