// `run --save`: a directory that cannot take the files is a usage error
// before anything runs; each file appears complete under its final name or
// not at all; a file that cannot be written fails the run with KD-E050
// naming it. The memory check counts what a checked run really holds.
#include <doctest/doctest.h>
#include <fmt/format.h>
#include <sys/resource.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "hostile_helpers.hpp"

using namespace hostile;

TEST_CASE("hostile save: a --save path that cannot be a directory is a usage error before running") {
  const fs::path dir = dir_with_cpu_plugin();
  const fs::path file = dir.parent_path() / "plain-file";
  write_file(file, "x");
  const ToolResult r =
      run_tool({"run", "layernorm.rmsnorm", "--json", "--save", file.string(), "--plugin-path", dir.string()});
  CHECK(r.exit_code == 1);
  const Json doc = json_of(r);
  CHECK(doc["error"]["code"] == "usage");
  CHECK(doc["error"]["message"].get<std::string>().find("--save " + file.string()) == 0);
  CHECK_FALSE(doc.contains("results"));
  fs::remove_all(dir.parent_path());
}

TEST_CASE("hostile save: files are renamed into place whole, and one that cannot be written is KD-E050") {
  const fs::path dir = dir_with_cpu_plugin();
  const fs::path save = dir.parent_path() / "saved";
  fs::create_directory(save);
  // A directory under the name of one of the files.
  const fs::path blocked = save / "layernorm.rmsnorm.cpu.float32.x.in.npy";
  fs::create_directory(blocked);
  const ToolResult r = run_tool({"run", "layernorm.rmsnorm", "--dtype", "float32", "--iters", "1", "--json", "--save",
                                 save.string(), "--plugin-path", dir.string()});
  CHECK(r.exit_code == 2);
  const Json doc = json_of(r);
  REQUIRE(doc["results"].size() == 1);
  CHECK(doc["results"][0]["ok"] == true);
  const std::string error = doc["results"][0]["error"];
  CHECK(error.find("[KD-E050] cannot write " + blocked.string() + ": exists and is not a regular file") == 0);
  size_t npy = 0;
  for (const auto& entry : fs::directory_iterator(save)) {
    const std::string name = entry.path().filename().string();
    CHECK_MESSAGE(name.find(".tmp-") == std::string::npos, name);
    if (entry.is_regular_file() && name.ends_with(".npy")) {
      ++npy;
      std::ifstream in(entry.path(), std::ios::binary);
      char magic[6] = {};
      in.read(magic, 6);
      CHECK(std::string(magic, 6) == "\x93NUMPY");
    }
  }
  CHECK(npy >= 2);  // weight.in and out.out at least
  CHECK(fs::is_regular_file(save / "layernorm.rmsnorm.cpu.float32.attrs.json"));
  fs::remove_all(dir.parent_path());
}

TEST_CASE("hostile save: the memory check counts copies and the float64 reference, not two copies") {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  // A sanitized tool reserves terabytes of shadow memory at start and
  // cannot run under the address-space limit this test sets.
  MESSAGE("skipped in sanitizer builds");
  return;
#endif
  const fs::path dir = dir_with_cpu_plugin();
  // The tool runs under a 2 GiB address-space limit, which it takes as the
  // memory it may use. rmsnorm float32 with rows of 2048: out and x take
  // 16 KiB a row; checked, the run holds three copies and 16 bytes per
  // element of float64 reference (112 KiB a row). Two copies of 40,000 rows
  // fit in 2 GiB, the peak does not.
  rlimit saved{};
  REQUIRE(getrlimit(RLIMIT_AS, &saved) == 0);
  rlimit limit = saved;
  limit.rlim_cur = rlim_t{2} << 30;
  REQUIRE(setrlimit(RLIMIT_AS, &limit) == 0);
  const ToolResult r = run_tool({"run", "layernorm.rmsnorm", "--dtype", "float32", "--shape", "H=2048", "--shape",
                                 "*=40000", "--plugin-path", dir.string()});
  REQUIRE(setrlimit(RLIMIT_AS, &saved) == 0);
  CHECK(r.exit_code == 1);
  CHECK(r.err.find("running it needs about") != std::string::npos);
  CHECK(r.err.find("this process may use 2.0 GiB of memory") != std::string::npos);
  fs::remove_all(dir.parent_path());
}
