// A tuning file as the selector and the dispatcher use it: its choices by
// op, each "when" compiled against the op's schema (docs/tuning.md).
#pragma once

#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "kdispatch/tuning.hpp"
#include "constraint.hpp"

namespace kdispatch {

struct TunedChoice {
  Dtype dtype;
  std::optional<Constraint> when;  // absent: always
  std::string backend;
};

// Choices with a "when" per op: their verdicts are bits of the dispatcher's
// cache key, beside those of the op's constrained kernels.
inline constexpr size_t kMaxTunedConditions = 48;

struct TuningSet {
  TuningFile file;
  // op -> its choices in file order
  std::map<std::string, std::vector<TunedChoice>, std::less<>> by_op;

  // The key is checked against the machine once, when the file is first
  // consulted (the library hashes cost a read of each library).
  mutable std::once_flag checked;
  mutable bool active = false;
  mutable std::string mismatch;  // the first field that differs, when not active

  const std::vector<TunedChoice>* choices(std::string_view op) const {
    const auto it = by_op.find(op);
    return it == by_op.end() ? nullptr : &it->second;
  }
};

// The choices of `file` compiled against the ops of `registry`. Throws
// ManifestError KD-E011 naming the file and the JSON pointer of the first
// choice that does not fit.
std::shared_ptr<const TuningSet> compile_tuning(TuningFile file, const KernelRegistry& registry);

}  // namespace kdispatch
