#include "runner.hpp"

#include <fmt/format.h>
#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>

#include "json_text.hpp"
#include "kdispatch/dispatcher.hpp"
#include "kdispatch/selector.hpp"
#include "save_files.hpp"

namespace kdispatch::cli {

namespace {

using Clock = std::chrono::steady_clock;

struct Target {
  ProbedDevice device;
  DLDevice dl;
  const kd_memory_api* memory;
};

const kd_memory_api* memory_of(const PluginBinary& binary) {
  if (!KD_STRUCT_HAS_FIELD(kd_plugin_api, memory, binary.api->struct_size)) return nullptr;
  return binary.api->memory;
}

void synchronize(const Target& t) {
  if (t.memory == nullptr) return;
  char error[256] = "";
  if (t.memory->synchronize(t.dl.device_id, error, sizeof error) != KD_STATUS_OK) {
    throw KernelError(ErrorCode::device_error, fmt::format("synchronize failed: {}", error));
  }
}

bool flag_matches(const DeviceFlag& flag, const ProbedDevice& d) {
  if (flag.device.type != d.device.type) return false;
  if (flag.id) return *flag.id == d.id;
  return flag.device.arch.empty() || flag.device.arch == d.device.arch;
}

// Devices of `binary` to run on: --device narrows them.
std::vector<Target> targets_of(const PluginBinary& binary, const std::string& device_flag) {
  std::vector<Target> out;
  std::optional<DeviceFlag> wanted;
  if (!device_flag.empty()) wanted = parse_device_flag(device_flag);
  for (const ProbedDevice& d : binary.devices) {
    if (wanted && !flag_matches(*wanted, d)) continue;
    const DLDevice dl{static_cast<DLDeviceType>(to_dlpack_device_type(d.device.type)), d.id};
    out.push_back({d, dl, d.device.type == DeviceType::cpu ? nullptr : memory_of(binary)});
  }
  return out;
}

std::vector<Dtype> dtypes_for(const OpSchema& schema, const KernelSpec& spec, const std::string& flag) {
  std::vector<Dtype> out;
  for (Dtype d : harness::kernel_dtypes(schema, spec)) {
    if (flag.empty() || dtype_name(d) == flag) out.push_back(d);
  }
  return out;
}

std::string dtype_list(const std::vector<Dtype>& dtypes) {
  std::vector<std::string_view> names;
  for (Dtype d : dtypes) names.push_back(dtype_name(d));
  return fmt::format("{}", fmt::join(names, ", "));
}

// --dtype names a dtype, and one that the op takes when the op was named.
void check_dtype_flag(const std::string& flag, const OpSchema* named_op) {
  if (flag.empty()) return;
  const std::optional<Dtype> dtype = parse_dtype(flag);
  if (!dtype) {
    throw UsageError(fmt::format("--dtype {}: unknown dtype (known: {})", flag,
                                 dtype_list({std::begin(kAllDtypes), std::end(kAllDtypes)})));
  }
  if (named_op == nullptr) return;
  const std::vector<Dtype> allowed = harness::call_dtypes(*named_op);
  if (std::find(allowed.begin(), allowed.end(), *dtype) == allowed.end()) {
    throw UsageError(fmt::format("--dtype {}: op '{}' takes {}", flag, named_op->op, dtype_list(allowed)));
  }
}

std::string human_bytes(double bytes) {
  const char* const units[] = {"bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int u = 0;
  while (bytes >= 1024 && u < 6) {
    bytes /= 1024;
    ++u;
  }
  return u == 0 ? fmt::format("{:.0f} bytes", bytes) : fmt::format("{:.1f} {}", bytes, units[u]);
}

// Bytes this process may allocate: the machine's memory, or less where an
// address-space or data limit (ulimit -v, -d) is lower.
double usable_memory() {
  double memory = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGESIZE));
  for (const int resource : {RLIMIT_AS, RLIMIT_DATA}) {
    rlimit limit{};
    if (getrlimit(resource, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY) {
      memory = std::min(memory, static_cast<double>(limit.rlim_cur));
    }
  }
  return memory;
}

// --- device timing (tune on a GPU) ----------------------------------------------

// Calls in one timed batch: at least this many, and every input set once.
constexpr size_t kMinTimedCalls = 20;

// Why the backend of `spec` on `target` cannot time calls through its
// kd_memory_api, or "" when it can.
std::string cannot_time(const KernelSpec& spec, const Target& target) {
  if (spec.is_runtime()) {
    return "a kernel registered at run time has no device memory API here; Python's kdispatch.tuning.tune times "
           "those";
  }
  if (target.memory == nullptr) {
    return fmt::format("the {} plugin has no device memory API (kd_memory_api)", spec.plugin);
  }
  if (!KD_STRUCT_HAS_FIELD(kd_memory_api, time_calls, target.memory->struct_size)) {
    return fmt::format("the {} plugin cannot time calls (ABI 1.0)", spec.plugin);
  }
  if (target.memory->time_calls == nullptr) {
    return fmt::format("the {} plugin cannot time calls (its time_calls is NULL)", spec.plugin);
  }
  return {};
}

// The calls of one timed batch: call i runs on input set i % sets.
struct TimedCalls {
  const OpHandle* handle;
  std::vector<std::vector<DLTensor>>* sets;
  const std::vector<NamedAttr>* attrs;
  std::string error;  // the first failed call's, with its KD code
  ErrorCode code = ErrorCode::kernel_failed;
};

kd_status timed_call(void* user, int32_t index, void* stream) {
  auto* calls = static_cast<TimedCalls*>(user);
  try {
    std::vector<DLTensor>& tensors = (*calls->sets)[static_cast<size_t>(index) % calls->sets->size()];
    (*calls->handle)(tensors, *calls->attrs, stream);
    return KD_STATUS_OK;
  } catch (const Error& e) {
    calls->error = fmt::format("[{}] {}", e.code_string(), e.message());
    calls->code = e.code() == ErrorCode::device_error ? ErrorCode::device_error : ErrorCode::kernel_failed;
    return e.code() == ErrorCode::device_error ? KD_STATUS_DEVICE_ERROR : KD_STATUS_INTERNAL;
  } catch (const std::exception& e) {
    calls->error = e.what();
    return KD_STATUS_INTERNAL;
  } catch (...) {
    calls->error = "unknown exception";
    return KD_STATUS_INTERNAL;
  }
}

// --- input rotation (bench) --------------------------------------------------

// Rotated inputs, with the outputs, take this many times the cache: then
// every call reads its inputs from memory, as in a model where other work
// runs between two calls of one op (tools/gpu/bench.py does the same).
constexpr double kCachePasses = 3;
constexpr size_t kMaxInputSets = 64;

// A GPU's last-level (L2) cache. kd_memory_api reports no cache size, so
// this is fixed: an H200's 50 MiB L2 rounded up, as in tools/gpu/bench.py.
// On a GPU with a larger L2 part of the rotated inputs may stay cached.
constexpr double kDeviceCacheBytes = 60e6;

std::string read_first_line(const std::filesystem::path& path) {
  std::ifstream file(path);
  std::string line;
  std::getline(file, line);
  return line;
}

// "32768K" (sysfs) in bytes; 0 when it does not parse.
double parse_cache_size(const std::string& text) {
  size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    return 0;
  }
  const std::string unit = text.substr(used);
  if (unit == "K") return value * 1024;
  if (unit == "M") return value * 1024 * 1024;
  if (unit == "G") return value * 1024 * 1024 * 1024;
  return unit.empty() ? value : 0;
}

// The last-level cache the process's data may occupy on the host: the
// highest-level data or unified cache of each CPU this process may run on,
// from sysfs, every cache counted once (CPUs that share one list the same
// shared_cpu_list), since the cpu backend's threads spread over all of them.
// Else sysconf(_SC_LEVEL3_CACHE_SIZE) (on some CPUs the whole package's L3,
// more than a core's share), else 32 MiB.
CacheSize host_last_level_cache() {
  static const CacheSize cache = [] {
    namespace fs = std::filesystem;
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) != 0) CPU_SET(0, &set);
    std::map<std::string, double> caches;  // by shared_cpu_list: the highest level's
    int level = 0;
    std::error_code ec;
    for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
      if (!CPU_ISSET(cpu, &set)) continue;
      int cpu_level = 0;
      std::string shared;
      double bytes = 0;
      const fs::path dir = fmt::format("/sys/devices/system/cpu/cpu{}/cache", cpu);
      for (const auto& index : fs::directory_iterator(dir, ec)) {
        if (index.path().filename().string().rfind("index", 0) != 0) continue;
        if (read_first_line(index.path() / "type") == "Instruction") continue;
        const int l = std::atoi(read_first_line(index.path() / "level").c_str());
        const double b = parse_cache_size(read_first_line(index.path() / "size"));
        if (l > cpu_level && b > 0) {
          cpu_level = l;
          bytes = b;
          shared = read_first_line(index.path() / "shared_cpu_list");
        }
      }
      if (cpu_level == 0) continue;
      if (cpu_level > level) caches.clear();
      if (cpu_level >= level) {
        level = cpu_level;
        caches[shared.empty() ? std::to_string(cpu) : shared] = bytes;
      }
    }
    double total = 0;
    for (const auto& [cpus, bytes] : caches) total += bytes;
    if (total > 0) {
      return CacheSize{total, fmt::format("L{} of the CPUs this process may run on, {} cache{} (sysfs)", level,
                                          caches.size(), caches.size() == 1 ? "" : "s")};
    }
    const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
    if (l3 > 0) return CacheSize{static_cast<double>(l3), "L3 (sysconf)"};
    return CacheSize{32.0 * 1024 * 1024, "not found; 32 MiB assumed"};
  }();
  return cache;
}

