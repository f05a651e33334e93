#include "verdict_store.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <ctime>

#include "file_check.hpp"
#include "kdispatch/environment.hpp"
#include "kdispatch/error.hpp"
#include "kdispatch/log.hpp"
#include "kdispatch/plugin_security.hpp"
#include "line_fields.hpp"
#include "registry_cache.hpp"
#include "scanner.hpp"
#include "unique_fd.hpp"

namespace kdispatch {
namespace fs = std::filesystem;

namespace {

// The layout of the lines below; bump it when they change.
constexpr int kFormat = 1;
constexpr std::string_view kHeaderWord = "kdispatch-conformance-verdicts";

std::string header() { return fmt::format("{} {}", kHeaderWord, kFormat); }

std::string key_of(std::string_view backend, std::string_view op, std::string_view device, std::string_view library) {
  return fmt::format("{}\t{}\t{}\t{}", backend, op, device, library);
}

// A backend or op name, device kind or library identity: printable, no
// spaces, not empty.
bool plain_word(std::string_view w) {
  if (w.empty() || w.size() > 256) return false;
  return std::all_of(w.begin(), w.end(), [](char c) { return c > ' ' && c < 127 && c != '\\'; });
}

// Why the file behind `fd` is not read, with its code, or nullopt.
std::optional<std::pair<ErrorCode, std::string>> file_problem(const struct stat& st) {
  if (st.st_uid != ::geteuid()) {
    return std::pair{ErrorCode::plugin_insecure,
                     fmt::format("it belongs to uid {}, not to this user (uid {})", st.st_uid, ::geteuid())};
  }
  if ((st.st_mode & 022) != 0) {
    return std::pair{ErrorCode::plugin_insecure,
                     fmt::format("it is writable by its group or others (mode {:o})", st.st_mode & 07777)};
  }
  if (static_cast<uint64_t>(st.st_size) > kMaxVerdictFileBytes) {
    return std::pair{ErrorCode::manifest_bad_json,
                     fmt::format("it is {} bytes, more than a verdict file holds ({} MiB)", st.st_size,
                                 kMaxVerdictFileBytes >> 20)};
  }
  return std::nullopt;
}

// Reads the verdict file into `out`; a missing file is none. A bad one is
// warned about (once per file and stamp per process) and counts as none.
void read_file(const fs::path& path, std::map<std::string, Verdict>& out) {
  out.clear();
  std::string why;
  const UniqueFd fd{open_regular_file(path, O_RDONLY | O_NOFOLLOW, why)};
  struct stat st {};
  std::optional<std::pair<ErrorCode, std::string>> problem;
  std::string text;
  if (fd.fd < 0) {
    if (why == std::strerror(ENOENT)) return;
    problem = std::pair{ErrorCode::manifest_bad_json, fmt::format("cannot be read: {}", why)};
  } else if (::fstat(fd.fd, &st) != 0) {
    problem = std::pair{ErrorCode::manifest_bad_json, fmt::format("cannot be read: {}", std::strerror(errno))};
  } else {
    problem = file_problem(st);
  }
  if (!problem) {
    char buffer[65536];
    while (true) {
      const ssize_t n = ::read(fd.fd, buffer, sizeof buffer);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        problem = std::pair{ErrorCode::manifest_bad_json, fmt::format("cannot be read: {}", std::strerror(errno))};
        break;
      }
      if (n == 0) break;
      if (text.size() + static_cast<size_t>(n) > kMaxVerdictFileBytes) {
        problem = std::pair{ErrorCode::manifest_bad_json,
                            fmt::format("it grew beyond what a verdict file holds ({} MiB)", kMaxVerdictFileBytes >> 20)};
        break;
      }
      text.append(buffer, static_cast<size_t>(n));
    }
  }
  if (!problem && !parse_verdict_file(text, out, why)) problem = std::pair{ErrorCode::manifest_bad_json, why};
  if (!problem) return;
  out.clear();
  static std::mutex mutex;
  static auto* warned = new std::set<std::string>();  // never destroyed: used until exit
  const std::string once = fmt::format("{}\t{}:{}:{}:{}", path.string(), st.st_dev, st.st_ino, st.st_size,
                                       st.st_mtim.tv_nsec + st.st_mtim.tv_sec * 1'000'000'000LL);
  bool first;
  {
    std::lock_guard lock(mutex);
    first = warned->insert(once).second;
  }
  log(first ? LogLevel::warn : LogLevel::debug,
      "conformance verdicts {}: [{}] {}; its verdicts are ignored (the file is rewritten at the next verdict)",
      path.string(), code_string(problem->first), problem->second);
}

// Writes `verdicts` to the file, atomically; on failure returns why.
std::optional<std::string> write_file(const fs::path& path, const std::map<std::string, Verdict>& verdicts) {
  return replace_file(path, format_verdict_file(verdicts));
}

void warn_unwritable(const fs::path& path, const std::string& why) {
  static std::once_flag warned;
  std::call_once(warned, [&] {
    log(LogLevel::warn, "conformance verdicts {} cannot be written ({}); verdicts are kept in this process only",
        path.string(), why);
  });
}

}  // namespace

std::string Verdict::date() const {
  const std::time_t t = static_cast<std::time_t>(time);
  struct tm tm {};
  if (::gmtime_r(&t, &tm) == nullptr) return fmt::format("@{}", time);
  char text[64];
  std::strftime(text, sizeof text, "%Y-%m-%d %H:%M UTC", &tm);
  return text;
}

std::string Verdict::describe() const {
  return fmt::format("{} conformance on {} on {} ({}{}{})", passed ? "passed" : "failed", device, date(), source,
                     detail.empty() ? "" : ": ", detail);
}

fs::path verdict_file_path() {
  return registry_cache_path().parent_path() / fmt::format("conformance-verdicts-{}.txt", kFormat);
}

std::string library_hash(const std::string& path) {
  static std::mutex mutex;
  static auto* hashes = new std::map<std::string, std::string>();  // never destroyed: used until exit
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return "missing";
  const std::string key = fmt::format("{}\n{}\n{}.{}", path, st.st_size, st.st_mtim.tv_sec, st.st_mtim.tv_nsec);
  {
    std::lock_guard lock(mutex);
    if (auto it = hashes->find(key); it != hashes->end()) return it->second;
  }
  std::string hash;
  try {
    hash = "sha256:" + sha256_file(path);
  } catch (const std::exception& e) {
    hash = fmt::format("unreadable ({})", e.what());
  }
  std::lock_guard lock(mutex);
  hashes->emplace(key, hash);
  return hash;
}

bool parse_verdict_file(std::string_view text, std::map<std::string, Verdict>& out, std::string& why) {
  out.clear();
  size_t line_no = 0;
  while (!text.empty()) {
    const size_t newline = text.find('\n');
    const std::string_view line = text.substr(0, newline);
    text.remove_prefix(newline == std::string_view::npos ? text.size() : newline + 1);
    ++line_no;
    if (line_no == 1) {
      if (line != header()) {
        why = line.starts_with(kHeaderWord) ? "it is of another format of the verdict file"
                                            : "it is not a conformance verdict file (line 1)";
        return false;
      }
      continue;
    }
    std::vector<std::string_view> f;
    std::string_view rest = line;
    while (f.size() < 7) {
      const size_t tab = rest.find('\t');
      if (tab == std::string_view::npos) break;
      f.push_back(rest.substr(0, tab));
      rest.remove_prefix(tab + 1);
    }
    // f: passed|failed, time, backend, op, device, library, source; rest: detail
    Verdict v;
    const bool fields = f.size() == 7 && (f[0] == "passed" || f[0] == "failed") && plain_word(f[2]) &&
                        plain_word(f[3]) && plain_word(f[4]) && plain_word(f[5]) && rest.find('\t') == std::string_view::npos;
    if (fields) {
      const auto [end, ec] = std::from_chars(f[1].data(), f[1].data() + f[1].size(), v.time);
      if (ec != std::errc() || end != f[1].data() + f[1].size() || v.time < 0) {
        why = fmt::format("line {}: the time '{}' is not a number of seconds", line_no, f[1]);
        return false;
      }
    } else {
      why = fmt::format("line {} is not a verdict (result, time, backend, op, device, library, source, detail)",
                        line_no);
      return false;
    }
    v.passed = f[0] == "passed";
    v.backend = f[2];
    v.op = f[3];
    v.device = f[4];
    v.library = f[5];
    v.source = unescape_field(f[6]);
    v.detail = unescape_field(rest);
    out[key_of(v.backend, v.op, v.device, v.library)] = std::move(v);
  }
  if (line_no == 0) {
    why = "it is empty";
    return false;
  }
  return true;
}

std::string format_verdict_file(const std::map<std::string, Verdict>& verdicts) {
  std::string text = header() + "\n";
  for (const auto& [key, v] : verdicts) {
    text += fmt::format("{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\n", v.passed ? "passed" : "failed", v.time, v.backend, v.op,
                        v.device, v.library, escape_field(v.source), escape_field(v.detail));
  }
  return text;
}

VerdictStore::VerdictStore(bool enabled, bool persistent) : enabled_(enabled), persistent_(enabled && persistent) {}

std::unique_ptr<VerdictStore> VerdictStore::from_environment() {
  bool enabled = true;
  if (auto env = get_env("KDISPATCH_VERDICTS"); env && !env->empty()) {
    if (*env == "0") {
      enabled = false;
    } else if (*env != "1") {
      log(LogLevel::warn, "KDISPATCH_VERDICTS={}: expected 1 (on) or 0 (off); conformance verdicts stay on", *env);
    }
  }
  return std::make_unique<VerdictStore>(enabled, scan_policy() != ScanPolicy::off);
}

void VerdictStore::load_locked() const {
  if (loaded_.load(std::memory_order_relaxed)) return;
  if (persistent_) {
    const fs::path path = verdict_file_path();
    if (const std::string problem = registry_cache_dir_problem(path.parent_path()); !problem.empty()) {
      log(LogLevel::debug, "conformance verdicts {} are not read: {}", path.string(), problem);
    } else {
      read_file(path, file_);
      refresh_failed_locked();
    }
  }
  loaded_.store(true, std::memory_order_release);
}

void VerdictStore::refresh_failed_locked() const {
  bool any = false;
  for (const auto& [k, v] : file_) any = any || !v.passed;
  for (const auto& [k, v] : runtime_) any = any || !v.passed;
  any_failed_.store(any, std::memory_order_release);
}

void VerdictStore::record(Verdict verdict) {
  if (!enabled_) return;
  std::lock_guard lock(mutex_);
  load_locked();
  const std::string key = key_of(verdict.backend, verdict.op, verdict.device, verdict.library);
  if (verdict.passed && failed_here_.count(key) != 0) return;
  if (!verdict.passed) failed_here_.insert(key);
  if (verdict.library == "run-time") {
    runtime_[key] = std::move(verdict);
    refresh_failed_locked();
    return;
  }
  if (!persistent_) {
    file_[key] = std::move(verdict);
    refresh_failed_locked();
    return;
  }
  const fs::path path = verdict_file_path();
  std::optional<std::string> failed;
  if (std::string problem = registry_cache_dir_problem(path.parent_path()); !problem.empty()) {
    failed = std::move(problem);
  } else {
    // Read again under the lock: another process may have recorded since.
    std::string why;
    const UniqueFd lock_fd{open_regular_file(path.string() + ".lock", O_RDWR | O_CREAT | O_NOFOLLOW, why, 0600)};
    if (lock_fd.fd >= 0) {
      while (::flock(lock_fd.fd, LOCK_EX) != 0 && errno == EINTR) {
      }
    }
    std::map<std::string, Verdict> now;
    read_file(path, now);
    now[key] = verdict;
    // Bounded: the oldest verdicts go first.
    while (now.size() > kMaxVerdicts) {
      const auto oldest = std::min_element(now.begin(), now.end(),
                                           [](const auto& a, const auto& b) { return a.second.time < b.second.time; });
      now.erase(oldest);
    }
    failed = write_file(path, now);
    if (!failed) file_ = std::move(now);
  }
  if (failed) {
    warn_unwritable(path, *failed);
    file_[key] = std::move(verdict);
  }
  refresh_failed_locked();
}

std::optional<Verdict> VerdictStore::latest(std::string_view op, std::string_view backend, std::string_view device,
                                            std::string_view library) const {
  if (!enabled_) return std::nullopt;
  std::lock_guard lock(mutex_);
  load_locked();
  const std::string key = key_of(backend, op, device, library);
  const auto& map = library == "run-time" ? runtime_ : file_;
  const auto it = map.find(key);
  if (it == map.end()) return std::nullopt;
  return it->second;
}

bool VerdictStore::any_failed() const {
  if (!enabled_) return false;
  if (!loaded_.load(std::memory_order_acquire)) {
    std::lock_guard lock(mutex_);
    load_locked();
  }
  return any_failed_.load(std::memory_order_acquire);
}

std::vector<Verdict> VerdictStore::all() const {
  std::vector<Verdict> out;
  if (!enabled_) return out;
  std::lock_guard lock(mutex_);
  load_locked();
  for (const auto& [k, v] : file_) out.push_back(v);
  for (const auto& [k, v] : runtime_) out.push_back(v);
  return out;
}

bool VerdictStore::first_skip(std::string_view op, std::string_view backend) {
  std::lock_guard lock(mutex_);
  return skipped_.insert(fmt::format("{}\t{}", op, backend)).second;
}

}  // namespace kdispatch
