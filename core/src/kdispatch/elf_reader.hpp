// Reading a plugin file without loading it (kdispatch inspect): ELF header,
// exported symbols, needed libraries, the embedded manifest section. Uses
// libelf, which checks bounds on untrusted files.
#pragma once

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace kdispatch {

struct ElfInfo {
  std::string machine;                      // "x86-64", "AArch64", ...
  std::string elf_class;                    // "ELF64"
  std::vector<std::string> exported_symbols;  // defined, global/weak, dynamic
  std::vector<std::string> needed;          // DT_NEEDED entries
  std::optional<std::string> embedded_manifest;  // section .kdispatch_manifest
};

// Throws PluginError (KD-E020) naming the file when it is missing, not an
// ELF file, or truncated/corrupt.
ElfInfo read_elf(const std::filesystem::path& path);

}  // namespace kdispatch
