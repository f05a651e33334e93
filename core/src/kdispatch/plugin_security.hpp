// Checks made before a plugin file is read or opened: loading a library runs
// its code, and the manifest decides which library that is
// (docs/plugins.md, where plugins may live).
//
// Each file is opened once and checked through its descriptor; whatever is
// read or loaded afterwards comes from that descriptor (the library is
// loaded as /proc/self/fd/N), so renaming entries between the check and the
// load cannot put another file in its place.
#pragma once

#include <sys/stat.h>

#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <system_error>

#include "kdispatch/error.hpp"
#include "kdispatch/manifest.hpp"
#include "unique_fd.hpp"

namespace kdispatch {

// A file opened and checked (LocationChecks::library or ::manifest).
struct CheckedFile {
  UniqueFd file;
  struct stat st {};           // fstat of `file`
  std::filesystem::path real;  // where the opened file lies, every link resolved
  // "/proc/self/fd/N": opening it opens the checked file itself.
  std::string descriptor_path() const;
};

// The rules for one file: a regular file owned by root or the current user
// and writable by its owner only; every directory from its own up to `/`
// owned by root or the current user and writable by its owner only, or
// sticky and owned by root (/tmp).

// The library exists, is a regular file and stays inside the manifest's
// directory, also through symlinks (KD-E012); it and its directories follow
// the rules above (KD-E025).
std::optional<Problem> check_library_location(const Manifest& manifest);

// The same rules for a manifest file and its directories (KD-E025): the
// manifest names the library and its checksum.
std::optional<Problem> check_manifest_security(const std::filesystem::path& manifest);

// The same rules for a helper program that is run (KD-E025): `what` names
// it in the message ("plugin scanner").
std::optional<Problem> check_program_security(const std::filesystem::path& program, const char* what);

// The checks above for many files (one discovery): what a directory
// resolves to and whether its chain up to `/` is safe is found once per
// directory. A new object checks afresh. With `opened`, the checked file
// is handed over open, to be read or loaded from its descriptor.
class LocationChecks {
 public:
  std::optional<Problem> library(const Manifest& manifest, CheckedFile* opened = nullptr);
  std::optional<Problem> manifest(const std::filesystem::path& manifest, CheckedFile* opened = nullptr);

 private:
  struct Directory {
    std::error_code error;  // of resolving it
    std::filesystem::path canonical;
  };
  const Directory& directory(const std::filesystem::path& dir);
  // Why the resolved directory or one above it is unsafe, or nullopt.
  const std::optional<std::string>& insecure_directory(const std::filesystem::path& canonical);

  std::map<std::string, Directory> directories_;
  std::map<std::string, std::optional<std::string>> insecure_;
};

// When the manifest has "sha256", the library's digest matches (KD-E026).
std::optional<Problem> verify_library_checksum(const Manifest& manifest);
// The same, reading the checked library through its descriptor.
std::optional<Problem> verify_library_checksum(const Manifest& manifest, const CheckedFile& library);

// Lowercase hex SHA-256 of a file (libcrypto). Throws std::runtime_error
// when the file cannot be read.
std::string sha256_file(const std::filesystem::path& path);
// The same for an open file, read from its start with pread; `name` is for
// messages.
std::string sha256_fd(int fd, const std::string& name);

}  // namespace kdispatch
