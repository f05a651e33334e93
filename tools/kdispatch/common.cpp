#include "common.hpp"

#include <fmt/format.h>

#include <cstdio>
#include <iostream>

#include "json_text.hpp"
#include "kdispatch/platform.hpp"

namespace kdispatch::cli {

void add_common_options(CLI::App& cmd, CommonOptions& options) {
  cmd.add_option("--plugin-path", options.plugin_path,
                 "Search only DIR for plugins (repeatable; replaces the default path and KDISPATCH_PLUGIN_PATH)")
      ->type_name("DIR");
  cmd.add_option("--add-plugin-path", options.add_plugin_path,
                 "Search DIR before the plugin path (repeatable)")
      ->type_name("DIR");
  cmd.add_flag("--json", options.json, "Print one JSON document on stdout, errors included");
}

std::unique_ptr<Context> make_context(const CommonOptions& options) {
  ContextOptions context_options;
  for (const auto& p : options.plugin_path) context_options.search.replace.emplace_back(p);
  for (const auto& p : options.add_plugin_path) context_options.search.add.emplace_back(p);
  return std::make_unique<Context>(std::move(context_options));
}

DeviceChoice choose_device(const std::string& flag) {
  try {
    if (!flag.empty()) return {Device::parse(flag), "--device"};
    DetectedPlatform detected = detect_platform();
    return {detected.device, detected.source};
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
}

int report_error(const Error& error, bool json) {
  const bool kernel_failure =
      error.code() == ErrorCode::kernel_failed || error.code() == ErrorCode::device_error;
  if (json) {
    print_json(error_json(error.code_string(), error.message(), error.hints()));
  } else {
    std::fflush(stdout);
    std::cerr << fmt::format("error[{}]: {}\n", error.code_string(), error.message());
    for (const auto& hint : error.hints()) std::cerr << "  hint: " << hint << "\n";
    std::cerr << fmt::format("  (kdispatch explain {} says more)\n", error.code_string());
  }
  return kernel_failure ? kKernelFailure : kDispatchError;
}

Json error_json(std::string_view code, std::string_view message, const std::vector<std::string>& hints) {
  return Json{{"error", {{"code", code}, {"message", message}, {"hints", hints}}}};
}

void print_json(const Json& doc) { std::cout << json_text(doc) << std::endl; }

Json problem_json(const Problem& problem) {
  return {{"code", code_string(problem.code)},
          {"file", problem.file},
          {"message", problem.message},
          {"severity", problem.warning ? "warning" : "error"}};
}

Json problems_json(const std::vector<Problem>& problems) {
  Json out = Json::array();
  for (const auto& p : problems) out.push_back(problem_json(p));
  return out;
}

Json plugin_json(const PluginRecord& record) {
  Json p;
  p["name"] = record.name;
  p["backend"] = record.backend;
  p["manifest"] = record.manifest_path;
  p["library"] = record.library_path;
  p["status"] = record.state == PluginState::found ? "ok" : "error";
  p["state"] = plugin_state_name(record.state);
  if (!record.note.empty()) p["note"] = record.note;
  p["problems"] = problems_json(record.problems);
  return p;
}

}  // namespace kdispatch::cli
