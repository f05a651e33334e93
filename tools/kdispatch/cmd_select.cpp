// kdispatch select: which backend a call of OP would run, by the selection
// rules (README.md, Selection). Metadata only: no plugin library is opened.
#include <fmt/format.h>

#include "common.hpp"

namespace kdispatch::cli {

Runner add_select(CLI::App& app) {
  struct Options {
    CommonOptions common;
    std::string op;
    std::string backend;
    std::string device;
    std::string dtype;
  };
  auto options = std::make_shared<Options>();
  CLI::App* cmd = app.add_subcommand("select", "Show which backend runs OP on a device, or why none can");
  cmd->add_option("op", options->op, "Op id, e.g. layernorm.rmsnorm")->required()->type_name("OP");
  cmd->add_option("--backend", options->backend, "Require this backend (backend=... in the API)")
      ->type_name("B");
  cmd->add_option("--device", options->device,
                  "cpu, cuda, cuda:9.0, cuda:1 (device 1), hip, hip:gfx90a, hip:0 (default: KDISPATCH_DEVICE, else the first GPU, else cpu)")
      ->type_name("D");
  cmd->add_option("--dtype", options->dtype, "Only backends supporting this dtype, e.g. bfloat16")
      ->type_name("T");
  add_common_options(*cmd, options->common);
  cmd->footer("Example: kdispatch select layernorm.rmsnorm --device cuda:9.0 --backend cuda");

  return [options]() -> int {
    const DeviceChoice device = choose_device(options->device);
    std::optional<Dtype> dtype;
    if (!options->dtype.empty()) {
      dtype = parse_dtype(options->dtype);
      if (!dtype) throw UsageError(fmt::format("unknown dtype '{}'", options->dtype));
    }
    Context& ctx = make_context(options->common);
    try {
      const Selection selection = ctx.choose({options->op, options->backend, device.device, dtype});
      const KernelSpec& spec = *selection.spec;
      std::vector<std::string> ranked;
      for (const KernelSpec* s : selection.ranked) ranked.push_back(s->backend);
      if (options->common.json) {
        Json doc{{"op", spec.op},
                 {"backend", spec.backend},
                 {"plugin", spec.plugin},
                 {"symbol", spec.symbol},
                 {"device", device.device.str()},
                 {"rule", rule_name(selection.rule)},
                 {"ranked", ranked}};
        if (!spec.constraints.empty()) doc["constraints"] = spec.constraints;
        if (!selection.conditional.empty()) {
          Json conditional = Json::array();
          for (const ConditionalChoice& c : selection.conditional) {
            conditional.push_back({{"dtype", dtype_name(c.dtype)}, {"when", c.when}, {"backend", c.backend}});
          }
          doc["conditional"] = conditional;
        }
        print_json(doc);
      } else {
        fmt::print("{} on {}: backend '{}' (plugin '{}', symbol '{}', {})\n", spec.op, device.device.str(),
                   spec.backend, spec.plugin, spec.symbol, spec.manifest);
        fmt::print("  decided by: {}; ranked: {}\n", rule_name(selection.rule), fmt::join(ranked, ", "));
        // The call's sizes and attributes are unknown here: a call for
        // which a constraint is false selects among the other backends.
        for (const std::string& c : spec.constraints) {
          fmt::print("  only for calls where {}\n", for_command_line(c));
        }
        // Tuned choices that depend on the call's sizes: a call for which
        // one holds runs its backend instead.
        for (const ConditionalChoice& c : selection.conditional) {
          fmt::print("  tuned: {} calls where {} run '{}'\n", dtype_name(c.dtype), for_command_line(c.when), c.backend);
        }
      }
      return kOk;
    } catch (const Error& e) {
      return report_error(e, options->common.json);
    }
  };
}

}  // namespace kdispatch::cli
