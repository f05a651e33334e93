#include "runtime.hpp"

#include <atomic>
#include <memory>
#include <mutex>

namespace kdispatch::python {

namespace {

struct State {
  std::mutex mutex;
  ContextOptions options;
  std::atomic<Runtime*> current{nullptr};  // owned by `all`; read without the lock
  std::vector<std::unique_ptr<Runtime>> all;
};

State& state() {
  static State* s = new State();  // never destroyed, nor its runtimes: they outlive interpreter shutdown
  return *s;
}

}  // namespace

Runtime& runtime() {
  State& s = state();
  if (Runtime* r = s.current.load(std::memory_order_acquire)) [[likely]]
    return *r;
  std::lock_guard lock(s.mutex);
  if (Runtime* r = s.current.load(std::memory_order_acquire)) return *r;
  s.all.push_back(std::make_unique<Runtime>(s.options));
  s.current.store(s.all.back().get(), std::memory_order_release);
  return *s.all.back();
}

void configure(std::vector<std::filesystem::path> replace, std::vector<std::filesystem::path> add) {
  State& s = state();
  std::lock_guard lock(s.mutex);
  s.options = ContextOptions{};
  s.options.search.replace = std::move(replace);
  s.options.search.add = std::move(add);
  s.current.store(nullptr, std::memory_order_release);
}

}  // namespace kdispatch::python
