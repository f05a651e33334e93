// Out-of-process scanning: plugins whose constructors segfault, abort,
// exit(0), loop forever or print to stdout, and a corrupted ELF file, beside
// the cpu plugin. `kdispatch scan` reports each with its code and cause;
// doctor and run --all then finish with valid JSON and every cpu result;
// the registry cache keeps the outcomes and the parsed manifests until a
// file changes, a warm cache gives the tool's output a cold one gives, and
// a broken cache never stops the tool.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include "hostile_helpers.hpp"

using namespace hostile;

namespace {

struct Folder {
  fs::path plugins;
  fs::path cache;  // XDG_CACHE_HOME of the commands
  // Under the sanitizer presets the helper is instrumented too: its SIGSEGV
  // must stay a signal (not a sanitizer report and exit 1), and the exit(0)
  // of a constructor must stay status 0 (no leak check at that exit).
  std::map<std::string, std::string> env() const {
    return {{"XDG_CACHE_HOME", cache.string()},
            {"KDISPATCH_SCAN_TIMEOUT", "2"},
            {"ASAN_OPTIONS", "handle_segv=0:detect_leaks=0"},
            {"TSAN_OPTIONS", "handle_segv=0"}};
  }
  ~Folder() { fs::remove_all(plugins.parent_path()); }
};

Folder hostile_folder() {
  Folder f;
  f.plugins = dir_with_cpu_plugin();
  f.cache = f.plugins.parent_path() / "cache";
  for (const char* name :
       {"fx_ctor_segv", "fx_ctor_abort", "fx_ctor_exit", "fx_ctor_loop", "fx_ctor_stdout", "fx_corrupt_elf"}) {
    add_fixture(f.plugins, name);
  }
  return f;
}

// The registry cache leaves out manifests changed within the last 100 ms.
void settle() { std::this_thread::sleep_for(std::chrono::milliseconds(150)); }

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

std::map<std::string, std::string> env_with(std::map<std::string, std::string> env, const std::string& key,
                                            const std::string& value) {
  env[key] = value;
  return env;
}

}  // namespace

TEST_CASE("hostile scan: every misbehaving plugin is reported with its code and cause") {
  const Folder f = hostile_folder();
  const ToolResult r = run_tool({"scan", "--json", "--plugin-path", f.plugins.string()}, f.env());
  CHECK(r.exit_code == 2);
  const Json doc = json_of(r);
  std::map<std::string, Json> by_name;
  for (const auto& p : doc["plugins"]) by_name[p["name"]] = p;
  CHECK(by_name["cpu"]["verdict"] == "ok");
  CHECK(by_name["cpu"]["problem"].is_null());
  const std::map<std::string, std::pair<std::string, std::string>> expected = {
      {"fx_ctor_segv", {"crashed", "crashed with signal 11"}},
      {"fx_ctor_abort", {"crashed", "crashed with signal 6"}},
      {"fx_ctor_exit", {"exited", "exited with status 0"}},
      {"fx_ctor_loop", {"hung", "hung (still running after 2.0 s, killed)"}},
      {"fx_ctor_stdout", {"wrote-stdout", "wrote to stdout (\"hello from a plugin constructor"}},
  };
  for (const auto& [name, verdict] : expected) {
    INFO(name);
    CHECK(by_name[name]["verdict"] == verdict.first);
    CHECK(by_name[name]["problem"]["code"] == "KD-E027");
    CHECK(by_name[name]["problem"]["message"].get<std::string>().find(verdict.second) != std::string::npos);
  }
  // The corrupt ELF file is refused by the helper's ELF check, with its code.
  CHECK(by_name["fx_good"]["verdict"] == "incompatible");
  CHECK(by_name["fx_good"]["problem"]["code"] == "KD-E020");
}

namespace {
// One float32 result per kernel of the cpu backend's manifest that serves
// float32 (moe.align_block_size's serves int32 and int64 ids only).
size_t cpu_float32_kernels() {
  std::ifstream in(std::string(KDISPATCH_SOURCE_DIR) + "/manifests/cpu.json");
  const Json manifest = Json::parse(in);
  size_t n = 0;
  for (const Json& k : manifest["kernels"]) {
    for (const Json& d : k["dtypes"]) n += d == "float32";
  }
  return n;
}
}  // namespace

