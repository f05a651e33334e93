#include "kdispatch/tuning.hpp"

#include <fmt/format.h>
#include <sched.h>
#include <sys/stat.h>
#include <sys/utsname.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>
#include <thread>
#include <mutex>

#include "kdispatch/context.hpp"
#include "kdispatch/environment.hpp"
#include "kdispatch/manifest.hpp"
#include "kdispatch/plugin_security.hpp"
#include "kdispatch/registry.hpp"
#include "kdispatch/version.h"
#include "schema_check.hpp"
#include "tuning_set.hpp"
#include "verdict_store.hpp"

namespace kdispatch {

namespace {

using json = nlohmann::json;
using ojson = nlohmann::ordered_json;  // written files keep the documented key order

bool is_symbol_name(std::string_view s) {
  if (s.empty() || s.size() > 64) return false;
  const auto alpha = [](char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; };
  if (!alpha(s[0])) return false;
  return std::all_of(s.begin(), s.end(), [&](char c) { return alpha(c) || (c >= '0' && c <= '9'); });
}

// The backend with the least time; the first by name among equals.
std::string winner(const TuningMeasurement& m) {
  if (m.us.empty()) {
    throw std::invalid_argument(fmt::format("a measurement of op '{}' has no times", m.op));
  }
  const auto best = std::min_element(m.us.begin(), m.us.end(),
                                     [](const auto& a, const auto& b) { return a.second < b.second; });
  return best->first;
}

std::string shown(const json& value) {
  std::string text = value.dump(-1, ' ', true, json::error_handler_t::replace);
  if (text.size() > 60) text = text.substr(0, 57) + "...";
  return text;
}

}  // namespace

std::vector<TuningChoice> build_tuning_choices(const std::vector<TuningMeasurement>& measurements) {
  // (op, dtype name) -> measurements, in that order.
  std::map<std::pair<std::string, std::string>, std::vector<const TuningMeasurement*>> groups;
  for (const TuningMeasurement& m : measurements) {
    if (m.us.empty()) throw std::invalid_argument(fmt::format("a measurement of op '{}' has no times", m.op));
    for (const auto& [name, value] : m.sizes) {
      if (!is_symbol_name(name)) {
        throw std::invalid_argument(fmt::format("a measurement of op '{}' names symbol '{}'", m.op, name));
      }
      (void)value;
    }
    groups[{m.op, std::string(dtype_name(m.dtype))}].push_back(&m);
  }
  std::vector<TuningChoice> out;
  for (auto& [group, ms] : groups) {
    // The symbols whose value is not the same in every measurement.
    std::set<std::string> names;
    for (const auto* m : ms) {
      for (const auto& [name, value] : m->sizes) names.insert(name);
    }
    std::vector<std::string> varying;
    for (const std::string& name : names) {
      std::set<std::optional<int64_t>> values;
      for (const auto* m : ms) {
        const auto it = m->sizes.find(name);
        values.insert(it == m->sizes.end() ? std::nullopt : std::optional<int64_t>(it->second));
      }
      if (values.size() > 1) varying.push_back(name);
    }
    const auto choice = [&](std::string when, std::string backend) {
      TuningChoice c;
      c.op = ms.front()->op;
      c.dtype = ms.front()->dtype;
      c.when = std::move(when);
      c.backend = std::move(backend);
      return c;
    };
    const bool one_symbol =
        varying.size() == 1 &&
        std::all_of(ms.begin(), ms.end(), [&](const auto* m) { return m->sizes.count(varying[0]) == 1; });
    if (varying.empty() || one_symbol) {
      std::vector<const TuningMeasurement*> sorted = ms;
      if (one_symbol) {
        std::stable_sort(sorted.begin(), sorted.end(), [&](const auto* a, const auto* b) {
          return a->sizes.at(varying[0]) < b->sizes.at(varying[0]);
        });
      }
      // Runs of one winner.
      struct Run {
        std::string backend;
        std::vector<const TuningMeasurement*> measured;
      };
      std::vector<Run> runs;
      for (const auto* m : sorted) {
        const std::string w = winner(*m);
        if (runs.empty() || runs.back().backend != w) runs.push_back({w, {}});
        runs.back().measured.push_back(m);
      }
      if (runs.size() == 1 || !one_symbol) {
        TuningChoice c = choice("", runs.front().backend);
        for (const auto* m : sorted) c.measured.push_back(*m);
        out.push_back(std::move(c));
        continue;
      }
      const std::string& s = varying[0];
      std::vector<int64_t> bounds;  // between run i and i + 1
      for (size_t i = 0; i + 1 < runs.size(); ++i) {
        const int64_t a = runs[i].measured.back()->sizes.at(s);
        const int64_t b = runs[i + 1].measured.front()->sizes.at(s);
        auto mean = static_cast<int64_t>(std::floor(std::sqrt(static_cast<double>(a) * static_cast<double>(b))));
        if (a <= 0 || b <= 0) mean = a + (b - a) / 2;
        bounds.push_back(std::clamp(mean, a, b - 1));
      }
      for (size_t i = 0; i < runs.size(); ++i) {
        std::string when;
        if (i == 0) {
          when = fmt::format("{} <= {}", s, bounds[0]);
        } else if (i + 1 == runs.size()) {
          when = fmt::format("{} > {}", s, bounds[i - 1]);
        } else {
          when = fmt::format("{} > {} && {} <= {}", s, bounds[i - 1], s, bounds[i]);
        }
        TuningChoice c = choice(std::move(when), runs[i].backend);
        for (const auto* m : runs[i].measured) c.measured.push_back(*m);
        out.push_back(std::move(c));
      }
      continue;
    }
    // Several symbols vary: each shape its own exact match.
    for (const auto* m : ms) {
      std::vector<std::string> terms;
      for (const auto& [name, value] : m->sizes) terms.push_back(fmt::format("{} == {}", name, value));
      TuningChoice c = choice(fmt::format("{}", fmt::join(terms, " && ")), winner(*m));
      c.measured.push_back(*m);
      out.push_back(std::move(c));
    }
  }
  return out;
}

namespace {

std::string read_first_line_field(const char* path, std::string_view field) {
  std::ifstream in(path);
  std::string line;
  for (int i = 0; i < 4096 && std::getline(in, line); ++i) {
    if (!line.starts_with(field)) continue;
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string value = line.substr(colon + 1);
    const auto first = value.find_first_not_of(" \t");
    return first == std::string::npos ? std::string() : value.substr(first);
  }
  return {};
}

// The cpu plugin's thread count (kd_plugin::cpu_thread_count): a valid
// KDISPATCH_CPU_THREADS, else the CPUs this process may run on.
int64_t cpu_threads() {
  if (auto env = get_env("KDISPATCH_CPU_THREADS"); env && !env->empty()) {
    char* end = nullptr;
    errno = 0;
    const long n = std::strtol(env->c_str(), &end, 10);
    if (end != env->c_str() && *end == '\0' && errno == 0 && n >= 1 && n <= 1024) return n;
  }
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n >= 1) return n;
  }
  const unsigned n = std::thread::hardware_concurrency();
  return n >= 1 ? n : 1;
}

}  // namespace

