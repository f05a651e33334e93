// Reading the cpu kernels' arguments: the tensor and attribute helpers of
// <kdispatch/plugin_helpers.hpp>, and the cheap defensive checks every
// kernel makes.
//
// The host has validated the call against the op schema before it reaches a
// kernel; these checks only keep a kernel from reading out of bounds when
// called directly with bad arguments.
#pragma once

#include <kdispatch/plugin_api.h>
#include <kdispatch/plugin_helpers.hpp>

#include <cstdint>

namespace kdispatch::cpu {

using kd_plugin::data_as;
using kd_plugin::dim;
using kd_plugin::dispatch_float_dtype;  // float, Float16 or BFloat16
using kd_plugin::find_attr;
using kd_plugin::is_dtype;
using kd_plugin::leading_rows;
using kd_plugin::same_dtype;
using kd_plugin::TypeTag;

// Checks the argument counts and that every tensor has at least
// `min_ndim[i]` dimensions and data. A kernel gives min_ndim 0 for an
// optional tensor: there an absent one (no data, no dims: ABI 1.1) passes,
// and the kernel tests for it. Returns KD_STATUS_OK or a failure with its
// message written.
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
    if (min_ndim[i] == 0 && t.data == nullptr && t.ndim == 0) continue;
    if (t.ndim < min_ndim[i] || (t.ndim > 0 && t.shape == nullptr)) {
      return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT,
                             "%s: tensor %d has %d dimensions, expected at least %d", op, i,
                             t.ndim, min_ndim[i]);
    }
    if (t.data == nullptr && t.ndim == 0) continue;  // an optional tensor left out
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

}  // namespace kdispatch::cpu
