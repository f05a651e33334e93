#include "kdispatch/log.hpp"

#include <atomic>
#include <cstdio>
#include <mutex>

#include "kdispatch/environment.hpp"

namespace kdispatch {
namespace {

std::atomic<int> g_level{-1};  // -1: not read from the environment yet
std::mutex g_sink_mutex;

// Never destroyed: other threads may still log while the process exits.
LogSink& current_sink() {
  static auto* const s = new LogSink();
  return *s;
}

std::string_view level_name(LogLevel level) {
  switch (level) {
    case LogLevel::error: return "error";
    case LogLevel::warn: return "warn";
    case LogLevel::info: return "info";
    case LogLevel::debug: return "debug";
    case LogLevel::off: return "off";
  }
  return "?";
}

}  // namespace

bool parse_log_level(std::string_view text, LogLevel* out) {
  for (LogLevel l : {LogLevel::off, LogLevel::error, LogLevel::warn, LogLevel::info, LogLevel::debug}) {
    if (text == level_name(l)) {
      *out = l;
      return true;
    }
  }
  return false;
}

LogLevel log_level() {
  int level = g_level.load(std::memory_order_relaxed);
  if (level < 0) {
    LogLevel parsed = LogLevel::warn;
    if (auto env = get_env("KDISPATCH_LOG")) {
      if (!parse_log_level(*env, &parsed)) {
        std::fprintf(stderr, "kdispatch: warn: KDISPATCH_LOG='%s' is not one of off, error, warn, info, debug; using warn\n",
                     env->c_str());
        parsed = LogLevel::warn;
      }
    }
    level = static_cast<int>(parsed);
    int expected = -1;
    g_level.compare_exchange_strong(expected, level);
  }
  return static_cast<LogLevel>(level);
}

void set_log_level(LogLevel level) { g_level.store(static_cast<int>(level)); }

void set_log_sink(LogSink sink) {
  std::lock_guard lock(g_sink_mutex);
  current_sink() = std::move(sink);
}

void log_message(LogLevel level, std::string_view message) {
  std::lock_guard lock(g_sink_mutex);
  if (const LogSink& s = current_sink()) {
    s(level, message);
    return;
  }
  std::fprintf(stderr, "kdispatch: %.*s: %.*s\n", static_cast<int>(level_name(level).size()),
               level_name(level).data(), static_cast<int>(message.size()), message.data());
}

}  // namespace kdispatch
