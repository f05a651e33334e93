// Opening plugin binaries (docs/plugins.md, the entry point). plugin_loader.cpp is the only
// file of the core that includes Boost.DLL.
#pragma once

#include <memory>

#include "kdispatch/manifest.hpp"
#include "kdispatch/plugin.hpp"

namespace kdispatch {

// Opens the library of `manifest` with RTLD_NOW | RTLD_LOCAL and checks, in
// this order, each failure with its own code and a message naming the file
// and the cause:
//   library location is safe and, when the manifest gives sha256, matches
//                                                          (KD-E012/E025/E026)
//   the library opens (dlopen error classified: not found, wrong
//   architecture, missing dependency, undefined symbol)  (KD-E020)
//   the entry symbol exists and returns a table            (KD-E021)
//   ABI major equal, struct_size covers what is read       (KD-E022)
//   the embedded manifest agrees with the file's: plugin, backend and
//   kernels (op + symbol)                                  (KD-E023)
//   probe succeeds                                         (KD-E024)
//   every declared kernel symbol is found                  (KD-E023)
// Throws PluginError. Not thread-safe by itself: the caller serialises loads.
std::unique_ptr<PluginBinary> load_plugin_binary(const Manifest& manifest);

}  // namespace kdispatch
