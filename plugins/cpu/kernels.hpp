// The kernels of the cpu plugin, one per manifest symbol (kd_cpu_<name>).
// Each has the kd_kernel_fn signature and never throws.
#pragma once

#include <kdispatch/plugin_api.h>

namespace kdispatch::cpu {

kd_status rmsnorm(const kd_call_args* args) noexcept;
kd_status fused_add_rmsnorm(const kd_call_args* args) noexcept;
kd_status layernorm(const kd_call_args* args) noexcept;
kd_status silu_and_mul(const kd_call_args* args) noexcept;
kd_status gelu_and_mul(const kd_call_args* args) noexcept;
kd_status gelu_tanh_and_mul(const kd_call_args* args) noexcept;
kd_status rotary_embedding(const kd_call_args* args) noexcept;
kd_status topk_softmax(const kd_call_args* args) noexcept;

}  // namespace kdispatch::cpu