TEST_CASE("hostile scan: doctor and run --all finish with valid JSON and every cpu result") {
  const Folder f = hostile_folder();
  for (int pass = 0; pass < 2; ++pass) {  // a cold cache, then a warm one
    INFO("pass " << pass);
    const ToolResult doctor = run_tool({"doctor", "--json", "--plugin-path", f.plugins.string()}, f.env());
    CHECK(doctor.exit_code == 2);
    const Json doc = json_of(doctor);
    CHECK((*plugin_named(doc, "cpu"))["loaded"] == true);
    for (const char* name : {"fx_ctor_segv", "fx_ctor_abort", "fx_ctor_exit", "fx_ctor_loop", "fx_ctor_stdout"}) {
      REQUIRE(plugin_named(doc, name) != nullptr);
      CHECK((*plugin_named(doc, name))["problems"].back()["code"] == "KD-E027");
    }
    const ToolResult run = run_tool(
        {"run", "--all", "--json", "--iters", "1", "--dtype", "float32", "--plugin-path", f.plugins.string()}, f.env());
    CHECK(run.exit_code == 2);
    size_t cpu_ok = 0;
    const Json results = json_of(run)["results"];
    for (const auto& result : results) cpu_ok += result["backend"] == "cpu" && result["ok"] == true;
    CHECK(cpu_ok == cpu_float32_kernels());
  }
}

TEST_CASE("hostile scan: definite outcomes are cached until the plugin's file changes, a timeout is not") {
  const Folder f = hostile_folder();
  const auto info = env_with(f.env(), "KDISPATCH_LOG", "info");
  CHECK(run_tool({"scan", "--plugin-path", f.plugins.string()}, f.env()).exit_code == 2);
  const ToolResult warm = run_tool({"doctor", "--plugin-path", f.plugins.string()}, info);
  // Every definite outcome from the cache; a timeout is not one (a loaded
  // machine can cause it), so the plugin that hung is scanned again.
  const size_t first_scan = warm.err.find("plugin scanner:");
  REQUIRE(first_scan != std::string::npos);
  CHECK(warm.err.find("plugin scanner: 'fx_ctor_loop': hung") == first_scan);
  CHECK(warm.err.find("plugin scanner:", first_scan + 1) == std::string::npos);
  CHECK(warm.out.find("crashed with signal 11") != std::string::npos);
  CHECK(warm.out.find("hung (still running after 2.0 s, killed) when the plugin scanner opened it; it is not opened "
                      "in this process, and the next process scans it again") != std::string::npos);
  // A new modification time makes the entry stale: scanned again.
  fs::last_write_time(f.plugins / "libfx_ctor_segv.so", fs::file_time_type::clock::now());
  const ToolResult touched = run_tool({"doctor", "--plugin-path", f.plugins.string()}, info);
  CHECK(touched.err.find("plugin scanner: 'fx_ctor_segv': crashed") != std::string::npos);
  CHECK(touched.err.find("plugin scanner: 'fx_ctor_abort'") == std::string::npos);
  // A library rewritten with the same size and its old mtime put back (what
  // `cp -p`, `tar` or `rsync -t` of a rebuilt library of the same size
  // does) has a new change time: scanned again too.
  const fs::path abort_library = f.plugins / "libfx_ctor_abort.so";
  const fs::file_time_type mtime = fs::last_write_time(abort_library);
  const std::string bytes = read_file(abort_library);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  std::ofstream(abort_library, std::ios::binary | std::ios::trunc) << bytes;
  fs::last_write_time(abort_library, mtime);
  const ToolResult copied = run_tool({"doctor", "--plugin-path", f.plugins.string()}, info);
  CHECK(copied.err.find("plugin scanner: 'fx_ctor_abort': crashed") != std::string::npos);
  CHECK(copied.err.find("plugin scanner: 'fx_ctor_segv'") == std::string::npos);
  // KDISPATCH_SCAN=always scans all of them again.
  const ToolResult always =
      run_tool({"doctor", "--plugin-path", f.plugins.string()}, env_with(info, "KDISPATCH_SCAN", "always"));
  CHECK(always.err.find("plugin scanner: 'fx_ctor_abort': crashed") != std::string::npos);
}

