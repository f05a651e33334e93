#include "hostile_helpers.hpp"

#include <doctest/doctest.h>

#include <fstream>

namespace hostile {

namespace {
const std::string kPluginDir = KDISPATCH_PLUGIN_DIR;
const std::string kHostile = KDISPATCH_HOSTILE_DIR;
}  // namespace

Json json_of(const ToolResult& r) {
  INFO("exit " << r.exit_code << "\nstdout: " << r.out << "\nstderr: " << r.err);
  REQUIRE_NOTHROW(Json::parse(r.out));
  return Json::parse(r.out);
}

void write_file(const fs::path& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

fs::path dir_with_cpu_plugin(const std::string& name) {
  const fs::path dir = fs::path(make_temp_dir()) / name;
  fs::create_directories(dir);
  fs::permissions(dir, fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec | fs::perms::others_read |
                           fs::perms::others_exec);
  for (const char* file : {"cpu.json", "libkdispatch-cpu.so", "reference.json", "libkdispatch-reference.so"}) {
    fs::copy_file(kPluginDir + "/" + file, dir / file);
  }
  return dir;
}

void add_fixture(const fs::path& dir, const std::string& name) {
  for (const auto& entry : fs::directory_iterator(kHostile + "/" + name)) {
    fs::copy_file(entry.path(), dir / entry.path().filename(), fs::copy_options::overwrite_existing);
  }
}

const Json* plugin_named(const Json& doc, const std::string& name) {
  for (const auto& p : doc["plugins"]) {
    if (p["name"] == name) return &p;
  }
  return nullptr;
}

}  // namespace hostile
