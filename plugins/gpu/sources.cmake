# The GPU kernel sources shared by plugins/cuda (nvcc) and plugins/hip (hipcc).
# Paths are taken from this file's folder, so that both can include it.
set(KDISPATCH_GPU_DIR "${CMAKE_CURRENT_LIST_DIR}")
set(KDISPATCH_GPU_SOURCES
  "${CMAKE_CURRENT_LIST_DIR}/activation.cu"
  "${CMAKE_CURRENT_LIST_DIR}/layernorm.cu"
  "${CMAKE_CURRENT_LIST_DIR}/plugin.cu"
  "${CMAKE_CURRENT_LIST_DIR}/rmsnorm.cu"
  "${CMAKE_CURRENT_LIST_DIR}/rotary_embedding.cu"
  "${CMAKE_CURRENT_LIST_DIR}/topk_softmax.cu")
set(KDISPATCH_GPU_HEADERS
  "${CMAKE_CURRENT_LIST_DIR}/device_utils.cuh"
  "${CMAKE_CURRENT_LIST_DIR}/gpu_compat.hpp"
  "${CMAKE_CURRENT_LIST_DIR}/launch_utils.hpp"
  "${CMAKE_CURRENT_LIST_DIR}/ops.hpp"
  "${CMAKE_CURRENT_LIST_DIR}/../common/kd_plugin.hpp")