CacheSize last_level_cache(const Target& t) {
  if (t.device.device.type == DeviceType::cpu) return host_last_level_cache();
  return CacheSize{kDeviceCacheBytes, "fixed: the plugin reports no L2 size; an H200's 50 MiB rounded up"};
}

// How many input sets the timing rotates among for a call whose inputs
// (tensors read, in-place ones included) take `input_bytes` and whose
// outputs (written only, one buffer for every set) `output_bytes`: the
// fewest whose inputs and the outputs take kCachePasses x the cache, 1 when
// one set does, at most kMaxInputSets and within a quarter of the memory
// this process may use.
size_t input_sets_for(double input_bytes, double output_bytes, double cache_bytes, double memory) {
  if (input_bytes <= 0) return 1;
  const double wanted = std::ceil((kCachePasses * cache_bytes - output_bytes) / input_bytes);
  const double affordable = std::floor(memory / 4 / input_bytes);
  return static_cast<size_t>(std::clamp(std::min(wanted, affordable), 1.0, static_cast<double>(kMaxInputSets)));
}

// `sets` sets of tensors for the timed calls: the first is `data`'s; the
// others hold their own copies of the inputs of `host` (the values before
// any call) on `data`'s device and share `data`'s outputs.
struct InputSets {
  std::vector<harness::Buffer> buffers;        // the copies
  std::vector<std::vector<DLTensor>> tensors;  // per set, in schema order
};

