// kdispatch scan: every plugin found is opened in the plugin scanner (a
// helper process), never in this one, and each outcome is printed and kept
// in the registry cache ($XDG_CACHE_HOME/kdispatch/).
#include <fmt/format.h>

#include "common.hpp"

namespace kdispatch::cli {

Runner add_scan(CLI::App& app) {
  auto options = std::make_shared<CommonOptions>();
  CLI::App* cmd = app.add_subcommand(
      "scan", "Open every plugin in a helper process and record how it went (crash, hang, exit, output, ok)");
  add_common_options(*cmd, *options);
  cmd->footer(
      "Exit code 2 when any plugin cannot be loaded. KDISPATCH_SCAN_TIMEOUT=SECONDS (default 10) bounds each scan.");
  return [options]() -> int {
    Context& ctx = make_context(*options);
    const std::vector<PluginScanResult> scans = ctx.scan_plugins();
    bool any_error = false;
    Json plugins = Json::array();
    for (const auto& s : scans) {
      any_error = any_error || s.problem.has_value() || s.verdict == "unscanned";
      plugins.push_back({{"name", s.plugin},
                         {"library", s.library},
                         {"verdict", s.verdict},
                         {"problem", s.problem ? problem_json(*s.problem) : Json(nullptr)}});
    }
    if (options->json) {
      print_json(Json{{"plugins", plugins}});
    } else {
      for (const auto& s : scans) {
        fmt::print("{:<24} {:<13} {}\n", s.plugin, s.verdict,
                   s.problem ? fmt::format("{}: {}", code_string(s.problem->code), s.problem->message) : s.library);
      }
      if (scans.empty()) fmt::print("no plugins found\n");
    }
    return any_error ? kDispatchError : kOk;
  };
}

}  // namespace kdispatch::cli
