// Finding plugins (docs/environment.md, plugin discovery): the search path, manifests in each
// directory, name filters. Reads JSON (or, for manifests unchanged since an
// earlier process, the registry cache) and stats library files; never opens
// a library.
#pragma once

#include <kdispatch/export.h>

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "kdispatch/error.hpp"
#include "kdispatch/manifest.hpp"

namespace kdispatch KDISPATCH_API {

struct SearchPathOptions {
  // --plugin-path: replaces the default path (and KDISPATCH_PLUGIN_PATH).
  std::vector<std::filesystem::path> replace;
  // --add-plugin-path: in front of the path (after KDISPATCH_ADD_PLUGIN_PATH).
  std::vector<std::filesystem::path> add;
  // Read KDISPATCH_PLUGIN_PATH, KDISPATCH_ADD_PLUGIN_PATH,
  // KDISPATCH_PLUGINS_DISABLE and KDISPATCH_PLUGINS_SELECT.
  bool use_environment = true;
  // Include the default directories (beside the binary, install prefix).
  bool use_default_path = true;
  // Plugin-name globs, as KDISPATCH_PLUGINS_DISABLE / _SELECT (which apply
  // too when use_environment): disabled first, then only selected ones.
  std::vector<std::string> disable;
  std::vector<std::string> select;
};

struct SearchDir {
  std::filesystem::path path;
  std::string origin;  // "--plugin-path", "KDISPATCH_PLUGIN_PATH", "default", ...
};

// The directories searched, in order, duplicates removed.
std::vector<SearchDir> resolve_search_path(const SearchPathOptions& options);
// The default directories: the plugin folder beside the running binary and
// beside the core library ($ORIGIN/../lib/kdispatch/plugins), then the
// install prefix.
std::vector<std::filesystem::path> default_plugin_dirs();

enum class PluginState {
  found,     // manifest valid, library present and safe: kernels registered
  error,     // manifest or library problem: not registered
  disabled,  // filtered out by KDISPATCH_PLUGINS_DISABLE / _SELECT
  shadowed,  // a plugin of the same name was found earlier in the path
};
std::string_view plugin_state_name(PluginState state);

struct PluginRecord {
  // name, backend and ops are what the manifest declares, also when it is
  // invalid: each as far as that field validated (empty when it did not,
  // or when the file could not be read at all).
  std::string name;
  std::string backend;
  std::vector<std::string> ops;  // op ids of its kernels
  std::string manifest_path;
  std::string library_path;
  PluginState state = PluginState::found;
  std::optional<Manifest> manifest;  // set when the manifest is valid
  std::vector<Problem> problems;  // warnings, then the errors that stopped it
  std::string note;               // why disabled / shadowed
};

struct DiscoveryResult {
  std::vector<SearchDir> search_path;
  std::vector<PluginRecord> plugins;  // in discovery order
  std::vector<Problem> problems;      // of the search path itself: directories that cannot be listed
};

DiscoveryResult discover_plugins(const SearchPathOptions& options);

}  // namespace kdispatch
