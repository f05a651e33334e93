// Plugin manifests and op-schema files: parsing and validation
// (docs/manifest.md, docs/op-schema.md). The implementation, manifest.cpp, is the only file of the core
// that includes nlohmann/json.
#pragma once

#include <kdispatch/export.h>

#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kdispatch/error.hpp"
#include "kdispatch/kernel_spec.hpp"
#include "kdispatch/schema.hpp"

namespace kdispatch KDISPATCH_API {

inline constexpr int kManifestFormatMajor = 1;
inline constexpr int kManifestFormatMinor = 0;

struct Manifest {
  std::string path;          // the file it was read from
  std::string format;        // "1.0"
  std::string plugin;        // [a-z0-9_]+
  std::string backend;       // [a-z0-9_]+
  std::string library;       // plain file name, resolved next to the manifest
  std::string abi;           // "1.0"
  std::optional<std::string> sha256;  // 64 lowercase hex digits
  std::string description;
  KernelRole role = KernelRole::backend;  // "role": "backend" (default) or "reference"
  std::vector<Target> targets;        // default for kernels without their own
  std::vector<KernelSpec> kernels;    // targets resolved, plugin/backend/manifest filled
  std::vector<OpSchema> ops;          // op schemas this plugin defines

  // The library's path: the manifest's directory / library.
  std::filesystem::path library_path() const;
  // The op ids of its kernels, in manifest order.
  std::vector<std::string> kernel_ops() const;
  // Every field equal.
  bool operator==(const Manifest&) const = default;
};

// The backend of a kernel of `m` with `role`: the manifest's, except for a
// reference kernel in a manifest whose own role is not reference, which is
// the backend "reference".
std::string kernel_backend(const Manifest& m, KernelRole role);

struct ManifestResult {
  std::optional<Manifest> manifest;  // set when there is no error
  std::vector<Problem> errors;       // KD-E010..E013, naming file and field
  std::vector<Problem> warnings;     // unknown keys, newer minor version
  // What the document says about itself, read best-effort whether or not
  // it is valid: each field only where that field validated on its own
  // (empty otherwise; all empty for text that is not JSON, repeats a key,
  // is no object or has an unknown major format). Nothing of an invalid
  // manifest is registered; these let errors, `list` and `doctor` name the
  // plugin, its backend and the ops it would have provided.
  std::string plugin;
  std::string backend;
  std::vector<std::string> ops;  // op ids of its kernels, in manifest order, each once
  // Validation stopped on an exception that no input should cause (a JSON
  // value read as the wrong type, a key looked up with at() that is not
  // there): a bug here, never a verdict on the input. `errors` then ends
  // with a KD-E011 "internal error while validating" problem and
  // `manifest` is empty. The tests and the fuzz target require it false.
  bool internal_error = false;
  bool ok() const { return manifest.has_value(); }
};

// Parses and validates a manifest. Never throws for bad input: every problem
// is returned with its code, the file, and the JSON pointer of the field
// ("/kernels/2/targets/0/min_arch: expected \"major.minor\", found \"9\"").
// Bad JSON reports file:line:col. Also checks the library path is a plain
// file name (KD-E012); it does not look at the file system. An exception of
// the parser itself is caught as well, so that a process that only scans
// plugins outlives a bug here, and flagged as internal_error.
ManifestResult parse_manifest(std::string_view text, const std::string& path);
ManifestResult read_manifest(const std::filesystem::path& path);

// A JSON list of target objects as a manifest's "targets" holds them
// (docs/manifest.md, Targets), read by the manifest's own rules. Throws
// ManifestError (KD-E010 bad JSON, KD-E011 a bad or unknown field) whose
// message starts with `what`.
std::vector<Target> parse_targets(std::string_view json_list, const std::string& what);

// The text of a manifest or op-schema file, read up to the size a manifest
// may have (16 MiB); otherwise the problem (KD-E010, naming the file) in
// `problem`. A FIFO, device or directory is refused as not a regular file,
// without blocking.
std::optional<std::string> read_manifest_text(const std::filesystem::path& path, Problem& problem);

struct SchemaFileResult {
  std::vector<OpSchema> schemas;
  std::vector<Problem> errors;
  std::vector<Problem> warnings;
  bool internal_error = false;  // as in ManifestResult
};

// Parses an op-schema file: a JSON list of op schemas (manifests/ops/*.json).
SchemaFileResult parse_op_schemas(std::string_view text, const std::string& path);

// Checks a name against [a-z0-9_]+ and an op id against <group>.<name>.
bool is_valid_name(std::string_view name);
bool is_valid_op_id(std::string_view op);

}  // namespace kdispatch
