// libFuzzer target: the manifest parser and validator, the op-schema file
// parser, and the registry cache's manifest records, on arbitrary bytes.
// None may crash, hang or leak, nor fail internally: the parsers catch
// their own exceptions and flag them (internal_error), which would
// otherwise pass here unseen. A manifest that parses must pass what the
// parser promises, and its record must decode to that same manifest (a
// manifest with op schemas may instead not decode: the cache then parses
// it again, which is slower but never wrong).
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "kdispatch/manifest.hpp"
#include "manifest_for_cache.hpp"
#include "manifest_record.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  std::string ops_json;
  const kdispatch::ManifestResult manifest = kdispatch::parse_manifest_for_cache(text, "fuzz.json", ops_json);
  if (manifest.internal_error) __builtin_trap();
  if (manifest.ok()) {
    if (!kdispatch::is_valid_name(manifest.manifest->plugin)) __builtin_trap();
    for (const auto& k : manifest.manifest->kernels) {
      if (!kdispatch::is_valid_op_id(k.op)) __builtin_trap();
    }
    const std::string record = kdispatch::encode_manifest_record(*manifest.manifest, ops_json);
    if (record.find('\n') != std::string::npos) __builtin_trap();
    const std::optional<kdispatch::Manifest> decoded = kdispatch::decode_manifest_record(record, "fuzz.json");
    if (decoded ? !(*decoded == *manifest.manifest) : ops_json.empty()) __builtin_trap();
  }
  if (kdispatch::parse_op_schemas(text, "fuzz-ops.json").internal_error) __builtin_trap();
  (void)kdispatch::decode_manifest_record(text, "fuzz-record.json");
  return 0;
}
