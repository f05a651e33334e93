# The GPU kernel sources shared by plugins/cuda (nvcc) and plugins/hip (hipcc).
# Paths are taken from this file's folder, so that both can include it.
# Every .cu file of the folder is a source of both plugins, so a new kernel
# file needs no CMake edit; the headers are what the HIP custom commands
# depend on (CMake scans the CUDA sources' includes itself).
set(KDISPATCH_GPU_DIR "${CMAKE_CURRENT_LIST_DIR}")
file(GLOB KDISPATCH_GPU_SOURCES CONFIGURE_DEPENDS "${CMAKE_CURRENT_LIST_DIR}/*.cu")
file(GLOB KDISPATCH_GPU_HEADERS CONFIGURE_DEPENDS
  "${CMAKE_CURRENT_LIST_DIR}/*.cuh" "${CMAKE_CURRENT_LIST_DIR}/*.hpp"
  "${CMAKE_CURRENT_LIST_DIR}/../../core/include/kdispatch/plugin_helpers.hpp"
  "${CMAKE_CURRENT_LIST_DIR}/../../core/include/kdispatch/plugin_rows.hpp")
