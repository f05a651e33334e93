// The text form in which the registry cache (registry_cache.cpp) keeps a
// parsed manifest: one line of tab-separated fields that decodes straight
// into the Manifest the parser gave, without reading or validating JSON
// again. Only the op schemas a manifest defines itself (rare, and the
// largest structures) stay JSON: parse_op_schemas rebuilds them.
//
// The fields, in order (a list is its length, then its items):
//   format plugin backend library abi sha256 description role
//   targets: [device min_arch max_arch archs: [arch] features: [feature]]
//   kernels: [op symbol description dtypes targets flags priority constraints: [text]]
//   ops_json
// A kernel's dtypes are one field, a digit per dtype (its place in
// kAllDtypes); its targets are "=" when they are the manifest's, else a
// list as above; its flags are "r" (role reference) or "b" (backend),
// followed by "o" when it is opt-in. An absent sha256 or arch is an empty field. Tabs, newlines
// and backslashes inside a field are written \t, \n and \\.
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "kdispatch/manifest.hpp"

namespace kdispatch {

// The record format; the registry cache's header carries it. Bump it
// whenever the fields above or the parser's output change meaning, so that
// records written by other code are not read as this code's.
inline constexpr int kManifestRecordFormat = 5;

// `manifest` as one record (it holds no newline). `ops_json` is the text
// parse_manifest_for_cache gave with it. The path is not part of the
// record: the cache keys records by it.
std::string encode_manifest_record(const Manifest& manifest, std::string_view ops_json);

// The manifest of `record`, with `path` as its path and every kernel's;
// nullopt when the record does not decode (not one encode_manifest_record
// wrote, or op schemas that no longer parse without a finding).
std::optional<Manifest> decode_manifest_record(std::string_view record, const std::string& path);

}  // namespace kdispatch
