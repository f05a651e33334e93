// The dispatcher the Python module calls through: one Context and one
// Dispatcher per configuration, made on first use. Runtimes are never
// destroyed: op handles point into them, and plugins stay loaded until the
// process exits.
#pragma once

#include <kdispatch/context.hpp>
#include <kdispatch/dispatcher.hpp>

#include <filesystem>
#include <vector>

namespace kdispatch::python {

struct Runtime {
  Context context;
  Dispatcher dispatcher;
  explicit Runtime(ContextOptions options) : context(std::move(options)), dispatcher(context) {}
};

// The current runtime, made with the configured search path on first use.
Runtime& runtime();

// Replaces the search path of the runtime made next (the tool's
// --plugin-path and --add-plugin-path; empty `replace` keeps the default
// path). The current runtime, if any, stays valid for the handles made from
// it; later calls use the new one.
void configure(std::vector<std::filesystem::path> replace, std::vector<std::filesystem::path> add);

}  // namespace kdispatch::python
