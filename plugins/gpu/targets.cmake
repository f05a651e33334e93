# What the GPU plugins run on, each list set once, and the two manifests
# generated from it. The top-level CMakeLists includes this file before
# plugins/ and tests/, whether or not nvcc or hipcc is found: the tests and
# tools read the manifests without the plugins.
#
#   KDISPATCH_CUDA_ARCHITECTURES  compute capabilities as CMake writes them
#                                 (90 = 9.0). The CUDA plugin carries SASS for
#                                 each and PTX of the highest, which newer
#                                 GPUs compile at load time; its manifest's
#                                 min_arch is the lowest.
#   KDISPATCH_HIP_ARCHITECTURES   AMD GPU targets (--offload-arch), the hip
#                                 manifest's archs.
#
# Derived from them:
#   KDISPATCH_CUDA_CMAKE_ARCHITECTURES  the CUDA plugin's CMAKE_CUDA_ARCHITECTURES
#   KDISPATCH_CUDA_MANIFEST, KDISPATCH_HIP_MANIFEST   the generated manifests,
#       ${KDISPATCH_GPU_MANIFEST_DIR}/cuda.json and hip.json, written at
#       configure time from the one template manifests/gpu.json.in
#   KDISPATCH_CUDA_SYMBOL_PREFIX, KDISPATCH_HIP_SYMBOL_PREFIX   what their
#       kernel symbols start with (kd_cuda_, kd_hip_)

set(KDISPATCH_CUDA_ARCHITECTURES 90 CACHE STRING
    "CUDA architectures of the CUDA plugin (90 = sm_90): SASS for each, PTX for the highest")
set(KDISPATCH_HIP_ARCHITECTURES gfx90a gfx1030 CACHE STRING
    "AMD GPU targets of the HIP plugin (--offload-arch)")
set(KDISPATCH_GPU_MANIFEST_DIR "${PROJECT_BINARY_DIR}/manifests")

# The template's placeholders: @KD_GPU_NAME@ (plugin, backend, library),
# @KD_GPU_DESCRIPTION@, @KD_GPU_TARGET@ (the one entry of "targets") and
# @KD_GPU_SYMBOL_PREFIX@.
function(_kdispatch_gpu_manifest name description target out_manifest out_prefix)
  set(KD_GPU_NAME "${name}")
  set(KD_GPU_DESCRIPTION "${description}")
  set(KD_GPU_TARGET "${target}")
  set(KD_GPU_SYMBOL_PREFIX "kd_${name}_")
  set(manifest "${KDISPATCH_GPU_MANIFEST_DIR}/${name}.json")
  configure_file("${PROJECT_SOURCE_DIR}/manifests/gpu.json.in" "${manifest}" @ONLY)
  set(${out_manifest} "${manifest}" PARENT_SCOPE)
  set(${out_prefix} "${KD_GPU_SYMBOL_PREFIX}" PARENT_SCOPE)
endfunction()

# Everything else set below stays inside the block.
block(PROPAGATE KDISPATCH_CUDA_CMAKE_ARCHITECTURES KDISPATCH_CUDA_MANIFEST KDISPATCH_CUDA_SYMBOL_PREFIX
                KDISPATCH_HIP_MANIFEST KDISPATCH_HIP_SYMBOL_PREFIX)
# --- CUDA: "90" -> SASS sm_90, min_arch "9.0" ------------------------------------
set(cuda_archs ${KDISPATCH_CUDA_ARCHITECTURES})
if(NOT cuda_archs)
  message(FATAL_ERROR "KDISPATCH_CUDA_ARCHITECTURES is empty")
endif()
foreach(arch IN LISTS cuda_archs)
  if(NOT arch MATCHES "^[1-9][0-9]*[0-9]$")
    message(FATAL_ERROR "KDISPATCH_CUDA_ARCHITECTURES: '${arch}' is not a compute capability "
                        "as CMake writes it (e.g. 90 for 9.0)")
  endif()
endforeach()
list(REMOVE_DUPLICATES cuda_archs)
list(SORT cuda_archs COMPARE NATURAL)
list(GET cuda_archs 0 cuda_lowest)
list(GET cuda_archs -1 cuda_highest)
set(KDISPATCH_CUDA_CMAKE_ARCHITECTURES "")
set(cuda_sass "")
foreach(arch IN LISTS cuda_archs)
  list(APPEND KDISPATCH_CUDA_CMAKE_ARCHITECTURES ${arch}-real)
  list(APPEND cuda_sass sm_${arch})
endforeach()
list(APPEND KDISPATCH_CUDA_CMAKE_ARCHITECTURES ${cuda_highest}-virtual)
string(REGEX REPLACE "([0-9])$" ".\\1" cuda_min_arch "${cuda_lowest}")
list(LENGTH cuda_sass cuda_sass_count)
list(JOIN cuda_sass ", " cuda_sass)
if(cuda_sass_count EQUAL 1)
  set(cuda_sass "${cuda_sass} binary")
else()
  set(cuda_sass "${cuda_sass} binaries")
endif()

# --- HIP ---------------------------------------------------------------------------
set(hip_archs ${KDISPATCH_HIP_ARCHITECTURES})
if(NOT hip_archs)
  message(FATAL_ERROR "KDISPATCH_HIP_ARCHITECTURES is empty")
endif()
foreach(arch IN LISTS hip_archs)
  if(NOT arch MATCHES "^gfx[0-9a-z]+$")
    message(FATAL_ERROR "KDISPATCH_HIP_ARCHITECTURES: '${arch}' is not an AMD GPU target (e.g. gfx90a)")
  endif()
endforeach()
list(TRANSFORM hip_archs PREPEND "        \"")
list(TRANSFORM hip_archs APPEND "\"")
list(JOIN hip_archs ",\n" hip_archs)

# --- the manifests -----------------------------------------------------------------
_kdispatch_gpu_manifest(cuda
  "CUDA kernels for NVIDIA GPUs (${cuda_sass} plus compute_${cuda_highest} PTX)"
"    {
      \"device\": \"cuda\",
      \"min_arch\": \"${cuda_min_arch}\"
    }"
  KDISPATCH_CUDA_MANIFEST KDISPATCH_CUDA_SYMBOL_PREFIX)
_kdispatch_gpu_manifest(hip
  "HIP kernels for AMD GPUs, built from the CUDA sources"
"    {
      \"device\": \"hip\",
      \"archs\": [
${hip_archs}
      ]
    }"
  KDISPATCH_HIP_MANIFEST KDISPATCH_HIP_SYMBOL_PREFIX)
endblock()
