// kdispatch list: ops x backends and whether each is usable on a device.
// Metadata only: no plugin library is opened.
#include <fmt/format.h>

#include <algorithm>

#include "common.hpp"

namespace kdispatch::cli {

Runner add_list(CLI::App& app) {
  struct Options {
    CommonOptions common;
    std::string device;
  };
  auto options = std::make_shared<Options>();
  CLI::App* cmd = app.add_subcommand("list", "List ops and their backends, and which are usable on a device");
  cmd->add_option("--device", options->device,
                  "cpu, cuda, cuda:9.0, cuda:1 (device 1), hip, hip:gfx90a, hip:0 (default: KDISPATCH_DEVICE, else the first GPU, else cpu)")
      ->type_name("D");
  add_common_options(*cmd, options->common);
  cmd->footer("Example: kdispatch list --device cuda:9.0");

  return [options]() -> int {
    const DeviceChoice device = choose_device(options->device);
    Context& ctx = make_context(options->common);
    const Selector& sel = ctx.selector();
    const auto& plugins = ctx.discovery().plugins;

    if (options->common.json) {
      Json doc;
      doc["device"] = device.device.str();
      doc["plugins"] = Json::array();
      for (const PluginReport& r : doctor_report(ctx, /*open_plugins=*/false).plugins) {
        doc["plugins"].push_back(plugin_report_json(r));
      }
      doc["ops"] = Json::array();
      for (const auto& op : ctx.registry().ops()) {
        Json backends = Json::array();
        for (const auto& e : sel.eligibility(op, device.device, std::nullopt)) {
          backends.push_back({{"backend", e.spec->backend},
                              {"plugin", e.spec->plugin},
                              {"role", e.spec->is_reference() ? "reference" : "backend"},
                              {"opt_in", e.spec->opt_in},
                              {"constraints", e.spec->constraints},
                              {"eligible", e.eligible},
                              {"reason", e.eligible ? Json(nullptr) : Json(e.reason)}});
        }
        doc["ops"].push_back({{"op", op}, {"backends", backends}});
      }
      print_json(doc);
      return kOk;
    }

    fmt::print("device: {} ({})\n\n", device.device.str(), device.source);
    fmt::print("plugins:\n");
    if (plugins.empty()) fmt::print("  (none found; try kdispatch doctor)\n");
    // A manifest that is invalid still shows the names that validated; "?"
    // stands for one that did not.
    size_t name_width = 10;
    size_t plugin_backend_width = 10;
    for (const auto& rec : plugins) {
      name_width = std::max(name_width, rec.name.size());
      plugin_backend_width = std::max(plugin_backend_width, rec.backend.size());
    }
    if (!plugins.empty()) {
      fmt::print("  {:<{}} {:<{}} {:<9} {}\n", "NAME", name_width, "BACKEND", plugin_backend_width, "STATE",
                 "MANIFEST");
    }
    const size_t indent = name_width + plugin_backend_width + 1;
    for (const auto& rec : plugins) {
      fmt::print("  {:<{}} {:<{}} {:<9} {}\n", rec.name.empty() ? "?" : rec.name, name_width,
                 rec.backend.empty() ? "?" : rec.backend, plugin_backend_width, plugin_state_name(rec.state),
                 rec.manifest_path);
      if (!rec.note.empty()) fmt::print("  {:<{}} {}\n", "", indent, rec.note);
      for (const auto& p : rec.problems) {
        fmt::print("  {:<{}} {}: {}\n", "", indent, code_string(p.code), p.message);
      }
    }
    const auto ops = ctx.registry().ops();
    size_t width = 2;
    size_t backend_width = 10;
    for (const auto& op : ops) {
      width = std::max(width, op.size());
      for (const auto& e : sel.eligibility(op, device.device, std::nullopt)) {
        backend_width = std::max(backend_width, e.spec->backend.size());
      }
    }
    fmt::print("\n{:<{}}  {:<{}} {:<7} {}\n", "OP", width, "BACKEND", backend_width, "USABLE", "WHY NOT");
    for (const auto& op : ops) {
      bool first = true;
      for (const auto& e : sel.eligibility(op, device.device, std::nullopt)) {
        std::string note = !e.eligible              ? e.reason
                           : e.spec->is_reference() ? kReferenceOnlyWhenAsked
                           : e.spec->opt_in         ? kOptInOnlyWhenAsked
                                                    : "";
        // A kernel with constraints is usable for the calls that meet them.
        if (e.eligible && !e.spec->constraints.empty()) {
          note += fmt::format("{}only for calls where {}", note.empty() ? "" : "; ",
                              fmt::join(e.spec->constraints, ", and "));
        }
        note = for_command_line(note);
        fmt::print("{:<{}}  {:<{}} {:<7} {}\n", first ? op : "", width, e.spec->backend, backend_width,
                   e.eligible ? "yes" : "no", note);
        first = false;
      }
    }
    return kOk;
  };
}

}  // namespace kdispatch::cli
