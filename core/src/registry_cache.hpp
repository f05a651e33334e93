// The registry cache of scan outcomes, under $XDG_CACHE_HOME/kdispatch/
// (or ~/.cache/kdispatch/). One file per kdispatch version and plugin ABI,
// so two versions never read each other's outcomes. Each entry is keyed by
// the library path and stamped with the library's size and mtime and the
// manifest's sha256: any change makes the entry stale and the plugin is
// scanned again. The file is rewritten whole under a temporary name and
// renamed into place; a corrupt, truncated or unreadable cache is ignored
// (with a warning) and rebuilt, an unwritable one only warned about.
#pragma once

#include <filesystem>
#include <optional>

#include "kdispatch/manifest.hpp"
#include "scanner.hpp"

namespace kdispatch {

std::filesystem::path registry_cache_path();

// The recorded outcome for `manifest`'s library, when its stamps match.
std::optional<ScanOutcome> cache_lookup(const Manifest& manifest);

// Records `outcome` for `manifest`'s library.
void cache_store(const Manifest& manifest, const ScanOutcome& outcome);

}  // namespace kdispatch
