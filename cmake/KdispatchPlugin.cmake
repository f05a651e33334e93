# kdispatch_add_plugin(): the one way every kdispatch plugin is built, the
# shipped ones and third-party ones alike. Installed beside the package
# config, so that after `find_package(kdispatch CONFIG REQUIRED)` a plugin
# project needs nothing else:
#
#   kdispatch_add_plugin(<target>
#     MANIFEST <file.json>            the plugin's manifest; its "library"
#                                     names the output file
#     SOURCES <src>...                C, C++ or CUDA sources, or objects
#     [LINK_LIBRARIES <lib>...]       private link dependencies
#     [KERNEL_NAMESPACE <ns>]         C++ namespace of the kernel functions
#                                     (default: the global namespace)
#     [SYMBOL_PREFIX <prefix>]        what every manifest symbol starts with
#                                     and its function name does not
#                                     (default: nothing)
#     [EMBED_MANIFEST <file.json>]    manifest text compiled into the binary
#                                     (default: MANIFEST; tests use another
#                                     one to build a binary that disagrees)
#     [OUTPUT_DIRECTORY <dir>]        where the library and a copy of its
#                                     manifest go in the build tree; default
#                                     KDISPATCH_PLUGIN_OUTPUT_DIR when set,
#                                     else ${CMAKE_CURRENT_BINARY_DIR}/plugins
#     [INSTALL_DESTINATION <dir>]     default: the package's plugin folder,
#                                     <libdir>/kdispatch/plugins, relative to
#                                     the installing project's prefix
#     [NO_INSTALL]
#     [VALIDATE ON|OFF]               `kdispatch validate` the manifest before
#                                     anything is compiled (default ON)
#     [CHECK_SYMBOLS ON|OFF])         `kdispatch inspect` the linked library,
#                                     then load it (`kdispatch doctor`): every
#                                     declared kernel symbol resolves
#                                     (default ON, OFF with EMBED_MANIFEST)
#
# The result is a MODULE library with hidden visibility that exports only
# `kdispatch_plugin_api` (version script), carries its manifest in the ELF
# section `.kdispatch_manifest`, and lies beside a copy of its manifest, as
# in a plugin directory: `kdispatch --add-plugin-path <dir>` finds it there.
# The library's file name is the manifest's "library" (the loader looks for
# that name next to the manifest). Nothing is written outside the build tree
# before `cmake --install`.
#
# The build runs the package's own tool, KDISPATCH_EXECUTABLE (the target
# kdispatch::kdispatch: built first in the kdispatch tree, the installed
# `bin/kdispatch` in a package), through KdispatchPluginCheck.cmake: the
# manifest is validated (format, meaning and the op schemas under "ops")
# before the kernel header is generated, and an invalid one fails the build
# with the tool's KD-Ennn message; after linking, `kdispatch inspect` checks
# that the library exports the entry symbol and embeds the manifest it was
# declared with, and `kdispatch doctor` loads it alone from its folder, so a
# kernel symbol its table does not resolve (KD-E023) or a failing probe
# (KD-E024) fails the build too (a failure removes the library). A cross build, whose tool
# cannot run here, passes VALIDATE OFF CHECK_SYMBOLS OFF.
#
# The kernels are declared once, by the manifest. At build time the helper
# generates `kd_plugin_kernels.hpp` from MANIFEST (KdispatchPluginKernels.cmake)
# and puts it on the target's include path: a prototype per manifest symbol,
# named by the rule
#
#   symbol <SYMBOL_PREFIX><name>  ->  kd_status <KERNEL_NAMESPACE>::<name>(const kd_call_args*) noexcept
#
# and `kd_plugin::find_kernel(symbol)`, the symbol -> function table to give
# kd_plugin_api.find_kernel. A plugin defines each of those functions once,
# in its sources, and writes no table. (A plugin that writes its own table,
# or a C plugin, ignores the header.) kdispatch_plugin_include_dir() names
# the header's directory for sources compiled outside the target.

include_guard(GLOBAL)
include(GNUInstallDirs)

set(_KDISPATCH_PLUGIN_HELPER_DIR "${CMAKE_CURRENT_LIST_DIR}")

# kdispatch_plugin_include_dir(<target> <var>): sets <var> to the directory
# of the kernel header that kdispatch_add_plugin(<target> ...) generates, for
# sources compiled by custom commands rather than by the target itself.
function(kdispatch_plugin_include_dir target var)
  set(${var} "${CMAKE_CURRENT_BINARY_DIR}/${target}_include" PARENT_SCOPE)
endfunction()

# Outside the kdispatch build the helper needs the package's targets
# (kdispatch::plugin_api, and the tool kdispatch::kdispatch that checks
# plugins at build time); they are beside it in an installed package.
if(NOT TARGET kdispatch::plugin_api AND EXISTS "${_KDISPATCH_PLUGIN_HELPER_DIR}/kdispatchTargets.cmake")
  include("${_KDISPATCH_PLUGIN_HELPER_DIR}/kdispatchTargets.cmake")
