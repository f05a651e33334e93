// The kernel entry points of the GPU plugins, kd_gpu::<name>, one per op.
// They are declared by kd_plugin_kernels.hpp, which kdispatch_add_plugin()
// generates from the plugin's manifest (manifests/cuda.json: symbol
// kd_cuda_<name>, manifests/hip.json: kd_hip_<name>; see plugins/cuda and
// plugins/hip), together with the symbol table plugin.cu hands to the host.
#pragma once

#include "kd_plugin_kernels.hpp"
