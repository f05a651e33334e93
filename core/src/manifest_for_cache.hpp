// Parsing a manifest for the registry cache (registry_cache.cpp). Defined in
// manifest.cpp, the one file that handles JSON; not part of the public API.
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "kdispatch/manifest.hpp"

namespace kdispatch {

// parse_manifest, and in `ops_json` the manifest's "ops" list as compact
// JSON text (empty when it defines no op schema): parse_op_schemas of that
// text with the same path gives the same op schemas again.
ManifestResult parse_manifest_for_cache(std::string_view text, const std::string& path, std::string& ops_json);

// read_manifest_text of a file already open as `fd` (read from its start);
// `name` is the file's path, for messages.
std::optional<std::string> read_manifest_text_from(int fd, const std::string& name, Problem& problem);

}  // namespace kdispatch
