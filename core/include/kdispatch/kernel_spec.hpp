// KernelSpec: one backend's implementation of one op, as declared by a
// plugin manifest or registered at run time (Context::register_kernel).
// Pure metadata: no library is opened to build one.
#pragma once

#include <kdispatch/export.h>
#include <kdispatch/plugin_api.h>

#include <cstdint>
#include <string>
#include <vector>

#include "kdispatch/device.hpp"
#include "kdispatch/dtype.hpp"

namespace kdispatch KDISPATCH_API {

// What a kernel is for. A reference kernel is the oracle of its op: the
// selector never picks one on its own, only when it is named or forced, and
// the checks of every other backend compare against it (docs/manifest.md).
enum class KernelRole : uint8_t { backend, reference };

struct KernelSpec {
  std::string op;           // "layernorm.rmsnorm"
  std::string backend;      // "cuda"
  std::string plugin;       // "cuda"
  std::string symbol;       // "kd_cuda_rmsnorm"
  std::vector<Target> targets;  // OR; empty = any device
  std::vector<Dtype> dtypes;    // empty = any dtype
  std::string description;
  std::string manifest;     // path of the manifest that declared it
  KernelRole role = KernelRole::backend;  // the kernel's "role", else the manifest's
  // "opt_in": eligible only when its backend is named in the call, forced
  // (KDISPATCH_FORCE_BACKEND) or listed in KDISPATCH_BACKEND_ORDER, so that
  // installing a second implementation of an op changes no existing call.
  bool opt_in = false;
  // "constraints": conditions over the op schema's shape symbols, the call's
  // dtype and int/bool attributes, all of which must hold for a call to be
  // eligible (docs/manifest.md, Constraints). Empty: every call.
  std::vector<std::string> constraints;
  // "priority": ranks this kernel among the eligible ones of its op when no
  // user preference, tuned choice or KDISPATCH_BACKEND_ORDER decides; the
  // higher wins, and equal priorities are a tie (KD-E004). Default 0.
  int32_t priority = 0;
  // "supports": the symbol of the kernel's eligibility function (ABI 1.1),
  // a kd_kernel_fn its plugin's find_kernel returns like a kernel's: called
  // with a call's arguments before the kernel, KD_STATUS_OK lets the kernel
  // run, KD_STATUS_UNSUPPORTED passes the call to the next ranked backend.
  // Empty: none.
  std::string supports_symbol;
  // A kernel registered at run time: the function itself and the data it
  // gets as kd_call_args::kernel_data. Plugin, symbol and manifest are then
  // empty. Null for a plugin's kernels, whose function the plugin gives.
  kd_kernel_fn function = nullptr;
  void* function_data = nullptr;

  bool is_reference() const { return role == KernelRole::reference; }
  bool is_runtime() const { return function != nullptr; }

  bool supports(Dtype dtype) const;
  // Same plugin and symbol (same function and data for a kernel registered
  // at run time): registering it again is a no-op.
  bool same_implementation(const KernelSpec& other) const {
    return plugin == other.plugin && symbol == other.symbol && function == other.function &&
           function_data == other.function_data;
  }
  // "plugin 'cuda' symbol 'kd_cuda_rmsnorm' (lib/kdispatch/plugins/cuda.json)",
  // "kernel registered at run time (backend 'torch')"
  std::string describe() const;
  // Every field equal.
  bool operator==(const KernelSpec&) const = default;
};

}  // namespace kdispatch