TEST_CASE("hostile scan: a corrupt, truncated or unwritable registry cache never stops the tool") {
  const Folder f = hostile_folder();
  settle();
  CHECK(run_tool({"scan", "--plugin-path", f.plugins.string()}, f.env()).exit_code == 2);
  fs::path cache_file;
  for (const auto& entry : fs::directory_iterator(f.cache / "kdispatch")) cache_file = entry.path();
  REQUIRE(!cache_file.empty());
  const std::string text = read_file(cache_file);
  // Scan outcomes and parsed manifests, the cpu plugin's among them.
  REQUIRE(text.find("\nscan\t") != std::string::npos);
  const size_t cpu_record = text.find("\tkd_cpu_");
  REQUIRE(cpu_record != std::string::npos);
  std::string flipped = text;
  flipped[cpu_record + 4] ^= 0x01;
  for (const std::string& broken : {std::string("\x7f"
                                                "ELF garbage\n\t\t\n"),
                                    text.substr(0, text.size() / 2), text.substr(0, cpu_record), flipped,
                                    text.substr(0, text.find('\n') + 1) + "a\tb\tc\n\\\\\t\nmanifest\t\t\n"}) {
    write_file(cache_file, broken);
    const ToolResult r = run_tool({"doctor", "--json", "--plugin-path", f.plugins.string()}, f.env());
    CHECK(r.exit_code == 2);
    const Json doc = json_of(r);
    CHECK((*plugin_named(doc, "cpu"))["loaded"] == true);
    CHECK((*plugin_named(doc, "fx_ctor_segv"))["problems"].back()["code"] == "KD-E027");
  }
  // Rebuilt: the file is a cache again, with the cpu plugin's manifest.
  const std::string rebuilt = read_file(cache_file);
  CHECK(rebuilt.starts_with("kdispatch-registry-cache "));
  CHECK(rebuilt.find("\tkd_cpu_") != std::string::npos);
  // A cache directory that cannot be made (a file stands in its way).
  const fs::path blocked = f.plugins.parent_path() / "not-a-dir";
  write_file(blocked, "x");
  const ToolResult r = run_tool({"doctor", "--json", "--plugin-path", f.plugins.string()},
                                env_with(f.env(), "XDG_CACHE_HOME", blocked.string()));
  CHECK(r.exit_code == 2);
  CHECK((*plugin_named(json_of(r), "cpu"))["loaded"] == true);
  CHECK(r.err.find("cannot be written") != std::string::npos);
}

TEST_CASE("hostile scan: a huge or sparse registry cache is not read: one warning, and it is rebuilt") {
  const fs::path dir = dir_with_cpu_plugin();
  const fs::path cache = dir.parent_path() / "cache";
  const std::map<std::string, std::string> env{{"XDG_CACHE_HOME", cache.string()}};
  REQUIRE(run_tool({"doctor", "--json", "--plugin-path", dir.string()}, env).exit_code == 0);
  fs::path cache_file;
  for (const auto& entry : fs::directory_iterator(cache / "kdispatch")) cache_file = entry.path();
  REQUIRE(!cache_file.empty());
  // 8 GiB, nearly all of it a hole: reading it whole would take the memory.
  fs::resize_file(cache_file, uint64_t{8} << 30);
  const ToolResult r = run_tool({"doctor", "--json", "--plugin-path", dir.string()}, env);
  INFO("stderr: " << r.err);
  CHECK(r.exit_code == 0);
  CHECK((*plugin_named(json_of(r), "cpu"))["loaded"] == true);
  CHECK(r.err.find("is 8589934592 bytes, more than a cache holds (64 MiB); rebuilding it") != std::string::npos);
  CHECK(r.err.find("bad_alloc") == std::string::npos);
  CHECK(fs::file_size(cache_file) < (uint64_t{1} << 20));
  CHECK(read_file(cache_file).starts_with("kdispatch-registry-cache "));
}

