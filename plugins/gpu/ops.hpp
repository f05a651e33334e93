// The kernel entry points of the GPU plugins, one per op; plugin.cu lists them
// under their manifest symbols (kd_cuda_<name>, kd_hip_<name>).
#pragma once

#include <kdispatch/plugin_api.h>

namespace kd_gpu {

kd_status rmsnorm(const kd_call_args* args) noexcept;
kd_status fused_add_rmsnorm(const kd_call_args* args) noexcept;
kd_status layernorm(const kd_call_args* args) noexcept;
kd_status silu_and_mul(const kd_call_args* args) noexcept;
kd_status gelu_and_mul(const kd_call_args* args) noexcept;
kd_status gelu_tanh_and_mul(const kd_call_args* args) noexcept;
kd_status rotary_embedding(const kd_call_args* args) noexcept;
kd_status topk_softmax(const kd_call_args* args) noexcept;

}  // namespace kd_gpu
