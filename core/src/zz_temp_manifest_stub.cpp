// TEMPORARY stand-in for manifest.cpp so the loader can be linked and tested
// before the real parser lands; drop this file when merging it.
#include <nlohmann/json.hpp>

#include <fstream>
#include <sstream>

#include "kdispatch/manifest.hpp"

namespace kdispatch {

std::filesystem::path Manifest::library_path() const {
  return std::filesystem::path(path).parent_path() / library;
}

ManifestResult parse_manifest(std::string_view text, const std::string& path) {
  ManifestResult result;
  try {
    const auto j = nlohmann::json::parse(text);
    Manifest m;
    m.path = path;
    m.format = j.at("kdispatch_manifest").get<std::string>();
    m.plugin = j.at("plugin").get<std::string>();
    m.backend = j.at("backend").get<std::string>();
    m.library = j.at("library").get<std::string>();
    m.abi = j.at("abi").get<std::string>();
    if (j.contains("sha256")) m.sha256 = j.at("sha256").get<std::string>();
    for (const auto& k : j.at("kernels")) {
      KernelSpec spec;
      spec.op = k.at("op").get<std::string>();
      spec.symbol = k.at("symbol").get<std::string>();
      spec.plugin = m.plugin;
      spec.backend = m.backend;
      spec.manifest = path;
      m.kernels.push_back(spec);
    }
    result.manifest = std::move(m);
  } catch (const std::exception& e) {
    result.errors.push_back({ErrorCode::manifest_bad_json, path, e.what()});
  }
  return result;
}

ManifestResult read_manifest(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::ostringstream text;
  text << in.rdbuf();
  return parse_manifest(text.str(), path.string());
}

}  // namespace kdispatch
