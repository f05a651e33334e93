// Context: one set of plugins and the registry built from their manifests.
// Constructing it discovers plugins and registers their kernels from the
// manifests alone; a plugin library is opened only when one of its kernels
// is first asked for (kernel()).
#pragma once

#include <kdispatch/export.h>

#include <kdispatch/plugin_api.h>

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "kdispatch/discovery.hpp"
#include "kdispatch/plugin.hpp"
#include "kdispatch/registry.hpp"
#include "kdispatch/selector.hpp"
#include "kdispatch/verdicts.hpp"

namespace kdispatch KDISPATCH_API {

struct ContextOptions {
  SearchPathOptions search;
  // Default: SelectorOptions::from_environment().
  std::optional<SelectorOptions> selector;
  // Register the op schemas compiled into the core (manifests/ops/).
  bool builtin_schemas = true;
  // The device, with its arch, that tensors on (type, id) live on; the
  // dispatcher selects for each device on its own. Default: device_of() of
  // platform.hpp, which asks the vendor driver. A program that knows its
  // devices (or a test with fixture devices) may answer instead.
  std::function<Device(DeviceType, int32_t)> device_of;
};

// What became of a plugin once its library was asked for.
struct PluginLoadState {
  const PluginBinary* binary = nullptr;  // set when loaded
  std::optional<Problem> failure;        // set when loading failed
};

class VerdictStore;

struct PluginScanResult {
  std::string plugin;
  std::string library;
  std::string verdict;             // ok, incompatible, crashed, hung, exited, wrote-stdout; unscanned without a helper
  std::optional<Problem> problem;  // what stops it from loading, with its code
};

class Context {
 public:
  explicit Context(ContextOptions options = {});
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  KernelRegistry& registry() { return *registry_; }
  const KernelRegistry& registry() const { return *registry_; }
  const Selector& selector() const { return *selector_; }
  const DiscoveryResult& discovery() const { return discovery_; }

  // Registers a manifest given by the API (its library is found next to its
  // path). Problems are returned, and kept for problems().
  std::vector<Problem> add_manifest(const Manifest& manifest);

  // Registers a kernel at run time: `spec.function` (required) is called
  // with `spec.function_data` as kd_call_args::kernel_data, through the
  // same checks, selection rules and fallback as a plugin's kernels.
  // `spec` is checked as a manifest's kernel entry: its op must have a
  // schema (else SelectionError KD-E001), its role must be backend (a
  // kernel registered at run time is never an op's reference), its dtypes
  // within the schema's, its constraints must fit the op and its priority
  // be in [-1000, 1000] (else ManifestError KD-E011); plugin, symbol and
  // manifest must be empty. The same (op, backend) again with the same
  // function and data is a no-op; anything else is RegistrationError
  // KD-E005, unless the earlier one was unregistered. Cached selections,
  // handles resolved before included, follow it.
  void register_kernel(KernelSpec spec);
  // Withdraws the kernel of (op, backend) registered at run time. Throws
  // SelectionError KD-E002 when there is none, RegistrationError KD-E005
  // when the pair's kernel is a plugin's.
  void unregister_kernel(std::string_view op, std::string_view backend);

  // Every problem so far: discovery, registration conflicts, failed loads.
  std::vector<Problem> problems() const;