InputSets make_input_sets(const OpSchema& schema, const harness::CallData& host, harness::CallData& data, size_t sets,
                          const Target& target) {
  InputSets out;
  out.tensors.push_back(data.dl());
  size_t inputs = 0;
  for (const TensorArg& a : schema.tensors) inputs += !a.written || a.inplace;
  out.buffers.reserve(inputs * (sets - 1));  // DLTensors point into them: no reallocation
  for (size_t s = 1; s < sets; ++s) {
    std::vector<DLTensor> tensors = out.tensors.front();
    for (size_t i = 0; i < schema.tensors.size(); ++i) {
      const TensorArg& a = schema.tensors[i];
      if (a.written && !a.inplace) continue;
      const harness::Buffer& b = host.tensors[i];
      harness::Buffer copy(b.dtype(), b.shape(), target.dl, target.memory, b.name());
      std::memcpy(copy.host(), b.host(), b.bytes());
      copy.upload();
      out.buffers.push_back(std::move(copy));
      tensors[i] = out.buffers.back().dl();
    }
    out.tensors.push_back(std::move(tensors));
  }
  return out;
}

// What one checked call of the sweep holds at its peak, in bytes: the host
// inputs, the copy the kernel writes, a second copy for the cpu backend's
// result when another backend is checked against it, and the float64
// reference, which reads every tensor as doubles and returns its outputs as
// doubles too (8 bytes per element, twice). Without checks: the inputs and
// the working copy.
double peak_bytes(const OpSchema& schema, Dtype dtype, const harness::Shapes& shapes, bool check) {
  const auto bytes = static_cast<double>(harness::call_bytes(schema, dtype, shapes));
  if (!check) return 2.0 * bytes;
  double elements = 0;
  for (const TensorArg& arg : schema.tensors) {
    double n = 1;
    for (int64_t d : harness::tensor_shape(arg, shapes)) n *= static_cast<double>(d);
    elements += n;
  }
  return 3.0 * bytes + 16.0 * elements;
}

