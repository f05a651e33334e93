// Checks made before a plugin library is opened: loading a library runs its
// code (DESIGN.md section 6).
#pragma once

#include <filesystem>
#include <optional>
#include <string>

#include "kdispatch/error.hpp"
#include "kdispatch/manifest.hpp"

namespace kdispatch {

// The library exists and stays inside the manifest's directory, also through
// symlinks (KD-E012); neither the file nor its directory is world-writable
// or owned by another non-root user (KD-E025). Uses stat only.
std::optional<Problem> check_library_location(const Manifest& manifest);

// The same rule for a manifest file and its directory (KD-E025): the
// manifest names the library and its checksum.
std::optional<Problem> check_manifest_security(const std::filesystem::path& manifest);

// When the manifest has "sha256", the library's digest matches (KD-E026).
std::optional<Problem> verify_library_checksum(const Manifest& manifest);

// Lowercase hex SHA-256 of a file (libcrypto). Throws std::runtime_error
// when the file cannot be read.
std::string sha256_file(const std::filesystem::path& path);

}  // namespace kdispatch
