// The text fields of the per-user cache files (registry cache, conformance
// verdicts): one entry a line, fields separated by tabs, so a field's
// backslashes, tabs, newlines and carriage returns are escaped.
#pragma once

#include <string>
#include <string_view>

namespace kdispatch {

inline std::string escape_field(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '\\': out += "\\\\"; break;
      case '\t': out += "\\t"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      default: out += c;
    }
  }
  return out;
}

// The inverse of escape_field; a backslash before another character, or
// at the end, stands for that character.
inline std::string unescape_field(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] != '\\' || i + 1 == text.size()) {
      out += text[i];
      continue;
    }
    const char c = text[++i];
    out += c == 't' ? '\t' : c == 'n' ? '\n' : c == 'r' ? '\r' : c;
  }
  return out;
}

}  // namespace kdispatch
