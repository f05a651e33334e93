// The one place where the tool turns a JSON document into text. Strings in
// its documents come from places nobody checked for UTF-8: command-line
// arguments, manifest text, file and directory names, what a plugin returns.
// nlohmann's dump throws type_error 316 on such bytes; json_text replaces
// each byte that is not part of valid UTF-8 with U+FFFD instead, so every
// document is valid JSON and nothing else in it is lost.
#pragma once

#include <nlohmann/json.hpp>

#include <string>

namespace kdispatch::cli {

// `indent` as nlohmann's dump: -1 for one line. Never throws for content.
std::string json_text(const nlohmann::ordered_json& doc, int indent = 2);

}  // namespace kdispatch::cli
