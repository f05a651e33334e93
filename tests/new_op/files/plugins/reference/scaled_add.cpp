// scratch.scaled_add in float64.
#include <kdispatch/plugin_helpers.hpp>

#include "kd_plugin_kernels.hpp"
#include "tensor.hpp"

namespace kdispatch::reference {

// kd_ref_scaled_add. Tensors (out, x, y), attribute alpha: out = x + alpha * y.
kd_status scaled_add(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(args, [&] {
    expect_arity(args, 3, 1, "scratch.scaled_add");
    const Tensor out(args->tensors[0]), x(args->tensors[1]), y(args->tensors[2]);
    const double alpha = kd_plugin::float_attr(args, "alpha");
    for (int64_t i = 0; i < x.numel(); ++i) out.set(i, x.get(i) + alpha * y.get(i));
  });
}

}  // namespace kdispatch::reference
