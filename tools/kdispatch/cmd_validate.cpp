// kdispatch validate: schema and semantic checks of manifests and op-schema
// files, one line per problem, and a note for each op a manifest implements
// that has no reference kernel.
#include <fmt/format.h>

#include <set>

#include "common.hpp"
#include "kdispatch/context.hpp"
#include "kdispatch/manifest.hpp"

namespace kdispatch::cli {

namespace {

// An op-schema file is a JSON list; a manifest is an object.
bool looks_like_schema_list(const std::string& text) {
  for (char c : text) {
    if (c == ' ' || c == '\n' || c == '\r' || c == '\t') continue;
    return c == '[';
  }
  return false;
}

}  // namespace

Runner add_validate(CLI::App& app) {
  struct Options {
    std::vector<std::string> files;
    bool json = false;
  };
  auto options = std::make_shared<Options>();
  CLI::App* cmd = app.add_subcommand(
      "validate", "Check plugin manifests (and op-schema files) against the format; exit 2 on any problem");
  cmd->add_option("files", options->files, "Manifest or op-schema files")->required()->type_name("MANIFEST...");
  add_json_flag(*cmd, options->json);
  cmd->footer("Prints FILE: KD-Ennn: message per problem. Example: kdispatch validate manifests/*.json");

  return [options]() -> int {
    // Reference kernels: of the files given and of the plugins on the
    // default path, so that a backend's manifest is checked against the
    // references it will meet.
    std::set<std::string> referenced;
    std::vector<ManifestResult> parsed;
    for (const auto& file : options->files) parsed.push_back(read_manifest(file));
    for (const auto& r : parsed) {
      if (!r.manifest || r.manifest->role != KernelRole::reference) continue;
      for (const auto& k : r.manifest->kernels) referenced.insert(k.op);
    }
    {
      const Context installed;
      for (const auto& op : installed.registry().ops()) {
        if (installed.registry().reference(op) != nullptr) referenced.insert(op);
      }
    }
    Json results = Json::array();
    bool any_error = false;
    for (const auto& file : options->files) {
      std::vector<Problem> errors;
      std::vector<Problem> warnings;
      std::string summary;
      std::vector<std::string> without_reference;
      Problem unreadable{};
      const std::optional<std::string> text = read_manifest_text(file, unreadable);
      if (!text) {
        errors.push_back(std::move(unreadable));
      } else if (looks_like_schema_list(*text)) {
        SchemaFileResult r = parse_op_schemas(*text, file);
        errors = std::move(r.errors);
        warnings = std::move(r.warnings);
        summary = fmt::format("{} op schema(s)", r.schemas.size());
      } else {
        ManifestResult r = parse_manifest(*text, file);
        errors = std::move(r.errors);
        warnings = std::move(r.warnings);
        if (r.manifest) {
          summary = fmt::format("plugin '{}', backend '{}', {} kernel(s)", r.manifest->plugin, r.manifest->backend,
                                r.manifest->kernels.size());
          for (const auto& k : r.manifest->kernels) {
            if (referenced.count(k.op) == 0) without_reference.push_back(k.op);
          }
        }
      }
      any_error = any_error || !errors.empty();
      if (options->json) {
        results.push_back({{"file", file},
                           {"ok", errors.empty()},
                           {"errors", problems_json(errors)},
                           {"warnings", problems_json(warnings)},
                           {"ops_without_reference", without_reference}});
        continue;
      }
      for (const auto& e : errors) fmt::print("{}: {}: {}\n", file, code_string(e.code), e.message);
      for (const auto& w : warnings) fmt::print("{}: warning: {}\n", file, w.message);
      for (const auto& op : without_reference) {
        fmt::print("{}: note: op '{}' has no reference kernel (no plugin with \"role\": \"reference\" provides it); "
                   "run and bench report its results unchecked\n",
                   file, op);
      }
      if (errors.empty()) fmt::print("{}: ok ({})\n", file, summary);
    }
    if (options->json) print_json(Json{{"results", results}});
    return any_error ? kDispatchError : kOk;
  };
}

}  // namespace kdispatch::cli
