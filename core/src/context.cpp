#include "kdispatch/context.hpp"

#include "kdispatch/plugin_loader.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <tuple>
#include <thread>

#include "builtin_schemas.hpp"
#include "constraint.hpp"
#include "schema_check.hpp"
#include "kdispatch/manifest.hpp"
#include "kdispatch/platform.hpp"
#include "kdispatch/log.hpp"
#include "scanner.hpp"
#include "verdict_store.hpp"

namespace kdispatch {
Context::Context(ContextOptions options)
    : registry_(std::make_unique<KernelRegistry>()),
      selector_(std::make_unique<Selector>(*registry_, options.selector ? std::move(*options.selector)
                                                                        : SelectorOptions::from_environment())),
      verdicts_(VerdictStore::from_environment()),
      device_of_(options.device_of ? std::move(options.device_of) : kdispatch::device_of) {
  problems_ = selector_->options().problems;
  fallback_.store(selector_->options().fallback, std::memory_order_relaxed);
  if (options.builtin_schemas) {
    for (const BuiltinSchemaFile& file : builtin_schema_files()) {
      SchemaFileResult parsed = parse_op_schemas(file.text, file.name);
      for (const auto& e : parsed.errors) {
        log(LogLevel::error, "built-in op schemas {}: {}", file.name, e.message);
        problems_.push_back(e);
      }
      for (const auto& schema : parsed.schemas) registry_->add_schema(schema);
    }
  }
  discovery_ = discover_plugins(options.search);
  for (PluginRecord& record : discovery_.plugins) register_record(record);
  selector_->set_machine_key([this](DeviceType type, const std::vector<std::string>& backends) {
    // A GPU's name and versions come from its plugin's probe: the plugins
    // of the key's backends are opened first (a failure is theirs to report).
    if (type != DeviceType::cpu) {
      for (const std::string& backend : backends) {
        for (const std::string& op : registry_->ops()) {
          const KernelSpec* spec = registry_->get_backend(op, backend);
          if (spec == nullptr) continue;
          try {
            load_plugin(spec->plugin);
          } catch (const Error&) {
          }
          break;
        }
      }
    }
    return tuning_key(*this, type, backends);
  });
  // The tuning file names ops: it is read once they are registered.
  if (const std::string file = selector_->options().tuning_file; !file.empty()) {
    try {
      selector_->set_tuning_file(file);
    } catch (const Error& e) {
      log(LogLevel::warn, "KDISPATCH_TUNING_FILE: [{}] {}; the file is ignored", e.code_string(), e.message());
      selector_->add_tuning_problem({e.code(), file, e.message()});
    }
  }
}

void Context::set_tuning_file(const std::filesystem::path& path) {
  selector_->set_tuning_file(path);
  registry_->invalidate();
}

Context::~Context() = default;

Device Context::device(DeviceType type, int32_t id) const { return device_of_(type, id); }

void Context::register_record(PluginRecord& record) {
  switch (record.state) {
    case PluginState::shadowed:
      return;
    case PluginState::disabled:
      registry_->record_failure({record.name, record.backend, record.manifest_path, record.ops,
                                 Problem{ErrorCode::backend_not_registered, record.manifest_path, record.note}});
      return;
    case PluginState::error: {
      // Warnings come first; the first error is what the failure reports.
      const auto is_error = [](const Problem& p) { return !p.warning; };
      const auto first = std::find_if(record.problems.begin(), record.problems.end(), is_error);
      if (first == record.problems.end()) return;
      const auto errors = static_cast<size_t>(std::count_if(first, record.problems.end(), is_error));
      registry_->record_failure({record.name, record.backend, record.manifest_path, record.ops, *first,
                                 /*manifest_invalid=*/!record.manifest.has_value(), errors - 1});
      return;
    }
    case PluginState::found:
      break;
  }
  const Manifest& m = *record.manifest;
  for (const OpSchema& schema : m.ops) {
    try {
      registry_->add_schema(schema);
    } catch (const RegistrationError& e) {
      log(LogLevel::warn, "{}: {}", record.manifest_path, e.message());
      record.problems.push_back({e.code(), record.manifest_path, e.message()});
    }
  }
  for (const KernelSpec& spec : m.kernels) {
    try {
      // Constraints name the op's symbols and attributes: checked here when
      // the schema is known, else when the op is first called.
      if (const OpSchema* schema = spec.constraints.empty() ? nullptr : registry_->schema(spec.op)) {
        const CompiledSchema compiled(*schema);
        compile_constraints(spec, {compiled.constraint_symbols(), compiled.selecting_dtype_var(), schema->attrs});
      }
      registry_->add(spec);
    } catch (const ManifestError& e) {
      log(LogLevel::warn, "{}", e.message());
      record.problems.push_back({e.code(), record.manifest_path, e.message()});
    } catch (const RegistrationError& e) {
      // The first registration stays; the rest of this plugin still loads.
      log(LogLevel::warn, "{}", e.message());
      record.problems.push_back({e.code(), record.manifest_path, e.message()});
    }
  }
}

std::vector<Problem> Context::add_manifest(const Manifest& manifest) {
  PluginRecord record;
  record.name = manifest.plugin;
  record.backend = manifest.backend;
  record.ops = manifest.kernel_ops();
  record.manifest_path = manifest.path;
  record.library_path = manifest.library_path().string();
  record.manifest = manifest;
  register_record(record);
  std::lock_guard lock(load_mutex_);
  api_manifests_.push_back(manifest);
  for (const auto& p : record.problems) problems_.push_back(p);
  return record.problems;
}

void Context::register_kernel(KernelSpec spec) {
  const auto refuse = [&](std::string what) {
    throw ManifestError(ErrorCode::manifest_bad_field,
                        fmt::format("kernel registered at run time for op '{}', backend '{}': {}", spec.op,
                                    spec.backend, what));
  };
  if (spec.function == nullptr) refuse("no function given");
  if (!is_valid_name(spec.backend)) refuse("the backend name must match [a-z0-9_]+");
  if (!spec.plugin.empty() || !spec.symbol.empty() || !spec.manifest.empty()) {
    refuse("plugin, symbol and manifest are for a plugin's kernels; leave them empty");
  }
  if (spec.role != KernelRole::backend) {
    refuse("a kernel registered at run time is never an op's reference; its role must be backend");
  }
  if (spec.priority < -1000 || spec.priority > 1000) {
    refuse(fmt::format("priority {} is outside [-1000, 1000]", spec.priority));
  }
  const OpSchema* schema = registry_->schema(spec.op);
  if (schema == nullptr) {
    std::vector<std::string> hints;
    if (!is_valid_op_id(spec.op)) hints.emplace_back("op ids are \"<group>.<name>\" of [a-z0-9_]+");
    hints.emplace_back("a kernel is registered at run time for an op with a schema: a built-in one or a plugin's "
                       "(`kdispatch list` shows them)");
    throw SelectionError(ErrorCode::unknown_op,
                         fmt::format("No op schema for op '{}': cannot register a kernel for it at run time (backend "
                                     "'{}')",
                                     spec.op, spec.backend),
                         std::move(hints));
  }
  const std::vector<Dtype> takes = schema->call_dtypes();
  for (const Dtype dtype : spec.dtypes) {
    if (std::find(takes.begin(), takes.end(), dtype) == takes.end()) {
      std::vector<std::string> names;
      for (const Dtype d : takes) names.emplace_back(dtype_name(d));
      refuse(fmt::format("dtype {} is not one the op's schema takes ({})", dtype_name(dtype), fmt::join(names, ", ")));
    }
  }
  const CompiledSchema compiled(*schema);
  compile_constraints(spec, {compiled.constraint_symbols(), compiled.selecting_dtype_var(), schema->attrs});
  registry_->add(spec);
}

void Context::unregister_kernel(std::string_view op, std::string_view backend) {
  registry_->remove_runtime(op, backend);
}

bool Context::demote(std::string_view op, std::string_view backend, DeviceType type, int32_t id, std::string error) {
  if (!selector_->demote(op, backend, type, id, std::move(error))) return false;
  registry_->invalidate();
  return true;
}

void Context::set_preference(std::string_view op, std::vector<std::string> backends) {
  selector_->set_preference(op, std::move(backends));
  registry_->invalidate();
}

std::vector<Problem> Context::problems() const {
  std::vector<Problem> out;
  for (const auto& rec : discovery_.plugins) {
    for (const auto& p : rec.problems) out.push_back(p);
  }
  std::lock_guard lock(load_mutex_);
  out.insert(out.end(), problems_.begin(), problems_.end());
  for (const auto& [name, problem] : failed_) out.push_back(problem);
  for (auto& p : selector_->tuning_problems()) out.push_back(std::move(p));
  return out;
}

namespace {
// The identity of the library a kernel comes from: "sha256:<hex>" of a
// plugin's library, "run-time" for a kernel registered at run time.
// `manifest_of` is called with `mutex` held (Context::load_mutex_, under
// which api_manifests_ grows).
template <class ManifestOf>
std::string library_identity(const KernelSpec& spec, std::mutex& mutex, ManifestOf&& manifest_of) {
  if (spec.function != nullptr || spec.plugin.empty()) return "run-time";
  std::string library;
  {
    std::lock_guard lock(mutex);
    const Manifest* manifest = manifest_of(spec.plugin);
    if (manifest == nullptr) return "unknown";
    library = std::filesystem::absolute(manifest->library_path()).string();
  }
  return library_hash(library);
}
}  // namespace

void Context::record_verdict(const KernelSpec& spec, const Device& device, bool passed, std::string_view source,
                             std::string detail) {
  if (!verdicts_->enabled() || spec.is_reference()) return;
  Verdict v;
  v.op = spec.op;
  v.backend = spec.backend;
  v.device = device.str();
  v.library = library_identity(spec, load_mutex_, [this](const std::string& p) { return manifest_of(p); });
  if (!v.library.starts_with("sha256:") && v.library != "run-time") return;  // nothing to key it by
  v.passed = passed;
  v.time = static_cast<int64_t>(std::time(nullptr));
  v.source = source;
  v.detail = std::move(detail);
  verdicts_->record(std::move(v));
}

std::optional<Verdict> Context::failed_verdict(const KernelSpec& spec, const Device& device) const {
  if (!verdicts_->any_failed()) return std::nullopt;
  const std::string library = library_identity(spec, load_mutex_, [this](const std::string& p) { return manifest_of(p); });
  std::optional<Verdict> v = verdicts_->latest(spec.op, spec.backend, device.str(), library);
  if (!v || v->passed) return std::nullopt;
  return v;
}

std::vector<Verdict> Context::failed_verdicts() const {
  std::vector<Verdict> out;
  if (!verdicts_->any_failed()) return out;
  for (Verdict& v : verdicts_->all()) {
    if (v.passed) continue;
    const KernelSpec* spec = registry_->get_backend(v.op, v.backend);
    if (spec == nullptr) continue;
    const std::string library = library_identity(*spec, load_mutex_, [this](const std::string& p) { return manifest_of(p); });
    if (library == v.library) out.push_back(std::move(v));
  }
  std::sort(out.begin(), out.end(), [](const Verdict& a, const Verdict& b) {
    return std::tie(a.op, a.backend, a.device) < std::tie(b.op, b.backend, b.device);
  });
  return out;
}

bool Context::first_verdict_skip(std::string_view op, std::string_view backend) {
  return verdicts_->first_skip(op, backend);
}

const Manifest* Context::manifest_of(const std::string& plugin) const {
  for (const auto& rec : discovery_.plugins) {
    if (rec.state == PluginState::found && rec.name == plugin) return &*rec.manifest;
  }
  for (const auto& m : api_manifests_) {
    if (m.plugin == plugin) return &m;
  }
  return nullptr;
}

const PluginBinary& Context::load_plugin(const std::string& plugin) {
  std::unique_lock lock(load_mutex_);
  while (true) {
    if (auto it = loaded_.find(plugin); it != loaded_.end()) return *it->second;
    if (auto it = failed_.find(plugin); it != failed_.end()) {
      throw PluginError(it->second.code, it->second.message);
    }
    const auto loading = loading_.find(plugin);
    if (loading == loading_.end()) break;
    // Another thread is loading it. A load that the parent of a fork()ed
    // child had under way never finishes in the child: the child loads the
    // plugin itself.
    if (loading->second != ::getpid()) {
      loading_.erase(loading);
      break;
    }
    // Polled rather than waited for on a condition variable, whose waiters
    // a fork() would leave behind in the child.
    lock.unlock();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    lock.lock();
  }
  const Manifest* found = manifest_of(plugin);
  if (found == nullptr) {
    throw PluginError(ErrorCode::plugin_open_failed, fmt::format("no usable manifest for plugin '{}'", plugin));
  }
  const Manifest manifest = *found;  // api_manifests_ may grow once the lock is let go
  // The scan and the dlopen run without the lock: they take long (a helper
  // process, library constructors), and a fork() by another thread
  // meanwhile must leave the lock free in the child, which can then load
  // plugins itself.
  loading_[plugin] = ::getpid();
  lock.unlock();
  std::unique_ptr<PluginBinary> binary;
  std::optional<PluginError> error;
  try {
    log(LogLevel::info, "loading plugin '{}' from {}", plugin, manifest.library_path().string());
    // A helper process opens it first (or the registry cache says how that
    // went): a plugin that crashes or hangs there is never opened here.
    if (auto problem = scan_before_load(manifest)) throw PluginError(problem->code, problem->message);
    binary = load_plugin_binary(manifest);
  } catch (const PluginError& e) {
    error = e;
  } catch (...) {
    lock.lock();
    loading_.erase(plugin);
    throw;
  }
  lock.lock();
  loading_.erase(plugin);
  if (binary) {
    const PluginBinary& ref = *binary;
    loaded_.emplace(plugin, std::move(binary));
    return ref;
  }
  Problem problem{error->code(), manifest.library_path().string(), error->message()};
  log(LogLevel::warn, "plugin '{}' failed to load: {}: {}", plugin, code_string(error->code()), error->message());
  failed_.emplace(plugin, problem);
  registry_->withdraw_plugin(plugin, problem);
  throw *error;
}

std::vector<PluginScanResult> Context::scan_plugins() {
  std::vector<PluginScanResult> out;
  for (const auto& rec : discovery_.plugins) {
    if (rec.state != PluginState::found || !rec.manifest) continue;
    PluginScanResult r{rec.name, rec.library_path, "unscanned", std::nullopt};
    if (const std::optional<ScanOutcome> outcome = scan_now(*rec.manifest)) {
      r.verdict = std::string(scan_verdict_name(outcome->verdict));
      r.problem = scan_problem(*rec.manifest, *outcome);
    }
    out.push_back(std::move(r));
  }
  return out;
}

std::optional<PluginLoadState> Context::load_state(const std::string& plugin) const {
  std::lock_guard lock(load_mutex_);
  if (auto it = loaded_.find(plugin); it != loaded_.end()) return PluginLoadState{it->second.get(), std::nullopt};
  if (auto it = failed_.find(plugin); it != failed_.end()) return PluginLoadState{nullptr, it->second};
  return std::nullopt;
}

kd_kernel_fn Context::supports(const KernelSpec& spec) {
  if (spec.supports_symbol.empty() || spec.is_runtime()) return nullptr;
  const PluginBinary& binary = load_plugin(spec.plugin);
  auto it = binary.kernels.find(spec.supports_symbol);
  if (it == binary.kernels.end()) {
    throw PluginError(ErrorCode::plugin_manifest_mismatch,
                      fmt::format("plugin '{}' ({}) has no supports function '{}' for op '{}'", spec.plugin,
                                  binary.library_path, spec.supports_symbol, spec.op));
  }
  return it->second;
}

kd_kernel_fn Context::kernel(const KernelSpec& spec) {
  if (spec.is_runtime()) return spec.function;
  const PluginBinary& binary = load_plugin(spec.plugin);
  auto it = binary.kernels.find(spec.symbol);
  if (it == binary.kernels.end()) {
    throw PluginError(ErrorCode::plugin_manifest_mismatch,
                      fmt::format("plugin '{}' ({}) has no kernel '{}' for op '{}'", spec.plugin, binary.library_path,
                                  spec.symbol, spec.op));
  }
  // ABI 1.0 has no absent tensors (plugin_api.h, changelog of 1.1).
  if (binary.abi_major == 1 && binary.abi_minor < 1) {
    if (const OpSchema* schema = registry_->schema(spec.op)) {
      for (const TensorArg& t : schema->tensors) {
        if (!t.optional) continue;
        throw PluginError(ErrorCode::plugin_abi_mismatch,
                          fmt::format("plugin '{}' ({}) was built for ABI 1.{}, which has no absent tensors, and op "
                                      "'{}' has the optional tensor '{}': rebuild it against ABI 1.1 or later",
                                      spec.plugin, binary.library_path, binary.abi_minor, spec.op, t.name));
      }
    }
  }
  return it->second;
}

}  // namespace kdispatch
