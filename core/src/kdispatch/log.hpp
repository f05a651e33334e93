// The core's logging calls (internal): formatted messages at a level, sent to
// the sink of logging.hpp.
#pragma once

#include <fmt/format.h>

#include <string_view>

#include "kdispatch/logging.hpp"

namespace kdispatch {

void log_message(LogLevel level, std::string_view message);

template <class... Args>
void log(LogLevel level, fmt::format_string<Args...> format, Args&&... args) {
  if (level <= log_level()) log_message(level, fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace kdispatch
