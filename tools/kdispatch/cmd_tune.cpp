// kdispatch tune: time an op's backends on the cpu or on a GPU over a grid
// of sizes, each checked against the reference first, and write the tuning
// file the selector follows (docs/tuning.md). On a GPU the backend's plugin
// times the calls (kd_memory_api.time_calls): the core links no GPU runtime.
#include <fmt/format.h>

#include <chrono>
#include <fstream>
#include <map>
#include <set>

#include "kdispatch/tuning.hpp"
#include "runner.hpp"

namespace kdispatch::cli {

namespace {

using Clock = std::chrono::steady_clock;

struct SizeList {
  std::string symbol;
  std::vector<int64_t> values;
};

SizeList parse_size(const std::string& text) {
  const auto eq = text.find('=');
  if (eq == std::string::npos || eq == 0 || eq + 1 == text.size()) {
    throw UsageError(fmt::format("--size '{}': expected SYMBOL=V[,V,...], e.g. H=64,4096", text));
  }
  SizeList out{text.substr(0, eq), {}};
  std::string rest = text.substr(eq + 1);
  size_t start = 0;
  while (start <= rest.size()) {
    const size_t comma = std::min(rest.find(',', start), rest.size());
    const std::string item = rest.substr(start, comma - start);
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || errno != 0 || v < 0) {
      throw UsageError(fmt::format("--size '{}': '{}' is not a whole number", text, item));
    }
    out.values.push_back(v);
    start = comma + 1;
  }
  return out;
}

// The schema's shape symbols that a "when" can read, "rows" included.
std::set<std::string> symbols_of(const OpSchema& schema) {
  std::set<std::string> out;
  for (const TensorArg& t : schema.tensors) {
    for (const ShapeToken& dim : t.shape) {
      if (dim.kind == ShapeToken::Kind::symbol) out.insert(dim.symbol);
    }
  }
  if (names_rows(schema)) out.insert("rows");
  return out;
}

// The values of the schema's named symbols in one traced call's shapes:
// patterns are matched from their last dim, after any leading "*".
std::map<std::string, int64_t> symbols_of_call(const OpSchema& schema,
                                               const std::vector<std::vector<int64_t>>& shapes) {
  std::map<std::string, int64_t> out;
  for (size_t i = 0; i < schema.tensors.size() && i < shapes.size(); ++i) {
    const std::vector<ShapeToken>& pattern = schema.tensors[i].shape;
    const std::vector<int64_t>& dims = shapes[i];
    // "rows": the leading dims of the first tensor that has them.
    if (!pattern.empty() && pattern.front().kind == ShapeToken::Kind::leading && names_rows(schema) &&
        !out.contains("rows") && dims.size() + 1 >= pattern.size()) {
      int64_t rows = 1;
      for (size_t d = 0; d + pattern.size() - 1 < dims.size(); ++d) rows *= dims[d];
      out.emplace("rows", rows);
    }
    for (size_t k = 0; k < pattern.size(); ++k) {
      const ShapeToken& t = pattern[pattern.size() - 1 - k];
      if (t.kind == ShapeToken::Kind::leading || k >= dims.size()) break;
      const int64_t dim = dims[dims.size() - 1 - k];
      if (dim < 0) continue;
      if (t.kind == ShapeToken::Kind::symbol) {
        out.emplace(t.symbol, dim);
      } else if (t.kind == ShapeToken::Kind::multiple && t.value > 0 && dim % t.value == 0) {
        out.emplace(t.symbol, dim / t.value);
      }
    }
  }
  return out;
}

// Every combination of the lists, the first list varying slowest.
std::vector<std::map<std::string, int64_t>> grid(const std::vector<SizeList>& lists) {
  std::vector<std::map<std::string, int64_t>> out{{}};
  for (const SizeList& l : lists) {
    std::vector<std::map<std::string, int64_t>> next;
    for (const auto& partial : out) {
      for (int64_t v : l.values) {
        auto m = partial;
        m[l.symbol] = v;
        next.push_back(std::move(m));
      }
    }
    out = std::move(next);
  }
  return out;
}

std::string sizes_text(const std::map<std::string, int64_t>& sizes) {
  std::vector<std::string> parts;
  for (const auto& [k, v] : sizes) parts.push_back(fmt::format("{}={}", k, v));
  return parts.empty() ? std::string("(example)") : fmt::format("{}", fmt::join(parts, " "));
}

std::string default_out(DeviceType type) {
  const char* home = std::getenv("XDG_CONFIG_HOME");
  std::string dir = home != nullptr && *home != '\0' ? home : "";
  if (dir.empty()) {
    const char* h = std::getenv("HOME");
    dir = fmt::format("{}/.config", h != nullptr ? h : ".");
  }
  return fmt::format("{}/kdispatch/tuning-{}.json", dir, device_type_name(type));
}

// Throws KD-E003 when no backend of `op` (the reference aside) has a plugin
// that reports a device matching `flag` here: nothing could be timed.
void require_device(Context& ctx, const std::string& op, const DeviceFlag& flag, const std::string& text) {
  std::vector<std::string> backends;
  std::vector<std::string> hints;
  for (const KernelSpec* spec : ctx.registry().get(op)) {
    if (spec->is_reference()) continue;
    backends.push_back(spec->backend);
    if (spec->is_runtime()) continue;
    try {
      for (const ProbedDevice& d : ctx.load_plugin(spec->plugin).devices) {
        if (d.device.type != flag.device.type) continue;
        if (flag.id ? *flag.id == d.id : flag.device.arch.empty() || flag.device.arch == d.device.arch) return;
      }
    } catch (const Error& e) {
      hints.push_back(fmt::format("the {} plugin did not load: [{}] {}", spec->plugin, e.code_string(), e.message()));
    }
  }
  hints.push_back(
      fmt::format("`kdispatch doctor` lists the devices each plugin reports; without a {} device, tune "
                  "--device cpu times the CPU backends",
                  device_type_name(flag.device.type)));
  throw SelectionError(ErrorCode::no_usable_backend,
                       fmt::format("op '{}' has no backend usable on device '{}': no plugin of its backends ({}) "
                                   "reports a {} device here, so nothing can be timed",
                                   op, text, fmt::join(backends, ", "), text),
                       std::move(hints));
}

}  // namespace

