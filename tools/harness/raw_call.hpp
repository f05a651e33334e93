// One kernel call built by hand through the plugin C ABI (kd_call_args), for
// the tests and tools that drive a plugin's kernels directly, without the
// core: the kernel, its tensors and attributes and the buffer it writes its
// error message into, kept together. Header-only; needs only the C ABI.
#pragma once

#include <kdispatch/plugin_api.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace kdispatch::harness {

struct RawCall {
  kd_kernel_fn fn = nullptr;
  std::vector<DLTensor> tensors;
  std::vector<kd_attr> attrs;
  char error[512] = {};

  // Calls `fn` on `stream` (a cudaStream_t or hipStream_t; null: the default
  // stream, and what a cpu kernel is given). Clears `error` first.
  kd_status run(void* stream = nullptr) {
    std::memset(error, 0, sizeof(error));
    kd_call_args args{};
    args.struct_size = sizeof(args);
    args.tensors = tensors.data();
    args.num_tensors = static_cast<int32_t>(tensors.size());
    args.attrs = attrs.empty() ? nullptr : attrs.data();
    args.num_attrs = static_cast<int32_t>(attrs.size());
    args.stream = stream;
    args.error = error;
    args.error_capacity = sizeof(error);
    args.kernel_data = nullptr;  // a plugin's kernel
    return fn(&args);
  }
};

inline kd_attr float_attr(const char* name, double v) {
  kd_attr a{};
  a.name = name;
  a.type = KD_ATTR_TYPE_FLOAT;
  a.value.f = v;
  return a;
}

inline kd_attr bool_attr(const char* name, bool v) {
  kd_attr a{};
  a.name = name;
  a.type = KD_ATTR_TYPE_BOOL;
  a.value.b = v ? 1 : 0;
  return a;
}

}  // namespace kdispatch::harness
