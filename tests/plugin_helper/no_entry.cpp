// A kernel and no KD_DEFINE_PLUGIN: the library links, but exports nothing
// the host could open it by.
#include "kd_plugin_kernels.hpp"

kd_status silu_and_mul(const kd_call_args*) noexcept { return KD_STATUS_UNSUPPORTED; }
