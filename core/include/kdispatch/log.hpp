// Logging that explains itself (KDISPATCH_LOG=error|warn|info|debug): every
// directory searched, every manifest found and why anything was skipped.
#pragma once

#include <fmt/format.h>

#include <functional>
#include <string_view>

namespace kdispatch {

enum class LogLevel : int { off = 0, error = 1, warn = 2, info = 3, debug = 4 };

// The level in force: set_log_level() if called, else KDISPATCH_LOG, else warn.
LogLevel log_level();
void set_log_level(LogLevel level);
bool parse_log_level(std::string_view text, LogLevel* out);

// Where messages go; default: stderr as "kdispatch: warn: ...". Pass an empty
// function to restore the default. Used by tests to capture messages.
using LogSink = std::function<void(LogLevel, std::string_view)>;
void set_log_sink(LogSink sink);

void log_message(LogLevel level, std::string_view message);

template <class... Args>
void log(LogLevel level, fmt::format_string<Args...> format, Args&&... args) {
  if (level <= log_level()) log_message(level, fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace kdispatch
