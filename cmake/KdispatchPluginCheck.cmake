# Runs one check of the kdispatch tool on a plugin at build time;
# kdispatch_add_plugin() runs it (cmake -P):
#
#   cmake -DTOOL=<kdispatch> -DCHECK=validate -DFILE=<manifest.json> -DSTAMP=<file> -P KdispatchPluginCheck.cmake
#   cmake -DTOOL=<kdispatch> -DCHECK=inspect -DFILE=<library.so> -DPLUGIN=<name> -P KdispatchPluginCheck.cmake
#
# validate: the manifest's format and meaning, op schemas included
# (`kdispatch validate`); on success writes STAMP, which the plugin's build
# depends on. inspect: the built library against the manifest beside it
# (`kdispatch inspect`: the entry symbol is exported, the embedded manifest
# is the file's), then the library loaded as a program would load it
# (`kdispatch doctor` over its folder, this plugin alone): its table
# resolves every kernel symbol the manifest declares (KD-E023) and its
# probe succeeds (KD-E024). On failure it removes the library, so that the
# next build links and checks it again. A failure prints the tool's own output (the
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
if(result EQUAL 0 AND CHECK STREQUAL "inspect" AND DEFINED PLUGIN)
  get_filename_component(folder "${FILE}" DIRECTORY)
  set(ENV{KDISPATCH_PLUGINS_SELECT} "${PLUGIN}")
  unset(ENV{KDISPATCH_PLUGINS_DISABLE})
  execute_process(COMMAND "${TOOL}" doctor --plugin-path "${folder}"
    RESULT_VARIABLE result OUTPUT_VARIABLE doctor_output ERROR_VARIABLE doctor_errors)
  if(NOT result EQUAL 0)
    # The plugin's own lines of the report: its KD-Ennn.
    string(REGEX MATCHALL "[^\n]*KD-E0[0-9][0-9]: [^\n]*" loaded "${doctor_output}")
    list(FILTER loaded EXCLUDE REGEX "warning")
    string(REPLACE ";" "\n" loaded "${loaded}")
    set(output "${output}${loaded}\n")
    set(errors "${errors}${doctor_errors}")
    message(NOTICE "${output}${errors}")
    file(REMOVE "${FILE}")
    message(FATAL_ERROR "kdispatch doctor: the plugin does not load (above); removed ${FILE}")
  endif()
endif()
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
