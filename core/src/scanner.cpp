#include "scanner.hpp"

#include <dlfcn.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstring>
#include <mutex>

#include "kdispatch/environment.hpp"
#include "kdispatch/log.hpp"
#include "kdispatch/plugin_security.hpp"
#include "registry_cache.hpp"
#include "unique_fd.hpp"

extern char** environ;

namespace kdispatch {
namespace fs = std::filesystem;

namespace {

constexpr const char* kScannerName = "kdispatch-plugin-scanner";
constexpr auto kDefaultTimeout = std::chrono::seconds(10);
constexpr size_t kMaxShownOutput = 200;

std::chrono::milliseconds scan_timeout() {
  if (auto text = get_env("KDISPATCH_SCAN_TIMEOUT"); text && !text->empty()) {
    double seconds = 0;
    const auto [end, ec] = std::from_chars(text->data(), text->data() + text->size(), seconds);
    if (ec == std::errc() && end == text->data() + text->size() && seconds > 0 && seconds < 3600) {
      return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
    }
    log(LogLevel::warn, "KDISPATCH_SCAN_TIMEOUT={}: not a number of seconds, using {} s", *text,
        kDefaultTimeout.count());
  }
  return kDefaultTimeout;
}

std::string shown(std::string text) {
  if (text.size() > kMaxShownOutput) text = text.substr(0, kMaxShownOutput) + "...";
  for (char& c : text) {
    if (c == '\n' || c == '\r' || c == '\t') c = ' ';
  }
  return text;
}

}  // namespace

std::string_view scan_verdict_name(ScanVerdict verdict) {
  switch (verdict) {
    case ScanVerdict::ok:
      return "ok";
    case ScanVerdict::incompatible:
      return "incompatible";
    case ScanVerdict::crashed:
      return "crashed";
    case ScanVerdict::hung:
      return "hung";
    case ScanVerdict::exited:
      return "exited";
    case ScanVerdict::wrote_stdout:
      return "wrote-stdout";
  }
  return "?";
}

bool parse_scan_verdict(std::string_view name, ScanVerdict* out) {
  for (ScanVerdict v : {ScanVerdict::ok, ScanVerdict::incompatible, ScanVerdict::crashed, ScanVerdict::hung,
                        ScanVerdict::exited, ScanVerdict::wrote_stdout}) {
    if (scan_verdict_name(v) == name) {
      *out = v;
      return true;
    }
  }
  return false;
}

ScanPolicy scan_policy() {
  const auto value = get_env("KDISPATCH_SCAN");
  if (!value || value->empty() || *value == "cache") return ScanPolicy::cache;
  if (*value == "always") return ScanPolicy::always;
  if (*value == "off") return ScanPolicy::off;
  static std::once_flag warned;
  std::call_once(warned,
                 [&] { log(LogLevel::warn, "KDISPATCH_SCAN={}: expected cache, always or off; using cache", *value); });
  return ScanPolicy::cache;
}

std::optional<ScannerProgram> scanner_program() {
  if (auto env = get_env("KDISPATCH_SCANNER"); env && !env->empty()) return ScannerProgram{fs::path(*env), true};
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec && fs::is_regular_file(exe.parent_path() / kScannerName, ec)) {
    return ScannerProgram{exe.parent_path() / kScannerName, false};
  }
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&scanner_program), &info) != 0 && info.dli_fname != nullptr) {
    const fs::path beside = fs::weakly_canonical(info.dli_fname, ec).parent_path() / "kdispatch" / kScannerName;
    if (!ec && fs::is_regular_file(beside, ec)) return ScannerProgram{beside, false};
  }
  return std::nullopt;
}

ScanOutcome run_scanner(const fs::path& program, const fs::path& manifest_path, std::chrono::milliseconds timeout) {
  ScanOutcome outcome;
  int out_pipe[2];
  int result_pipe[2];
  if (::pipe2(out_pipe, O_CLOEXEC) != 0) return {ScanVerdict::exited, -1, std::strerror(errno), false};
  UniqueFd out_read{out_pipe[0]}, out_write{out_pipe[1]};
  if (::pipe2(result_pipe, O_CLOEXEC) != 0) return {ScanVerdict::exited, -1, std::strerror(errno), false};
  UniqueFd result_read{result_pipe[0]}, result_write{result_pipe[1]};

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&actions, out_write.fd, 1);
  posix_spawn_file_actions_adddup2(&actions, result_write.fd, 3);
  const std::string program_text = program.string();
  const std::string manifest_text = manifest_path.string();
  char* argv[] = {const_cast<char*>(program_text.c_str()), const_cast<char*>(manifest_text.c_str()), nullptr};
  pid_t pid = -1;
  const int spawned = ::posix_spawn(&pid, program_text.c_str(), &actions, nullptr, argv, environ);
  posix_spawn_file_actions_destroy(&actions);
  out_write.reset();
  result_write.reset();
  if (spawned != 0)
    return {ScanVerdict::exited, -1, fmt::format("cannot run {}: {}", program_text, std::strerror(spawned)), false};

  std::string printed;
  std::string result;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  bool timed_out = false;
  while (out_read.fd >= 0 || result_read.fd >= 0) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      timed_out = true;
      break;
    }
    pollfd fds[2] = {{out_read.fd, POLLIN, 0}, {result_read.fd, POLLIN, 0}};
    const int ready = ::poll(fds, 2, static_cast<int>(left.count()));
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0) break;
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
      char buffer[4096];
      const ssize_t n = ::read(fds[i].fd, buffer, sizeof buffer);
      if (n <= 0) {
        (i == 0 ? out_read : result_read).reset();
        continue;
      }
      std::string& into = i == 0 ? printed : result;
      if (into.size() < 65536) into.append(buffer, static_cast<size_t>(n));
    }
  }
  int status = 0;
  if (timed_out) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &status, 0);
    return {ScanVerdict::hung, 0,
            fmt::format("still running after {:.1f} s, killed", static_cast<double>(timeout.count()) / 1000),
            false};
  }
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (!printed.empty()) return {ScanVerdict::wrote_stdout, 0, shown(printed)};
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    return {ScanVerdict::crashed, sig, fmt::format("signal {} ({})", sig, ::strsignal(sig)), sig != SIGKILL};
  }
  if (result.starts_with("ok")) return {ScanVerdict::ok, 0, {}};
  if (result.starts_with("error\t")) {
    const size_t tab = result.find('\t', 6);
    int code = static_cast<int>(ErrorCode::plugin_open_failed);
    std::from_chars(result.data() + 6, result.data() + (tab == std::string::npos ? result.size() : tab), code);
    std::string message = tab == std::string::npos ? std::string() : result.substr(tab + 1);
    while (!message.empty() && message.back() == '\n') message.pop_back();
    return {ScanVerdict::incompatible, code, message};
  }
  return {ScanVerdict::exited, WIFEXITED(status) ? WEXITSTATUS(status) : -1, "no report"};
}

