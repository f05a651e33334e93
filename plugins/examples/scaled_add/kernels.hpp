// Kernels of the example plugin. The core has checked every call against the
// op schema before a kernel runs (tensor count, dtypes, shapes, contiguity),
// so a kernel reads its tensors in schema order without checking them again.
#pragma once

#include <kdispatch/plugin_api.h>

namespace example {

// elementwise.scaled_add: tensors (out, a, b), attribute alpha.
kd_status scaled_add(const kd_call_args* args) noexcept;
// activation.silu_and_mul: tensors (out, x).
kd_status silu_and_mul(const kd_call_args* args) noexcept;

}  // namespace example