// The host tensors of one call, or a usage error naming the shapes where
// they cannot be made: sizes past 64 bits, a peak use (peak_bytes) past the
// memory this process may use, or a shape that leaves an index tensor no valid value.
harness::CallData make_host_call(const OpSchema& schema, Dtype dtype, const harness::Shapes& shapes, uint64_t seed,
                                 bool check, const harness::Variant& variant) {
  const std::string where = fmt::format("{} {} at {}", schema.op, dtype_name(dtype), harness::shapes_str(shapes));
  try {
    const double bytes = static_cast<double>(harness::call_bytes(schema, dtype, shapes));
    const double peak = peak_bytes(schema, dtype, shapes, check);
    const double memory = usable_memory();
    if (memory > 0 && peak > memory) {
      throw UsageError(
          fmt::format("{}: the call's tensors take {}, and running it needs about {} (copies and a float64 reference); "
                      "this process may use {} of memory",
                      where, human_bytes(bytes), human_bytes(peak), human_bytes(memory)));
    }
    return harness::make_call(schema, dtype, shapes, seed, variant);
  } catch (const std::invalid_argument& e) {
    throw UsageError(fmt::format("{}: {}", where, e.what()));
  }
}

// Writes every file of one result; a file that fails does not stop the
// others. Throws the first failure (KD-E050), with how many more failed.
void save_call(const std::string& dir, const OpSchema& schema, const std::string& backend, const harness::CallData& in,
               const harness::CallData& out) {
  const std::string stem = fmt::format("{}/{}.{}.{}", dir, schema.op, backend, dtype_name(in.dtype));
  std::vector<Error> failures;
  const auto save = [&](const std::string& path, const std::function<void(const std::string&)>& write) {
    try {
      write_atomically(path, write);
    } catch (const Error& e) {
      failures.push_back(e);
    }
  };
  for (size_t i = 0; i < schema.tensors.size(); ++i) {
    const TensorArg& a = schema.tensors[i];
    if (!a.written || a.inplace) {
      save(fmt::format("{}.{}.in.npy", stem, a.name),
           [&](const std::string& temporary) { harness::save_npy(temporary, in.tensors[i]); });
    }
    if (a.written || a.inplace) {
      save(fmt::format("{}.{}.out.npy", stem, a.name),
           [&](const std::string& temporary) { harness::save_npy(temporary, out.tensors[i]); });
    }
  }
  Json attrs = Json::object();
  for (const auto& attr : in.attrs) {
    std::visit([&](const auto& v) { attrs[std::string(attr.name)] = v; }, attr.value);
  }
  save(stem + ".attrs.json", [&](const std::string& temporary) {
    std::ofstream file(temporary);
    file << json_text(attrs) << "\n";
    file.close();
    if (!file) throw std::runtime_error("error writing " + temporary);
  });
  if (failures.empty()) return;
  if (failures.size() == 1) throw failures.front();
  throw Error(failures.front().code(),
              fmt::format("{} (and {} more files)", failures.front().message(), failures.size() - 1));
}

}  // namespace

std::string_view result_status(const SweepResult& r) {
  if (!r.ok) return "failed";
  return r.checked ? "passed" : "unchecked";
}

