#include "kdispatch/registry.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <mutex>

namespace kdispatch {

bool KernelRegistry::add(const KernelSpec& spec) {
  std::unique_lock lock(mutex_);
  auto& by_backend = kernels_[spec.op];
  auto it = by_backend.find(spec.backend);
  if (it != by_backend.end()) {
    Entry& existing = *it->second;
    if (existing.spec.same_implementation(spec)) {
      if (!existing.withdrawn) return false;
      // The same implementation comes back (e.g. a plugin re-registered by
      // the API after a failed load was fixed): use it again.
      existing.withdrawn = false;
      bump();
      return true;
    }
    if (existing.withdrawn && existing.spec.is_runtime() && spec.is_runtime()) {
      // A kernel registered at run time and withdrawn since: the new one
      // takes its place. The old spec stays allocated (selections and
      // handles may point at it).
      retired_.push_back(std::move(it->second));
      it->second = std::make_unique<Entry>(Entry{spec, false});
      bump();
      return true;
    }
    throw RegistrationError(
        ErrorCode::conflicting_registration,
        fmt::format("Conflicting kernel registration for op '{}', backend '{}': {} != {}", spec.op,
                    spec.backend, existing.spec.describe(), spec.describe()),
        {"the first registration stays; remove or rename one of the two declarations"});
  }
  by_backend.emplace(spec.backend, std::make_unique<Entry>(Entry{spec, false}));
  bump();
  return true;
}

bool KernelRegistry::add_schema(const OpSchema& schema) {
  std::unique_lock lock(mutex_);
  auto it = schemas_.find(schema.op);
  if (it != schemas_.end()) {
    if (it->second->same_signature(schema)) return false;
    throw RegistrationError(
        ErrorCode::conflicting_registration,
        fmt::format("Conflicting op schema for op '{}': {} != {}", schema.op, it->second->source, schema.source),
        {"an op is defined once; a plugin may add new ops but not redefine existing ones"});
  }
  schemas_.emplace(schema.op, std::make_unique<OpSchema>(schema));
  bump();
  return true;
}

void KernelRegistry::withdraw_plugin(const std::string& plugin, const Problem& problem) {
  std::unique_lock lock(mutex_);
  PluginFailure failure{plugin, {}, {}, {}, problem};
  for (auto& [op, by_backend] : kernels_) {
    for (auto& [name, entry] : by_backend) {
      if (entry->spec.plugin == plugin) {
        entry->withdrawn = true;
        failure.backend = entry->spec.backend;
        failure.manifest = entry->spec.manifest;
        failure.ops.push_back(op);
      }
    }
  }
  std::sort(failure.ops.begin(), failure.ops.end());
  failures_.push_back(std::move(failure));
  bump();
}

void KernelRegistry::remove_runtime(std::string_view op, std::string_view backend) {
  std::unique_lock lock(mutex_);
  Entry* entry = nullptr;
  if (const auto it = kernels_.find(op); it != kernels_.end()) {
    if (const auto jt = it->second.find(backend); jt != it->second.end()) entry = jt->second.get();
  }
  if (entry == nullptr || entry->withdrawn) {
    throw SelectionError(ErrorCode::backend_not_registered,
                         fmt::format("No '{}' backend registered for op '{}': nothing to unregister", backend, op));
  }
  const KernelSpec& spec = entry->spec;
  if (!spec.is_runtime()) {
    throw RegistrationError(
        ErrorCode::conflicting_registration,
        fmt::format("Cannot unregister the '{}' backend of op '{}': its kernel comes from {}, and only kernels "
                    "registered at run time can be unregistered",
                    backend, op, spec.describe()),
        {fmt::format("leave out the plugin instead: KDISPATCH_PLUGINS_DISABLE={}", spec.plugin)});
  }
  entry->withdrawn = true;
  bump();
}

void KernelRegistry::record_failure(PluginFailure failure) {
  std::unique_lock lock(mutex_);
  failures_.push_back(std::move(failure));
  bump();
}

std::vector<const KernelSpec*> KernelRegistry::get(std::string_view op) const {
  std::shared_lock lock(mutex_);
  std::vector<const KernelSpec*> out;
  auto it = kernels_.find(op);
  if (it == kernels_.end()) return out;
  for (const auto& [backend, entry] : it->second) {
    if (!entry->withdrawn) out.push_back(&entry->spec);
  }
  return out;
}

const KernelSpec* KernelRegistry::get_backend(std::string_view op, std::string_view backend) const {
  std::shared_lock lock(mutex_);
  auto it = kernels_.find(op);
  if (it == kernels_.end()) return nullptr;
  auto jt = it->second.find(backend);
  if (jt == it->second.end() || jt->second->withdrawn) return nullptr;
  return &jt->second->spec;
}

const KernelSpec* KernelRegistry::reference(std::string_view op) const {
  std::shared_lock lock(mutex_);
  auto it = kernels_.find(op);
  if (it == kernels_.end()) return nullptr;
  const KernelSpec* found = nullptr;
  for (const auto& [backend, entry] : it->second) {
    if (entry->withdrawn || !entry->spec.is_reference()) continue;
    if (backend == "reference") return &entry->spec;
    if (found == nullptr) found = &entry->spec;
  }
  return found;
}

std::vector<std::string> KernelRegistry::ops() const {
  std::shared_lock lock(mutex_);
  std::vector<std::string> out;
  for (const auto& [op, by_backend] : kernels_) {
    for (const auto& [backend, entry] : by_backend) {
      if (!entry->withdrawn) {
        out.push_back(op);
        break;
      }
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

const OpSchema* KernelRegistry::schema(std::string_view op) const {
  std::shared_lock lock(mutex_);
  auto it = schemas_.find(op);
  return it == schemas_.end() ? nullptr : it->second.get();
}

std::vector<const OpSchema*> KernelRegistry::schemas() const {
  std::shared_lock lock(mutex_);
  std::vector<const OpSchema*> out;
  for (const auto& [op, schema] : schemas_) out.push_back(schema.get());
  return out;
}

std::vector<PluginFailure> KernelRegistry::failures() const {
  std::shared_lock lock(mutex_);
  return failures_;
}

}  // namespace kdispatch