TEST_CASE("hostile scan: the registry cache lives only in a private folder of this user's") {
  const fs::path dir = dir_with_cpu_plugin();
  const fs::path base = dir.parent_path();
  const auto doctor = [&](const std::map<std::string, std::string>& env) {
    const ToolResult r = run_tool({"doctor", "--json", "--plugin-path", dir.string()}, env);
    INFO("stderr: " << r.err);
    CHECK(r.exit_code == 0);
    CHECK((*plugin_named(json_of(r), "cpu"))["loaded"] == true);
    return r;
  };
  const auto mode = [](const fs::path& p) { return fs::status(p).permissions() & fs::perms::all; };
  // Missing: created 0700.
  const fs::path fresh = base / "fresh";
  doctor({{"XDG_CACHE_HOME", fresh.string()}});
  CHECK(mode(fresh / "kdispatch") == fs::perms::owner_all);
  // Ours but open to others (an older build's, or made by hand): made 0700.
  const fs::path open_dir = base / "open";
  fs::create_directories(open_dir / "kdispatch");
  fs::permissions(open_dir / "kdispatch", fs::perms::all);
  doctor({{"XDG_CACHE_HOME", open_dir.string()}});
  CHECK(mode(open_dir / "kdispatch") == fs::perms::owner_all);
  // Another user's (a forged cache could sit in it): not used, said once.
  const fs::path foreign = base / "foreign";
  fs::create_directories(foreign / "kdispatch");
  REQUIRE(::chown((foreign / "kdispatch").c_str(), 65534, 65534) == 0);
  const ToolResult r = doctor({{"XDG_CACHE_HOME", foreign.string()}, {"KDISPATCH_SCAN", "always"}});
  CHECK(r.err.find("belongs to uid 65534, not to this user") != std::string::npos);
  CHECK(r.err.find("belongs to uid 65534", r.err.find("belongs to uid 65534") + 1) == std::string::npos);
  CHECK(fs::is_empty(foreign / "kdispatch"));
  // No HOME and no XDG_CACHE_HOME: a folder of this user's own in the
  // temporary folder, not a shared one.
  const fs::path tmp = base / "tmp";
  fs::create_directories(tmp);
  doctor({{"HOME", ""}, {"XDG_CACHE_HOME", ""}, {"TMPDIR", tmp.string()}});
  const fs::path own = tmp / fmt::format("kdispatch-{}", ::geteuid());
  CHECK(fs::is_directory(own));
  CHECK(mode(own) == fs::perms::owner_all);
  CHECK_FALSE(fs::exists(tmp / "kdispatch"));
}

TEST_CASE("hostile scan: KDISPATCH_SCAN=off opens plugins in-process and writes no cache") {
  const fs::path dir = dir_with_cpu_plugin();
  const fs::path cache = dir.parent_path() / "cache";
  const ToolResult r = run_tool({"doctor", "--json", "--plugin-path", dir.string()},
                                {{"XDG_CACHE_HOME", cache.string()}, {"KDISPATCH_SCAN", "off"}});
  CHECK(r.exit_code == 0);
  CHECK((*plugin_named(json_of(r), "cpu"))["loaded"] == true);
  CHECK_FALSE(fs::exists(cache / "kdispatch"));
  fs::remove_all(dir.parent_path());
}

namespace {
// A manifest of `kernels` ops of its own, its library a placeholder file
// (list and select never open it).
void add_generated(const fs::path& dir, const std::string& name, int kernels) {
  std::string list;
  for (int k = 0; k < kernels; ++k) {
    list += fmt::format(R"({}{{"op": "{}.op{}", "symbol": "kd_{}_{}", "dtypes": ["float32", "bfloat16"],
                           "description": "kernel {}"}})",
                        k == 0 ? "" : ", ", name, k, name, k, k);
  }
  write_file(dir / (name + ".json"),
             fmt::format(R"({{"kdispatch_manifest": "1.0", "plugin": "{}", "backend": "{}", "library": "lib{}.so",
                            "abi": "1.0", "targets": [{{"device": "cpu"}}], "kernels": [{}]}})",
                         name, name, name, list));
  write_file(dir / ("lib" + name + ".so"), "placeholder\n");
}
}  // namespace

