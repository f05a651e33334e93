// kdispatch validate: schema and semantic checks of manifests and op-schema
// files, one line per problem, then what the files, with the built-in op
// schemas and the installed plugins, leave unchecked (warnings, coverage.hpp).
#include <fmt/format.h>

#include <set>

#include "common.hpp"
#include "kdispatch/context.hpp"
#include "kdispatch/coverage.hpp"
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
  cmd->footer(
      "Prints FILE: KD-Ennn: message per error and FILE: warning: KD-Ennn: message per warning. Beyond each file's\n"
      "format, it warns (KD-E014) where the files, with the built-in op schemas and the plugins on the default path,\n"
      "leave an op unchecked: a kernel whose op has no schema, kernel dtypes the schema does not take or schema\n"
      "dtypes no kernel serves, a schema with no written tensor, a reference that checks nothing, an op without\n"
      "a reference. Warnings leave the exit code 0. Example: kdispatch validate manifests/*.json");

  return [options]() -> int {
    // Each file once: a manifest, or a list of op schemas.
    struct Given {
      std::string file;
      std::vector<Problem> errors;
      std::vector<Problem> warnings;
      std::optional<Manifest> manifest;
      std::vector<OpSchema> schemas;
      std::string summary;
    };
    std::vector<Given> given;
    given.reserve(options->files.size());  // the view below points into them
    for (const auto& file : options->files) {
      Given g{file, {}, {}, std::nullopt, {}, {}};
      Problem unreadable{};
      const std::optional<std::string> text = read_manifest_text(file, unreadable);
      if (!text) {
        g.errors.push_back(std::move(unreadable));
      } else if (looks_like_schema_list(*text)) {
        SchemaFileResult r = parse_op_schemas(*text, file);
        g.errors = std::move(r.errors);
        g.warnings = std::move(r.warnings);
        g.schemas = std::move(r.schemas);
        g.summary = fmt::format("{} op schema(s)", g.schemas.size());
      } else {
        ManifestResult r = parse_manifest(*text, file);
        g.errors = std::move(r.errors);
        g.warnings = std::move(r.warnings);
        g.manifest = std::move(r.manifest);
        if (g.manifest) {
          g.summary = fmt::format("plugin '{}', backend '{}', {} kernel(s)", g.manifest->plugin,
                                  g.manifest->backend, g.manifest->kernels.size());
        }
      }
      given.push_back(std::move(g));
    }

    // What the files meet where they are installed: the built-in op schemas
    // and the plugins on the default path. The files given come first and
    // replace an installed plugin of the same name.
    const Context installed;
    CoverageView view;
    std::set<std::string> given_plugins;
    for (const Given& g : given) {
      for (const OpSchema& s : g.schemas) view.add_schema(s);
      if (!g.manifest) continue;
      view.add_manifest(*g.manifest);
      given_plugins.insert(g.manifest->plugin);
    }
    for (const OpSchema* s : installed.registry().schemas()) {
      if (s->source.starts_with("<builtin>")) view.add_schema(*s);
    }
    for (const PluginRecord& rec : installed.discovery().plugins) {
      if (rec.state == PluginState::found && rec.manifest && given_plugins.count(rec.manifest->plugin) == 0) {
        view.add_manifest(*rec.manifest);
      }
    }
    std::set<std::string> referenced;
    for (const Manifest* m : view.manifests()) {
      for (const auto& k : m->kernels) {
        if (k.is_reference()) referenced.insert(k.op);
      }
    }

    Json results = Json::array();
    bool any_error = false;
    for (Given& g : given) {
      std::vector<std::string> without_reference;
      if (g.manifest) {
        for (Problem& p : check_manifest_coverage(*g.manifest, view)) g.warnings.push_back(std::move(p));
        for (const auto& k : g.manifest->kernels) {
          if (!k.is_reference() && referenced.count(k.op) == 0) without_reference.push_back(k.op);
        }
      }
      for (const OpSchema& s : g.schemas) {
        for (Problem& p : check_schema_outputs(s, g.file)) g.warnings.push_back(std::move(p));
      }
      any_error = any_error || !g.errors.empty();
      if (options->json) {
        results.push_back({{"file", g.file},
                           {"ok", g.errors.empty()},
                           {"errors", problems_json(g.errors)},
                           {"warnings", problems_json(g.warnings)},
                           {"ops_without_reference", without_reference}});
        continue;
      }
      for (const auto& e : g.errors) fmt::print("{}: {}: {}\n", g.file, code_string(e.code), e.message);
      for (const auto& w : g.warnings) fmt::print("{}: warning: {}: {}\n", g.file, code_string(w.code), w.message);
      if (g.errors.empty()) {
        fmt::print("{}: ok ({}{})\n", g.file, g.summary,
                   g.warnings.empty() ? "" : fmt::format("; {} warning{}", g.warnings.size(),
                                                         g.warnings.size() == 1 ? "" : "s"));
      }
    }
    if (options->json) print_json(Json{{"results", results}});
    return any_error ? kDispatchError : kOk;
  };
}

}  // namespace kdispatch::cli
