// Reading kernel arguments: typed data pointers, row/column views of the
// schema's ["*", ...] shapes, the cheap defensive checks every kernel makes,
// and the switch from a DLPack dtype to a storage type.
//
// The host has validated the call against the op schema before it reaches a
// kernel; these checks only keep a kernel from reading out of bounds when
// called directly with bad arguments.
#pragma once

#include <kdispatch/plugin_api.h>

#include <cstdint>

#include "half_float.hpp"
#include "kd_plugin.hpp"

namespace kdispatch::cpu {

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

// Checks the argument counts and that every tensor has at least
// `min_ndim[i]` dimensions and data. Returns KD_STATUS_OK or a failure with
// its message written.
template <int NumTensors>
kd_status check_arguments(const kd_call_args* args, const char* op, int num_attrs,
                          const int (&min_ndim)[NumTensors]) {
  if (args == nullptr) return KD_STATUS_INVALID_ARGUMENT;
  if (args->num_tensors != NumTensors || args->tensors == nullptr) {
    return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT, "%s: expected %d tensors, got %d",
                           op, NumTensors, args->num_tensors);
  }
  if (args->num_attrs != num_attrs || (num_attrs > 0 && args->attrs == nullptr)) {
    return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT,
                           "%s: expected %d attributes, got %d", op, num_attrs, args->num_attrs);
  }
  for (int i = 0; i < NumTensors; ++i) {
    const DLTensor& t = args->tensors[i];
    if (t.ndim < min_ndim[i] || (t.ndim > 0 && t.shape == nullptr)) {
      return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT,
                             "%s: tensor %d has %d dimensions, expected at least %d", op, i,
                             t.ndim, min_ndim[i]);
    }
    for (int d = 0; d < t.ndim; ++d) {
      if (t.shape[d] < 0) {
        return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT,
                               "%s: tensor %d has a negative dimension", op, i);
      }
    }
    if (t.data == nullptr && leading_rows(t, 0) != 0) {
      return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT, "%s: tensor %d has no data", op,
                             i);
    }
  }
  return KD_STATUS_OK;
}

template <class T>
struct TypeTag {
  using type = T;
};

// Calls fn(TypeTag<T>{}) with T the storage type of `t` (float, Half or
// BFloat16); any other dtype is KD_STATUS_UNSUPPORTED.
template <class Fn>
kd_status dispatch_float_dtype(const kd_call_args* args, const char* op, const DLTensor& t,
                               Fn&& fn) {
  if (is_dtype(t, kDLFloat, 32)) return fn(TypeTag<float>{});
  if (is_dtype(t, kDLFloat, 16)) return fn(TypeTag<Half>{});
  if (is_dtype(t, kDLBfloat, 16)) return fn(TypeTag<BFloat16>{});
  return kd_plugin::fail(args, KD_STATUS_UNSUPPORTED,
                         "%s: unsupported dtype (code %u, %u bits, %u lanes); expected float32, "
                         "float16 or bfloat16",
                         op, static_cast<unsigned>(t.dtype.code),
                         static_cast<unsigned>(t.dtype.bits),
                         static_cast<unsigned>(t.dtype.lanes));
}

// Attribute `index`, checked for its type.
inline const kd_attr* attr_of_type(const kd_call_args* args, int index, kd_attr_type type) {
  const kd_attr* a = &args->attrs[index];
  return a->type == type ? a : nullptr;
}

}  // namespace kdispatch::cpu
