# Writes a plugin's kernel header from its manifest; kdispatch_add_plugin()
# runs it at build time (cmake -P), whenever the manifest changes:
#
#   cmake -DMANIFEST=<file.json> -DOUTPUT=<header> [-DKERNEL_NAMESPACE=<ns>]
#         [-DSYMBOL_PREFIX=<prefix>] -P KdispatchPluginKernels.cmake
#
# The header declares one function per distinct "symbol" of the manifest's
# "kernels", named by the rule
#
#   symbol <prefix><name>  ->  kd_status <ns>::<name>(const kd_call_args*) noexcept
#
# (no namespace: the global one; no prefix: the function is named as the
# symbol), and defines kd_plugin::find_kernel(symbol), which returns that
# function for its manifest symbol and NULL for any other: the plugin's
# find_kernel. The header is rewritten only when its text changes, so a
# manifest edit that leaves the kernels alone recompiles nothing.

foreach(var MANIFEST OUTPUT)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "KdispatchPluginKernels.cmake: -D${var}=... is required")
  endif()
endforeach()
if(NOT DEFINED KERNEL_NAMESPACE)
  set(KERNEL_NAMESPACE "")
endif()
if(NOT DEFINED SYMBOL_PREFIX)
  set(SYMBOL_PREFIX "")
endif()
if(NOT KERNEL_NAMESPACE STREQUAL "" AND NOT KERNEL_NAMESPACE MATCHES "^[A-Za-z_][A-Za-z0-9_]*(::[A-Za-z_][A-Za-z0-9_]*)*$")
  message(FATAL_ERROR "KERNEL_NAMESPACE '${KERNEL_NAMESPACE}' is not a C++ namespace name")
endif()

file(READ "${MANIFEST}" text)
string(JSON count ERROR_VARIABLE error LENGTH "${text}" kernels)
if(error)
  message(FATAL_ERROR "${MANIFEST}: no \"kernels\" list: ${error}")
endif()
foreach(key plugin backend)
  string(JSON ${key}_name ERROR_VARIABLE error GET "${text}" ${key})
  if(error OR NOT ${key}_name MATCHES "^[a-z0-9_]+$")
    message(FATAL_ERROR "${MANIFEST}: /${key}: expected a name of [a-z0-9_]+")
  endif()
endforeach()

string(LENGTH "${SYMBOL_PREFIX}" prefix_length)
set(symbols "")
if(count GREATER 0)
  math(EXPR last "${count} - 1")
  foreach(i RANGE ${last})
    string(JSON symbol ERROR_VARIABLE error GET "${text}" kernels ${i} symbol)
    if(error)
      message(FATAL_ERROR "${MANIFEST}: /kernels/${i}/symbol: ${error}")
    endif()
    string(FIND "${symbol}" "${SYMBOL_PREFIX}" at)
    if(NOT at EQUAL 0)
      message(FATAL_ERROR "${MANIFEST}: /kernels/${i}/symbol '${symbol}' does not start with "
                          "SYMBOL_PREFIX '${SYMBOL_PREFIX}'")
    endif()
    string(SUBSTRING "${symbol}" ${prefix_length} -1 name)
    if(NOT name MATCHES "^[A-Za-z_][A-Za-z0-9_]*$")
      message(FATAL_ERROR "${MANIFEST}: /kernels/${i}/symbol '${symbol}': '${name}' is not a C++ "
                          "function name")
    endif()
    list(APPEND symbols "${symbol}")
  endforeach()
endif()
list(REMOVE_DUPLICATES symbols)

# Where the prototypes go and how the table names them.
set(qualifier "::")
set(open_namespace "")
set(close_namespace "")
if(NOT KERNEL_NAMESPACE STREQUAL "")
  set(qualifier "::${KERNEL_NAMESPACE}::")
  set(open_namespace "namespace ${KERNEL_NAMESPACE} {\n\n")
  set(close_namespace "\n}  // namespace ${KERNEL_NAMESPACE}\n")
endif()
set(prototypes "")
set(entries "")
foreach(symbol IN LISTS symbols)
  string(SUBSTRING "${symbol}" ${prefix_length} -1 name)
  string(APPEND prototypes "kd_status ${name}(const kd_call_args* args) noexcept;\n")
  string(APPEND entries "      {\"${symbol}\", ${qualifier}${name}},\n")
endforeach()

set(declarations "${open_namespace}${prototypes}${close_namespace}")
if(symbols)
  set(lookup
"  struct Entry {
    const char* symbol;
    kd_kernel_fn fn;
  };
  static constexpr Entry kKernels[] = {
${entries}  };
  if (symbol == nullptr) return nullptr;
  for (const Entry& k : kKernels) {
    if (std::strcmp(k.symbol, symbol) == 0) return k.fn;
  }
  return nullptr;")
else()
  set(lookup "  (void)symbol;\n  return nullptr;")
endif()

get_filename_component(manifest_name "${MANIFEST}" NAME)
set(header
"// Generated from ${manifest_name} by kdispatch_add_plugin(): do not edit.
// The manifest's kernels, symbol <prefix><name> declared as <namespace>::<name>
// (prefix '${SYMBOL_PREFIX}', namespace '${KERNEL_NAMESPACE}'), and the plugin's find_kernel.
#pragma once

#include <kdispatch/plugin_api.h>

#include <cstring>

${declarations}
namespace kd_plugin {

// The manifest's \"plugin\" and \"backend\".
inline constexpr char kPluginName[] = \"${plugin_name}\";
inline constexpr char kBackendName[] = \"${backend_name}\";

// The kernel of a symbol of the manifest; NULL for any other symbol.
inline kd_kernel_fn find_kernel(const char* symbol) noexcept {
${lookup}
}

}  // namespace kd_plugin
")

set(staged "${OUTPUT}.new")
file(WRITE "${staged}" "${header}")
file(COPY_FILE "${staged}" "${OUTPUT}" ONLY_IF_DIFFERENT)
file(REMOVE "${staged}")
