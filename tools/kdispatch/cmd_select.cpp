// kdispatch select: which backend a call of OP would run, by the selection
// rules (README.md, Selection). Metadata only: no plugin library is opened.
#include <fmt/format.h>

#include <stdexcept>

#include "common.hpp"
#include "harness.hpp"
#include "kdispatch/dispatcher.hpp"

namespace kdispatch::cli {

namespace {

// The selection of a call of `op` in `dtype` at the schema's example sizes
// with `sizes` ("SYM=V", "rows=V") and `attrs` ("NAME=V") applied: dense
// tensors without data, on `device`.
Selection select_call(Context& ctx, const std::string& op, const std::string& backend, const Device& device,
                      Dtype dtype, const std::vector<std::string>& sizes, const std::vector<std::string>& attr_texts) {
  const OpSchema* schema = ctx.registry().schema(op);
  if (schema == nullptr) {
    ctx.choose({op, backend, device, dtype});  // KD-E001 with did-you-mean, or KD-E002
    throw CallError(ErrorCode::bad_arguments, fmt::format("op '{}' has no schema: its calls cannot be described", op));
  }
  harness::Shapes shapes = harness::example_shapes(*schema);
  std::vector<NamedAttr> attrs;
  std::vector<std::vector<int64_t>> dims;
  try {
    std::vector<std::string> overrides;
    for (const std::string& s : sizes) {
      overrides.push_back(s.starts_with("rows=") && names_rows(*schema) ? "*=" + s.substr(5) : s);
    }
    harness::apply_overrides(shapes, overrides, *schema);
    harness::apply_attr_overrides(attrs, attr_texts, *schema, /*skip_unknown=*/false);
    for (const TensorArg& arg : schema->tensors) dims.push_back(harness::tensor_shape(arg, shapes));
  } catch (const std::invalid_argument& e) {
    // The harness words a size as `run` takes it (--shape).
    std::string what = e.what();
    if (what.starts_with("--shape")) what.replace(0, 7, "--size");
    throw UsageError(what);
  }
  std::vector<DLTensor> tensors(schema->tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::vector<Dtype> alternatives = schema->tensor_dtypes(schema->tensors[i], dtype);
    DLTensor& t = tensors[i];
    t.device = {static_cast<DLDeviceType>(to_dlpack_device_type(device.type)), 0};
    t.ndim = static_cast<int32_t>(dims[i].size());
    t.dtype = to_dlpack(alternatives.empty() ? dtype : alternatives.front());
    t.shape = dims[i].data();
  }
  Dispatcher dispatcher(ctx);
  return dispatcher.op(op, backend).select(device, 0, tensors, attrs);
}

}  // namespace

Runner add_select(CLI::App& app) {
  struct Options {
    CommonOptions common;
    std::string op;
    std::string backend;
    std::string device;
    std::string dtype;
    std::vector<std::string> sizes;
    std::vector<std::string> attrs;
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
  cmd->add_option("--size", options->sizes,
                  "A shape symbol's value in the call, e.g. H=4096, or rows=64 for the product of the leading dims "
                  "(repeatable; needs --dtype): kernel constraints and the tuning file's choices are then evaluated "
                  "for that call; other symbols take the schema's example sizes")
      ->type_name("SYM=V");
  cmd->add_option("--attr", options->attrs,
                  "An attribute of the call, e.g. renormalize=true (repeatable; needs --dtype), as with --size")
      ->type_name("NAME=V");
  add_common_options(*cmd, options->common);
  cmd->footer("Example: kdispatch select layernorm.rmsnorm --device cuda:9.0 --backend cuda\n"
              "         kdispatch select activation.silu_and_mul --dtype bfloat16 --size rows=64");

  return [options]() -> int {
    const DeviceChoice device = choose_device(options->device);
    std::optional<Dtype> dtype;
    if (!options->dtype.empty()) {
      dtype = parse_dtype(options->dtype);
      if (!dtype) throw UsageError(fmt::format("unknown dtype '{}'", options->dtype));
    }
    const bool call = !options->sizes.empty() || !options->attrs.empty();
    if (call && !dtype) throw UsageError("--size and --attr describe a call: give its dtype too (--dtype)");
    Context& ctx = make_context(options->common);
    try {
      const Selection selection =
          call ? select_call(ctx, options->op, options->backend, device.device, *dtype, options->sizes, options->attrs)
               : ctx.choose({options->op, options->backend, device.device, dtype});
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
        // Without --size/--attr the call's sizes and attributes are
        // unknown: a call for which a constraint is false selects among
        // the other backends.
        for (const std::string& c : call ? std::vector<std::string>{} : spec.constraints) {
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
