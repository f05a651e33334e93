// The example's kernels, written with <kdispatch/plugin_helpers.hpp>.
// kd_plugin_kernels.hpp, which kdispatch_add_plugin() generates from the
// manifest, declares them: the symbol example_<name> is the function
// example::<name> (KERNEL_NAMESPACE example, SYMBOL_PREFIX example_). The
// core has checked every call against the op schema before a kernel runs
// (tensor count, dtypes, shapes, contiguity), so a kernel reads its tensors
// in schema order and its attributes by name without checking them again.
#include <kdispatch/plugin_helpers.hpp>
#include <kdispatch/plugin_rows.hpp>

#include <cmath>
#include <cstdint>

#include "kd_plugin_kernels.hpp"

namespace example {

// elementwise.scaled_add: out = a + alpha * b, computed in float and rounded
// to T once.
kd_status scaled_add(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(args, [&] {
    const kd_plugin::Tensor out(args, 0), a(args, 1), b(args, 2);
    const auto alpha = static_cast<float>(kd_plugin::float_attr(args, "alpha"));
    return kd_plugin::dispatch_float_dtype(args, "elementwise.scaled_add", a.dl(), [&](auto tag) {
      using T = typename decltype(tag)::type;
      T* o = out.data<T>();
      const T* x = a.data<const T>();
      const T* y = b.data<const T>();
      kd_plugin::parallel_for(out.numel(), 3, [&](int64_t begin, int64_t end) noexcept {
        for (int64_t i = begin; i < end; ++i) {
          o[i] = kd_plugin::from_float<T>(kd_plugin::to_float(x[i]) + alpha * kd_plugin::to_float(y[i]));
        }
      });
      return KD_STATUS_OK;
    });
  });
}

// activation.silu_and_mul: out = silu(x[..., :D]) * x[..., D:], computed in
// float and rounded to T once. Its schema gives out and x the "rows" layout
// (a row may start anywhere), so rows are found through RowLayout.
kd_status silu_and_mul(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(args, [&] {
    const kd_plugin::Tensor out(args, 0), x(args, 1);
    return kd_plugin::dispatch_float_dtype(args, "activation.silu_and_mul", x.dl(), [&](auto tag) {
      using T = typename decltype(tag)::type;
      T* o = out.data<T>();
      const T* in = x.data<const T>();
      const int64_t d = out.cols();
      const kd_plugin::RowLayout out_rows = kd_plugin::row_layout(out.dl(), 1);
      const kd_plugin::RowLayout x_rows = kd_plugin::row_layout(x.dl(), 1);
      kd_plugin::parallel_for(out_rows.count, 3 * d, [&](int64_t begin, int64_t end) noexcept {
        for (int64_t r = begin; r < end; ++r) {
          const T* gate = in + x_rows.offset(r);
          const T* up = gate + d;
          T* row = o + out_rows.offset(r);
          for (int64_t j = 0; j < d; ++j) {
            const float g = kd_plugin::to_float(gate[j]);
            row[j] = kd_plugin::from_float<T>(g / (1.0f + std::exp(-g)) * kd_plugin::to_float(up[j]));
          }
        }
      });
      return KD_STATUS_OK;
    });
  });
}

}  // namespace example
