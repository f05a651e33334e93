// Environment variables, read with secure_getenv (ignored in setuid programs).
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kdispatch {

std::optional<std::string> get_env(const char* name);
// Splits "a,b, c" (or "a:b" with sep ':') into trimmed, non-empty items.
std::vector<std::string> split_list(std::string_view text, char sep);
// fnmatch-style glob ('*', '?', '[...]') against a whole name.
bool glob_match(std::string_view pattern, std::string_view name);

}  // namespace kdispatch
