# Configures and builds the project of this folder with one plugin and
# passes when the build fails with output matching EXPECT:
#
#   cmake -DBINARY=<dir> -DPLUGIN=<name> -DEXPECT=<regex> -DKDISPATCH_TOOL=<kdispatch>
#         -DKDISPATCH_INCLUDE_DIRS=<dirs> -P build_fails.cmake
get_filename_component(source "${CMAKE_CURRENT_LIST_DIR}" ABSOLUTE)
get_filename_component(kdispatch_source "${source}/../.." ABSOLUTE)
file(REMOVE_RECURSE "${BINARY}")
execute_process(COMMAND "${CMAKE_COMMAND}" -S "${source}" -B "${BINARY}" "-DPLUGIN=${PLUGIN}"
                        "-DKDISPATCH_SOURCE_DIR=${kdispatch_source}" "-DKDISPATCH_TOOL=${KDISPATCH_TOOL}"
                        "-DKDISPATCH_INCLUDE_DIRS=${KDISPATCH_INCLUDE_DIRS}"
  RESULT_VARIABLE result OUTPUT_VARIABLE output ERROR_VARIABLE output)
if(NOT result EQUAL 0)
  message(FATAL_ERROR "configuring the ${PLUGIN} project failed:\n${output}")
endif()
execute_process(COMMAND "${CMAKE_COMMAND}" --build "${BINARY}"
  RESULT_VARIABLE result OUTPUT_VARIABLE output ERROR_VARIABLE output)
message("${output}")
if(result EQUAL 0)
  message(FATAL_ERROR "the build of ${PLUGIN} succeeded; expected it to fail")
endif()
if(NOT output MATCHES "${EXPECT}")
  message(FATAL_ERROR "the build of ${PLUGIN} failed, but its output does not match: ${EXPECT}")
endif()
