#include "kdispatch/discovery.hpp"

#include <dlfcn.h>
#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <set>
#include <system_error>

#include "file_check.hpp"
#include "kdispatch/environment.hpp"
#include "kdispatch/log.hpp"
#include "kdispatch/plugin_security.hpp"
#include "registry_cache.hpp"
#include "scanner.hpp"

namespace fs = std::filesystem;

namespace kdispatch {

std::string_view plugin_state_name(PluginState state) {
  switch (state) {
    case PluginState::found: return "found";
    case PluginState::error: return "error";
    case PluginState::disabled: return "disabled";
    case PluginState::shadowed: return "shadowed";
  }
  return "?";
}

std::vector<fs::path> default_plugin_dirs() {
  std::vector<fs::path> dirs;
  std::error_code ec;
  // Beside the running program: <prefix>/bin/kdispatch -> <prefix>/lib/kdispatch/plugins.
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) dirs.push_back((exe.parent_path() / ".." / "lib" / "kdispatch" / "plugins").lexically_normal());
  // Beside the core library, for programs that live elsewhere (e.g. a Python
  // extension): <prefix>/lib/libkdispatch.so -> <prefix>/lib/kdispatch/plugins.
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&default_plugin_dirs), &info) != 0 && info.dli_fname != nullptr) {
    const fs::path lib = fs::weakly_canonical(info.dli_fname, ec);
    if (!ec) dirs.push_back((lib.parent_path() / "kdispatch" / "plugins").lexically_normal());
  }
  dirs.emplace_back(KDISPATCH_INSTALL_PLUGIN_DIR);
  return dirs;
}

std::vector<SearchDir> resolve_search_path(const SearchPathOptions& options) {
  std::vector<SearchDir> dirs;
  std::set<std::string> seen;
  const auto push = [&](const fs::path& p, std::string origin) {
    std::error_code ec;
    fs::path key = fs::weakly_canonical(fs::absolute(p, ec), ec);
    if (ec) key = p.lexically_normal();
    if (seen.insert(key.string()).second) dirs.push_back({p, std::move(origin)});
  };
  for (const auto& p : options.add) push(p, "--add-plugin-path");
  if (options.use_environment) {
    if (auto env = get_env("KDISPATCH_ADD_PLUGIN_PATH")) {
      for (const auto& p : split_list(*env, ':')) push(p, "KDISPATCH_ADD_PLUGIN_PATH");
    }
  }
  std::optional<std::string> env_path;
  if (options.use_environment) env_path = get_env("KDISPATCH_PLUGIN_PATH");
  if (!options.replace.empty()) {
    for (const auto& p : options.replace) push(p, "--plugin-path");
  } else if (env_path) {
    for (const auto& p : split_list(*env_path, ':')) push(p, "KDISPATCH_PLUGIN_PATH");
  } else if (options.use_default_path) {
    for (const auto& p : default_plugin_dirs()) push(p, "default");
  }
  return dirs;
}

namespace {

struct NameFilter {
  std::vector<std::string> disable;
  std::vector<std::string> select;

  // Why `name` is filtered out, or empty.
  std::string reject_reason(const std::string& name) const {
    for (const auto& g : disable) {
      if (glob_match(g, name)) return fmt::format("disabled by KDISPATCH_PLUGINS_DISABLE (matches '{}')", g);
    }
    if (select.empty()) return {};
    for (const auto& g : select) {
      if (glob_match(g, name)) return {};
    }
    return fmt::format("not selected by KDISPATCH_PLUGINS_SELECT={}", fmt::join(select, ","));
  }
};

struct DirectoryListing {
  std::vector<fs::path> manifests;
  std::vector<Problem> special;  // *.json entries that are not regular files
  std::optional<Problem> unreadable;  // the directory itself could not be listed
};

// The *.json regular files of `dir`, sorted. Entries named *.json that are
// FIFOs, devices or directories are never opened (a FIFO would block the
// read): each is a problem naming the file and what it is.
DirectoryListing manifests_in(const fs::path& dir) {
  DirectoryListing out;
  std::error_code ec;
  for (auto it = fs::directory_iterator(dir, ec); !ec && it != fs::directory_iterator(); it.increment(ec)) {
    const fs::path& path = it->path();
    if (path.extension() != ".json") continue;
    if (std::string why = regular_file_problem(path); !why.empty()) {
      out.special.push_back({ErrorCode::manifest_bad_json, path.string(),
                             fmt::format("{}: cannot read: {}; skipped", path.string(), why)});
      continue;
    }
    out.manifests.push_back(path);
  }
  if (ec) {
    // An existing directory that cannot be read hides every plugin in it.
    out.unreadable = Problem{ErrorCode::manifest_bad_json, dir.string(),
                             fmt::format("cannot list plugin directory {}: {}; no manifest in it was read",
                                         dir.string(), ec.message())};
    log(LogLevel::warn, "{}", out.unreadable->message);
  }
  // By name; all share the directory, so the strings order as the paths do.
  std::sort(out.manifests.begin(), out.manifests.end(),
            [](const fs::path& a, const fs::path& b) { return a.native() < b.native(); });
  std::sort(out.special.begin(), out.special.end(),
            [](const Problem& a, const Problem& b) { return a.file < b.file; });
  return out;
}

// One warning per invalid manifest: the first problem and how many more
// (a bad name repeated in every kernel would otherwise fill the screen);
// every problem at debug level.
void log_skipped_manifest(const PluginRecord& rec, const std::vector<Problem>& errors) {
  if (errors.empty()) return;
  std::string who;
  if (!rec.name.empty()) who += fmt::format("plugin '{}'", rec.name);
  if (!rec.backend.empty()) who += fmt::format("{}backend '{}'", who.empty() ? "" : ", ", rec.backend);
  const Problem& first = errors.front();
  log(LogLevel::warn, "skipping manifest {}{}: {}: {}{}", rec.manifest_path, who.empty() ? "" : " (" + who + ")",
      code_string(first.code), first.message,
      errors.size() == 1 ? ""
                         : fmt::format(" (and {} more problem{}; `kdispatch validate` lists them all)",
                                       errors.size() - 1, errors.size() == 2 ? "" : "s"));
  for (const Problem& e : errors) {
    log(LogLevel::debug, "problem of manifest {}: {}: {}", rec.manifest_path, code_string(e.code), e.message);
  }
}

}  // namespace

