// KernelRegistry: every (op, backend) implementation known, the op schemas,
// and the plugins that could not be used (so errors can say why). Metadata
// only: nothing here opens a library.
#pragma once

#include <kdispatch/export.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "kdispatch/error.hpp"
#include "kdispatch/kernel_spec.hpp"
#include "kdispatch/schema.hpp"

namespace kdispatch KDISPATCH_API {

// A plugin whose kernels are not registered, and why.
struct PluginFailure {
  std::string plugin;    // may be empty when the manifest did not say
  std::string backend;   // may be empty when the manifest did not say
  std::string manifest;  // path
  std::vector<std::string> ops;  // ops its manifest declares, when known
  Problem problem;       // the first error
  // The manifest itself is invalid (or unreadable): plugin, backend and ops
  // are what it declares as far as those fields validated.
  bool manifest_invalid = false;
  size_t more_problems = 0;  // errors after `problem`
};

// Thread-safe. Specs are never freed: pointers returned stay valid for the
// registry's lifetime, so selections can be cached without copying. Every
// change bumps generation(), which invalidates cached selections.
class KernelRegistry {
 public:
  KernelRegistry() = default;
  KernelRegistry(const KernelRegistry&) = delete;
  KernelRegistry& operator=(const KernelRegistry&) = delete;

  // Registers `spec`. The same (op, backend) again with the same plugin and
  // symbol is a no-op (returns false). A different implementation throws
  // RegistrationError KD-E005 naming both; the first registration stays.
  bool add(const KernelSpec& spec);
  // Defines an op schema; the same signature again is a no-op, a different
  // one throws RegistrationError KD-E005.
  bool add_schema(const OpSchema& schema);

  // Withdraws the kernel of (op, backend) registered at run time. Throws
  // SelectionError KD-E002 when the pair has no kernel, RegistrationError
  // KD-E005 when its kernel is a plugin's. The spec stays allocated; a
  // later add() of the pair replaces it.
  void remove_runtime(std::string_view op, std::string_view backend);
  // Withdraws every kernel of `plugin` (it failed to load) and records why.
  void withdraw_plugin(const std::string& plugin, const Problem& problem);
  // Records a plugin whose manifest never made it into the registry.
  void record_failure(PluginFailure failure);

  // Usable specs of an op, sorted by backend; withdrawn ones are left out.
  std::vector<const KernelSpec*> get(std::string_view op) const;
  const KernelSpec* get_backend(std::string_view op, std::string_view backend) const;
  bool has(std::string_view op) const { return !get(op).empty(); }
  // The op's reference kernel (role "reference"), the oracle its checks
  // compare against; nullptr when it has none. Where several plugins provide
  // one, the backend named "reference" wins, else the first by backend name.
  const KernelSpec* reference(std::string_view op) const;
  bool has(std::string_view op, std::string_view backend) const {
    return get_backend(op, backend) != nullptr;
  }
  std::vector<std::string> ops() const;  // sorted, ops with a usable spec
  const OpSchema* schema(std::string_view op) const;
  std::vector<const OpSchema*> schemas() const;  // sorted by op
  std::vector<PluginFailure> failures() const;

  uint64_t generation() const noexcept { return generation_.load(std::memory_order_acquire); }
  // Something selections depend on besides the registry changed (a user
  // preference): bumps generation(), dropping every cached selection.
  void invalidate() { bump(); }

 private:
  struct Entry {
    KernelSpec spec;
    bool withdrawn = false;
  };
  void bump() { generation_.fetch_add(1, std::memory_order_acq_rel); }

  // Looked up by std::string_view without a copy.
  struct OpHash {
    using is_transparent = void;
    size_t operator()(std::string_view op) const noexcept { return std::hash<std::string_view>{}(op); }
  };

  mutable std::shared_mutex mutex_;
  // op -> backend -> entry. Hashed by op: a plugin folder may declare tens
  // of thousands of ops, and registering them is most of discovery.
  std::unordered_map<std::string, std::map<std::string, std::unique_ptr<Entry>, std::less<>>, OpHash,
                     std::equal_to<>>
      kernels_;
  std::map<std::string, std::unique_ptr<OpSchema>, std::less<>> schemas_;
  std::vector<PluginFailure> failures_;
  std::vector<std::unique_ptr<Entry>> retired_;  // replaced run-time kernels, kept for pointers to them
  std::atomic<uint64_t> generation_{1};
};

}  // namespace kdispatch
