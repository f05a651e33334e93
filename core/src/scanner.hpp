// Out-of-process plugin scanning (docs/internals.md, after GStreamer's
// plugin scanner). Opening a library runs its code, and a constructor that
// segfaults, aborts, exits, loops or prints would take the process down or
// corrupt its output. So the first time a plugin file is to be opened, a
// helper process (kdispatch-plugin-scanner) opens it, calls its entry and
// probe and reports back; the outcome is kept in a registry cache, and a
// plugin that crashed, hung, exited or wrote to stdout there is not opened
// in-process until its files change.
#pragma once

#include <chrono>
#include <filesystem>
#include <optional>
#include <string>

#include "kdispatch/error.hpp"
#include "kdispatch/manifest.hpp"

namespace kdispatch {

enum class ScanVerdict {
  ok,            // opened and probed in the helper
  incompatible,  // refused with its own code (KD-E02x), as in-process loading would
  crashed,       // killed by a signal
  hung,          // still running after the timeout; killed
  exited,        // ended without reporting (exit() in a constructor, say)
  wrote_stdout,  // printed to stdout, which corrupts the tool's output
};
std::string_view scan_verdict_name(ScanVerdict verdict);
bool parse_scan_verdict(std::string_view name, ScanVerdict* out);

struct ScanOutcome {
  ScanVerdict verdict = ScanVerdict::ok;
  int code = 0;        // incompatible: the ErrorCode; crashed: the signal; exited: the exit status
  std::string detail;  // the helper's message, or what it printed
  // False when the outcome may say more about this machine's state than
  // about the plugin: a timeout (a loaded machine), a helper that could not
  // be started (a process or file limit), a SIGKILL from outside (the OOM
  // killer). Such an outcome refuses the plugin in this process but is not
  // cached: the next process scans it again.
  bool definite = true;
};

enum class ScanPolicy { cache, always, off };
// KDISPATCH_SCAN=cache|always|off (default cache; an unknown value warns).
ScanPolicy scan_policy();

// The helper program: KDISPATCH_SCANNER, else kdispatch-plugin-scanner
// beside the running program, else <libdir>/kdispatch/ beside the core
// library. nullopt when there is none (then nothing is scanned). A program
// named by KDISPATCH_SCANNER runs only when it and its directories pass the
// plugin location rules (KD-E025), and its outcomes are never cached.
struct ScannerProgram {
  std::filesystem::path path;
  bool from_environment = false;  // named by KDISPATCH_SCANNER
};
std::optional<ScannerProgram> scanner_program();

// Runs the helper on `manifest_path`, waiting at most `timeout`.
ScanOutcome run_scanner(const std::filesystem::path& program, const std::filesystem::path& manifest_path,
                        std::chrono::milliseconds timeout);

// What the loader does before opening `manifest`'s library in-process:
// under the policy, looks the plugin up in the registry cache or scans it
// (and records the outcome); returns the problem that must stop the load
// (KD-E027 for a crash, hang, exit or output; the helper's own code when
// incompatible), or nullopt.
std::optional<Problem> scan_before_load(const Manifest& manifest);

// Scans `manifest` now (whatever the cache holds) and records the outcome.
// nullopt when there is no helper program.
std::optional<ScanOutcome> scan_now(const Manifest& manifest);

// The problem an outcome means for loading, or nullopt for ok.
std::optional<Problem> scan_problem(const Manifest& manifest, const ScanOutcome& outcome);

}  // namespace kdispatch