DiscoveryResult discover_plugins(const SearchPathOptions& options) {
  DiscoveryResult result;
  result.search_path = resolve_search_path(options);
  NameFilter filter{options.disable, options.select};
  if (options.use_environment) {
    if (auto env = get_env("KDISPATCH_PLUGINS_DISABLE")) {
      for (auto& g : split_list(*env, ',')) filter.disable.push_back(std::move(g));
    }
    if (auto env = get_env("KDISPATCH_PLUGINS_SELECT")) {
      for (auto& g : split_list(*env, ',')) filter.select.push_back(std::move(g));
    }
  }
  std::map<std::string, std::string> first_manifest;  // plugin name -> manifest path
  // Unchanged manifests come parsed from the registry cache.
  ManifestCache cache(scan_policy());
  LocationChecks checks;

  for (const SearchDir& dir : result.search_path) {
    std::error_code ec;
    if (!fs::is_directory(dir.path, ec)) {
      log(LogLevel::info, "plugin directory {} ({}): does not exist, skipped", dir.path.string(), dir.origin);
      continue;
    }
    log(LogLevel::debug, "searching plugin directory {} ({})", dir.path.string(), dir.origin);
    DirectoryListing listing = manifests_in(dir.path);
    if (listing.unreadable) result.problems.push_back(std::move(*listing.unreadable));
    for (Problem& problem : listing.special) {
      log(LogLevel::warn, "skipping manifest {}: {}: {}", problem.file, code_string(problem.code), problem.message);
      PluginRecord rec;
      rec.manifest_path = problem.file;
      rec.state = PluginState::error;
      rec.problems.push_back(std::move(problem));
      result.plugins.push_back(std::move(rec));
    }
    for (const fs::path& file : listing.manifests) {
      PluginRecord rec;
      rec.manifest_path = file.string();
      // The manifest is read from the descriptor that was checked.
      CheckedFile opened;
      if (auto problem = checks.manifest(file, &opened)) {
        log(LogLevel::warn, "skipping manifest {}: {}: {}", rec.manifest_path, code_string(problem->code),
            problem->message);
        rec.state = PluginState::error;
        rec.problems.push_back(std::move(*problem));
        result.plugins.push_back(std::move(rec));
        continue;
      }
      ManifestResult parsed = cache.read(file, opened.file.fd, opened.st);
      opened.file.reset();
      rec.name = std::move(parsed.plugin);
      rec.backend = std::move(parsed.backend);
      rec.ops = std::move(parsed.ops);
      for (const auto& w : parsed.warnings) {
        log(LogLevel::warn, "{}", w.message);
        rec.problems.push_back(w);
      }
      if (!parsed.ok()) {
        // An invalid manifest claims no plugin name: a valid one of the same
        // name later in the path still loads.
        rec.state = PluginState::error;
        log_skipped_manifest(rec, parsed.errors);
        for (auto& e : parsed.errors) rec.problems.push_back(std::move(e));
        result.plugins.push_back(std::move(rec));
        continue;
      }
      const Manifest& m = *parsed.manifest;
      rec.library_path = m.library_path().string();
      log(LogLevel::debug, "found manifest {}: plugin '{}', backend '{}', {} kernel(s)", rec.manifest_path, m.plugin,
          m.backend, m.kernels.size());

      if (auto it = first_manifest.find(m.plugin); it != first_manifest.end()) {
        rec.state = PluginState::shadowed;
        rec.note = fmt::format("plugin '{}' was already found at {}; the first one wins", m.plugin, it->second);
        log(LogLevel::warn, "skipping manifest {}: {}", rec.manifest_path, rec.note);
      } else if (std::string why = filter.reject_reason(m.plugin); !why.empty()) {
        first_manifest.emplace(m.plugin, rec.manifest_path);
        rec.state = PluginState::disabled;
        rec.note = std::move(why);
        log(LogLevel::info, "skipping plugin '{}' ({}): {}", m.plugin, rec.manifest_path, rec.note);
      } else {
        first_manifest.emplace(m.plugin, rec.manifest_path);
        if (auto problem = checks.library(m)) {
          rec.state = PluginState::error;
          log(LogLevel::warn, "skipping plugin '{}': {}: {}", m.plugin, code_string(problem->code), problem->message);
          rec.problems.push_back(std::move(*problem));
        }
      }
      rec.manifest = std::move(parsed.manifest);
      result.plugins.push_back(std::move(rec));
    }
  }
  cache.save();
  if (cache.hits() > 0) log(LogLevel::debug, "{} manifest(s) from the registry cache", cache.hits());
  return result;
}

}  // namespace kdispatch
