// Shared by the subcommands: common options, building a Context, printing
// results and errors (human text or one JSON document), exit codes.
#pragma once

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kdispatch/context.hpp"
#include "kdispatch/doctor.hpp"
#include "kdispatch/error.hpp"

namespace kdispatch::cli {

using Json = nlohmann::ordered_json;

// The exit codes of README.md (the kdispatch tool), and kUnchecked: `run`
// and `bench` found nothing wrong but did not check everything they were
// asked to (an unchecked result, an op or a dtype that never ran). 2 and 3
// take precedence.
enum ExitCode : int { kOk = 0, kUsage = 1, kDispatchError = 2, kKernelFailure = 3, kUnchecked = 4 };

struct CommonOptions {
  std::vector<std::string> plugin_path;      // --plugin-path (replaces)
  std::vector<std::string> add_plugin_path;  // --add-plugin-path (prepends)
  bool json = false;
};

// Adds --plugin-path, --add-plugin-path and --json to a subcommand.
void add_common_options(CLI::App& cmd, CommonOptions& options);
// Adds --json alone, for subcommands that read no plugins.
void add_json_flag(CLI::App& cmd, bool& json);
// The same options before the subcommand (`kdispatch --json list`): added to
// the app, and handed after parsing to the options of every subcommand, in
// front of what was given after it.
void add_leading_options(CLI::App& app, CommonOptions& leading);
void apply_leading_options(const CommonOptions& leading);
// The core's messages name the API's arguments (`pass backend=...`); on the
// command line these are options (`pass --backend B`).
std::string for_command_line(std::string message);
// The plugins of the options' path, discovered and registered; the context
// lives until the process exits.
//
// With `probed_arch`, a device whose arch the vendor driver does not report
// (no driver here) takes the arch that the probe of a loaded plugin reports
// for it, so that a backend's kernels can be called on the devices its own
// plugin reports (`tune` on a device).
Context& make_context(const CommonOptions& options, bool probed_arch = false);

// --device: "cpu", "cuda", "cuda:9.0" (a device of that arch), "cuda:1"
// (device 1, whatever its arch: the driver says which), "hip", "hip:gfx90a",
// "hip:0". Throws UsageError naming the accepted forms.
struct DeviceFlag {
  Device device;
  std::optional<int32_t> id;  // set by the ordinal form
};
DeviceFlag parse_device_flag(const std::string& text);

// Parses --device, or detects the platform (KDISPATCH_DEVICE, a GPU driver,
// else cpu). Throws UsageError on a malformed device.
struct DeviceChoice {
  Device device;
  std::string source;
};
DeviceChoice choose_device(const std::string& flag);

// Whether the op's patterns have leading dims ("*") and no symbol "rows",
// so that "rows" (in --size, constraints and tuned choices) names the
// product of the leading dims.
bool names_rows(const OpSchema& schema);

// Bad command-line input that CLI11 cannot see (exit 1).
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Prints `error` as `error[KD-E002]: message` plus hint lines on stderr, or
// as {"error": {...}} on stdout with --json. Returns the exit code.
int report_error(const Error& error, bool json);
// The document of an error with --json: {"error": {"code", "message", "hints"}}.
Json error_json(std::string_view code, std::string_view message, const std::vector<std::string>& hints = {});
void print_json(const Json& doc);

Json problem_json(const Problem& problem);
Json problems_json(const std::vector<Problem>& problems);
// The "plugins" entries of list and doctor.
// A plugin of the doctor report (list and doctor): "name", "backend",
// "manifest", "library", "status", "state", "note" (when there is one),
// "problems", "loaded" and, when loaded, "version", "abi" and "devices".
Json plugin_report_json(const PluginReport& report);

// A subcommand: registers its options; returns the function that runs it.
using Runner = std::function<int()>;
Runner add_list(CLI::App& app);
Runner add_select(CLI::App& app);
Runner add_validate(CLI::App& app);
Runner add_explain(CLI::App& app);
Runner add_doctor(CLI::App& app);
Runner add_inspect(CLI::App& app);
Runner add_run(CLI::App& app);
Runner add_bench(CLI::App& app);
Runner add_tune(CLI::App& app);
Runner add_scan(CLI::App& app);

}  // namespace kdispatch::cli
