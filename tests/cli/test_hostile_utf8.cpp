// Bytes that are not UTF-8 (arguments, manifest text, file and directory names,
// strings a plugin returns) must leave every --json document valid, with the
// other plugins still reported.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <map>

#include "hostile_helpers.hpp"

using namespace hostile;

TEST_CASE("hostile utf8: names, manifest text and arguments that are not UTF-8 keep --json valid") {
  const fs::path dir = dir_with_cpu_plugin("plugins-\xff\xfe");
  // A manifest whose text holds a Latin-1 byte, under a file name that is not
  // UTF-8 either: KD-E010, quoting the bytes.
  write_file(dir / "caf\xe9.json", "{\"kdispatch_manifest\": \"1.0\", \"plugin\": \"caf\xe9\"}");
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"list", "--json", "--device", "cpu"}, {"doctor", "--json"}}) {
    std::vector<std::string> full = args;
    full.insert(full.end(), {"--plugin-path", dir.string()});
    const ToolResult r = run_tool(full);
    INFO(args[0]);
    CHECK(r.exit_code == (args[0] == "doctor" ? 2 : 0));
    const Json doc = json_of(r);
    const Json* cpu = plugin_named(doc, "cpu");
    REQUIRE(cpu != nullptr);
    CHECK((*cpu)["status"] == "ok");
    bool bad_reported = false;
    for (const auto& p : doc["plugins"]) {
      for (const auto& q : p["problems"]) bad_reported = bad_reported || q["code"] == "KD-E010";
    }
    CHECK(bad_reported);
  }
  const ToolResult v = run_tool({"validate", "--json", (dir / "caf\xe9.json").string()});
  CHECK(v.exit_code == 2);
  CHECK(json_of(v)["results"][0]["errors"][0]["code"] == "KD-E010");

  // An argument that is not UTF-8: KD-E001 as a JSON document.
  const ToolResult s =
      run_tool({"select", "layernorm.\xff\xfe", "--device", "cpu", "--json", "--plugin-path", dir.string()});
  CHECK(s.exit_code == 2);
  CHECK(json_of(s)["error"]["code"] == "KD-E001");
  const ToolResult u = run_tool({"run", "--json", "--device", "\xff"});
  CHECK(u.exit_code == 1);
  CHECK(json_of(u)["error"]["code"] == "usage");
  fs::remove_all(dir.parent_path());
}

TEST_CASE("hostile utf8: a plugin's probe returning bytes that are not UTF-8") {
  const fs::path dir = dir_with_cpu_plugin();
  add_fixture(dir, "fx_utf8");
  const ToolResult r = run_tool({"doctor", "--json", "--plugin-path", dir.string()});
  CHECK(r.exit_code == 0);
  const Json doc = json_of(r);
  const Json* fx = plugin_named(doc, "fx_utf8");
  REQUIRE(fx != nullptr);
  CHECK((*fx)["loaded"] == true);
  // Each invalid byte became U+FFFD; the valid text around them stayed.
  CHECK((*fx)["devices"][0]["name"] == "caf\xef\xbf\xbd cpu \xef\xbf\xbd\xef\xbf\xbd");
  REQUIRE(plugin_named(doc, "cpu") != nullptr);
  CHECK((*plugin_named(doc, "cpu"))["loaded"] == true);
  fs::remove_all(dir.parent_path());
}
