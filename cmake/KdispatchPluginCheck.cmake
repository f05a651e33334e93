# Runs one check of the kdispatch tool on a plugin at build time;
# kdispatch_add_plugin() runs it (cmake -P):
#
#   cmake -DTOOL=<kdispatch> -DCHECK=validate -DFILE=<manifest.json> -DSTAMP=<file> -P KdispatchPluginCheck.cmake
#   cmake -DTOOL=<kdispatch> -DCHECK=inspect -DFILE=<library.so> -P KdispatchPluginCheck.cmake
#
# validate: the manifest's format and meaning, op schemas included
# (`kdispatch validate`); on success writes STAMP, which the plugin's build
# depends on. inspect: the built library against the manifest beside it
# (`kdispatch inspect`: the entry symbol is exported, the embedded manifest
# is the file's); on failure removes the library, so that the next build
# links and checks it again. A failure prints the tool's own output (the
# KD-Ennn lines) and fails the build; on success only the tool's warnings
# are printed. The tool reads and writes no registry cache here
# (KDISPATCH_SCAN=off).

foreach(var TOOL CHECK FILE)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "KdispatchPluginCheck.cmake: -D${var}=... is required")
  endif()
endforeach()
if(NOT CHECK MATCHES "^(validate|inspect)$")
  message(FATAL_ERROR "KdispatchPluginCheck.cmake: CHECK must be validate or inspect, not '${CHECK}'")
endif()

set(ENV{KDISPATCH_SCAN} off)
execute_process(COMMAND "${TOOL}" ${CHECK} "${FILE}"
  RESULT_VARIABLE result OUTPUT_VARIABLE output ERROR_VARIABLE errors)
if(NOT result EQUAL 0)
  # The tool's lines as it prints them, then one short line of CMake's.
  message(NOTICE "${output}${errors}")
  if(CHECK STREQUAL "inspect")
    file(REMOVE "${FILE}")
    message(FATAL_ERROR "kdispatch inspect: the plugin does not agree with its manifest (above); removed ${FILE}")
  endif()
  message(FATAL_ERROR "kdispatch validate: the manifest is invalid (above)")
endif()

string(REGEX MATCHALL "[^\n]*: warning: [^\n]*" warnings "${output}")
foreach(line IN LISTS warnings)
  message(NOTICE "${line}")
endforeach()
if(errors)
  message(NOTICE "${errors}")
endif()
if(DEFINED STAMP)
  file(TOUCH "${STAMP}")
endif()
