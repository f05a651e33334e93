#include "kdispatch/tuning.hpp"

#include <fmt/format.h>
#include <sched.h>
#include <sys/stat.h>
#include <sys/utsname.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <fstream>
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
#include "verdict_store.hpp"

namespace kdispatch {

namespace {

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

}  // namespace kdispatch
