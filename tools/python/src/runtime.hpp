// The dispatcher the Python module calls through: one Context and one
// Dispatcher per configuration, made on first use. A runtime lives while
// anything holds it: the module until the next configure() (and for good
// after the last), each kdispatch.op handle made from it (op handles point
// into it), and each call in flight. Plugins stay loaded until the process
// exits, whichever runtimes go.
#pragma once

#include <kdispatch/context.hpp>
#include <kdispatch/dispatcher.hpp>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

namespace kdispatch::python {

struct Runtime {
  Context context;
  Dispatcher dispatcher;
  explicit Runtime(ContextOptions options);
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;
};

// The current runtime, made with the configured search path on first use.
// Whoever uses it after letting the GIL go (a call running its kernel)
// keeps the pointer until done: a configure() meanwhile may drop the
// module's hold on it.
std::shared_ptr<Runtime> runtime();

// The op's user preference (Context::set_preference) in the current
// runtime and in each one made after a configure().
void set_preference(const std::string& op, std::vector<std::string> backends);

// Context::register_kernel / unregister_kernel in the current runtime and
// in each one made after a configure().
void register_kernel(KernelSpec spec);
void unregister_kernel(const std::string& op, const std::string& backend);

// Context::set_fallback in the current runtime and in each one made after a
// configure(); fallback() reads the current runtime's.
void set_fallback(bool on);
bool fallback();
// The tuning file (Context::set_tuning_file; empty: none) in the current
// runtime and in each one made after a configure().
void set_tuning_file(const std::filesystem::path& path);

// How many runtimes are alive (kdispatch._live_runtimes, for the tests).
size_t live_runtimes();

// Replaces the search path of the runtime made next (the tool's
// --plugin-path and --add-plugin-path; empty `replace` keeps the default
// path). The current runtime, if any, stays valid for the handles made from
// it and the calls in flight, and goes with the last of them; later calls
// use the new one.
void configure(std::vector<std::filesystem::path> replace, std::vector<std::filesystem::path> add);

}  // namespace kdispatch::python