TuningKey tuning_key(const Context& context, DeviceType type, const std::vector<std::string>& backends) {
  TuningKey key;
  key.kdispatch = KDISPATCH_VERSION_STRING;
  key.device = type;
  if (type == DeviceType::cpu) {
    struct utsname u {};
    if (::uname(&u) == 0) {
      key.arch = u.machine;
      key.driver = u.release;
    }
    key.name = read_first_line_field("/proc/cpuinfo", "model name");
    key.threads = cpu_threads();
  } else {
    key.arch = context.device(type, 0).arch;
    // Name and versions from the probe of a loaded plugin that reports
    // device 0 of the type (kd_device_info 1.1).
    for (const PluginRecord& record : context.discovery().plugins) {
      const auto state = context.load_state(record.name);
      if (!state || state->binary == nullptr) continue;
      const auto it = std::find_if(state->binary->devices.begin(), state->binary->devices.end(),
                                   [&](const ProbedDevice& d) { return d.device.type == type && d.id == 0; });
      if (it == state->binary->devices.end()) continue;
      key.name = it->name;
      key.driver = it->driver_version;
      key.runtime = it->runtime_version;
      break;
    }
  }
  for (const std::string& backend : backends) {
    const KernelSpec* spec = nullptr;
    for (const std::string& op : context.registry().ops()) {
      if ((spec = context.registry().get_backend(op, backend)) != nullptr) break;
    }
    if (spec == nullptr) {
      throw SelectionError(ErrorCode::backend_not_registered,
                           fmt::format("No '{}' backend registered (for the tuning key)", backend));
    }
    std::string hash = "run-time";
    for (const PluginRecord& record : context.discovery().plugins) {
      if (record.name == spec->plugin && !record.library_path.empty()) {
        hash = library_hash(record.library_path);
        break;
      }
    }
    key.backends.emplace(backend, std::move(hash));
  }
  return key;
}