Sweep run_sweep(Context& ctx, const SweepOptions& options) {
  Sweep sweep;
  sweep.unchecked_allowed = options.allow_unchecked || !options.check;
  Dispatcher dispatch(ctx);
  std::vector<std::string> ops = options.ops;
  std::vector<std::string> schema_ops;
  for (const OpSchema* s : ctx.registry().schemas()) schema_ops.push_back(s->op);
  // Ops with kernels and no schema: nothing can make their inputs. A typo
  // in a manifest's op id is the usual cause.
  std::vector<std::string> ops_without_schema;
  for (const std::string& op : ctx.registry().ops()) {
    if (ctx.registry().schema(op) == nullptr) ops_without_schema.push_back(op);
  }
  if (ops.empty()) {
    for (const OpSchema* s : ctx.registry().schemas()) {
      if (ctx.registry().has(s->op)) ops.push_back(s->op);
    }
    for (const std::string& op : ops_without_schema) {
      std::vector<std::string> backends;
      for (const KernelSpec* s : ctx.registry().get(op)) {
        if (options.backend.empty() || s->backend == options.backend) backends.push_back(s->backend);
      }
      if (backends.empty()) continue;
      const std::vector<std::string> near = closest_ops(op, schema_ops, 1);
      sweep.not_run.push_back({op, fmt::format("{}", fmt::join(backends, ",")),
                               fmt::format("has kernels but no op schema{}: nothing can make its inputs",
                                           near.empty() ? "" : fmt::format(" (did you mean '{}'?)", near.front()))});
    }
  }
  check_dtype_flag(options.dtype, nullptr);
  // With every op, an --attr applies to the ops that have it; it must name
  // an attribute of one of them at least.
  if (options.ops.empty()) {
    for (const std::string& o : options.attr_overrides) {
      const std::string name = o.substr(0, o.find('='));
      bool known = false;
      for (const std::string& op : ops) {
        for (const AttrArg& a : ctx.registry().schema(op)->attrs) known = known || a.name == name;
      }
      if (!known) throw UsageError(fmt::format("--attr {}: no op has an attribute '{}'", o, name));
    }
  }
  if (!options.save_dir.empty()) check_save_dir(options.save_dir);
  const bool show_progress = options.progress && isatty(2);
  // The progress line is blanked when the sweep ends, by an error too.
  struct ProgressLine {
    bool shown;
    ~ProgressLine() {
      if (shown) fmt::print(stderr, "{:80}\r", "");
    }
  } const progress_line{show_progress};
  const auto fail_dispatch = [&] { sweep.exit_code = std::max(sweep.exit_code, static_cast<int>(kDispatchError)); };
  const auto failed_result = [](const std::string& op, const std::string& backend, const Error& e) {
    SweepResult failed;
    failed.op = op;
    failed.backend = backend;
    failed.device = "-";
    failed.dtype = "-";
    failed.shapes = "-";
    failed.error = fmt::format("[{}] {}", e.code_string(), e.message());
    return failed;
  };

  for (const std::string& op : ops) {
    const size_t results_before = sweep.results.size();
    // With --all, an op that cannot be run at all (its schema is past what
    // the checker handles, its example sizes cannot be allocated, ...) is
    // reported and the sweep goes on; an op named on the command line stops
    // it with its error, as a usage error where it is one.
    try {
      // Resolving the handle checks that the op exists and has a schema.
      OpHandle handle = dispatch.op(op);
      const OpSchema& schema = handle.schema();
      if (!options.ops.empty()) check_dtype_flag(options.dtype, &schema);
      std::vector<const KernelSpec*> specs = ctx.registry().get(op);
      if (!options.backend.empty()) {
        const KernelSpec* s = ctx.registry().get_backend(op, options.backend);
        if (s == nullptr) {
          // The selector words KD-E002, with why a plugin did not load.
          ctx.select({op, options.backend, Device::host_cpu(), std::nullopt});
        }
        specs = {s};
      }
      harness::Shapes shapes = harness::example_shapes(schema);
      if (options.bench_sizes && schema.bench_sizes) shapes = *schema.bench_sizes;
      try {
        harness::apply_overrides(shapes, options.shape_overrides, schema);
        std::vector<NamedAttr> attrs;  // --attr checked before anything runs
        harness::apply_attr_overrides(attrs, options.attr_overrides, schema, options.ops.empty());
      } catch (const std::invalid_argument& e) {
        throw UsageError(e.what());
      }
      // The op's oracle. It is run only when named: as a backend of its own
      // it would only be compared with itself.
      const KernelSpec* reference = ctx.registry().reference(op);

      // The kernels asked for, whatever the devices here: the named
      // backend's, else every one but the reference. A dtype of the schema
      // that none of them serves never runs.
      std::vector<const KernelSpec*> asked;
      for (const KernelSpec* s : specs) {
        if (!s->is_reference() || !options.backend.empty()) asked.push_back(s);
      }
      const std::vector<Dtype> takes = harness::call_dtypes(schema);
      if (!asked.empty()) {
        std::vector<Dtype> unserved;
        for (Dtype d : takes) {
          if (!options.dtype.empty() && dtype_name(d) != options.dtype) continue;
          if (std::none_of(asked.begin(), asked.end(), [&](const KernelSpec* s) { return s->supports(d); })) {
            unserved.push_back(d);
          }
        }
        if (!unserved.empty()) {
          sweep.not_run.push_back(
              {op, options.backend.empty() ? "-" : options.backend,
               fmt::format("{}, {} of its schema, {} serves (none lists {} in its manifest's \"dtypes\"): never run",
                           dtype_list(unserved), unserved.size() == 1 ? "a dtype" : "dtypes",
                           options.backend.empty() ? "no backend's kernel" : "its kernel",
                           unserved.size() == 1 ? "it" : "them")});
        }
      } else if (options.ops.empty()) {
        sweep.not_run.push_back({op, "-", "no backend but its reference implements it: never run"});
      }

      for (const KernelSpec* spec : specs) {
        if (spec->is_reference() && options.backend.empty()) continue;
        std::vector<Dtype> outside;
        for (Dtype d : spec->dtypes) {
          const bool wanted = options.dtype.empty() || dtype_name(d) == options.dtype;
          if (wanted && std::find(takes.begin(), takes.end(), d) == takes.end()) outside.push_back(d);
        }
        if (!outside.empty()) {
          sweep.not_run.push_back({op, spec->backend,
                                   fmt::format("its kernel declares {}, which the op's schema does not take ({}): "
                                               "never run",
                                               dtype_list(outside), dtype_list(takes))});
        }
        const PluginBinary* binary = nullptr;
        try {
          binary = &ctx.load_plugin(spec->plugin);
        } catch (const Error& e) {
          sweep.results.push_back(failed_result(op, spec->backend, e));
          fail_dispatch();
          continue;
        }
        const std::vector<Target> targets = targets_of(*binary, options.device);
        if (targets.empty()) {
          sweep.skipped.push_back({op, spec->backend,
                                   options.device.empty() ? "its plugin reports no device here"
                                                          : fmt::format("no {} device here", options.device)});
          continue;
        }
        for (const Target& target : targets) {
          try {
            ctx.select({op, spec->backend, target.device.device, std::nullopt});
          } catch (const Error& e) {
            sweep.skipped.push_back({op, spec->backend, e.message()});
            continue;
          }
          const bool device_timed = options.device_timing && target.device.device.type != DeviceType::cpu;
          if (device_timed) {
            if (std::string why = cannot_time(*spec, target); !why.empty()) {
              sweep.skipped.push_back({op, spec->backend, std::move(why), true});
              continue;
            }
          }
          const std::vector<Dtype> dtypes = dtypes_for(schema, *spec, options.dtype);
          if (dtypes.empty()) {
            sweep.skipped.push_back({op, spec->backend, fmt::format("does not support dtype '{}'", options.dtype)});
            continue;
          }
          const OpHandle backend_handle = dispatch.op(op, spec->backend);
          for (Dtype dtype : dtypes) {
            SweepResult r;
            r.op = op;
            r.backend = spec->backend;
            r.device = fmt::format("{}:{}", device_type_name(target.device.device.type), target.device.id);
            r.dtype = dtype_name(dtype);
            r.shapes = harness::shapes_str(shapes);
            if (show_progress) {
              fmt::print(stderr, "  running {} on {} {} {} ...\r", op, r.backend, r.device, r.dtype);
              std::fflush(stderr);
            }
            try {
              // An --attr that a tensor is "flattened" by, nonzero, asks for
              // those tensors flattened ([*, H*D]); its value stays the one
              // given, which the core checks against them.
              harness::Variant variant;
              try {
                std::vector<NamedAttr> given;
                harness::apply_attr_overrides(given, options.attr_overrides, schema, options.ops.empty());
                variant.flattened = harness::flattens(schema, given);
              } catch (const std::invalid_argument& e) {
                throw UsageError(e.what());
              }
              harness::CallData host =
                  make_host_call(schema, dtype, shapes, 0x5eed + sweep.results.size(), options.check, variant);
              try {
                harness::apply_attr_overrides(host.attrs, options.attr_overrides, schema, options.ops.empty());
              } catch (const std::invalid_argument& e) {
                throw UsageError(e.what());
              }
              harness::CallData data = harness::clone_to(host, target.dl, target.memory);
              std::vector<DLTensor> tensors = data.dl();
              // The kernel first: where it refuses the arguments (K > E, say),
              // its message is the result's, and no reference is computed.
              // One that writes outside a tensor fails the result.
              const std::string kernel = fmt::format("kernel '{}' of backend '{}'", spec->symbol, spec->backend);
              {
                harness::GuardWatch watch(kernel);
                watch.watch(data);
                backend_handle(tensors, data.attrs);
                synchronize(target);
              }
              harness::download_all(data);
              harness::check_guards(data, kernel);
              // Expected outputs: the op's reference kernel on the same
              // inputs, on the host.
              if (!options.check) {
                r.ok = true;
                r.checked_against = "not checked: --no-check";
              } else if (!schema.has_output()) {
                r.ok = true;
                r.checked_against =
                    "not checked: no tensor of the op's schema is \"written\" or \"inplace\": nothing to compare";
              } else if (reference == nullptr) {
                r.ok = true;
                r.checked_against = "not checked: the op has no reference kernel";
              } else if (reference == spec) {
                r.ok = true;
                r.checked_against = "not checked: it is the op's reference";
              } else {
                harness::CallData ref = harness::clone_to(host, DLDevice{kDLCPU, 0}, nullptr);
                std::vector<DLTensor> t = ref.dl();
                const std::string reference_kernel =
                    fmt::format("the reference kernel '{}' of backend '{}'", reference->symbol, reference->backend);
                try {
                  harness::GuardWatch watch(reference_kernel);
                  watch.watch(ref);
                  dispatch.op(op, reference->backend)(t, ref.attrs);
                } catch (const Error& e) {
                  throw KernelError(ErrorCode::kernel_failed,
                                    fmt::format("the reference ('{}') failed: [{}] {}", reference->backend,
                                                e.code_string(), e.message()));
                }
                harness::check_guards(ref, reference_kernel);
                const harness::Comparison c = harness::compare(schema, data, ref);
                r.checked = true;
                r.checked_against = fmt::format("reference ({})", reference->backend);
                r.ok = c.ok;
                r.max_abs_err = c.max_abs_err;
                r.max_rel_err = c.max_rel_err;
                r.max_ulps = c.max_ulps;
                r.mean_ulps = c.mean_ulps;
                if (!c.ok) r.error = c.first_mismatch;
                ctx.record_verdict(*spec, target.device.device, c.ok, options.verdict_source,
                                   c.ok ? std::string() : fmt::format("{} {}: {}", r.dtype, r.shapes, c.first_mismatch));
              }
              if (!options.save_dir.empty()) {
                try {
                  save_call(options.save_dir, schema, spec->backend, host, data);
                } catch (const Error& e) {
                  // The result stands; the files it could not write fail the run.
                  r.error = fmt::format("[{}] {}", e.code_string(), e.message());
                  fail_dispatch();
                }
              }
              // Timing: in-place ops keep transforming their tensors, which is
              // fine for timing (values stay finite) and never checked.
              double input_bytes = 0;
              double output_bytes = 0;
              for (size_t i = 0; i < schema.tensors.size(); ++i) {
                const TensorArg& a = schema.tensors[i];
                ((a.written && !a.inplace) ? output_bytes : input_bytes) +=
                    static_cast<double>(data.tensors[i].bytes());
              }
              size_t sets = 1;
              r.rotated_bytes = input_bytes + output_bytes;
              if (options.rotate_inputs) {
                const CacheSize cache = last_level_cache(target);
                sweep.caches.emplace(r.device, cache);
                sets = input_sets_for(input_bytes, output_bytes, cache.bytes, usable_memory());
                r.rotated_bytes = static_cast<double>(sets) * input_bytes + output_bytes;
                r.rotation_capped = r.rotated_bytes < kCachePasses * cache.bytes;
              }
              InputSets rotation = make_input_sets(schema, host, data, sets, target);
              r.input_sets = sets;
              // A result that does not match is not timed on a device.
              if (device_timed && r.ok) {
                harness::GuardWatch watch(kernel);
                watch.watch(data);
                for (const harness::Buffer& b : rotation.buffers) watch.watch(b);
                TimedCalls calls{&backend_handle, &rotation.tensors, &data.attrs, {}};
                const auto count = static_cast<int32_t>(std::max(sets, kMinTimedCalls));
                double graph_us = 0;
                double eager_us = 0;
                char error[512] = "";
                const kd_status status = target.memory->time_calls(target.dl.device_id, &timed_call, &calls, count,
                                                                   &graph_us, &eager_us, error, sizeof error);
                if (status != KD_STATUS_OK) {
                  if (!calls.error.empty()) throw KernelError(calls.code, calls.error);
                  throw KernelError(
                      status == KD_STATUS_DEVICE_ERROR ? ErrorCode::device_error : ErrorCode::kernel_failed,
                      fmt::format("timing {} failed: {}", kernel, error));
                }
                r.device_timed = true;
                r.us_per_call = graph_us;
                r.eager_us = eager_us;
                r.gb_per_s = graph_us > 0 ? static_cast<double>(data.bytes_moved(schema)) / (graph_us * 1e3) : 0;
              }
              if (device_timed) {
                if (!r.ok) sweep.exit_code = std::max(sweep.exit_code, static_cast<int>(kKernelFailure));
                sweep.results.push_back(std::move(r));
                continue;
              }
              int iters = std::max(options.iters, 1);
              std::vector<double> samples;
              size_t next = 0;
              const auto deadline = Clock::now() + std::chrono::duration<double>(options.min_seconds);
              harness::GuardWatch watch(kernel);
              watch.watch(data);
              for (const harness::Buffer& b : rotation.buffers) watch.watch(b);
              do {
                const auto start = Clock::now();
                for (int i = 0; i < iters; ++i) {
                  backend_handle(rotation.tensors[next], data.attrs);
                  next = next + 1 == sets ? 0 : next + 1;
                }
                synchronize(target);
                samples.push_back(std::chrono::duration<double>(Clock::now() - start).count() / iters);
              } while (Clock::now() < deadline && samples.size() < 1000);
              std::sort(samples.begin(), samples.end());
              r.us_per_call = samples[samples.size() / 2] * 1e6;
              r.gb_per_s = static_cast<double>(data.bytes_moved(schema)) / (r.us_per_call * 1e3);
              // The timed calls wrote the host tensors in place: their guards
              // are checked again (a device's would need another download).
              if (target.memory == nullptr) harness::check_guards(data, kernel);
            } catch (const harness::GuardViolation& e) {
              r.ok = false;
              r.error = e.what();
              if (options.check) {
                ctx.record_verdict(*spec, target.device.device, false, options.verdict_source,
                                   fmt::format("{} {}: {}", r.dtype, r.shapes, e.what()));
              }
            } catch (const KernelError& e) {
              r.ok = false;
              r.error = fmt::format("[{}] {}", e.code_string(), e.message());
            } catch (const CallError& e) {
              // The generated call does not fit the op (a required attribute
              // without default, say): this result fails, the sweep goes on.
              r.ok = false;
              r.error = fmt::format("[{}] {}", e.code_string(), e.message());
              fail_dispatch();
            } catch (const std::bad_alloc&) {
              r.ok = false;
              r.error = fmt::format("not enough memory for the tensors at {}", r.shapes);
              fail_dispatch();
            }
            if (!r.ok) sweep.exit_code = std::max(sweep.exit_code, static_cast<int>(kKernelFailure));
            sweep.results.push_back(std::move(r));
          }
        }
      }
    } catch (const UsageError& e) {
      if (!options.ops.empty()) throw;
      sweep.skipped.push_back({op, "-", e.what()});
    } catch (const Error& e) {
      if (!options.ops.empty()) throw;
      sweep.results.push_back(failed_result(op, "-", e));
      fail_dispatch();
    } catch (const std::bad_alloc&) {
      if (!options.ops.empty()) throw;
      sweep.skipped.push_back({op, "-", "not enough memory for its example sizes"});
    }
    if (!options.ops.empty() && sweep.results.size() == results_before) {
      std::string why;
      const std::vector<const KernelSpec*> kernels = ctx.registry().get(op);
      if (kernels.empty()) {
        const std::vector<std::string> near = closest_ops(op, ops_without_schema, 1);
        why = near.empty() ? "no kernel implements it"
                           : fmt::format(
                                 "no kernel implements it; kernels are registered for '{}', which has no op "
                                 "schema: a typo in their manifest's op id?",
                                 near.front());
      } else if (options.backend.empty() &&
                 std::all_of(kernels.begin(), kernels.end(), [](const KernelSpec* s) { return s->is_reference(); })) {
        why = "no backend but its reference implements it";
      } else {
        why = "every kernel was skipped (above)";
      }
      sweep.not_run.push_back({op, options.backend.empty() ? "-" : options.backend, "ran no case: " + why});
    }
  }
  const bool unchecked = std::any_of(sweep.results.begin(), sweep.results.end(),
                                     [](const SweepResult& r) { return result_status(r) == "unchecked"; });
  if (sweep.exit_code == kOk && (!sweep.not_run.empty() || (unchecked && !sweep.unchecked_allowed))) {
    sweep.exit_code = kUnchecked;
  }
  return sweep;
}

}  // namespace kdispatch::cli
