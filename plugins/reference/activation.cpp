// The gated activations out = act(x[..., :D]) * x[..., D:] in float64.
#include <cmath>
#include <numbers>

#include <kdispatch/plugin_helpers.hpp>

#include "kd_plugin_kernels.hpp"
#include "tensor.hpp"

namespace kdispatch::reference {
namespace {

// Tensors (out [*, D], x [*, 2*D]).
template <class Act>
kd_status gated(const kd_call_args* args, const char* op, Act act) {
  return kd_plugin::guarded(args, [&] {
    expect_arity(args, 2, 0, op);
    const Tensor out(args->tensors[0]), x(args->tensors[1]);
    const int64_t d = out.dim(-1);
    for (int64_t r = 0; r < out.rows(1); ++r) {
      for (int64_t j = 0; j < d; ++j) out.set(r * d + j, act(x.get(r * 2 * d + j)) * x.get(r * 2 * d + d + j));
    }
  });
}

}  // namespace

// kd_ref_silu_and_mul
kd_status silu_and_mul(const kd_call_args* args) noexcept {
  return gated(args, "activation.silu_and_mul", [](double a) { return a / (1.0 + std::exp(-a)); });
}

// kd_ref_gelu_and_mul
kd_status gelu_and_mul(const kd_call_args* args) noexcept {
  return gated(args, "activation.gelu_and_mul",
               [](double a) { return 0.5 * a * (1.0 + std::erf(a / std::numbers::sqrt2)); });
}

// kd_ref_gelu_tanh_and_mul
kd_status gelu_tanh_and_mul(const kd_call_args* args) noexcept {
  return gated(args, "activation.gelu_tanh_and_mul", [](double a) {
    const double k = std::sqrt(2.0 / std::numbers::pi);
    return 0.5 * a * (1.0 + std::tanh(k * (a + 0.044715 * a * a * a)));
  });
}

}  // namespace kdispatch::reference