std::string tuning_key_mismatch(const TuningKey& file, const TuningKey& machine) {
  const auto differ = [](std::string_view field, const std::string& a, const std::string& b) {
    return fmt::format("{}: the file has '{}', this machine has '{}'", field, a, b);
  };
  if (file.kdispatch != machine.kdispatch) return differ("kdispatch", file.kdispatch, machine.kdispatch);
  if (file.device != machine.device) {
    return differ("device", std::string(device_type_name(file.device)), std::string(device_type_name(machine.device)));
  }
  if (file.name != machine.name) return differ("name", file.name, machine.name);
  if (file.arch != machine.arch) return differ("arch", file.arch, machine.arch);
  if (file.driver != machine.driver) return differ("driver", file.driver, machine.driver);
  if (file.runtime != machine.runtime) return differ("runtime", file.runtime, machine.runtime);
  if (file.threads != machine.threads) {
    return differ("threads", std::to_string(file.threads), std::to_string(machine.threads));
  }
  for (const auto& [backend, hash] : file.backends) {
    const auto it = machine.backends.find(backend);
    const std::string has = it == machine.backends.end() ? std::string("no such backend") : it->second;
    if (has != hash) return differ(fmt::format("backends/{}", backend), hash, has);
  }
  return {};
}

namespace {

ojson measurement_json(const TuningMeasurement& m) {
  ojson sizes = ojson::object();
  for (const auto& [k, v] : m.sizes) sizes[k] = v;
  ojson us = ojson::object();
  for (const auto& [k, v] : m.us) us[k] = v;
  return ojson{{"sizes", sizes}, {"us", us}};
}

}  // namespace

std::string tuning_file_text(const TuningFile& file) {
  ojson key = ojson::object();
  key["kdispatch"] = file.key.kdispatch;
  key["device"] = std::string(device_type_name(file.key.device));
  key["name"] = file.key.name;
  key["arch"] = file.key.arch;
  key["driver"] = file.key.driver;
  key["runtime"] = file.key.runtime;
  key["threads"] = file.key.threads;
  ojson backends = ojson::object();
  for (const auto& [k, v] : file.key.backends) backends[k] = v;
  key["backends"] = backends;
  ojson choices = ojson::array();
  for (const TuningChoice& c : file.choices) {
    ojson measured = ojson::array();
    for (const auto& m : c.measured) measured.push_back(measurement_json(m));
    ojson entry = ojson::object();
    entry["op"] = c.op;
    entry["dtype"] = std::string(dtype_name(c.dtype));
    entry["when"] = c.when;
    entry["backend"] = c.backend;
    entry["measured"] = measured;
    choices.push_back(std::move(entry));
  }
  ojson doc = ojson::object();
  doc["kdispatch_tuning"] = 1;
  doc["key"] = key;
  doc["choices"] = choices;
  return doc.dump(2, ' ', false, ojson::error_handler_t::replace) + "\n";
}