std::optional<Problem> scan_problem(const Manifest& manifest, const ScanOutcome& outcome) {
  const std::string library = fs::absolute(manifest.library_path()).string();
  const auto failed = [&](const std::string& what) {
    return Problem{ErrorCode::plugin_scan_failed, library,
                   fmt::format("plugin library {} {} when the plugin scanner opened it; {}", library, what,
                               outcome.definite ? "it is not opened in this process until the file changes"
                                                : "it is not opened in this process, and the next process scans "
                                                  "it again")};
  };
  switch (outcome.verdict) {
    case ScanVerdict::ok:
      return std::nullopt;
    case ScanVerdict::incompatible:
      return Problem{static_cast<ErrorCode>(outcome.code), library, outcome.detail};
    case ScanVerdict::crashed:
      return failed(fmt::format("crashed with {}", outcome.detail));
    case ScanVerdict::hung:
      return failed(fmt::format("hung ({})", outcome.detail));
    case ScanVerdict::exited:
      return failed(fmt::format("exited with status {} ({})", outcome.code, outcome.detail));
    case ScanVerdict::wrote_stdout:
      return failed(fmt::format("wrote to stdout (\"{}\")", outcome.detail));
  }
  return std::nullopt;
}

namespace {

std::optional<ScanOutcome> scan_with(const std::optional<ScannerProgram>& program, const Manifest& manifest) {
  if (!program) return std::nullopt;
  if (program->from_environment) {
    // Its "ok" lets a library into this process: a program that someone
    // else could replace would decide that for them.
    if (std::optional<Problem> problem = check_program_security(program->path, "plugin scanner")) {
      log(LogLevel::warn, "KDISPATCH_SCANNER: {}: {}", code_string(problem->code), problem->message);
      return ScanOutcome{ScanVerdict::incompatible, static_cast<int>(problem->code), problem->message, false};
    }
  }
  log(LogLevel::debug, "scanning plugin '{}' ({}) with {}", manifest.plugin, manifest.library_path().string(),
      program->path.string());
  ScanOutcome outcome = run_scanner(program->path, fs::absolute(manifest.path), scan_timeout());
  log(LogLevel::info, "plugin scanner: '{}': {}{}{}", manifest.plugin, scan_verdict_name(outcome.verdict),
      outcome.detail.empty() ? "" : ": ", outcome.detail);
  // What a program named by the user found is this process's business: the
  // registry cache keeps only the outcomes of the scanner installed with
  // kdispatch, which every later process trusts.
  if (program->from_environment) outcome.definite = false;
  if (outcome.definite) cache_store(manifest, outcome);
  return outcome;
}

}  // namespace

std::optional<ScanOutcome> scan_now(const Manifest& manifest) { return scan_with(scanner_program(), manifest); }

std::optional<Problem> scan_before_load(const Manifest& manifest) {
  const ScanPolicy policy = scan_policy();
  if (policy == ScanPolicy::off) return std::nullopt;
  std::error_code ec;
  if (manifest.path.empty() || !fs::is_regular_file(manifest.path, ec)) return std::nullopt;
  const std::optional<ScannerProgram> program = scanner_program();
  // A scanner named by KDISPATCH_SCANNER always runs: the cache holds what
  // the installed one found.
  if (policy == ScanPolicy::cache && !(program && program->from_environment)) {
    if (const std::optional<ScanOutcome> cached = cache_lookup(manifest)) {
      log(LogLevel::debug, "plugin '{}': scan outcome from the registry cache: {}", manifest.plugin,
          scan_verdict_name(cached->verdict));
      return scan_problem(manifest, *cached);
    }
  }
  const std::optional<ScanOutcome> outcome = scan_with(program, manifest);
  if (!outcome) {
    log(LogLevel::debug, "no {} found: plugin '{}' is opened without a scan", kScannerName, manifest.plugin);
    return std::nullopt;
  }
  return scan_problem(manifest, *outcome);
}

}  // namespace kdispatch
