// Where the core's messages go and how many of them: every directory
// searched, every manifest found and why anything was skipped
// (KDISPATCH_LOG=error|warn|info|debug).
#pragma once

#include <kdispatch/export.h>

#include <functional>
#include <string_view>

namespace kdispatch KDISPATCH_API {

enum class LogLevel : int { off = 0, error = 1, warn = 2, info = 3, debug = 4 };

// The level in force: set_log_level() if called, else KDISPATCH_LOG, else warn.
LogLevel log_level();
void set_log_level(LogLevel level);
bool parse_log_level(std::string_view text, LogLevel* out);

// Where messages go; default: stderr as "kdispatch: warn: ...". Pass an empty
// function to restore the default (a program's own logger, or a test that
// captures messages).
using LogSink = std::function<void(LogLevel, std::string_view)>;
void set_log_sink(LogSink sink);

}  // namespace kdispatch
