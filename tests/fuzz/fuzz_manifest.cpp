// libFuzzer target: the manifest parser and validator, and the op-schema
// file parser, on arbitrary bytes. Neither may crash, hang or leak, and a
// manifest that parses must pass what the parser promises.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "kdispatch/manifest.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const kdispatch::ManifestResult manifest = kdispatch::parse_manifest(text, "fuzz.json");
  if (manifest.ok()) {
    if (!kdispatch::is_valid_name(manifest.manifest->plugin)) __builtin_trap();
    for (const auto& k : manifest.manifest->kernels) {
      if (!kdispatch::is_valid_op_id(k.op)) __builtin_trap();
    }
  }
  (void)kdispatch::parse_op_schemas(text, "fuzz-ops.json");
  return 0;
}
