// The tuning file's text (docs/tuning.md): written from a TuningFile, read
// back and checked against the ops of a registry, its "when" expressions
// compiled against each op's schema. Apart from the rest of tuning.cpp,
// which needs a Context, so that the reader stands on the registry alone.
#include <fmt/format.h>

#include <algorithm>
#include <nlohmann/json.hpp>

#include "kdispatch/manifest.hpp"
#include "kdispatch/registry.hpp"
#include "kdispatch/tuning.hpp"
#include "json_depth.hpp"
#include "schema_check.hpp"
#include "tuning_set.hpp"

namespace kdispatch {

namespace {

using json = nlohmann::json;
using ojson = nlohmann::ordered_json;  // written files keep the documented key order

// An integer of the JSON text that an int64_t holds: nlohmann reads one
// above INT64_MAX as unsigned, and get<int64_t>() would wrap it.
bool is_int64(const json& value) {
  return value.is_number_integer() &&
         !(value.is_number_unsigned() && value.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX));
}

std::string shown(const json& value) {
  std::string text = value.dump(-1, ' ', true, json::error_handler_t::replace);
  if (text.size() > 60) text = text.substr(0, 57) + "...";
  return text;
}

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
      if (!is_int64(v)) bad_field(path, fmt::format("{}/sizes/{}", pointer, k), "an integer of 64 bits", v);
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
  if (auto deep = json_depth_error(text, path)) throw ManifestError(ErrorCode::manifest_bad_json, std::move(*deep));
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
  if (!is_int64(threads)) bad_field(path, "/key/threads", "an integer of 64 bits", threads);
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