  const KernelSpec& select(const SelectRequest& request) const { return selector_->select(request); }
  Selection choose(const SelectRequest& request) const { return selector_->choose(request); }
  // The op's user preference (Selector::set_preference); calls made after
  // it follow it, including through handles resolved before.
  void set_preference(std::string_view op, std::vector<std::string> backends);
  // The tuning file (Selector::set_tuning_file, docs/tuning.md); an empty
  // path removes it. Calls made after it follow it, including through
  // handles resolved before. Throws ManifestError KD-E010/E011 for a bad
  // file, which then changes nothing.
  void set_tuning_file(const std::filesystem::path& path);
  // Fallback on device and internal errors (docs/internals.md, Fallback):
  // with it on, a kernel that fails with KD_STATUS_DEVICE_ERROR or
  // KD_STATUS_INTERNAL is demoted for its op on that device and the call goes
  // to the next ranked backend; off, the failure is the call's error.
  // Starts as KDISPATCH_FALLBACK says (SelectorOptions::fallback).
  void set_fallback(bool on) { fallback_.store(on, std::memory_order_relaxed); }
  bool fallback() const { return fallback_.load(std::memory_order_relaxed); }
  // Selector::demote, dropping every cached selection the first time.
  bool demote(std::string_view op, std::string_view backend, DeviceType type, int32_t id, std::string error);
  std::vector<Demotion> demotions() const { return selector_->demotions(); }
  // Conformance verdicts (verdicts.hpp, docs/internals.md). Records that
  // `spec`'s kernel passed or failed a check against the op's reference on
  // `device` (its kind: type and arch). Within one process a failure is not
  // undone by a later pass of the same kernel on the same kind of device;
  // the verdict of a later process replaces it. Kept in the per-user file
  // beside the registry cache for a plugin's kernel, in this Context only
  // for a kernel registered at run time; does nothing when the store is off
  // (KDISPATCH_VERDICTS=0).
  void record_verdict(const KernelSpec& spec, const Device& device, bool passed, std::string_view source,
                      std::string detail = {});
  // The latest verdict of `spec`'s kernel on `device`'s kind when it is a
  // failure recorded for the library loaded now; else nullopt.
  std::optional<Verdict> failed_verdict(const KernelSpec& spec, const Device& device) const;
  // Every failed verdict of a kernel registered now, for its library as it
  // is now (doctor), by op and backend.
  std::vector<Verdict> failed_verdicts() const;
  // True the first time fallback skips (op, backend) for a failed verdict:
  // its warning is given once.
  bool first_verdict_skip(std::string_view op, std::string_view backend);
  // The device tensors on (type, id) live on (ContextOptions::device_of).
  Device device(DeviceType type, int32_t id) const;

  // The kernel of `spec`: its function when registered at run time, else
  // the plugin's, loading the plugin on first use (serialised; a
  // plugin is opened at most once and never unloaded). Throws PluginError
  // when the plugin cannot be used; its kernels are then withdrawn, so later
  // selections report why (KD-E002/E003).
  kd_kernel_fn kernel(const KernelSpec& spec);
  // The kernel's supports function (KernelSpec::supports_symbol), loading its
  // plugin on first use; nullptr when it names none.
  kd_kernel_fn supports(const KernelSpec& spec);
  // Loads a plugin by name (doctor). Throws PluginError.
  const PluginBinary& load_plugin(const std::string& plugin);
  // nullopt when the plugin was never asked for.
  std::optional<PluginLoadState> load_state(const std::string& plugin) const;
  // `kdispatch scan`: every plugin found is opened now in the helper process
  // (docs/internals.md), whatever the registry cache holds, and the
  // outcome recorded there. Nothing is opened in this process.
  std::vector<PluginScanResult> scan_plugins();

 private:
  void register_record(PluginRecord& record);
  const Manifest* manifest_of(const std::string& plugin) const;

  std::unique_ptr<KernelRegistry> registry_;
  std::unique_ptr<Selector> selector_;
  std::unique_ptr<VerdictStore> verdicts_;
  DiscoveryResult discovery_;
  std::vector<Manifest> api_manifests_;
  std::function<Device(DeviceType, int32_t)> device_of_;
  std::atomic<bool> fallback_{false};
  std::vector<Problem> problems_;  // registration problems (guarded by load_mutex_)

  mutable std::mutex load_mutex_;
  std::map<std::string, std::unique_ptr<PluginBinary>> loaded_;
  std::map<std::string, Problem> failed_;
  // Plugins being loaded, each by the process (pid) whose thread loads it.
  std::map<std::string, int> loading_;
};

}  // namespace kdispatch
