// Helpers of the hostile-input CLI tests (tests/cli/test_hostile_*.cpp):
// private plugin folders holding the built cpu plugin and hostile fixtures.
#pragma once

#include <nlohmann/json.hpp>

#include <filesystem>
#include <string>

#include "run_tool.hpp"

namespace hostile {

namespace fs = std::filesystem;
using Json = nlohmann::json;

// The tool's stdout as JSON; fails the test (showing both streams) if it is not.
Json json_of(const ToolResult& r);
void write_file(const fs::path& path, const std::string& text);

// A private plugin folder (mode 0755) named `name` holding the built cpu
// plugin and the reference plugin it is checked against, inside a fresh
// temporary directory (its parent_path()).
fs::path dir_with_cpu_plugin(const std::string& name = "plugins");
// Copies the built hostile fixture `name` (manifest and library) into `dir`.
void add_fixture(const fs::path& dir, const std::string& name);
// The entry of `doc["plugins"]` named `name`, or nullptr.
const Json* plugin_named(const Json& doc, const std::string& name);

}  // namespace hostile
