// kdispatch: the command-line face of the dispatcher (README.md, the kdispatch tool).
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <iostream>
#include <string>
#include <string_view>

#include "common.hpp"
#include "kdispatch/version.h"

namespace {

// Whether --json was asked for: then errors that no subcommand reports
// itself (usage errors, the last-resort ones) are still one JSON document on
// stdout, as the README promises, with "usage" or "error" as code.
bool wants_json(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "--") return false;
    if (arg == "--json") return true;
  }
  return false;
}

int report_plain_error(const std::string& code, const std::string& message, bool json, int exit_code) {
  using namespace kdispatch::cli;
  if (json) {
    print_json(error_json(code, message));
  } else {
    std::cerr << "error: " << message << "\n";
  }
  return exit_code;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace kdispatch::cli;
  const bool json = wants_json(argc, argv);
  CLI::App app{
      "kdispatch: a kernel dispatcher with plugin backends.\n"
      "Lists, selects, runs, benchmarks and tunes the kernels that plugins (CPU, CUDA, HIP, third-party)\n"
      "declare in their manifests, and explains every error.\n\n"
      "Environment: KDISPATCH_PLUGIN_PATH, KDISPATCH_ADD_PLUGIN_PATH, KDISPATCH_PLUGINS_DISABLE,\n"
      "KDISPATCH_PLUGINS_SELECT, KDISPATCH_DEVICE, KDISPATCH_FORCE_BACKEND, KDISPATCH_BACKEND_ORDER,\n"
      "KDISPATCH_PREFERENCE_FILE=FILE (per-op backend preferences), KDISPATCH_TUNING_FILE=FILE (measured\n"
      "per-shape choices, `kdispatch tune`), KDISPATCH_FALLBACK=1 (demote a\n"
      "backend whose kernel fails with a device or internal error and pass the call on, never to a kernel\n"
      "that failed its conformance checks), KDISPATCH_VERDICTS=0 (record and use no conformance verdicts),\n"
      "KDISPATCH_LOG=error|warn|info|debug, KDISPATCH_TRACE=FILE, KDISPATCH_CPU_THREADS=N,\n"
      "KDISPATCH_SCAN=cache|always|off, KDISPATCH_SCAN_TIMEOUT=SECONDS (see docs/environment.md).\n"
      "Exit codes: 0 ok, 1 usage, 2 dispatch or manifest error, 3 kernel failure or result mismatch.",
      "kdispatch"};
  app.require_subcommand(0, 1);
  CommonOptions leading;
  add_leading_options(app, leading);
  app.footer("Common options (--plugin-path, --add-plugin-path, --json) go before or after the subcommand.\n"
             "Run `kdispatch SUBCOMMAND --help` for a subcommand's options.\n"
             "Example: kdispatch --add-plugin-path ./build/plugins list");
  app.set_version_flag("--version", std::string("kdispatch ") + kdispatch::version());

  std::vector<Runner> runners;
  std::vector<CLI::App*> commands;
  for (auto add : {add_list, add_select, add_run, add_bench, add_tune, add_doctor, add_scan, add_inspect, add_validate, add_explain}) {
    runners.push_back(add(app));
    commands.push_back(app.get_subcommands({}).back());
  }

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (json && e.get_exit_code() != 0) return report_plain_error("usage", e.what(), true, kUsage);
    const int code = app.exit(e);
    return code == 0 ? kOk : kUsage;
  }
  apply_leading_options(leading);
  try {
    if (app.get_subcommands().empty()) {
      std::cout << app.help();
      return kUsage;
    }
    for (size_t i = 0; i < commands.size(); ++i) {
      if (commands[i]->parsed()) return runners[i]();
    }
  } catch (const UsageError& e) {
    return report_plain_error("usage", e.what(), json, kUsage);
  } catch (const kdispatch::Error& e) {
    // report_error inside each subcommand handles most; this is the fallback
    // for anything thrown outside that.
    return report_error(e, json);
  } catch (const std::exception& e) {
    return report_plain_error("error", e.what(), json, kDispatchError);
  }
  return kUsage;
}
