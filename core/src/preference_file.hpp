// The preference file (KDISPATCH_PREFERENCE_FILE): a per-op ranking of
// backends that the selector applies before every other ranking rule
// (docs/environment.md, Preference file). One JSON object:
//
//   {"preferences": {"layernorm.rmsnorm": ["cpu", "torch"], "activation.silu_and_mul": ["torch"]}}
//
// A file with any error is ignored whole: a half-read ranking would change
// some selections and not others.
#pragma once

#include <filesystem>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "kdispatch/error.hpp"

namespace kdispatch {

using Preferences = std::map<std::string, std::vector<std::string>, std::less<>>;

struct PreferenceFileResult {
  Preferences preferences;      // empty when `errors` is not
  std::vector<Problem> errors;  // KD-E010 (unreadable, not JSON), KD-E011 (a field)
  std::vector<Problem> warnings;
};

PreferenceFileResult parse_preference_file(std::string_view text, const std::string& path);
PreferenceFileResult read_preference_file(const std::filesystem::path& path);

}  // namespace kdispatch
