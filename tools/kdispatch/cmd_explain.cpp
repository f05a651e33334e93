// kdispatch explain: the catalogue entry of an error code.
#include <fmt/format.h>

#include "common.hpp"
#include "kdispatch/error_catalogue.hpp"

namespace kdispatch::cli {

Runner add_explain(CLI::App& app) {
  struct Options {
    std::string code;
    bool json = false;
  };
  auto options = std::make_shared<Options>();
  CLI::App* cmd = app.add_subcommand("explain", "Explain an error code: meaning, common causes, fix");
  cmd->add_option("code", options->code, "KD-Ennn (without it: list every code)")->type_name("KD-Ennn");
  add_json_flag(*cmd, options->json);

  return [options]() -> int {
    if (options->code.empty()) {
      Json all = Json::array();
      for (const auto& e : error_catalogue()) {
        if (options->json) {
          all.push_back({{"code", code_string(e.code)}, {"title", e.title}});
        } else {
          fmt::print("{}  {}\n", code_string(e.code), e.title);
        }
      }
      if (options->json) print_json(Json{{"codes", all}});
      return kOk;
    }
    ErrorCode code{};
    if (!parse_code(options->code, &code)) {
      throw UsageError(fmt::format("unknown error code '{}'; `kdispatch explain` lists them all", options->code));
    }
    const CatalogueEntry& e = *find_catalogue_entry(code);
    if (options->json) {
      print_json(Json{{"code", code_string(e.code)},
                      {"title", e.title},
                      {"meaning", e.meaning},
                      {"causes", e.causes},
                      {"fix", e.fix}});
      return kOk;
    }
    fmt::print("{}: {}\n\n{}\n\nCommon causes:\n{}\n\nFix:\n{}\n", code_string(e.code), e.title, e.meaning, e.causes,
               e.fix);
    return kOk;
  };
}

}  // namespace kdispatch::cli
