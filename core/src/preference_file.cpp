#include "preference_file.hpp"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "json_depth.hpp"
#include "kdispatch/manifest.hpp"

namespace kdispatch {

namespace {

using json = nlohmann::json;

std::string shown(const json& value) {
  std::string text = value.dump(-1, ' ', true, json::error_handler_t::replace);
  if (text.size() > 60) text = text.substr(0, 57) + "...";
  return text;
}

}  // namespace

PreferenceFileResult parse_preference_file(std::string_view text, const std::string& path) {
  PreferenceFileResult result;
  const auto bad = [&](const std::string& pointer, std::string_view expected, const json& found) {
    result.errors.push_back({ErrorCode::manifest_bad_field, path,
                             fmt::format("{}: {}: expected {}, found {}", path, pointer, expected, shown(found))});
  };
  json doc;
  try {
    doc = json::parse(text);
  } catch (const json::exception& e) {
    result.errors.push_back({ErrorCode::manifest_bad_json, path, fmt::format("{}: not valid JSON: {}", path, e.what())});
    return result;
  }
  if (auto deep = json_depth_error(text, path)) {
    result.errors.push_back({ErrorCode::manifest_bad_json, path, std::move(*deep)});
    return result;
  }
  constexpr std::string_view kDocExpected = "an object {\"preferences\": {\"<op>\": [\"<backend>\", ...]}}";
  if (!doc.is_object()) {
    bad("/", kDocExpected, doc);
    return result;
  }
  for (const auto& item : doc.items()) {
    if (item.key() != "preferences") {
      result.warnings.push_back({ErrorCode::manifest_bad_field, path,
                                 fmt::format("{}: /{}: unknown key, ignored (known keys here: preferences)", path,
                                             item.key()),
                                 /*warning=*/true});
    }
  }
  const auto it = doc.find("preferences");
  if (it == doc.end() || !it->is_object()) {
    bad("/preferences", "an object {\"<op>\": [\"<backend>\", ...]}", it == doc.end() ? json() : *it);
    return result;
  }
  Preferences preferences;
  for (const auto& [op, backends] : it->items()) {
    const std::string pointer = "/preferences/" + op;
    if (!is_valid_op_id(op)) {
      bad(pointer, "an op id <group>.<name> of [a-z0-9_]+ as the key", json(op));
      continue;
    }
    if (!backends.is_array() || backends.empty()) {
      bad(pointer, "a non-empty list of backend names, the preferred first", backends);
      continue;
    }
    std::vector<std::string> names;
    for (size_t i = 0; i < backends.size(); ++i) {
      const json& name = backends[i];
      if (!name.is_string() || !is_valid_name(name.get<std::string>())) {
        bad(fmt::format("{}/{}", pointer, i), "a backend name of [a-z0-9_]+", name);
      } else if (std::find(names.begin(), names.end(), name.get<std::string>()) != names.end()) {
        bad(fmt::format("{}/{}", pointer, i), "each backend once", name);
      } else {
        names.push_back(name.get<std::string>());
      }
    }
    preferences.emplace(op, std::move(names));
  }
  if (result.errors.empty()) result.preferences = std::move(preferences);
  return result;
}

PreferenceFileResult read_preference_file(const std::filesystem::path& path) {
  Problem problem{};
  const std::optional<std::string> text = read_manifest_text(path, problem);
  if (!text) {
    PreferenceFileResult result;
    result.errors.push_back(std::move(problem));
    return result;
  }
  return parse_preference_file(*text, path.string());
}

}  // namespace kdispatch
