// The op-schema files of manifests/ops/, compiled into the core.
#pragma once

#include <vector>

namespace kdispatch {

struct BuiltinSchemaFile {
  const char* name;  // "<builtin>/layernorm.json"
  const char* text;
};

std::vector<BuiltinSchemaFile> builtin_schema_files();

}  // namespace kdispatch
