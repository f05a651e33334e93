// The kernel entry points of the GPU plugins, kd_gpu::<name>, one per op.
// They are declared by kd_plugin_kernels.hpp, which kdispatch_add_plugin()
// generates from the plugin's manifest (cuda.json: symbol kd_cuda_<name>,
// hip.json: kd_hip_<name>, both generated from manifests/gpu.json.in by
// plugins/gpu/targets.cmake), together with the symbol table plugin.cu hands
// to the host.
#pragma once

#include "kd_plugin_kernels.hpp"
