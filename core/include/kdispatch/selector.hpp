// The selection rules (README.md, Selection), in one place.
#pragma once

#include <kdispatch/export.h>

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "kdispatch/device.hpp"
#include "kdispatch/dtype.hpp"
#include "kdispatch/error.hpp"
#include "kdispatch/kernel_spec.hpp"
#include "kdispatch/registry.hpp"
#include "kdispatch/tuning.hpp"

namespace kdispatch {
// A call's values for kernel constraints (internal: core/src/constraint.hpp).
struct ConstraintCall;
// A tuning file's choices compiled for the selector (internal:
// core/src/tuning_set.hpp).
struct TuningSet;
}  // namespace kdispatch

namespace kdispatch KDISPATCH_API {

struct SelectorOptions {
  // KDISPATCH_FORCE_BACKEND: wins whenever it is eligible; otherwise a
  // warning (once per op) and the normal rules.
  std::string force_backend;
  // KDISPATCH_BACKEND_ORDER: ranks backends for every op, after the
  // op's preference.
  std::vector<std::string> backend_order;
  // Per-op user preference, the first ranking rule: op -> backends, the
  // preferred first. From KDISPATCH_PREFERENCE_FILE, and at run time from
  // Selector::set_preference (then read it through Selector::preference).
  std::map<std::string, std::vector<std::string>, std::less<>> preferences;
  // KDISPATCH_TUNING_FILE: measured per-shape choices (docs/tuning.md),
  // the second ranking rule. Read by Context once its plugins are
  // registered (the file names ops); at run time Context::set_tuning_file.
  std::string tuning_file;
  // KDISPATCH_FALLBACK=1: a kernel that fails with a device or internal
  // error is demoted for its op on that device and the call goes to the
  // next ranked backend (Context::set_fallback changes it at run time).
  bool fallback = false;
  // What was wrong with the environment's settings (a preference file that
  // could not be used, which is then ignored whole). Context::problems().
  std::vector<Problem> problems;

  static SelectorOptions from_environment();
};

// Which rule chose the backend of a selection (README.md, Selection).
enum class SelectionRule : uint8_t {
  only,        // the one eligible backend
  named,       // backend=... of the call
  forced,      // KDISPATCH_FORCE_BACKEND
  preference,  // the op's user preference
  tuned,       // a choice of the tuning file (docs/tuning.md)
  order,       // KDISPATCH_BACKEND_ORDER
  priority,    // the kernels' manifest "priority"
};
std::string_view rule_name(SelectionRule rule);

// A tuning-file choice that holds only for some calls (its "when",
// docs/tuning.md): a selection made without the call's values cannot
// evaluate it.
struct ConditionalChoice {
  Dtype dtype;
  std::string when;
  std::string backend;
};

struct Selection {
  const KernelSpec* spec = nullptr;
  SelectionRule rule = SelectionRule::only;
  // The chosen spec, then the other eligible backends in rank order.
  std::vector<const KernelSpec*> ranked;
  // Made without the call's values (SelectRequest::call null): the tuning
  // file's choices with a "when" for the op (and dtype, when known) and a
  // backend usable here, in file order. A call for which one holds is
  // decided by it; `spec` is the choice for the other calls.
  std::vector<ConditionalChoice> conditional;
};

struct SelectRequest {
  std::string_view op;
  std::string_view backend;  // empty: choose
  Device device;
  std::optional<Dtype> dtype;  // unknown: dtype is not checked
  // The call's shape symbols, dtype and attributes, which kernel
  // constraints read; null: constraints are not evaluated (every kernel
  // with constraints counts as eligible).
  const ConstraintCall* call = nullptr;
  // Which device of `device`'s type the call runs on: a backend demoted for
  // the op on that device (Selector::demote) is not eligible.
  int32_t device_id = 0;
};

// A backend taken out of an op's ranking on one device for the rest of the
// process, after its kernel failed with a device or internal error while
// fallback was on (Context::set_fallback, KDISPATCH_FALLBACK).
struct Demotion {
  std::string op;
  std::string backend;
  DeviceType device_type = DeviceType::cpu;
  int32_t device_id = 0;
  std::string error;  // the kernel's error, as KernelError words it
  std::string device() const;  // "cuda:0", as the trace names devices
};

// Why one registered backend was or was not eligible (for `list`, KD-E003).
struct Eligibility {
  const KernelSpec* spec = nullptr;
  bool eligible = false;
  std::string reason;  // empty when eligible
};

// Why a reference kernel usable on the device was not chosen (KD-E003's
// reason, and what `kdispatch list` says).
extern const char* const kReferenceOnlyWhenAsked;
// The same for an opt-in kernel (KernelSpec::opt_in).
extern const char* const kOptInOnlyWhenAsked;
// The backend name that reaches an op's reference kernel, whatever its
// plugin calls its backend (`backend=reference`,
// KDISPATCH_FORCE_BACKEND=reference).
inline constexpr std::string_view kReferenceBackend = "reference";

class Selector {
 public:
  explicit Selector(const KernelRegistry& registry, SelectorOptions options = {});
  ~Selector();
  Selector(const Selector&) = delete;
  Selector& operator=(const Selector&) = delete;

