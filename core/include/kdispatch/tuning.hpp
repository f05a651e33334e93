// Tuning files (docs/tuning.md): measured per-shape backend choices that the
// selector applies after the op's preference and before
// KDISPATCH_BACKEND_ORDER and priority (rule `tuned`). A file is made for
// one machine: its key names the device, the thread count, the kdispatch
// version and the hash of each plugin library its choices name, and a file
// whose key does not match is ignored whole.
#pragma once

#include <kdispatch/export.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "kdispatch/device.hpp"
#include "kdispatch/dtype.hpp"
#include "kdispatch/error.hpp"

namespace kdispatch KDISPATCH_API {

class Context;
class KernelRegistry;

// One shape of one op timed on every backend: microseconds per call.
struct TuningMeasurement {
  std::string op;
  Dtype dtype = Dtype::float32;
  std::map<std::string, int64_t> sizes;  // shape symbol -> value
  std::map<std::string, double> us;      // backend -> microseconds per call
};

// One entry of "choices": calls of `op` with `dtype` for which `when` (a
// constraint expression over the op's names; empty: always) holds go to
// `backend` first, if it is eligible.
struct TuningChoice {
  std::string op;
  Dtype dtype = Dtype::float32;
  std::string when;
  std::string backend;
  std::vector<TuningMeasurement> measured;  // what it was decided from
};

// Which machine a tuning file was made on ("key").
struct TuningKey {
  std::string kdispatch;  // the version string
  DeviceType device = DeviceType::cpu;
  std::string name;     // device name (cpu: /proc/cpuinfo "model name")
  std::string arch;     // cuda "9.0", hip "gfx90a", cpu: the machine (uname -m)
  std::string driver;   // cpu: the kernel release (uname -r)
  std::string runtime;  // cpu: empty
  int64_t threads = 0;  // cpu: the cpu plugin's thread count; gpu: 0
  // backend -> "sha256:<hex>" of its plugin library, or "run-time"
  std::map<std::string, std::string> backends;
  bool operator==(const TuningKey&) const = default;
};

struct TuningFile {
  std::string path;
  TuningKey key;
  std::vector<TuningChoice> choices;
};

// The choices that the measurements give, in order of op, dtype and shape:
// per (op, dtype), when one symbol varies, the measurements sorted by it,
// the least time winning each shape, boundaries at the geometric mean of
// neighbours with different winners ("T <= 181", "T > 181 && T <= 5792",
// "T > 5792"), runs of one winner merged (one winner overall: when "");
// when several symbols vary, one exact-match choice per measured shape.
// Throws std::invalid_argument for a measurement without times or with a
// symbol name that is not [A-Za-z_][A-Za-z0-9_]*.
std::vector<TuningChoice> build_tuning_choices(const std::vector<TuningMeasurement>& measurements);

// The key of this machine for devices of `type` (the first device of the
// type), hashing the plugin libraries of `backends` (of the context's
// registry). Throws Error KD-E002 for a backend with no kernels.
TuningKey tuning_key(const Context& context, DeviceType type, const std::vector<std::string>& backends);

// The tuning file's JSON text (docs/tuning.md).
std::string tuning_file_text(const TuningFile& file);

// Reads and checks a tuning file against the ops of `registry`: the whole
// file or nothing. Throws ManifestError KD-E010 (unreadable, not JSON, not
// UTF-8, too large) or KD-E011 (a field: wrong type, unknown op or dtype, a
// "when" that does not compile against the op), naming the file and the
// JSON pointer.
TuningFile read_tuning_file(const std::filesystem::path& path, const KernelRegistry& registry);
TuningFile parse_tuning_file(std::string_view text, const std::string& path, const KernelRegistry& registry);

// The first field of `file` that differs from `machine` ("name: file has
// 'X', this machine has 'Y'"), empty when they match. Only the hashes of
// the backends named in the file's key are compared.
std::string tuning_key_mismatch(const TuningKey& file, const TuningKey& machine);

}  // namespace kdispatch
