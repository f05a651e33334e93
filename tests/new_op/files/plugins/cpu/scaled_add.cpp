// scratch.scaled_add: out = x + alpha * y, in float, rounded to T once.
#include "convert.hpp"
#include "kd_plugin_kernels.hpp"
#include "tensor_access.hpp"

namespace kdispatch::cpu {

// kd_cpu_scaled_add
kd_status scaled_add(const kd_call_args* args) noexcept {
  constexpr const char* kOp = "scratch.scaled_add";
  if (const kd_status s = check_arguments<3>(args, kOp, 1, {1, 1, 1}); s != KD_STATUS_OK) return s;
  const kd_attr* alpha = find_attr(args, "alpha", KD_ATTR_TYPE_FLOAT);
  if (alpha == nullptr) return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT, "%s: alpha must be a float", kOp);
  const DLTensor& out = args->tensors[0];
  const DLTensor& x = args->tensors[1];
  const DLTensor& y = args->tensors[2];
  return dispatch_float_dtype(args, kOp, x, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const int64_t n = leading_rows(x, 0);
    T* o = data_as<T>(out);
    const T* a = data_as<const T>(x);
    const T* b = data_as<const T>(y);
    const auto scale = static_cast<float>(alpha->value.f);
    for (int64_t i = 0; i < n; ++i) o[i] = from_float<T>(to_float(a[i]) + scale * to_float(b[i]));
    return KD_STATUS_OK;
  });
}

}  // namespace kdispatch::cpu