  // The spec that a call described by `request` runs. Throws SelectionError
  // (KD-E001/E002/E003/E004/E006) or CallError KD-E031. Nothing is cached
  // here: the dispatcher keeps the one resolution cache, per op, in front of
  // the selector.
  const KernelSpec& select(const SelectRequest& request) const { return *choose(request).spec; }
  // The same, with the rule that decided and the ranked candidates.
  Selection choose(const SelectRequest& request) const;

  // The op's user preference: its backends, preferred first, rank ahead of
  // every other eligible backend; an empty list removes it (for any op).
  // Otherwise throws
  // SelectionError KD-E001 for an op with no kernels and KD-E002 for a
  // backend not registered for it, and then changes nothing. The caller
  // invalidates cached selections (Context::set_preference does).
  void set_preference(std::string_view op, std::vector<std::string> backends);
  std::vector<std::string> preference(std::string_view op) const;

  // The tuning file (docs/tuning.md): read and checked against the
  // registry's ops now; an empty path removes it. Throws ManifestError
  // KD-E010/E011 naming the file and the JSON pointer, and then changes
  // nothing. The file's key is checked against the machine when a call
  // first consults it; a file whose key does not match applies nothing,
  // with one warning (tuning_problems()). The caller invalidates cached
  // selections (Context::set_tuning_file does).
  void set_tuning_file(const std::filesystem::path& path);
  std::string tuning_file() const;
  // The compiled choices; null when there is no tuning file.
  std::shared_ptr<const TuningSet> tuning() const;
  // The key of this machine for a device type, hashing the libraries of
  // the given backends (Context sets tuning_key()). Without one, a file's
  // key is not checked.
  using MachineKey = std::function<TuningKey(DeviceType, const std::vector<std::string>&)>;
  void set_machine_key(MachineKey key);
  // A tuning file whose key did not match, once consulted (KD-E011, a
  // warning).
  std::vector<Problem> tuning_problems() const;
  // Checks the tuning file's key now (as the first call consulting it
  // would) and returns tuning_problems(): for `kdispatch doctor`.
  std::vector<Problem> check_tuning() const;
  // A problem with the tuning file found by the caller (a file from the
  // environment that could not be read), kept for tuning_problems().
  void add_tuning_problem(Problem problem);

  // Every registered backend of `op` checked against the device and dtype.
  // With `call`, a kernel whose constraints (KernelSpec::constraints) do
  // not hold for it is not eligible, the failed one's text in the reason.
  // A backend demoted for the op on device `device_id` of the device's
  // type is not eligible, its error in the reason.
  std::vector<Eligibility> eligibility(std::string_view op, const Device& device, std::optional<Dtype> dtype,
                                       const ConstraintCall* call = nullptr, int32_t device_id = 0) const;

  // Takes `backend` out of the ranking of `op` on device (type, id) for the
  // rest of the process: it stays registered and still runs when named.
  // True the first time; the caller invalidates cached selections
  // (Context::demote does).
  bool demote(std::string_view op, std::string_view backend, DeviceType type, int32_t id, std::string error);
  // The demotion of `backend` for `op` on (type, id), if any. Takes no lock
  // while nothing is demoted.
  std::optional<Demotion> demotion(std::string_view op, std::string_view backend, DeviceType type,
                                   int32_t id) const;
  // Every demotion so far, in the order they happened.
  std::vector<Demotion> demotions() const;

  const SelectorOptions& options() const { return options_; }
  const KernelRegistry& registry() const { return registry_; }

 private:
  const KernelRegistry& registry_;
  SelectorOptions options_;
  mutable std::mutex preferences_mutex_;  // guards options_.preferences
  // The backend the op's first holding tuned choice names, when eligible
  // (in `usable`); empty otherwise.
  std::string_view tuned_backend(const SelectRequest& request, const std::vector<const KernelSpec*>& usable,
                                 const TuningSet* tuning) const;
  // Selection::conditional of a request without the call's values.
  std::vector<ConditionalChoice> conditional_choices(const SelectRequest& request,
                                                    const std::vector<const KernelSpec*>& usable,
                                                    const TuningSet* tuning) const;
  bool tuning_applies(const TuningSet& tuning) const;
  mutable std::mutex tuning_mutex_;
  std::shared_ptr<const TuningSet> tuning_;  // guarded by tuning_mutex_
  MachineKey machine_key_;
  mutable std::vector<Problem> tuning_problems_;  // guarded by tuning_mutex_
  mutable std::mutex warned_mutex_;
  mutable std::set<std::string, std::less<>> warned_ops_;  // force-backend warnings
  mutable std::mutex demoted_mutex_;
  std::vector<Demotion> demoted_;          // guarded by demoted_mutex_
  std::atomic<size_t> demoted_count_{0};   // demoted_.size(), read without the lock
};

// Closest op ids to `op` (edit distance), for "did you mean".
std::vector<std::string> closest_ops(std::string_view op, const std::vector<std::string>& candidates,
                                     size_t max_results = 3);

}  // namespace kdispatch
