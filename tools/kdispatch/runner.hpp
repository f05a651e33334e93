// The sweep behind `kdispatch run` and `kdispatch bench`: every op x backend
// x usable device x dtype asked for, each call checked against the op's
// reference kernel (role "reference") and timed.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "common.hpp"
#include "harness.hpp"

namespace kdispatch::cli {

struct SweepOptions {
  std::vector<std::string> ops;  // empty: every op with a schema and a kernel
  std::string backend;           // empty: every registered backend
  std::string device;            // empty: every device each backend probes
  std::string dtype;             // empty: every dtype the backend supports
  std::vector<std::string> shape_overrides;
  std::vector<std::string> attr_overrides;  // "NAME=VALUE", typed by the op schema
  bool bench_sizes = false;                 // start from the schema's "bench" sizes (else its "example")
  int iters = 10;
  double min_seconds = 0;  // bench: time at least this long
  // bench: time the calls rotating among copies of the inputs that, with
  // the outputs, exceed the device's last-level cache (input_sets_for()).
  bool rotate_inputs = false;
  // On a device other than the cpu: time through the backend's
  // kd_memory_api.time_calls (graph replay, and launches back to back in
  // SweepResult::eager_us) instead of the host's clock. A backend that
  // cannot (no device memory, a 1.0 plugin, a kernel registered at run
  // time) is skipped, saying why.
  bool device_timing = false;
  bool check = true;
  // The check named in the conformance verdicts that checked results record
  // (Context::record_verdict).
  std::string verdict_source = "kdispatch run";
  // Unchecked results (no reference, nothing to compare) leave the exit
  // code 0 rather than kUnchecked. --no-check implies it.
  bool allow_unchecked = false;
  std::string save_dir;
  bool json = false;
  bool progress = true;
};

struct SweepResult {
  std::string op, backend, device, dtype, shapes;
  bool ok = false;              // false: failed
  bool checked = false;         // ok and not checked: unchecked, never passed
  std::string checked_against;  // "reference (reference)", or "not checked: <why>"
  std::string error;            // why not ok
  double max_abs_err = 0, max_rel_err = 0;
  double max_ulps = 0, mean_ulps = 0;  // in ulps of the output dtype (harness::Comparison)
  double us_per_call = 0, gb_per_s = 0;
  // SweepOptions::device_timing: us_per_call is per call under graph
  // replay, eager_us per call of the same calls launched back to back.
  double eager_us = 0;
  bool device_timed = false;
  size_t input_sets = 1;         // the timed calls rotated among this many copies of the inputs
  double rotated_bytes = 0;      // the bytes they touch: every set's inputs and the one set of outputs
  bool rotation_capped = false;  // the sets were capped before rotated_bytes reached 3x the cache
};

// The last-level cache of a device, as rotate_inputs counts it.
struct CacheSize {
  double bytes = 0;
  std::string source;  // how it was found
};

struct SweepSkip {
  std::string op, backend, reason;
  bool cannot_time = false;  // SweepOptions::device_timing: the backend cannot time calls on the device
};

// Something the sweep was asked to check that never ran, whatever the
// devices here: an op named that ran no case, a dtype of an op's schema that
// no kernel serves, a dtype a kernel declares that the schema does not take,
// an op with kernels and no schema. Each makes the exit code kUnchecked.
struct SweepGap {
  std::string op, backend;  // backend "-": the op as a whole
  std::string reason;
};

// "passed", "failed" or "unchecked".
std::string_view result_status(const SweepResult& r);

struct Sweep {
  std::vector<SweepResult> results;
  std::vector<SweepSkip> skipped;
  std::vector<SweepGap> not_run;
  std::map<std::string, CacheSize> caches;  // by SweepResult::device, where inputs were rotated
  bool unchecked_allowed = false;           // SweepOptions::allow_unchecked, or --no-check
  // kDispatchError or kKernelFailure where something failed; else
  // kUnchecked where something was not checked (not_run, or an unchecked
  // result without allow_unchecked); else kOk.
  int exit_code = kOk;
};

Sweep run_sweep(Context& ctx, const SweepOptions& options);

}  // namespace kdispatch::cli
