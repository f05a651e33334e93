// Special files (FIFOs, devices, directories) where a regular file is
// expected: reported with a code naming the file, never opened, never a hang.
#include <doctest/doctest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <map>

#include "hostile_helpers.hpp"

using namespace hostile;

TEST_CASE("hostile special files: FIFOs, devices and directories named like manifests are reported, never opened") {
  const fs::path dir = dir_with_cpu_plugin();
  REQUIRE(mkfifo((dir / "fifo.json").c_str(), 0644) == 0);
  fs::create_directory(dir / "folder.json");
  fs::create_symlink("/dev/null", dir / "null.json");
  for (const char* command : {"list", "doctor"}) {
    INFO(command);
    const ToolResult r = run_tool({command, "--json", "--plugin-path", dir.string()}, {{"KDISPATCH_LOG", "warn"}});
    CHECK(r.exit_code == (std::string(command) == "doctor" ? 2 : 0));
    const Json doc = json_of(r);
    REQUIRE(plugin_named(doc, "cpu") != nullptr);
    CHECK((*plugin_named(doc, "cpu"))["status"] == "ok");
    std::map<std::string, std::string> reported;
    for (const auto& p : doc["plugins"]) {
      for (const auto& q : p["problems"]) reported[fs::path(q["file"].get<std::string>()).filename()] = q["message"];
    }
    CHECK(reported["fifo.json"].find("a FIFO, not a regular file") != std::string::npos);
    CHECK(reported["folder.json"].find("a directory, not a regular file") != std::string::npos);
    CHECK(reported["null.json"].find("a character device, not a regular file") != std::string::npos);
    CHECK(r.err.find("fifo.json") != std::string::npos);
  }
  const ToolResult v = run_tool({"validate", (dir / "fifo.json").string(), (dir / "folder.json").string()});
  CHECK(v.exit_code == 2);
  CHECK(v.out.find("fifo.json: KD-E010:") != std::string::npos);
  CHECK(v.out.find("a FIFO, not a regular file") != std::string::npos);
  CHECK(v.out.find("a directory, not a regular file") != std::string::npos);
  const ToolResult i = run_tool({"inspect", (dir / "fifo.json").string()});
  CHECK(i.exit_code == 2);
  CHECK(i.out.find("a FIFO, not a regular file") != std::string::npos);
  // A library inspected beside a FIFO manifest: the FIFO is not read.
  const ToolResult lib = run_tool({"inspect", "--json", (dir / "libkdispatch-cpu.so").string()});
  CHECK(lib.exit_code == 0);
  CHECK(json_of(lib)["manifest"].get<std::string>().find("cpu.json") != std::string::npos);
  fs::remove_all(dir.parent_path());
}

TEST_CASE("hostile special files: a plugin library or inspected file that is a FIFO") {
  const fs::path dir = dir_with_cpu_plugin();
  REQUIRE(mkfifo((dir / "libfifo.so").c_str(), 0644) == 0);
  write_file(dir / "fifo.json", R"({"kdispatch_manifest": "1.0", "plugin": "fifo", "backend": "fifo",
    "library": "libfifo.so", "abi": "1.0", "kernels": [{"op": "fixture.scale", "symbol": "kd_fifo_scale"}]})");
  const ToolResult r = run_tool({"doctor", "--json", "--plugin-path", dir.string()});
  CHECK(r.exit_code == 2);
  const Json doc = json_of(r);
  REQUIRE(plugin_named(doc, "fifo") != nullptr);
  const Json& problem = (*plugin_named(doc, "fifo"))["problems"][0];
  CHECK(problem["code"] == "KD-E012");
  CHECK(problem["message"].get<std::string>().find("not a regular file") != std::string::npos);
  CHECK((*plugin_named(doc, "cpu"))["loaded"] == true);
  const ToolResult i = run_tool({"inspect", (dir / "libfifo.so").string()});
  CHECK(i.exit_code == 2);
  CHECK(i.err.find("KD-E020") != std::string::npos);
  CHECK(i.err.find("a FIFO, not a regular file") != std::string::npos);
  fs::remove_all(dir.parent_path());
}

TEST_CASE("hostile special files: KDISPATCH_TRACE naming a FIFO or a directory") {
  const fs::path dir = dir_with_cpu_plugin();
  REQUIRE(mkfifo((dir.parent_path() / "trace.fifo").c_str(), 0644) == 0);
  for (const fs::path& trace : {dir.parent_path() / "trace.fifo", dir.parent_path()}) {
    const ToolResult r =
        run_tool({"run", "layernorm.rmsnorm", "--dtype", "float32", "--iters", "1", "--plugin-path", dir.string()},
                 {{"KDISPATCH_TRACE", trace.string()}});
    CHECK(r.exit_code == 0);
    CHECK(r.err.find("KD-E050") != std::string::npos);
    CHECK(r.err.find(trace.string()) != std::string::npos);
    CHECK(r.err.find("not a regular file") != std::string::npos);
  }
  // A regular file still gets one JSON line per call.
  const fs::path trace = dir.parent_path() / "trace.jsonl";
  const ToolResult ok = run_tool(
      {"run", "layernorm.rmsnorm", "--dtype", "float32", "--iters", "1", "--no-check", "--plugin-path", dir.string()},
      {{"KDISPATCH_TRACE", trace.string()}});
  CHECK(ok.exit_code == 0);
  std::ifstream in(trace);
  std::string line;
  REQUIRE(std::getline(in, line));
  CHECK(Json::parse(line)["op"] == "layernorm.rmsnorm");
  fs::remove_all(dir.parent_path());
}

// --- a corrupt ELF file ------------------------------------------------------------

TEST_CASE("hostile elf: a library with one program-header byte changed is refused before dlopen") {
  const fs::path dir = dir_with_cpu_plugin();
  add_fixture(dir, "fx_corrupt_elf");
  const ToolResult doctor = run_tool({"doctor", "--json", "--plugin-path", dir.string()});
  CHECK(doctor.exit_code == 2);
  const Json doc = json_of(doctor);
  const Json* bad = plugin_named(doc, "fx_good");
  REQUIRE(bad != nullptr);
  CHECK((*bad)["loaded"] == false);
  const Json& problem = (*bad)["problems"].back();
  CHECK(problem["code"] == "KD-E020");
  CHECK(problem["message"].get<std::string>().find("corrupt ELF file") != std::string::npos);
  CHECK((*plugin_named(doc, "cpu"))["loaded"] == true);
  const ToolResult run =
      run_tool({"run", "--all", "--json", "--iters", "1", "--dtype", "float32", "--plugin-path", dir.string()});
  CHECK(run.exit_code == 2);
  size_t cpu_ok = 0;
  const Json results = json_of(run)["results"];
  bool refused = false;
  for (const auto& r : results) {
    cpu_ok += r["backend"] == "cpu" && r["ok"] == true;
    if (r["op"] == "fixture.scale") refused = r["error"].get<std::string>().find("[KD-E020]") == 0;
  }
  CHECK(cpu_ok >= 7);
  CHECK(refused);
  fs::remove_all(dir.parent_path());
}
