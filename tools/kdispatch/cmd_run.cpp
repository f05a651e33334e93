// kdispatch run: call ops on every usable backend and device with inputs
// generated from their schemas, check each result, report time per call.
#include <fmt/format.h>

#include <set>

#include "runner.hpp"

namespace kdispatch::cli {

namespace {

struct Counts {
  size_t passed = 0, failed = 0, unchecked = 0, skipped = 0, not_run = 0;
};

Counts count(const Sweep& sweep) {
  Counts c;
  for (const auto& r : sweep.results) {
    const std::string_view status = result_status(r);
    (status == "passed" ? c.passed : status == "failed" ? c.failed : c.unchecked)++;
  }
  c.skipped = sweep.skipped.size();
  c.not_run = sweep.not_run.size();
  return c;
}

Json results_json(const Sweep& sweep) {
  Json results = Json::array();
  for (const auto& r : sweep.results) {
    results.push_back({{"op", r.op},
                       {"status", result_status(r)},
                       {"backend", r.backend},
                       {"device", r.device},
                       {"dtype", r.dtype},
                       {"shapes", r.shapes},
                       {"ok", r.ok},
                       {"checked", r.checked},
                       {"checked_against", r.checked_against},
                       {"error", r.error.empty() ? Json(nullptr) : Json(r.error)},
                       {"max_abs_err", r.max_abs_err},
                       {"max_rel_err", r.max_rel_err},
                       {"max_ulps", r.max_ulps},
                       {"mean_ulps", r.mean_ulps},
                       {"us_per_call", r.us_per_call},
                       {"gb_per_s", r.gb_per_s},
                       {"input_sets", r.input_sets},
                       {"rotated_bytes", r.rotated_bytes},
                       {"rotation_capped", r.rotation_capped}});
  }
  Json skipped = Json::array();
  for (const auto& s : sweep.skipped) skipped.push_back({{"op", s.op}, {"backend", s.backend}, {"reason", s.reason}});
  Json not_run = Json::array();
  for (const auto& g : sweep.not_run) not_run.push_back({{"op", g.op}, {"backend", g.backend}, {"reason", g.reason}});
  Json caches = Json::object();
  for (const auto& [device, cache] : sweep.caches) caches[device] = {{"bytes", cache.bytes}, {"source", cache.source}};
  const Counts c = count(sweep);
  return Json{{"results", results},
              {"skipped", skipped},
              {"not_run", not_run},
              {"caches", caches},
              {"summary",
               {{"passed", c.passed},
                {"failed", c.failed},
                {"unchecked", c.unchecked},
                {"skipped", c.skipped},
                {"not_run", c.not_run}}},
              {"exit_code", sweep.exit_code}};
}

// --iters' check: an error message, or empty.
std::string at_least_one(const std::string& text) {
  const bool digits = !text.empty() && text.find_first_not_of("0123456789") == std::string::npos;
  const bool nonzero = text.find_first_not_of('0') != std::string::npos;
  return digits && nonzero ? std::string() : fmt::format("'{}' is not a whole number of at least 1", text);
}

}  // namespace

void print_sweep(const Sweep& sweep, bool bench) {
  size_t width = 2;
  size_t backend_width = 9;
  for (const auto& r : sweep.results) {
    width = std::max(width, r.op.size());
    backend_width = std::max(backend_width, r.backend.size());
  }
  fmt::print("{:<{}}  {:<{}} {:<7} {:<9} {:<28} {:<6} {:>9} {:>9} {:>9} {:>10} {:>8}{}\n", "OP", width, "BACKEND",
             backend_width, "DEVICE", "DTYPE", "SHAPES", "CHECK", "MAX_ABS", "MAX_ULPS", "MEAN_ULPS", "US/CALL", "GB/S",
             bench ? fmt::format(" {:>5}", "SETS") : "");
  for (const auto& r : sweep.results) {
    const std::string_view status = result_status(r);
    const std::string_view check = status == "passed" ? "ok" : status == "failed" ? "FAIL" : "-";
    fmt::print("{:<{}}  {:<{}} {:<7} {:<9} {:<28} {:<6} {:>9.2e} {:>9.3g} {:>9.3g} {:>10.2f} {:>8.2f}{}\n", r.op,
               width, r.backend, backend_width, r.device, r.dtype, r.shapes, check, r.max_abs_err, r.max_ulps,
               r.mean_ulps, r.us_per_call, r.gb_per_s,
               bench ? fmt::format(" {:>5}", fmt::format("{}{}", r.input_sets, r.rotation_capped ? "*" : "")) : "");
    if (!r.ok || !r.error.empty()) fmt::print("{:<{}}  -> {}\n", "", width, r.error);
  }
  if (bench && !sweep.caches.empty()) {
    fmt::print("\ntiming: the calls rotate among SETS copies of their inputs (outputs shared), the fewest whose\n"
               "inputs and outputs take 3x the device's last-level cache (at most 64), so that inputs come from\n"
               "memory as in a model; last-level cache:\n");
    for (const auto& [device, cache] : sweep.caches) {
      fmt::print("  {}: {:.1f} MiB, {}\n", device, cache.bytes / (1024.0 * 1024.0), cache.source);
    }
    for (const auto& r : sweep.results) {
      if (!r.rotation_capped) continue;
      fmt::print("* {} {} {} at {}: capped at {} sets, which with the outputs take {:.1f} MiB, under 3x the cache: "
                 "its calls may read from cache\n",
                 r.op, r.backend, r.dtype, r.shapes, r.input_sets, r.rotated_bytes / (1024.0 * 1024.0));
    }
  }
  for (const auto& s : sweep.skipped) fmt::print("skipped: {} (backend {}): {}\n", s.op, s.backend, s.reason);
  std::set<std::string> unchecked_ops;
  for (const auto& r : sweep.results) {
    if (result_status(r) == "unchecked") unchecked_ops.insert(fmt::format("{}: {}", r.op, r.checked_against));
  }
  for (const auto& u : unchecked_ops) fmt::print("unchecked: {}\n", u);
  for (const auto& g : sweep.not_run) {
    fmt::print("not run: {}{}: {}\n", g.op, g.backend == "-" ? "" : fmt::format(" (backend {})", g.backend), g.reason);
  }
  const Counts c = count(sweep);
  const std::string_view tool = bench ? "bench" : "run";
  fmt::print("\n{}: {} passed, {} failed, {} unchecked, {} skipped, {} not run\n", tool, c.passed, c.failed,
             c.unchecked, c.skipped, c.not_run);
  if (sweep.exit_code == kUnchecked) {
    std::vector<std::string> what;
    if (c.unchecked > 0 && !sweep.unchecked_allowed) what.push_back(fmt::format("{} unchecked", c.unchecked));
    if (c.not_run > 0) what.push_back(fmt::format("{} not run", c.not_run));
    fmt::print("{}: exit {}: nothing failed, but not everything asked for was checked: {} (above){}\n", tool,
               static_cast<int>(kUnchecked), fmt::join(what, ", "),
               c.unchecked > 0 && !sweep.unchecked_allowed ? "; --allow-unchecked accepts unchecked results" : "");
  }
}

int print_sweep_result(const Sweep& sweep, bool json, bool bench) {
  if (json) {
    print_json(results_json(sweep));
  } else {
    print_sweep(sweep, bench);
  }
  return sweep.exit_code;
}

Runner add_run(CLI::App& app) {
  struct Options {
    CommonOptions common;
    SweepOptions sweep;
    std::string op;
    bool all = false;
    bool no_check = false;
  };
  auto options = std::make_shared<Options>();
  CLI::App* cmd = app.add_subcommand(
      "run", "Run ops on every usable backend and device with generated inputs; check and time each result");
  cmd->add_option("op", options->op, "Op id, e.g. layernorm.rmsnorm")->type_name("OP");
  cmd->add_flag("--all", options->all, "Every op that has a schema and a kernel");
  cmd->add_option("--backend", options->sweep.backend, "Only this backend")->type_name("B");
  cmd->add_option("--device", options->sweep.device, "Only these devices: cpu, cuda, cuda:9.0 (that arch), cuda:1 (device 1), hip, hip:gfx90a, hip:0 (default: every device of every usable backend)")
      ->type_name("D");
  cmd->add_option("--dtype", options->sweep.dtype, "Only this dtype")->type_name("T");
  cmd->add_option("--shape", options->sweep.shape_overrides,
                  "Size of a shape symbol, e.g. H=4096, or the leading dims, e.g. '*=4,7' (repeatable)")
      ->type_name("NAME=N");
  cmd->add_option("--attr", options->sweep.attr_overrides,
                  "An attribute's value, typed by the op schema, e.g. eps=1e-5 or is_neox=false (repeatable)")
      ->type_name("NAME=VALUE");
  cmd->add_option("--iters", options->sweep.iters, "Timed calls per result, at least 1 (default 10)")
      ->type_name("N")
      ->check(CLI::Validator(at_least_one, ""));
  cmd->add_flag("--no-check", options->no_check, "Do not check results (implies --allow-unchecked)");
  cmd->add_flag("--allow-unchecked", options->sweep.allow_unchecked,
                "Exit 0 although results were not compared with anything (no reference kernel, no written tensor)");
  cmd->add_option("--save", options->sweep.save_dir,
                  "Write every tensor as .npy (DIR/<op>.<backend>.<dtype>.<arg>.{in,out}.npy) and the attributes as "
                  "DIR/<op>.<backend>.<dtype>.attrs.json (bfloat16 widened to float32; float8_e4m3fn and float8_e5m2 as "
                  "their raw bytes, uint8)")
      ->type_name("DIR");
  add_common_options(*cmd, options->common);
  cmd->footer(
      "Checks every result against the op's reference kernel (role \"reference\") within the tolerances of the op's\n"
      "schema; a result compared with nothing (the op has no reference, or its schema marks no tensor written) is\n"
      "reported unchecked, never passed. \"not run\" lists what was asked for and never ran, whatever the devices\n"
      "here: an op named that ran no case, schema dtypes no kernel serves, kernel dtypes the schema does not take,\n"
      "and (--all) ops with kernels and no schema.\n"
      "Exit code: 0 every result passed; 2 a dispatch, manifest or file error; 3 a result does not match or a kernel\n"
      "fails; 4 nothing failed but not everything was checked (an unchecked result,\n"
      "unless --allow-unchecked, or anything not run).\n"
      "Example: kdispatch run --all; kdispatch run layernorm.rmsnorm --dtype bfloat16 --shape H=8192");

  return [options]() -> int {
    if (options->all == !options->op.empty()) throw UsageError("run takes an op or --all (one of them)");
    if (!options->op.empty()) options->sweep.ops = {options->op};
    options->sweep.check = !options->no_check;
    options->sweep.json = options->common.json;
    Context& ctx = make_context(options->common);
    try {
      return print_sweep_result(run_sweep(ctx, options->sweep), options->common.json, false);
    } catch (const Error& e) {
      return report_error(e, options->common.json);
    }
  };
}

Runner add_bench(CLI::App& app) {
  struct Options {
    CommonOptions common;
    SweepOptions sweep;
    std::string op;
  };
  auto options = std::make_shared<Options>();
  options->sweep.verdict_source = "kdispatch bench";
  CLI::App* cmd = app.add_subcommand("bench", "Time one op on all its usable backends side by side, at large sizes");
  cmd->add_option("op", options->op, "Op id, e.g. layernorm.rmsnorm")->required()->type_name("OP");
  cmd->add_option("--dtype", options->sweep.dtype, "Only this dtype")->type_name("T");
  cmd->add_option("--shape", options->sweep.shape_overrides,
                  "Size of a shape symbol, e.g. H=8192, or the leading dims, e.g. '*=65536' (repeatable; "
                  "by default the op schema's \"bench\" sizes)")
      ->type_name("NAME=N");
  cmd->add_option("--attr", options->sweep.attr_overrides,
                  "An attribute's value, typed by the op schema, e.g. renormalize=true (repeatable)")
      ->type_name("NAME=VALUE");
  cmd->add_flag("--allow-unchecked", options->sweep.allow_unchecked,
                "Exit 0 although results were not compared with anything (no reference kernel, no written tensor)");
  add_common_options(*cmd, options->common);
  cmd->footer(
      "Each result is the median time per call over >= 0.3 s of calls; GB/s counts every byte read and written.\n"
      "The timed calls rotate among copies of the inputs (the SETS column; outputs are one buffer for all):\n"
      "the fewest copies whose inputs and outputs take 3x the device's last-level cache, at most 64 and\n"
      "within a quarter of memory, so that inputs come from memory as in a model, where other work runs\n"
      "between two calls of an op. The host's cache is the last level of the CPUs this process may run on\n"
      "(sysfs, else sysconf, else 32 MiB); a GPU's is taken as 60 MB (an H200's 50 MiB L2 rounded up: the\n"
      "plugins report no cache size). At the schemas' \"bench\" sizes one set is usually enough; a SETS\n"
      "figure marked * was capped before the copies reached 3x the cache (small calls).\n"
      "Results are checked as in `run`, with the same exit codes: 3 when one does not match or a kernel fails, 4\n"
      "when nothing failed but not everything was checked.\n"
      "Example: kdispatch bench moe.topk_softmax --dtype bfloat16 --shape '*=65536' --shape E=256");

  return [options]() -> int {
    options->sweep.ops = {options->op};
    options->sweep.bench_sizes = true;
    options->sweep.iters = 5;
    options->sweep.min_seconds = 0.3;
    options->sweep.rotate_inputs = true;
    options->sweep.json = options->common.json;
    Context& ctx = make_context(options->common);
    try {
      return print_sweep_result(run_sweep(ctx, options->sweep), options->common.json, true);
    } catch (const Error& e) {
      return report_error(e, options->common.json);
    }
  };
}

}  // namespace kdispatch::cli
