// The reference kernel of the example's op: the schema's formula in float64
// from the stored inputs, the output rounded once to its dtype. Every check
// (`kdispatch run`, `kdispatch bench`, kdispatch-conformance,
// kdispatch.testing) compares the op's other kernels with it, so it stays
// plain: no threads, no SIMD.
#include <kdispatch/plugin_helpers.hpp>

#include <cstdint>

#include "kd_plugin_kernels.hpp"

namespace example {

// elementwise.scaled_add: out = a + alpha * b.
kd_status scaled_add_reference(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(args, [&] {
    const kd_plugin::Tensor out(args, 0), a(args, 1), b(args, 2);
    const double alpha = kd_plugin::float_attr(args, "alpha");
    return kd_plugin::dispatch_float_dtype(args, "elementwise.scaled_add", a.dl(), [&](auto tag) {
      using T = typename decltype(tag)::type;
      T* o = out.data<T>();
      const T* x = a.data<const T>();
      const T* y = b.data<const T>();
      for (int64_t i = 0; i < out.numel(); ++i) {
        o[i] = kd_plugin::from_double<T>(kd_plugin::to_double(x[i]) + alpha * kd_plugin::to_double(y[i]));
      }
      return KD_STATUS_OK;
    });
  });
}

}  // namespace example
