#include "common.hpp"

#include <fmt/format.h>

#include <cstdio>
#include <iostream>

#include "json_text.hpp"
#include "kdispatch/platform.hpp"

namespace kdispatch::cli {

namespace {

// Every subcommand's options, for apply_leading_options().
std::vector<CommonOptions*>& registered_common() {
  static std::vector<CommonOptions*> all;
  return all;
}
std::vector<bool*>& registered_json() {
  static std::vector<bool*> all;
  return all;
}

void add_options_to(CLI::App& cmd, CommonOptions& options) {
  cmd.add_option("--plugin-path", options.plugin_path,
                 "Search only DIR for plugins (repeatable; replaces the default path and KDISPATCH_PLUGIN_PATH)")
      ->type_name("DIR");
  cmd.add_option("--add-plugin-path", options.add_plugin_path,
                 "Search DIR before the plugin path (repeatable)")
      ->type_name("DIR");
  cmd.add_flag("--json", options.json, "Print one JSON document on stdout, errors included");
}

}  // namespace

void add_common_options(CLI::App& cmd, CommonOptions& options) {
  add_options_to(cmd, options);
  registered_common().push_back(&options);
}

void add_json_flag(CLI::App& cmd, bool& json) {
  cmd.add_flag("--json", json, "Print one JSON document on stdout, errors included");
  registered_json().push_back(&json);
}

void add_leading_options(CLI::App& app, CommonOptions& leading) { add_options_to(app, leading); }

void apply_leading_options(const CommonOptions& leading) {
  for (CommonOptions* options : registered_common()) {
    options->plugin_path.insert(options->plugin_path.begin(), leading.plugin_path.begin(), leading.plugin_path.end());
    options->add_plugin_path.insert(options->add_plugin_path.begin(), leading.add_plugin_path.begin(),
                                    leading.add_plugin_path.end());
    options->json = options->json || leading.json;
  }
  for (bool* json : registered_json()) *json = *json || leading.json;
}

std::string for_command_line(std::string message) {
  constexpr std::string_view api = "backend=...";
  for (size_t at = message.find(api); at != std::string::npos; at = message.find(api, at)) {
    message.replace(at, api.size(), "--backend B");
  }
  return message;
}

Context& make_context(const CommonOptions& options, bool probed_arch) {
  ContextOptions context_options;
  for (const auto& p : options.plugin_path) context_options.search.replace.emplace_back(p);
  for (const auto& p : options.add_plugin_path) context_options.search.add.emplace_back(p);
  auto context = std::make_shared<const Context*>(nullptr);  // set once the context exists
  if (probed_arch) {
    context_options.device_of = [context](DeviceType type, int32_t id) {
      const Device driver = device_of(type, id);
      if (!driver.arch.empty() || *context == nullptr) return driver;
      for (const PluginRecord& record : (*context)->discovery().plugins) {
        const auto state = (*context)->load_state(record.name);
        if (!state || state->binary == nullptr) continue;
        for (const ProbedDevice& d : state->binary->devices) {
          if (d.device.type == type && d.id == id && !d.device.arch.empty()) return d.device;
        }
      }
      return driver;
    };
  }
  // Never destroyed: the tool exits after its one command, and freeing a
  // large registry spec by spec costs about as much as building it (clang's
  // -disable-free, for the same reason). The contexts stay reachable from
  // here, so leak checkers do not count them.
  static auto* const contexts = new std::vector<std::unique_ptr<Context>>();
  Context& made = *contexts->emplace_back(std::make_unique<Context>(std::move(context_options)));
  *context = &made;
  return made;
}

DeviceFlag parse_device_flag(const std::string& text) {
  const size_t colon = text.find(':');
  if (colon != std::string::npos && colon + 1 < text.size() &&
      text.find_first_not_of("0123456789", colon + 1) == std::string::npos) {
    const auto type = parse_device_type(text.substr(0, colon));
    const std::string digits = text.substr(colon + 1);
    if (type && *type != DeviceType::cpu && digits.size() <= 6) {
      const auto id = static_cast<int32_t>(std::stoi(digits));
      return {device_of(*type, id), id};
    }
  }
  try {
    return {Device::parse(text), std::nullopt};
  } catch (const std::invalid_argument& e) {
    throw UsageError(fmt::format("--device {}: {} (or cuda:N / hip:N for device N)", text, e.what()));
  }
}

bool names_rows(const OpSchema& schema) {
  bool leading = false;
  for (const TensorArg& t : schema.tensors) {
    for (const ShapeToken& dim : t.shape) {
      if (dim.kind == ShapeToken::Kind::leading) leading = true;
      if (dim.kind != ShapeToken::Kind::leading && dim.symbol == "rows") return false;
    }
  }
  return leading;
}

DeviceChoice choose_device(const std::string& flag) {
  try {
    if (!flag.empty()) return {parse_device_flag(flag).device, "--device"};
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
    print_json(error_json(error.code_string(), for_command_line(error.message()), error.hints()));
  } else {
    std::fflush(stdout);
    std::cerr << fmt::format("error[{}]: {}\n", error.code_string(), for_command_line(error.message()));
    for (const auto& hint : error.hints()) std::cerr << "  hint: " << for_command_line(hint) << "\n";
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

Json plugin_report_json(const PluginReport& report) {
  Json p;
  p["name"] = report.name;
  p["backend"] = report.backend;
  p["manifest"] = report.manifest;
  p["library"] = report.library;
  p["status"] = report.ok ? "ok" : "error";
  p["state"] = plugin_state_name(report.state);
  if (!report.note.empty()) p["note"] = report.note;
  p["problems"] = problems_json(report.problems);
  p["loaded"] = report.loaded;
  if (report.loaded) {
    p["version"] = report.version;
    p["abi"] = report.abi;
    Json devices = Json::array();
    for (const auto& d : report.devices) devices.push_back({{"device", d.device.str()}, {"id", d.id}, {"name", d.name}});
    p["devices"] = devices;
  }
  return p;
}

}  // namespace kdispatch::cli
