// doctor's verdict follows what it found: KD-E005 and unreadable plugin
// directories are problems, warnings are not; manifests fall under the
// ownership and permission rule of libraries (KD-E025).
#include <doctest/doctest.h>
#include <fcntl.h>
#include <grp.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>

#include "hostile_helpers.hpp"

using namespace hostile;

namespace {

// Runs the tool as uid/gid 65534 when the test runs as root (who may read
// any directory), else as the current user; stdout only.
ToolResult run_unprivileged(const std::vector<std::string>& args) {
  const std::string out = make_temp_dir() + "/out";
  const pid_t pid = fork();
  if (pid == 0) {
    const int fd = open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0666);
    dup2(fd, 1);
    const int null = open("/dev/null", O_WRONLY);
    dup2(null, 2);
    if (geteuid() == 0 && (setgroups(0, nullptr) != 0 || setgid(65534) != 0 || setuid(65534) != 0)) _exit(126);
    std::vector<std::string> argv_strings{KDISPATCH_TOOL};
    argv_strings.insert(argv_strings.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& a : argv_strings) argv.push_back(a.data());
    argv.push_back(nullptr);
    char* envp[] = {nullptr};
    alarm(60);
    execve(argv[0], argv.data(), envp);
    _exit(127);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  ToolResult r;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  std::ifstream in(out);
  r.out.assign(std::istreambuf_iterator<char>(in), {});
  fs::remove_all(fs::path(out).parent_path());
  return r;
}

// Whether the user run_unprivileged() switches to can reach the tool: every
// folder above it lets others through (a checkout in a private folder, such
// as one made by mktemp -d, does not).
bool unprivileged_can_reach_tool() {
  if (geteuid() != 0) return true;
  for (fs::path p = fs::path(KDISPATCH_TOOL).parent_path();; p = p.parent_path()) {
    struct stat st {};
    if (::stat(p.c_str(), &st) != 0 || (st.st_mode & S_IXOTH) == 0) return false;
    if (p == p.root_path() || p.empty()) return true;
  }
}

}  // namespace

TEST_CASE("hostile verdicts: doctor fails on KD-E005 instead of saying no problems found") {
  const fs::path dir = dir_with_cpu_plugin();
  // A second plugin declaring the cpu backend's kernels under another symbol.
  std::ifstream in(dir / "cpu.json");
  Json other = Json::parse(in);
  other["plugin"] = "cpu_copy";
  other["library"] = "libcopy.so";
  for (auto& k : other["kernels"]) k["symbol"] = "kd_copy";
  write_file(dir / "copy.json", other.dump());
  write_file(dir / "libcopy.so", "stand-in");
  const ToolResult human = run_tool({"doctor", "--no-load", "--plugin-path", dir.string()});
  CHECK(human.exit_code == 2);
  CHECK(human.out.find("KD-E005") != std::string::npos);
  CHECK(human.out.find("no problems found") == std::string::npos);
  CHECK(human.out.find("problems found") != std::string::npos);
  const ToolResult j = run_tool({"doctor", "--json", "--no-load", "--plugin-path", dir.string()});
  CHECK(j.exit_code == 2);
  bool conflict = false;
  const Json doc = json_of(j);  // a range-for over a temporary's member would dangle
  for (const auto& q : doc["problems"]) {
    conflict = conflict || (q["code"] == "KD-E005" && q["severity"] == "error");
  }
  CHECK(conflict);
  fs::remove_all(dir.parent_path());
}

TEST_CASE("hostile verdicts: warnings alone keep doctor's exit code 0") {
  const fs::path dir = dir_with_cpu_plugin();
  std::ifstream in(dir / "cpu.json");
  Json cpu = Json::parse(in);
  cpu["unknown_future_key"] = 1;
  write_file(dir / "cpu.json", cpu.dump());
  const ToolResult r = run_tool({"doctor", "--json", "--plugin-path", dir.string()});
  CHECK(r.exit_code == 0);
  CHECK(json_of(r)["problems"][0]["severity"] == "warning");
  fs::remove_all(dir.parent_path());
}

TEST_CASE("hostile verdicts: an unreadable plugin directory is a problem") {
  if (!unprivileged_can_reach_tool()) {
    // ctest reports the test as skipped (SKIP_REGULAR_EXPRESSION in tests/cli/CMakeLists.txt).
    MESSAGE("SKIPPED: uid 65534 cannot reach " << KDISPATCH_TOOL << " (a folder above it is private)");
    return;
  }
  const fs::path dir = dir_with_cpu_plugin();
  const fs::path locked = dir.parent_path() / "locked";
  fs::create_directory(locked);
  fs::permissions(locked, fs::perms::owner_all);
  fs::permissions(dir.parent_path(), fs::perms::owner_all | fs::perms::others_read | fs::perms::others_exec);
  const ToolResult r = run_unprivileged(
      {"doctor", "--json", "--no-load", "--plugin-path", dir.string(), "--plugin-path", locked.string()});
  CHECK(r.exit_code == 2);
  const Json doc = json_of(r);
  REQUIRE(doc["problems"].size() >= 1);
  CHECK(doc["problems"][0]["file"] == locked.string());
  CHECK(doc["problems"][0]["message"].get<std::string>().find("cannot list plugin directory") == 0);
  REQUIRE(plugin_named(doc, "cpu") != nullptr);
  fs::remove_all(dir.parent_path());
}

TEST_CASE("hostile verdicts: a world-writable or foreign-owned manifest is refused like a library (KD-E025)") {
  const fs::path dir = dir_with_cpu_plugin();
  write_file(dir / "other.json", R"({"kdispatch_manifest": "1.0", "plugin": "other", "backend": "other",
    "library": "libkdispatch-cpu.so", "abi": "1.0", "kernels": []})");
  fs::permissions(dir / "other.json", fs::perms::others_write, fs::perm_options::add);
  ToolResult r = run_tool({"doctor", "--json", "--no-load", "--plugin-path", dir.string()});
  CHECK(r.exit_code == 2);
  Json doc = json_of(r);
  const auto problem_of = [&](const Json& d) -> std::string {
    for (const auto& p : d["plugins"]) {
      if (fs::path(p["manifest"].get<std::string>()).filename() == "other.json") {
        CHECK(p["problems"][0]["code"] == "KD-E025");
        return p["problems"][0]["message"];
      }
    }
    return "not reported";
  };
  CHECK(problem_of(doc).find("world-writable") != std::string::npos);
  CHECK((*plugin_named(doc, "cpu"))["status"] == "ok");
  if (geteuid() == 0) {
    fs::permissions(dir / "other.json", fs::perms::others_write, fs::perm_options::remove);
    REQUIRE(chown((dir / "other.json").c_str(), 65534, 65534) == 0);
    r = run_tool({"doctor", "--json", "--no-load", "--plugin-path", dir.string()});
    CHECK(r.exit_code == 2);
    CHECK(problem_of(json_of(r)).find("owned by uid 65534") != std::string::npos);
  }
  fs::remove_all(dir.parent_path());
}