namespace {

[[noreturn]] void bad_field(const std::string& path, const std::string& pointer, std::string_view expected,
                            const json& found) {
  throw ManifestError(ErrorCode::manifest_bad_field,
                      fmt::format("{}: {}: expected {}, found {}", path, pointer, expected, shown(found)));
}

const json& member(const json& object, const char* name, const std::string& path, const std::string& pointer,
                   std::string_view expected) {
  const auto it = object.find(name);
  if (it == object.end()) bad_field(path, fmt::format("{}/{}", pointer, name), expected, json());
  return *it;
}

std::string string_member(const json& object, const char* name, const std::string& path, const std::string& pointer) {
  const json& v = member(object, name, path, pointer, "a string");
  if (!v.is_string()) bad_field(path, fmt::format("{}/{}", pointer, name), "a string", v);
  return v.get<std::string>();
}

TuningMeasurement parse_measurement(const json& m, const TuningChoice& c, const std::string& path,
                                    const std::string& pointer) {
  if (!m.is_object()) bad_field(path, pointer, "an object {\"sizes\": {...}, \"us\": {...}}", m);
  TuningMeasurement out;
  out.op = c.op;
  out.dtype = c.dtype;
  if (const auto it = m.find("sizes"); it != m.end()) {
    if (!it->is_object()) bad_field(path, pointer + "/sizes", "an object {\"<symbol>\": <integer>}", *it);
    for (const auto& [k, v] : it->items()) {
      if (!v.is_number_integer()) bad_field(path, fmt::format("{}/sizes/{}", pointer, k), "an integer", v);
      out.sizes.emplace(k, v.get<int64_t>());
    }
  }
  if (const auto it = m.find("us"); it != m.end()) {
    if (!it->is_object()) bad_field(path, pointer + "/us", "an object {\"<backend>\": <microseconds>}", *it);
    for (const auto& [k, v] : it->items()) {
      if (!v.is_number()) bad_field(path, fmt::format("{}/us/{}", pointer, k), "a number", v);
      out.us.emplace(k, v.get<double>());
    }
  }
  return out;
}

}  // namespace

TuningFile parse_tuning_file(std::string_view text, const std::string& path, const KernelRegistry& registry) {
  json doc;
  try {
    doc = json::parse(text);
  } catch (const json::exception& e) {
    throw ManifestError(ErrorCode::manifest_bad_json, fmt::format("{}: not valid JSON: {}", path, e.what()));
  }
  if (!doc.is_object()) bad_field(path, "/", "an object {\"kdispatch_tuning\": 1, \"key\": ..., \"choices\": ...}", doc);
  const json& version = member(doc, "kdispatch_tuning", path, "", "1");
  if (!version.is_number_integer() || version.get<int64_t>() != 1) bad_field(path, "/kdispatch_tuning", "1", version);
  TuningFile file;
  file.path = path;
  const json& key = member(doc, "key", path, "", "an object");
  if (!key.is_object()) bad_field(path, "/key", "an object", key);
  file.key.kdispatch = string_member(key, "kdispatch", path, "/key");
  const std::string device = string_member(key, "device", path, "/key");
  const auto type = parse_device_type(device);
  if (!type) bad_field(path, "/key/device", "\"cpu\", \"cuda\" or \"hip\"", json(device));
  file.key.device = *type;
  file.key.name = string_member(key, "name", path, "/key");
  file.key.arch = string_member(key, "arch", path, "/key");
  file.key.driver = string_member(key, "driver", path, "/key");
  file.key.runtime = string_member(key, "runtime", path, "/key");
  const json& threads = member(key, "threads", path, "/key", "an integer");
  if (!threads.is_number_integer()) bad_field(path, "/key/threads", "an integer", threads);
  file.key.threads = threads.get<int64_t>();
  const json& backends = member(key, "backends", path, "/key", "an object");
  if (!backends.is_object()) bad_field(path, "/key/backends", "an object {\"<backend>\": \"sha256:<hex>\"}", backends);
  for (const auto& [name, hash] : backends.items()) {
    if (!hash.is_string()) bad_field(path, "/key/backends/" + name, "a string", hash);
    file.key.backends.emplace(name, hash.get<std::string>());
  }
  const json& choices = member(doc, "choices", path, "", "a list");
  if (!choices.is_array()) bad_field(path, "/choices", "a list of choices", choices);
  for (size_t i = 0; i < choices.size(); ++i) {
    const json& c = choices[i];
    const std::string pointer = fmt::format("/choices/{}", i);
    if (!c.is_object()) bad_field(path, pointer, "an object {\"op\", \"dtype\", \"when\", \"backend\"}", c);
    TuningChoice choice;
    choice.op = string_member(c, "op", path, pointer);
    if (registry.get(choice.op).empty()) {
      bad_field(path, pointer + "/op", "an op with registered kernels", json(choice.op));
    }
    const std::string dtype = string_member(c, "dtype", path, pointer);
    const auto parsed = parse_dtype(dtype);
    if (!parsed) bad_field(path, pointer + "/dtype", "a dtype name (float32, bfloat16, ...)", json(dtype));
    choice.dtype = *parsed;
    choice.when = c.contains("when") ? string_member(c, "when", path, pointer) : std::string();
    choice.backend = string_member(c, "backend", path, pointer);
    if (!is_valid_name(choice.backend)) bad_field(path, pointer + "/backend", "a backend name", json(choice.backend));
    if (const auto it = c.find("measured"); it != c.end()) {
      if (!it->is_array()) bad_field(path, pointer + "/measured", "a list", *it);
      for (size_t j = 0; j < it->size(); ++j) {
        choice.measured.push_back(parse_measurement((*it)[j], choice, path, fmt::format("{}/measured/{}", pointer, j)));
      }
    }
    file.choices.push_back(std::move(choice));
  }
  compile_tuning(file, registry);  // checks each "when"
  return file;
}

