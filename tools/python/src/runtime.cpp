#include "runtime.hpp"

#include <kdispatch/logging.hpp>

#include <fmt/format.h>

#include <atomic>
#include <map>
#include <mutex>
#include <optional>

namespace kdispatch::python {

namespace {

std::atomic<size_t> g_live_runtimes{0};

struct State {
  std::mutex mutex;
  ContextOptions options;
  std::shared_ptr<Runtime> current;  // guarded by `mutex`
  // set_preference()'s, applied again to the runtime made after configure().
  std::map<std::string, std::vector<std::string>, std::less<>> preferences;
  // register_kernel()'s by (op, backend), applied again to the runtime
  // made after configure().
  std::map<std::pair<std::string, std::string>, KernelSpec> kernels;
  // set_fallback()'s, applied again to the runtime made after configure().
  std::optional<bool> fallback;
  // set_tuning_file()'s (empty: none set; nullopt: never called), applied
  // again to the runtime made after configure().
  std::optional<std::filesystem::path> tuning_file;
};

State& state() {
  // Never destroyed, nor so the current runtime: calls may still run on
  // other threads while the process exits.
  static State* s = new State();
  return *s;
}

}  // namespace

Runtime::Runtime(ContextOptions options) : context(std::move(options)), dispatcher(context) { ++g_live_runtimes; }

Runtime::~Runtime() { --g_live_runtimes; }

size_t live_runtimes() { return g_live_runtimes.load(); }

std::shared_ptr<Runtime> runtime() {
  State& s = state();
  std::lock_guard lock(s.mutex);
  if (!s.current) {
    s.current = std::make_shared<Runtime>(s.options);
    if (s.fallback) s.current->context.set_fallback(*s.fallback);
    if (s.tuning_file) {
      try {
        s.current->context.set_tuning_file(*s.tuning_file);
      } catch (const Error& e) {
        if (log_level() >= LogLevel::warn) {
          fmt::print(stderr, "kdispatch: warn: kdispatch.set_tuning_file('{}') no longer applies after "
                     "configure(): {}\n", s.tuning_file->string(), e.what());
        }
        s.tuning_file.reset();
      }
    }
    for (auto it = s.preferences.begin(); it != s.preferences.end();) {
      try {
        s.current->context.set_preference(it->first, it->second);
        ++it;
      } catch (const Error& e) {
        if (log_level() >= LogLevel::warn) {
          fmt::print(stderr, "kdispatch: warn: kdispatch.set_preference('{}', ...) no longer applies after "
                     "configure(): {}\n", it->first, e.what());
        }
        it = s.preferences.erase(it);
      }
    }
    for (auto it = s.kernels.begin(); it != s.kernels.end();) {
      try {
        s.current->context.register_kernel(it->second);
        ++it;
      } catch (const Error& e) {
        if (log_level() >= LogLevel::warn) {
          fmt::print(stderr, "kdispatch: warn: kdispatch.register_kernel('{}', '{}', ...) no longer applies after "
                     "configure(): {}\n", it->first.first, it->first.second, e.what());
        }
        it = s.kernels.erase(it);
      }
    }
  }
  return s.current;
}

void set_preference(const std::string& op, std::vector<std::string> backends) {
  std::shared_ptr<Runtime> current = runtime();
  current->context.set_preference(op, backends);
  State& s = state();
  std::lock_guard lock(s.mutex);
  if (backends.empty()) {
    s.preferences.erase(op);
  } else {
    s.preferences.insert_or_assign(op, std::move(backends));
  }
}

void register_kernel(KernelSpec spec) {
  std::shared_ptr<Runtime> current = runtime();
  current->context.register_kernel(spec);
  State& s = state();
  std::lock_guard lock(s.mutex);
  std::pair<std::string, std::string> key{spec.op, spec.backend};
  s.kernels.insert_or_assign(std::move(key), std::move(spec));
}

void unregister_kernel(const std::string& op, const std::string& backend) {
  std::shared_ptr<Runtime> current = runtime();
  current->context.unregister_kernel(op, backend);
  State& s = state();
  std::lock_guard lock(s.mutex);
  s.kernels.erase(std::pair<std::string, std::string>{op, backend});
}

void set_fallback(bool on) {
  std::shared_ptr<Runtime> current = runtime();
  current->context.set_fallback(on);
  State& s = state();
  std::lock_guard lock(s.mutex);
  s.fallback = on;
}

bool fallback() { return runtime()->context.fallback(); }

void set_tuning_file(const std::filesystem::path& path) {
  std::shared_ptr<Runtime> current = runtime();
  current->context.set_tuning_file(path);
  State& s = state();
  std::lock_guard lock(s.mutex);
  s.tuning_file = path;
}

void configure(std::vector<std::filesystem::path> replace, std::vector<std::filesystem::path> add) {
  State& s = state();
  std::shared_ptr<Runtime> retired;  // may be the last hold: destroyed after the lock is let go
  std::lock_guard lock(s.mutex);
  s.options = ContextOptions{};
  s.options.search.replace = std::move(replace);
  s.options.search.add = std::move(add);
  retired = std::move(s.current);
}

}  // namespace kdispatch::python