endif()
if(NOT DEFINED KDISPATCH_EXECUTABLE AND TARGET kdispatch::kdispatch)
  set(KDISPATCH_EXECUTABLE kdispatch::kdispatch)
endif()

function(kdispatch_add_plugin target)
  cmake_parse_arguments(ARG "NO_INSTALL"
    "MANIFEST;EMBED_MANIFEST;OUTPUT_DIRECTORY;INSTALL_DESTINATION;KERNEL_NAMESPACE;SYMBOL_PREFIX;VALIDATE;CHECK_SYMBOLS"
    "SOURCES;LINK_LIBRARIES" ${ARGN})
  if(ARG_UNPARSED_ARGUMENTS)
    message(FATAL_ERROR "kdispatch_add_plugin(${target}): unknown arguments: ${ARG_UNPARSED_ARGUMENTS}")
  endif()
  if(NOT ARG_MANIFEST)
    message(FATAL_ERROR "kdispatch_add_plugin(${target}): MANIFEST is required")
  endif()
  if(NOT ARG_SOURCES)
    message(FATAL_ERROR "kdispatch_add_plugin(${target}): SOURCES is required")
  endif()
  if(NOT TARGET kdispatch::plugin_api)
    message(FATAL_ERROR "kdispatch_add_plugin(${target}): target kdispatch::plugin_api not found; "
                        "call find_package(kdispatch CONFIG REQUIRED) first")
  endif()
  get_filename_component(manifest "${ARG_MANIFEST}" ABSOLUTE)
  if(NOT EXISTS "${manifest}")
    message(FATAL_ERROR "kdispatch_add_plugin(${target}): manifest ${manifest} does not exist")
  endif()
  if(NOT DEFINED ARG_VALIDATE)
    set(ARG_VALIDATE ON)
  endif()
  if(NOT DEFINED ARG_CHECK_SYMBOLS)
    # A binary built to disagree with its manifest (EMBED_MANIFEST) is a test fixture.
    if(ARG_EMBED_MANIFEST)
      set(ARG_CHECK_SYMBOLS OFF)
    else()
      set(ARG_CHECK_SYMBOLS ON)
    endif()
  endif()
  if((ARG_VALIDATE OR ARG_CHECK_SYMBOLS) AND NOT KDISPATCH_EXECUTABLE)
    message(FATAL_ERROR "kdispatch_add_plugin(${target}): the kdispatch tool was not found beside the package "
                        "(KDISPATCH_EXECUTABLE is empty); pass VALIDATE OFF CHECK_SYMBOLS OFF to build without it")
  endif()
  if(NOT ARG_EMBED_MANIFEST)
    set(ARG_EMBED_MANIFEST "${manifest}")
  endif()
  get_filename_component(embed "${ARG_EMBED_MANIFEST}" ABSOLUTE)
  if(NOT ARG_OUTPUT_DIRECTORY)
    if(KDISPATCH_PLUGIN_OUTPUT_DIR)
      set(ARG_OUTPUT_DIRECTORY "${KDISPATCH_PLUGIN_OUTPUT_DIR}")
    else()
      set(ARG_OUTPUT_DIRECTORY "${CMAKE_CURRENT_BINARY_DIR}/plugins")
    endif()
  endif()
  if(NOT ARG_INSTALL_DESTINATION)
    set(ARG_INSTALL_DESTINATION "${CMAKE_INSTALL_LIBDIR}/kdispatch/plugins")
  endif()

  file(READ "${manifest}" manifest_text)
  string(JSON library ERROR_VARIABLE json_error GET "${manifest_text}" library)
  if(json_error)
    message(FATAL_ERROR "kdispatch_add_plugin(${target}): ${manifest}: no \"library\": ${json_error}")
  endif()
  string(JSON plugin_name ERROR_VARIABLE json_error GET "${manifest_text}" plugin)
  if(json_error)
    message(FATAL_ERROR "kdispatch_add_plugin(${target}): ${manifest}: no \"plugin\": ${json_error}")
  endif()

  # The manifest text as a byte array in its own section, so that
  # `kdispatch inspect` can read it from the file without loading it. The
  # generated file is valid C, C++ and CUDA; it takes the first of those
  # languages the project enabled.
  get_property(languages GLOBAL PROPERTY ENABLED_LANGUAGES)
  if("C" IN_LIST languages)
    set(embed_ext c)
  elseif("CXX" IN_LIST languages)
    set(embed_ext cpp)
  elseif("CUDA" IN_LIST languages)
    set(embed_ext cu)
  else()
    message(FATAL_ERROR "kdispatch_add_plugin(${target}): enable C, CXX or CUDA in project()")
  endif()
  file(READ "${embed}" embed_hex HEX)
  string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," embed_bytes "${embed_hex}")
  set(embed_source "${CMAKE_CURRENT_BINARY_DIR}/${target}_embedded_manifest.${embed_ext}")
  file(CONFIGURE OUTPUT "${embed_source}" CONTENT
"/* Generated by kdispatch_add_plugin() from ${embed}. */
#ifdef __cplusplus
extern \"C\" {
#endif
__attribute__((visibility(\"hidden\"))) extern const char kd_plugin_embedded_manifest[];
__attribute__((section(\".kdispatch_manifest\"), used))
const char kd_plugin_embedded_manifest[] = {${embed_bytes}0x00};
#ifdef __cplusplus
}
#endif
")
  set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS "${manifest}" "${embed}")

  get_filename_component(manifest_name "${manifest}" NAME)
  set(check_script "${_KDISPATCH_PLUGIN_HELPER_DIR}/KdispatchPluginCheck.cmake")

  # The manifest validated by the tool, before anything is generated from it.
  set(validated "")
  if(ARG_VALIDATE)
    set(validated "${CMAKE_CURRENT_BINARY_DIR}/${target}_manifest.validated")
    add_custom_command(OUTPUT "${validated}"
      COMMAND ${CMAKE_COMMAND} "-DTOOL=$<TARGET_FILE:${KDISPATCH_EXECUTABLE}>" -DCHECK=validate
              "-DFILE=${manifest}" "-DSTAMP=${validated}" -P "${check_script}"
      DEPENDS "${manifest}" "${check_script}" ${KDISPATCH_EXECUTABLE}
      COMMENT "kdispatch validate ${manifest_name}"
      VERBATIM)
  endif()

  # The kernel prototypes and the symbol table, from the manifest (see above).
  kdispatch_plugin_include_dir(${target} include_dir)
  set(kernels_header "${include_dir}/kd_plugin_kernels.hpp")
  file(MAKE_DIRECTORY "${include_dir}")
  add_custom_command(OUTPUT "${kernels_header}"
    COMMAND ${CMAKE_COMMAND} "-DMANIFEST=${manifest}" "-DOUTPUT=${kernels_header}"
            "-DKERNEL_NAMESPACE=${ARG_KERNEL_NAMESPACE}" "-DSYMBOL_PREFIX=${ARG_SYMBOL_PREFIX}"
            -P "${_KDISPATCH_PLUGIN_HELPER_DIR}/KdispatchPluginKernels.cmake"
    DEPENDS "${manifest}" "${_KDISPATCH_PLUGIN_HELPER_DIR}/KdispatchPluginKernels.cmake" ${validated}
    COMMENT "kernel table of ${target} from ${manifest}"
    VERBATIM)

  add_library(${target} MODULE ${ARG_SOURCES} "${embed_source}" "${kernels_header}" ${validated})
  target_include_directories(${target} PRIVATE "${include_dir}")
  target_link_libraries(${target} PRIVATE kdispatch::plugin_api ${ARG_LINK_LIBRARIES})
  # The thread pool of <kdispatch/plugin_helpers.hpp>.
  if(TARGET Threads::Threads)
    target_link_libraries(${target} PRIVATE Threads::Threads)
  endif()
  set_target_properties(${target} PROPERTIES
    PREFIX "" SUFFIX "" OUTPUT_NAME "${library}"
    C_VISIBILITY_PRESET hidden CXX_VISIBILITY_PRESET hidden
    CUDA_VISIBILITY_PRESET hidden VISIBILITY_INLINES_HIDDEN ON
    LIBRARY_OUTPUT_DIRECTORY "${ARG_OUTPUT_DIRECTORY}")
  target_link_options(${target} PRIVATE
    "LINKER:--version-script=${_KDISPATCH_PLUGIN_HELPER_DIR}/plugin.map" "LINKER:--no-undefined")
  add_custom_command(TARGET ${target} POST_BUILD
    COMMAND ${CMAKE_COMMAND} -E copy_if_different "${manifest}"
            "${ARG_OUTPUT_DIRECTORY}/${manifest_name}"
    VERBATIM)
  if(ARG_CHECK_SYMBOLS)
    add_dependencies(${target} ${KDISPATCH_EXECUTABLE})
    add_custom_command(TARGET ${target} POST_BUILD
      COMMAND ${CMAKE_COMMAND} "-DTOOL=$<TARGET_FILE:${KDISPATCH_EXECUTABLE}>" -DCHECK=inspect
              "-DFILE=$<TARGET_FILE:${target}>" "-DPLUGIN=${plugin_name}" -P "${check_script}"
      VERBATIM)
  endif()
  if(NOT ARG_NO_INSTALL)
    install(TARGETS ${target} LIBRARY DESTINATION "${ARG_INSTALL_DESTINATION}")
    install(FILES "${manifest}" DESTINATION "${ARG_INSTALL_DESTINATION}")
  endif()
endfunction()