Runner add_tune(CLI::App& app) {
  struct Options {
    CommonOptions common;
    std::vector<std::string> ops;
    std::string device = "cpu";
    std::string dtype;
    std::vector<std::string> sizes;
    std::string from_trace;
    double budget = 60;
    std::string out;
  };
  auto options = std::make_shared<Options>();
  CLI::App* cmd = app.add_subcommand(
      "tune",
      "Time the backends of ops on the cpu or a GPU over a grid of sizes and write the tuning file that selection "
      "follows");
  cmd->add_option("op", options->ops, "Op ids, e.g. layernorm.rmsnorm")->type_name("OP...");
  cmd->add_option("--device", options->device,
                  "cpu (default), cuda or hip (device 0), cuda:N or hip:N: the device whose backends are timed")
      ->type_name("D");
  cmd->add_option("--dtype", options->dtype, "Only this dtype (default: every dtype of each backend)")->type_name("T");
  cmd->add_option("--size", options->sizes,
                  "Values of a shape symbol of the op's schema, e.g. H=64,4096, or rows=1,64 for the leading dims "
                  "(repeatable: the cross product is timed; other symbols take the schema's example sizes)")
      ->type_name("SYM=V[,V,...]");
  cmd->add_option("--from-trace", options->from_trace,
                  "Take the ops, dtypes and shapes from a KDISPATCH_TRACE file (its calls on the --device kind; --size "
                  "replaces the "
                  "shapes)")
      ->type_name("FILE");
  cmd->add_option("--budget", options->budget,
                  "Seconds to spend in all (default 60); stops early with what was "
                  "measured, saying so")
      ->type_name("SECONDS");
  cmd->add_option("--out", options->out,
                  "The tuning file to write (default: $XDG_CONFIG_HOME/kdispatch/tuning-<cpu|cuda|hip>.json)")
      ->type_name("FILE");
  add_common_options(*cmd, options->common);
  cmd->footer(
      "For each shape, every backend registered for the op on the device (opt-in ones too, never the\n"
      "reference) is first checked against the op's reference kernel: one whose result does not match is\n"
      "excluded and reported. The others are timed with their inputs rotated over copies that exceed the\n"
      "last-level cache: on the cpu as `kdispatch bench` times (median of batches); on a GPU by the backend's\n"
      "plugin, median per call under CUDA/HIP-graph replay (which decides) and back-to-back launches (the\n"
      "eager column). A GPU backend whose plugin cannot time calls (an ABI 1.0 plugin) is listed as not\n"
      "timed. The fastest per shape become the file's choices (docs/tuning.md); point\n"
      "KDISPATCH_TUNING_FILE at it.\n"
      "Example: kdispatch tune layernorm.rmsnorm --dtype bfloat16 --size H=64,4096 --out tuning.json\n"
      "         kdispatch tune activation.silu_and_mul --device cuda --dtype bfloat16 --size rows=1,64,32768");

  return [options]() -> int {
    const DeviceFlag device = parse_device_flag(options->device);
    const DeviceType device_type = device.device.type;
    if (device_type == DeviceType::cpu && options->device != "cpu") {
      throw UsageError(fmt::format("tune --device {}: expected cpu, cuda, hip, cuda:N or hip:N", options->device));
    }
    if (!(options->budget > 0)) throw UsageError("--budget: expected a positive number of seconds");
    std::set<std::pair<std::string, std::string>> from_trace;  // (op, dtype)
    // op -> the tensor shapes of its traced calls, each distinct once
    std::map<std::string, std::set<std::vector<std::vector<int64_t>>>> traced_shapes;
    if (!options->from_trace.empty()) {
      std::ifstream in(options->from_trace);
      if (!in) throw UsageError(fmt::format("--from-trace {}: cannot be read", options->from_trace));
      std::string line;
      for (size_t n = 1; std::getline(in, line) && n <= 1000000; ++n) {
        const Json entry = Json::parse(line, nullptr, false);
        if (entry.is_discarded() || !entry.is_object() || !entry.contains("op") || !entry["op"].is_string()) {
          throw UsageError(fmt::format("--from-trace {}: line {} is not a trace line", options->from_trace, n));
        }
        const std::string traced_device = entry.value("device", "");
        if (!traced_device.starts_with(device_type_name(device_type))) continue;
        std::string dtype;
        if (entry.contains("dtypes") && entry["dtypes"].is_array() && !entry["dtypes"].empty() &&
            entry["dtypes"][0].is_string()) {
          dtype = entry["dtypes"][0].get<std::string>();
        }
        from_trace.insert({entry["op"].get<std::string>(), dtype});
        std::vector<std::vector<int64_t>> shapes;
        if (entry.contains("shapes") && entry["shapes"].is_array()) {
          for (const Json& shape : entry["shapes"]) {
            std::vector<int64_t> dims;
            if (shape.is_array()) {
              for (const Json& d : shape) dims.push_back(d.is_number_integer() ? d.get<int64_t>() : -1);
            }
            shapes.push_back(std::move(dims));
          }
        }
        if (traced_shapes[entry["op"].get<std::string>()].size() < 64) {
          traced_shapes[entry["op"].get<std::string>()].insert(std::move(shapes));
        }
      }
      for (const auto& [op, dtype] : from_trace) {
        if (std::find(options->ops.begin(), options->ops.end(), op) == options->ops.end()) options->ops.push_back(op);
      }
    }
    if (options->ops.empty()) throw UsageError("tune takes one or more ops (or --from-trace FILE)");
    std::vector<SizeList> lists;
    for (const std::string& s : options->sizes) lists.push_back(parse_size(s));

    Context& ctx = make_context(options->common, /*probed_arch=*/device_type != DeviceType::cpu);
    try {
      const auto start = Clock::now();
      const auto elapsed = [&] { return std::chrono::duration<double>(Clock::now() - start).count(); };
      std::vector<TuningMeasurement> measurements;
      struct Row {
        std::string op, dtype, sizes;
        std::map<std::string, double> us;
        std::map<std::string, double> eager_us;  // a GPU's: back-to-back launches
      };
      std::vector<Row> rows;
      std::vector<std::string> excluded;
      std::vector<std::string> not_timed;  // backends that could not be timed on the device, and why
      const bool gpu = device_type != DeviceType::cpu;
      std::set<std::string> backends;
      bool stopped = false;
      // The shapes of every op first, to share the budget out.
      std::vector<std::pair<std::string, std::map<std::string, int64_t>>> work;
      for (const std::string& op : options->ops) {
        const OpSchema* schema = ctx.registry().schema(op);
        if (schema == nullptr) {
          ctx.select({op, {}, Device::host_cpu(), std::nullopt});  // KD-E001 with did-you-mean
          throw CallError(ErrorCode::bad_arguments, fmt::format("op '{}' has no schema: it cannot be called", op));
        }
        if (gpu) require_device(ctx, op, device, options->device);
        const std::set<std::string> symbols = symbols_of(*schema);
        for (const SizeList& l : lists) {
          if (!symbols.contains(l.symbol)) {
            throw UsageError(
                fmt::format("--size {}: op '{}' has no shape symbol '{}' a choice can read (its "
                            "symbols: {})",
                            l.symbol, op, l.symbol, fmt::join(symbols, ", ")));
          }
        }
        // Without --size, each distinct shape of the trace, its symbols
        // read back through the schema's patterns.
        const auto traced = traced_shapes.find(op);
        if (lists.empty() && traced != traced_shapes.end()) {
          std::set<std::map<std::string, int64_t>> seen;
          for (const auto& shapes : traced->second) {
            std::map<std::string, int64_t> sizes = symbols_of_call(*schema, shapes);
            if (seen.insert(sizes).second) work.emplace_back(op, std::move(sizes));
          }
          continue;
        }
        for (auto& shape : grid(lists)) work.emplace_back(op, std::move(shape));
      }
      const bool progress = isatty(2) != 0;
      for (size_t w = 0; w < work.size(); ++w) {
        const auto& [op, shape] = work[w];
        if (elapsed() >= options->budget) {
          stopped = true;
          break;
        }
        if (progress && elapsed() > 1.0) {
          fmt::print(stderr, "  tune: {} {} ({} of {}, {:.0f} s) ...\r", op, sizes_text(shape), w + 1, work.size(),
                     elapsed());
          std::fflush(stderr);
        }
        SweepOptions sweep;
        sweep.ops = {op};
        // "cuda" alone is device 0: the file holds one device's times.
        sweep.device = gpu && !device.id && device.device.arch.empty()
                           ? fmt::format("{}:0", device_type_name(device_type))
                           : options->device;
        sweep.device_timing = gpu;
        sweep.dtype = options->dtype;
        for (const auto& [k, v] : shape) {
          const bool leading = k == "rows" && names_rows(*ctx.registry().schema(op));
          sweep.shape_overrides.push_back(fmt::format("{}={}", leading ? "*" : k, v));
        }
        sweep.iters = 5;
        // Each shape's backends share what is left of the budget.
        const double share = (options->budget - elapsed()) / static_cast<double>(work.size() - w);
        sweep.min_seconds = std::clamp(share / 8, 0.01, 0.3);
        sweep.rotate_inputs = true;
        sweep.check = true;
        sweep.verdict_source = "kdispatch tune";
        sweep.allow_unchecked = true;
        sweep.progress = false;
        sweep.json = true;
        const Sweep result = run_sweep(ctx, sweep);
        std::map<std::string, TuningMeasurement> by_dtype;
        std::map<std::string, std::map<std::string, double>> eager_by_dtype;
        for (const SweepSkip& skip : result.skipped) {
          if (!skip.cannot_time) continue;
          const std::string line = fmt::format("{} {}: {}", op, skip.backend, skip.reason);
          if (std::find(not_timed.begin(), not_timed.end(), line) == not_timed.end()) not_timed.push_back(line);
        }
        for (const SweepResult& r : result.results) {
          if (!options->from_trace.empty() && !from_trace.contains({op, r.dtype}) && !from_trace.contains({op, ""})) {
            continue;
          }
          if (!r.ok) {
            excluded.push_back(fmt::format("{} {} {} {}: {}", op, r.backend, r.dtype, sizes_text(shape), r.error));
            continue;
          }
          TuningMeasurement& m = by_dtype[r.dtype];
          m.op = op;
          m.dtype = parse_dtype(r.dtype).value_or(Dtype::float32);
          m.sizes = shape;
          m.us[r.backend] = r.us_per_call;
          if (r.device_timed) eager_by_dtype[r.dtype][r.backend] = r.eager_us;
          backends.insert(r.backend);
        }
        for (auto& [dtype, m] : by_dtype) {
          rows.push_back({op, dtype, sizes_text(shape), m.us, eager_by_dtype[dtype]});
          measurements.push_back(std::move(m));
        }
      }
      if (progress) fmt::print(stderr, "{:<78}\r", "");
      TuningFile file;
      file.choices = build_tuning_choices(measurements);
      std::set<std::string> named;
      for (const TuningChoice& c : file.choices) named.insert(c.backend);
      file.key = tuning_key(ctx, device_type, std::vector<std::string>(named.begin(), named.end()));
      file.path = options->out.empty() ? default_out(device_type) : options->out;
      std::error_code ec;
      if (const auto parent = std::filesystem::path(file.path).parent_path(); !parent.empty()) {
        std::filesystem::create_directories(parent, ec);
      }
      {
        std::ofstream out(file.path, std::ios::binary | std::ios::trunc);
        out << tuning_file_text(file);
        if (!out) throw UsageError(fmt::format("--out {}: cannot be written", file.path));
      }
      if (options->common.json) {
        Json table = Json::array();
        for (const Row& r : rows) {
          Json us = Json::object();
          for (const auto& [b, v] : r.us) us[b] = v;
          Json row{{"op", r.op}, {"dtype", r.dtype}, {"sizes", r.sizes}, {"us", us}};
          if (gpu) {
            Json eager = Json::object();
            for (const auto& [b, v] : r.eager_us) eager[b] = v;
            row["eager_us"] = eager;
          }
          table.push_back(std::move(row));
        }
        print_json(Json{{"device", options->device},
                        {"timing", gpu ? "graph replay (us); back-to-back launches (eager_us)" : "host clock"},
                        {"measurements", table},
                        {"excluded", excluded},
                        {"not_timed", not_timed},
                        {"stopped_early", stopped},
                        {"out", file.path},
                        {"choices", Json::parse(tuning_file_text(file))["choices"]}});
      } else {
        fmt::print("{:<24} {:<9} {:<20}", "OP", "DTYPE", "SIZES");
        for (const std::string& b : backends) {
          fmt::print(" {:>12}", b + (gpu ? " graph" : " us"));
          if (gpu) fmt::print(" {:>12}", b + " eager");
        }
        fmt::print("  CHOICE\n");
        for (const Row& r : rows) {
          fmt::print("{:<24} {:<9} {:<20}", r.op, r.dtype, r.sizes);
          std::string best;
          for (const std::string& b : backends) {
            const auto it = r.us.find(b);
            fmt::print(" {:>12}", it == r.us.end() ? std::string("-") : fmt::format("{:.2f}", it->second));
            if (gpu) {
              const auto e = r.eager_us.find(b);
              fmt::print(" {:>12}", e == r.eager_us.end() ? std::string("-") : fmt::format("{:.2f}", e->second));
            }
            if (it != r.us.end() && (best.empty() || it->second < r.us.at(best))) best = b;
          }
          fmt::print("  {}\n", best);
        }
        if (gpu) fmt::print("us per call: graph = CUDA/HIP-graph replay (decides), eager = back-to-back launches\n");
        for (const std::string& e : excluded) fmt::print("excluded (result does not match the reference): {}\n", e);
        for (const std::string& n : not_timed) fmt::print("not timed: {}\n", n);
        if (stopped) {
          fmt::print("stopped early: the budget of {} s was spent; the file holds what was measured\n",
                     options->budget);
        }
        fmt::print("wrote {} ({} choices); use it with KDISPATCH_TUNING_FILE={}\n", file.path, file.choices.size(),
                   file.path);
      }
      if (!excluded.empty()) return kKernelFailure;
      // Nothing measured because no backend could be timed: a dispatch
      // failure, not an empty success.
      return measurements.empty() && !not_timed.empty() ? kDispatchError : kOk;
    } catch (const Error& e) {
      return report_error(e, options->common.json);
    }
  };
}

}  // namespace kdispatch::cli
