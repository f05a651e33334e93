// Checks made before a plugin library is opened: loading a library runs its
// code (docs/manifest.md, the library).
#pragma once

#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <system_error>

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

// The two checks above for many files (one discovery): what a directory
// resolves to and whether it is safe is found once per directory. Each
// check gives what the function above gives; a new object checks afresh.
class LocationChecks {
 public:
  std::optional<Problem> library(const Manifest& manifest);             // check_library_location
  std::optional<Problem> manifest(const std::filesystem::path& manifest);  // check_manifest_security

 private:
  struct Directory {
    std::error_code error;  // of resolving it
    std::filesystem::path canonical;
  };
  const Directory& directory(const std::filesystem::path& dir);
  // Why the resolved directory is unsafe, or nullopt.
  const std::optional<std::string>& insecure_directory(const std::filesystem::path& canonical);

  std::map<std::string, Directory> directories_;
  std::map<std::string, std::optional<std::string>> insecure_;
};

// When the manifest has "sha256", the library's digest matches (KD-E026).
std::optional<Problem> verify_library_checksum(const Manifest& manifest);

// Lowercase hex SHA-256 of a file (libcrypto). Throws std::runtime_error
// when the file cannot be read.
std::string sha256_file(const std::filesystem::path& path);

}  // namespace kdispatch
