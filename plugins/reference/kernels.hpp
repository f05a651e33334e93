// The reference kernels: one function per op of manifests/ops/, each the
// op's formula evaluated in float64 from the stored inputs, every output
// rounded once to its dtype. They are the oracle the checks of every other
// backend compare against, so they stay plain: no SIMD, no tables, no
// threads.
#pragma once

#include <kdispatch/plugin_api.h>

#include <exception>
#include <new>
#include <stdexcept>

#include "kd_plugin.hpp"

namespace kdispatch::reference {

// Runs `body`; std::invalid_argument becomes KD_STATUS_INVALID_ARGUMENT, any
// other exception KD_STATUS_INTERNAL, each with its message.
template <class Body>
kd_status run_kernel(const kd_call_args* args, Body&& body) noexcept {
  if (args == nullptr) return KD_STATUS_INVALID_ARGUMENT;
  try {
    body();
    return KD_STATUS_OK;
  } catch (const std::invalid_argument& e) {
    return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT, "%s", e.what());
  } catch (const std::bad_alloc&) {
    return kd_plugin::fail(args, KD_STATUS_INTERNAL, "out of host memory");
  } catch (const std::exception& e) {
    return kd_plugin::fail(args, KD_STATUS_INTERNAL, "%s", e.what());
  } catch (...) {
    return kd_plugin::fail(args, KD_STATUS_INTERNAL, "unknown exception");
  }
}

kd_status rmsnorm(const kd_call_args* args) noexcept;
kd_status fused_add_rmsnorm(const kd_call_args* args) noexcept;
kd_status layernorm(const kd_call_args* args) noexcept;
kd_status silu_and_mul(const kd_call_args* args) noexcept;
kd_status gelu_and_mul(const kd_call_args* args) noexcept;
kd_status gelu_tanh_and_mul(const kd_call_args* args) noexcept;
kd_status rotary_embedding(const kd_call_args* args) noexcept;
kd_status topk_softmax(const kd_call_args* args) noexcept;

}  // namespace kdispatch::reference
