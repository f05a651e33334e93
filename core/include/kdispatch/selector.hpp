// The selection rules (README.md, Selection), in one place.
#pragma once

#include <kdispatch/export.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "kdispatch/device.hpp"
#include "kdispatch/dtype.hpp"
#include "kdispatch/kernel_spec.hpp"
#include "kdispatch/registry.hpp"

namespace kdispatch {
// A call's values for kernel constraints (internal: core/src/constraint.hpp).
struct ConstraintCall;
}  // namespace kdispatch

namespace kdispatch KDISPATCH_API {

struct SelectorOptions {
  // KDISPATCH_FORCE_BACKEND: wins whenever it is eligible; otherwise a
  // warning (once per op) and the normal rules.
  std::string force_backend;
  // KDISPATCH_BACKEND_ORDER: breaks a tie between several eligible backends.
  // There is no built-in ranking: without an order a tie is KD-E004.
  std::vector<std::string> backend_order;

  static SelectorOptions from_environment();
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
  const KernelSpec& select(const SelectRequest& request) const;

  // Every registered backend of `op` checked against the device and dtype.
  // With `call`, a kernel whose constraints (KernelSpec::constraints) do
  // not hold for it is not eligible, the failed one's text in the reason.
  std::vector<Eligibility> eligibility(std::string_view op, const Device& device, std::optional<Dtype> dtype,
                                       const ConstraintCall* call = nullptr) const;

  const SelectorOptions& options() const { return options_; }
  const KernelRegistry& registry() const { return registry_; }

 private:
  const KernelRegistry& registry_;
  SelectorOptions options_;
  mutable std::mutex warned_mutex_;
  mutable std::set<std::string, std::less<>> warned_ops_;  // force-backend warnings
};

// Closest op ids to `op` (edit distance), for "did you mean".
std::vector<std::string> closest_ops(std::string_view op, const std::vector<std::string>& candidates,
                                     size_t max_results = 3);

}  // namespace kdispatch
