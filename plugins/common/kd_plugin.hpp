// Shared glue for the shipped plugins: error reporting, the exception wall
// around every kernel and the entry point. (The kernel table is generated
// from each plugin's manifest: kd_plugin_kernels.hpp, by
// kdispatch_add_plugin().) Third-party plugins may use it or write the same
// few lines against plugin_api.h.
#pragma once

#include <kdispatch/plugin_api.h>

#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <new>

extern "C" const char kd_plugin_embedded_manifest[];  // kdispatch_add_plugin()

namespace kd_plugin {

// Writes a printf-style message into the caller's buffer; returns `status`.
inline kd_status fail(const kd_call_args* args, kd_status status, const char* fmt, ...)
    __attribute__((format(printf, 3, 4)));
inline kd_status fail(const kd_call_args* args, kd_status status, const char* fmt, ...) {
  if (args != nullptr && args->error != nullptr && args->error_capacity > 0) {
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(args->error, args->error_capacity, fmt, ap);
    va_end(ap);
  }
  return status;
}

// Prints "kdispatch: warn: <message>" on stderr, in the core's format,
// unless KDISPATCH_LOG is off or error: a plugin's only way to tell the user
// about a setting it ignores.
inline void warn(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
inline void warn(const char* fmt, ...) {
  const char* log = secure_getenv("KDISPATCH_LOG");
  if (log != nullptr && (std::strcmp(log, "off") == 0 || std::strcmp(log, "error") == 0)) return;
  char message[512];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(message, sizeof(message), fmt, ap);
  va_end(ap);
  std::fprintf(stderr, "kdispatch: warn: %s\n", message);
}

// Runs `body` (returning kd_status) and turns any exception into a status:
// nothing C++ crosses the ABI.
template <class Body>
kd_status guarded(const kd_call_args* args, Body&& body) noexcept {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    return fail(args, KD_STATUS_INTERNAL, "out of host memory");
  } catch (const std::exception& e) {
    return fail(args, KD_STATUS_INTERNAL, "%s", e.what());
  } catch (...) {
    return fail(args, KD_STATUS_INTERNAL, "unknown exception");
  }
}

inline void copy_string(char* dst, size_t capacity, const char* src) noexcept {
  if (capacity == 0) return;
  std::snprintf(dst, capacity, "%s", src);
}

}  // namespace kd_plugin

// Defines the exported entry point. `probe_fn` and `find_kernel_fn` are
// functions of the plugin with the signatures of kd_plugin_api; `memory` is a
// const kd_memory_api* (NULL for host memory).
#define KD_DEFINE_PLUGIN(name, version, backend, probe_fn, find_kernel_fn, memory) \
  extern "C" __attribute__((visibility("default")))                        \
  const kd_plugin_api* kdispatch_plugin_api(void) {                       \
    static const kd_plugin_api api = {                                     \
        KD_PLUGIN_API_STRUCT_SIZE, KDISPATCH_ABI_MAJOR,                     \
        KDISPATCH_ABI_MINOR,       name,                                    \
        version,                   backend,                                 \
        kd_plugin_embedded_manifest, probe_fn,                              \
        find_kernel_fn,            memory};                                 \
    return &api;                                                           \
  }
