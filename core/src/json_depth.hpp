// How deep the JSON documents read from outside (manifests, op-schema
// files, tuning and preference files) may nest. nlohmann parses and frees
// a document of any depth without recursion, but dump() recurses once per
// level of the value it writes (a found value shown in a message, the
// "ops" a registry cache record keeps), so a document nested some ten
// thousand levels deep would exhaust the stack. Real documents nest a few
// levels; one nested deeper than kMaxJsonDepth is refused (KD-E010).
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

#include <fmt/format.h>

namespace kdispatch {

inline constexpr size_t kMaxJsonDepth = 128;

// Where a '[' or '{' of `text` opens a level deeper than kMaxJsonDepth:
// its 1-based line and column (in bytes). For text that parses as JSON;
// strings are skipped, escapes included.
struct JsonDepthExceeded {
  size_t line;
  size_t column;
};

inline std::optional<JsonDepthExceeded> json_too_deep(std::string_view text) {
  size_t depth = 0;
  size_t line = 1;
  size_t line_start = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;  // an escape: the next character does not end the string
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    switch (c) {
      case '"': in_string = true; break;
      case '\n':
        ++line;
        line_start = i + 1;
        break;
      case '[':
      case '{':
        if (++depth > kMaxJsonDepth) return JsonDepthExceeded{line, i - line_start + 1};
        break;
      case ']':
      case '}':
        if (depth > 0) --depth;
        break;
      default: break;
    }
  }
  return std::nullopt;
}

// The KD-E010 message for `text`, read from `file`, when it nests deeper than
// kMaxJsonDepth: "FILE:LINE:COLUMN: arrays and objects nested deeper than
// 128 levels"; nullopt when it does not.
inline std::optional<std::string> json_depth_error(std::string_view text, std::string_view file) {
  const auto deep = json_too_deep(text);
  if (!deep) return std::nullopt;
  return fmt::format("{}:{}:{}: arrays and objects nested deeper than {} levels", file, deep->line, deep->column,
                     kMaxJsonDepth);
}

}  // namespace kdispatch