TuningFile read_tuning_file(const std::filesystem::path& path, const KernelRegistry& registry) {
  Problem problem{};
  const std::optional<std::string> text = read_manifest_text(path, problem);
  if (!text) throw ManifestError(problem.code, problem.message);
  return parse_tuning_file(*text, path.string(), registry);
}

std::shared_ptr<const TuningSet> compile_tuning(TuningFile file, const KernelRegistry& registry) {
  auto set = std::make_shared<TuningSet>();
  std::map<std::string, std::unique_ptr<CompiledSchema>, std::less<>> schemas;
  for (size_t i = 0; i < file.choices.size(); ++i) {
    const TuningChoice& c = file.choices[i];
    TunedChoice tuned{c.dtype, std::nullopt, c.backend};
    if (!c.when.empty()) {
      auto it = schemas.find(c.op);
      if (it == schemas.end()) {
        const OpSchema* schema = registry.schema(c.op);
        it = schemas.emplace(c.op, schema ? std::make_unique<CompiledSchema>(*schema) : nullptr).first;
      }
      if (!it->second) {
        throw ManifestError(ErrorCode::manifest_bad_field,
                            fmt::format("{}: /choices/{}/when: op '{}' has no schema, so only \"\" (always) applies",
                                        file.path, i, c.op));
      }
      const CompiledSchema& compiled = *it->second;
      const ConstraintNames names{compiled.constraint_symbols(), compiled.selecting_dtype_var(), compiled.schema().attrs};
      try {
        tuned.when = Constraint::compile(c.when, &names);
      } catch (const std::invalid_argument& e) {
        throw ManifestError(ErrorCode::manifest_bad_field,
                            fmt::format("{}: /choices/{}/when: {}", file.path, i, e.what()));
      }
    }
    std::vector<TunedChoice>& of_op = set->by_op[c.op];
    if (tuned.when && std::count_if(of_op.begin(), of_op.end(), [](const TunedChoice& t) { return t.when; }) >=
                          static_cast<std::ptrdiff_t>(kMaxTunedConditions)) {
      throw ManifestError(ErrorCode::manifest_bad_field,
                          fmt::format("{}: /choices/{}: op '{}' has more than {} choices with a \"when\"", file.path,
                                      i, c.op, kMaxTunedConditions));
    }
    of_op.push_back(std::move(tuned));
  }
  set->file = std::move(file);
  return set;
}

}  // namespace kdispatch
