// kdispatch inspect: a plugin's manifest against its binary, read from the
// ELF file without loading it (no plugin code runs).
#include <fmt/format.h>

#include <algorithm>
#include <filesystem>

#include "common.hpp"
#include "kdispatch/elf_reader.hpp"
#include "kdispatch/manifest.hpp"
#include "kdispatch/manifest_agreement.hpp"
#include "kdispatch/plugin_api.h"

namespace fs = std::filesystem;

namespace kdispatch::cli {

namespace {

// The manifest in the same directory whose "library" is `library`.
std::optional<fs::path> manifest_for_library(const fs::path& library) {
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(library.parent_path().empty() ? "." : library.parent_path(), ec)) {
    if (entry.path().extension() != ".json") continue;
    ManifestResult r = read_manifest(entry.path());
    if (r.manifest && r.manifest->library == library.filename().string()) return entry.path();
  }
  return std::nullopt;
}

}  // namespace

Runner add_inspect(CLI::App& app) {
  struct Options {
    std::string file;
    bool json = false;
  };
  auto options = std::make_shared<Options>();
  CLI::App* cmd = app.add_subcommand(
      "inspect", "Compare a plugin's manifest with its binary (exported symbols, embedded manifest) without loading it");
  cmd->add_option("file", options->file, "A plugin library (.so) or its manifest (.json)")
      ->required()
      ->type_name("FILE.so|FILE.json");
  add_json_flag(*cmd, options->json);

  return [options]() -> int {
    std::vector<Problem> problems;
    std::optional<Manifest> manifest;
    fs::path library;
    fs::path manifest_path;
    const fs::path file = options->file;
    try {
      if (file.extension() == ".json") {
        manifest_path = file;
        ManifestResult r = read_manifest(file);
        problems.insert(problems.end(), r.errors.begin(), r.errors.end());
        if (!r.manifest) {
          if (options->json) {
            print_json(Json{{"manifest", file.string()}, {"problems", problems_json(problems)}});
          } else {
            for (const auto& p : problems) fmt::print("{}: {}: {}\n", file.string(), code_string(p.code), p.message);
          }
          return kDispatchError;
        }
        manifest = std::move(r.manifest);
        library = manifest->library_path();
      } else {
        library = file;
        if (auto m = manifest_for_library(file)) {
          manifest_path = *m;
          manifest = read_manifest(*m).manifest;
        }
      }
      const ElfInfo elf = read_elf(library);
      const bool exports_entry = std::find(elf.exported_symbols.begin(), elf.exported_symbols.end(),
                                           KDISPATCH_PLUGIN_ENTRY_SYMBOL) != elf.exported_symbols.end();
      if (!exports_entry) {
        problems.push_back({ErrorCode::plugin_no_entry, library.string(),
                            fmt::format("{} does not export {}", library.string(), KDISPATCH_PLUGIN_ENTRY_SYMBOL)});
      }
      std::optional<Manifest> embedded;
      if (!elf.embedded_manifest) {
        problems.push_back({ErrorCode::plugin_manifest_mismatch, library.string(),
                            fmt::format("{} has no {} section", library.string(), KDISPATCH_MANIFEST_SECTION)});
      } else {
        ManifestResult r = parse_manifest(*elf.embedded_manifest, "<embedded in " + library.string() + ">");
        for (const auto& e : r.errors) problems.push_back({ErrorCode::plugin_manifest_mismatch, library.string(), e.message});
        embedded = std::move(r.manifest);
      }
      if (!manifest) {
        problems.push_back({ErrorCode::manifest_bad_library_path, library.string(),
                            fmt::format("no manifest in {} names {} as its library", library.parent_path().string(),
                                        library.filename().string())});
      } else if (embedded) {
        for (const std::string& difference : manifest_differences(*manifest, *embedded)) {
          problems.push_back({ErrorCode::plugin_manifest_mismatch, library.string(),
                              fmt::format("the manifest and the binary disagree: {}", difference)});
        }
      }

      if (options->json) {
        Json doc;
        doc["library"] = library.string();
        doc["manifest"] = manifest_path.string();
        doc["machine"] = elf.machine;
        doc["class"] = elf.elf_class;
        doc["exported_symbols"] = elf.exported_symbols;
        doc["needed"] = elf.needed;
        doc["embedded_manifest"] = embedded ? Json{{"plugin", embedded->plugin},
                                                   {"backend", embedded->backend},
                                                   {"kernels", embedded->kernels.size()}}
                                            : Json(nullptr);
        doc["agrees"] = problems.empty();
        doc["problems"] = problems_json(problems);
        print_json(doc);
      } else {
        fmt::print("library:   {} ({}, {})\n", library.string(), elf.elf_class, elf.machine);
        fmt::print("manifest:  {}\n", manifest_path.empty() ? "(none found)" : manifest_path.string());
        fmt::print("exports:   {}\n", fmt::join(elf.exported_symbols, ", "));
        fmt::print("needs:     {}\n", fmt::join(elf.needed, ", "));
        if (embedded) {
          fmt::print("embedded:  plugin '{}', backend '{}', {} kernel(s)\n", embedded->plugin, embedded->backend,
                     embedded->kernels.size());
        }
        for (const auto& p : problems) fmt::print("{}: {}\n", code_string(p.code), p.message);
        fmt::print("{}\n", problems.empty() ? "manifest and binary agree" : "manifest and binary DISAGREE");
      }
      return problems.empty() ? kOk : kDispatchError;
    } catch (const Error& e) {
      return report_error(e, options->json);
    }
  };
}

}  // namespace kdispatch::cli
