// kdispatch doctor: the search path, every plugin found, whether it loads,
// its ABI and the devices its probe reports, every problem with its code,
// what the plugins together leave unchecked, library files no manifest
// names, the ops that have no reference kernel, and the backends fallback
// demoted (in a report made in-process; a fresh `kdispatch doctor` has none).
// Unlike list and select, doctor opens each plugin: that is what it checks.
#include <fmt/format.h>

#include "common.hpp"
#include "kdispatch/doctor.hpp"
#include "kdispatch/platform.hpp"

namespace kdispatch::cli {

Runner add_doctor(CLI::App& app) {
  struct Options {
    CommonOptions common;
    bool no_load = false;
  };
  auto options = std::make_shared<Options>();
  CLI::App* cmd = app.add_subcommand(
      "doctor", "Diagnose plugin discovery and loading: what was found, what loads, why anything does not");
  add_common_options(*cmd, options->common);
  cmd->add_flag("--no-load", options->no_load, "Check manifests and files only; open no plugin library");
  cmd->footer(
      "Exit code 2 when any plugin has an error; warnings (an op left unchecked, KD-E014; a library no manifest\n"
      "names, KD-E028) leave it 0. KDISPATCH_LOG=debug shows every step.");

  return [options]() -> int {
    Context& ctx = make_context(options->common);
    const DoctorReport report = doctor_report(ctx, !options->no_load);
    Json plugins = Json::array();
    for (const PluginReport& r : report.plugins) plugins.push_back(plugin_report_json(r));
    const Json problems = problems_json(report.problems);
    const std::vector<std::string>& without_reference = report.ops_without_reference;
    const bool any_error = report.any_error;

    if (options->common.json) {
      Json search = Json::array();
      for (const auto& d : report.search_path) search.push_back(d.path.string());
      Json doc;
      doc["search_path"] = search;
      doc["plugins"] = plugins;
      doc["problems"] = problems;
      doc["ops_without_reference"] = without_reference;
      Json demotions = Json::array();
      for (const Demotion& d : report.demotions) {
        demotions.push_back({{"op", d.op}, {"backend", d.backend}, {"device", d.device()}, {"error", d.error}});
      }
      doc["demotions"] = demotions;
      Json failed = Json::array();
      for (const Verdict& v : report.failed_verdicts) {
        failed.push_back({{"op", v.op}, {"backend", v.backend}, {"device", v.device}, {"library", v.library},
                          {"time", v.time}, {"date", v.date()}, {"source", v.source}, {"detail", v.detail}});
      }
      doc["failed_verdicts"] = failed;
      print_json(doc);
      return any_error ? kDispatchError : kOk;
    }

    fmt::print("search path:\n");
    for (const auto& d : report.search_path) {
      std::error_code ec;
      fmt::print("  {} ({}{})\n", d.path.string(), d.origin,
                 std::filesystem::is_directory(d.path, ec) ? "" : ", does not exist");
    }
    try {
      const DetectedPlatform platform = detect_platform();
      fmt::print("\nplatform: {} ({})\n", platform.device.str(), platform.source);
    } catch (const std::exception& e) {
      fmt::print("\nplatform: {}\n", e.what());
    }
    for (const Problem& q : ctx.discovery().problems) fmt::print("  {}: {}\n", code_string(q.code), q.message);
    fmt::print("\nplugins:\n");
    if (plugins.empty()) fmt::print("  none found\n");
    for (const auto& p : plugins) {
      fmt::print("  {} [{}]\n", p["name"].get<std::string>().empty() ? "?" : p["name"].get<std::string>(),
                 p["state"].get<std::string>());
      if (!p["backend"].get<std::string>().empty()) fmt::print("    backend:  {}\n", p["backend"].get<std::string>());
      fmt::print("    manifest: {}\n", p["manifest"].get<std::string>());
      if (!p["library"].get<std::string>().empty()) fmt::print("    library:  {}\n", p["library"].get<std::string>());
      if (p.contains("note")) fmt::print("    note:     {}\n", p["note"].get<std::string>());
      if (p.value("loaded", false)) {
        fmt::print("    loaded:   yes, version {}, ABI {}\n", p["version"].get<std::string>(),
                   p["abi"].get<std::string>());
        if (p["devices"].empty()) fmt::print("    devices:  none (no device of this kind here)\n");
        for (const auto& d : p["devices"]) {
          fmt::print("    device:   {} #{} {}\n", d["device"].get<std::string>(), d["id"].get<int>(),
                     d["name"].get<std::string>());
        }
      }
      for (const auto& q : p["problems"]) {
        fmt::print("    {}{}: {}\n", q["severity"] == "warning" ? "warning " : "", q["code"].get<std::string>(),
                   q["message"].get<std::string>());
      }
    }
    if (!report.coverage.empty()) {
      fmt::print("\nwhat the plugins leave unchecked, and libraries no manifest names:\n");
      for (const Problem& q : report.coverage) fmt::print("  warning {}: {}\n", code_string(q.code), q.message);
    }
    if (without_reference.empty()) {
      fmt::print("\nevery op has a reference kernel\n");
    } else {
      fmt::print("\nops without a reference kernel (run and bench report them unchecked): {}\n",
                 fmt::join(without_reference, ", "));
    }
    if (!report.demotions.empty()) {
      fmt::print("\nbackends demoted by fallback in this process:\n");
      for (const Demotion& d : report.demotions) {
        fmt::print("  {} for {} on {}: {}\n", d.backend, d.op, d.device(), d.error);
      }
    }
    if (!report.failed_verdicts.empty()) {
      fmt::print("\nkernels that failed conformance (never a fallback; their libraries unchanged since):\n");
      for (const Verdict& v : report.failed_verdicts) {
        fmt::print("  {} for {}: {}\n", v.backend, v.op, v.describe());
      }
    }
    const size_t warnings = report.warnings();
    if (any_error) {
      fmt::print("\nproblems found (kdispatch explain KD-Ennn says how to fix each)\n");
    } else if (warnings > 0) {
      fmt::print("\nno errors, {} warning{} (kdispatch explain KD-Ennn says how to fix each)\n", warnings,
                 warnings == 1 ? "" : "s");
    } else {
      fmt::print("\nno problems found\n");
    }
    return any_error ? kDispatchError : kOk;
  };
}

}  // namespace kdispatch::cli