TEST_CASE("registry cache: list and select over a warm cache print what a cold parse prints") {
  const fs::path dir = dir_with_cpu_plugin();
  const fs::path cache = dir.parent_path() / "cache";
  for (int i = 0; i < 30; ++i) add_generated(dir, fmt::format("gen{:02}", i), 5);
  // A manifest with a warning, which is parsed (and warned about) every time.
  write_file(dir / "warns.json", R"({"kdispatch_manifest": "1.0", "plugin": "warns", "backend": "warns",
    "library": "libwarns.so", "abi": "1.0", "colour": "blue", "kernels": [{"op": "warns.a", "symbol": "kd_a"}]})");
  write_file(dir / "libwarns.so", "placeholder\n");
  settle();
  const std::map<std::string, std::string> env = {{"XDG_CACHE_HOME", cache.string()}};
  const std::vector<std::string> list = {"list", "--json", "--device", "cpu", "--plugin-path", dir.string()};
  const std::vector<std::string> select = {"select", "gen07.op3", "--device", "cpu", "--plugin-path", dir.string()};

  const ToolResult cold = run_tool(list, env);
  REQUIRE(cold.exit_code == 0);
  const ToolResult cold_select = run_tool(select, env);
  const ToolResult warm = run_tool(list, env_with(env, "KDISPATCH_LOG", "debug"));
  CHECK(warm.exit_code == 0);
  // Every manifest but the one with a warning came from the cache.
  CHECK(warm.err.find("32 manifest(s) from the registry cache") != std::string::npos);  // 30, cpu and reference
  CHECK(json_of(warm) == json_of(cold));
  CHECK(warm.err.find("/colour: unknown key") != std::string::npos);
  CHECK(run_tool(list, env).err == cold.err);
  const ToolResult warm_select = run_tool(select, env);
  CHECK(warm_select.exit_code == 0);
  CHECK(warm_select.out == cold_select.out);
  const ToolResult off = run_tool(list, env_with(env, "KDISPATCH_SCAN", "off"));
  CHECK(json_of(off) == json_of(cold));

  // An edited manifest is read again: its new op is listed and selected.
  add_generated(dir, "gen07", 6);
  const ToolResult edited = run_tool({"select", "gen07.op5", "--device", "cpu", "--plugin-path", dir.string()}, env);
  CHECK(edited.exit_code == 0);
  CHECK(edited.out.find("backend 'gen07'") != std::string::npos);
  fs::remove_all(dir.parent_path());
}

TEST_CASE("hostile scan: a KDISPATCH_SCANNER program others could replace is refused (KD-E025), and never cached") {
  Folder f;
  f.plugins = dir_with_cpu_plugin();
  f.cache = f.plugins.parent_path() / "cache";
  const fs::path bin = f.plugins.parent_path() / "bin";
  fs::create_directories(bin);
  const fs::path scanner = bin / "my-scanner";
  fs::copy_file(fs::path(KDISPATCH_BINARY_DIR) / "lib" / "kdispatch" / "kdispatch-plugin-scanner", scanner);
  fs::permissions(scanner, fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec |
                               fs::perms::others_read | fs::perms::others_exec);
  auto env = env_with(env_with(f.env(), "KDISPATCH_SCANNER", scanner.string()), "KDISPATCH_LOG", "info");

  // Writable by its group: whoever is in it could choose what "ok" means.
  fs::permissions(scanner, fs::perms::group_write, fs::perm_options::add);
  const ToolResult refused = run_tool({"scan", "--plugin-path", f.plugins.string()}, env);
  CHECK(refused.exit_code == 2);
  CHECK(refused.out.find("KD-E025: refusing to run plugin scanner " + scanner.string() + ": plugin scanner " +
                         scanner.string() + " is group-writable") != std::string::npos);
  CHECK(refused.err.find("plugin scanner: 'cpu'") == std::string::npos);  // it never ran
  // Its directory writable by others: the same.
  fs::permissions(scanner, fs::perms::group_write, fs::perm_options::remove);
  fs::permissions(bin, fs::perms::others_write, fs::perm_options::add);
  const ToolResult directory = run_tool({"scan", "--plugin-path", f.plugins.string()}, env);
  CHECK(directory.exit_code == 2);
  CHECK(directory.out.find("plugin directory " + fs::canonical(bin).string() + " is world-writable") !=
        std::string::npos);
  fs::permissions(bin, fs::perms::others_write, fs::perm_options::remove);

  // A safe one runs on every load: what it found is never cached, so the
  // installed scanner still scans the plugin afterwards.
  const std::vector<std::string> run = {"run", "layernorm.rmsnorm", "--backend", "cpu", "--no-check",
                                        "--plugin-path", f.plugins.string()};
  for (int i = 0; i < 2; ++i) {
    const ToolResult ok = run_tool(run, env);
    CHECK(ok.exit_code == 0);
    CHECK(ok.err.find("plugin scanner: 'cpu': ok") != std::string::npos);
  }
  env.erase("KDISPATCH_SCANNER");
  const ToolResult installed = run_tool(run, env);
  CHECK(installed.exit_code == 0);
  CHECK(installed.err.find("plugin scanner: 'cpu': ok") != std::string::npos);
  const ToolResult warm = run_tool(run, env);
  CHECK(warm.err.find("plugin scanner: 'cpu'") == std::string::npos);
}
