// The kdispatch tool as DESIGN.md section 8 specifies it, driven as a real
// process over the shipped plugins and fixture manifests.
#include <doctest/doctest.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <sstream>

#include "run_tool.hpp"

namespace fs = std::filesystem;
using Json = nlohmann::json;

namespace {

const std::string kPluginDir = KDISPATCH_PLUGIN_DIR;
const std::string kManifests = std::string(KDISPATCH_SOURCE_DIR) + "/manifests";
// cuda.json and hip.json, generated from manifests/gpu.json.in at configure time.
const std::string kGpuManifests = KDISPATCH_GPU_MANIFEST_DIR;
const std::string kFixtures = KDISPATCH_FIXTURES_DIR;

// A plugin directory holding copies of `manifests`, each with a stand-in
// library file: enough for discovery, which only stats libraries. The
// libraries listed in `without_library` are left out.
std::string plugin_dir(const std::vector<std::string>& manifests, const std::vector<std::string>& without_library = {}) {
  const std::string dir = make_temp_dir();
  fs::permissions(dir, fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec |
                           fs::perms::others_read | fs::perms::others_exec);
  for (const auto& m : manifests) {
    fs::copy_file(m, dir + "/" + fs::path(m).filename().string());
    std::ifstream in(m);
    const Json j = Json::parse(in);
    const std::string lib = j.at("library");
    if (std::find(without_library.begin(), without_library.end(), lib) == without_library.end()) {
      std::ofstream(dir + "/" + lib) << "stand-in";
    }
  }
  return dir;
}

Json json_of(const ToolResult& r) {
  INFO("stdout: " << r.out << "\nstderr: " << r.err);
  REQUIRE_NOTHROW(Json::parse(r.out));
  return Json::parse(r.out);
}

}  // namespace

TEST_CASE("list --json over the shipped plugins") {
  const ToolResult r = run_tool({"list", "--json", "--device", "cpu"});
  CHECK(r.exit_code == 0);
  const Json doc = json_of(r);
  CHECK(doc["device"] == "cpu");
  bool cpu = false;
  for (const auto& p : doc["plugins"]) {
    for (const char* key : {"name", "backend", "manifest", "library", "status", "problems"}) CHECK(p.contains(key));
    if (p["name"] == "cpu") {
      cpu = true;
      CHECK(p["status"] == "ok");
    }
  }
  CHECK(cpu);
  bool rmsnorm = false;
  for (const auto& op : doc["ops"]) {
    if (op["op"] != "layernorm.rmsnorm") continue;
    rmsnorm = true;
    for (const auto& b : op["backends"]) {
      for (const char* key : {"backend", "plugin", "eligible", "reason"}) CHECK(b.contains(key));
      if (b["backend"] == "cpu") {
        CHECK(b["eligible"] == true);
        CHECK(b["reason"].is_null());
      }
      if (b["backend"] == "cuda") {
        CHECK(b["eligible"] == false);
        CHECK(b["reason"] == "targets cuda, not cpu");
      }
    }
  }
  CHECK(rmsnorm);
}

TEST_CASE("list and select open no plugin library") {
  for (const auto& args : std::vector<std::vector<std::string>>{
           {"list", "--device", "cpu"}, {"select", "layernorm.rmsnorm", "--device", "cpu"},
           {"list", "--device", "cuda:9.0", "--json"}}) {
    const ToolResult r = run_tool(args, {{"LD_DEBUG", "files"}});
    CHECK(r.exit_code == 0);
    CHECK(r.err.find("file=") != std::string::npos);  // LD_DEBUG is on
    // Plugin libraries are opened through their checked descriptor.
    CHECK(r.err.find("file=/proc/self/fd/") == std::string::npos);
    CHECK(r.err.find("libkdispatch-cpu.so") == std::string::npos);
    CHECK(r.err.find("libkdispatch-cuda.so") == std::string::npos);
    CHECK(r.err.find("libkdispatch-hip.so") == std::string::npos);
  }
}

TEST_CASE("select on cpu picks the cpu backend without naming it") {
  const ToolResult r = run_tool({"select", "layernorm.rmsnorm", "--device", "cpu", "--json"});
  CHECK(r.exit_code == 0);
  const Json doc = json_of(r);
  CHECK(doc == Json{{"op", "layernorm.rmsnorm"},
                    {"backend", "cpu"},
                    {"plugin", "cpu"},
                    {"symbol", "kd_cpu_rmsnorm"},
                    {"rule", "only"},
                    {"ranked", {"cpu"}},
                    {"device", "cpu"}});
  const ToolResult human = run_tool({"select", "layernorm.rmsnorm", "--device", "cpu"});
  CHECK(human.exit_code == 0);
  CHECK(human.out.find("backend 'cpu'") != std::string::npos);
}

TEST_CASE("select --device cuda:9.0 works without a GPU, on manifests alone") {
  const std::string dir = plugin_dir({kManifests + "/cpu.json", kGpuManifests + "/cuda.json"});
  const ToolResult r =
      run_tool({"select", "layernorm.rmsnorm", "--device", "cuda:9.0", "--json", "--plugin-path", dir});
  CHECK(r.exit_code == 0);
  CHECK(json_of(r)["backend"] == "cuda");
  CHECK(json_of(r)["device"] == "cuda:9.0");
  // Below the manifest's arch window: KD-E003 with the reason.
  const ToolResult old = run_tool({"select", "layernorm.rmsnorm", "--device", "cuda:8.0", "--plugin-path", dir});
  CHECK(old.exit_code == 2);
  CHECK(old.err.find("error[KD-E003]: op 'layernorm.rmsnorm' has no backend usable on device 'cuda:8.0' "
                     "(registered: [cpu, cuda])") == 0);
  CHECK(old.err.find("cuda: needs cuda arch >= 9.0, device has 8.0") != std::string::npos);
  fs::remove_all(dir);
}

TEST_CASE("list and select show a kernel's constraints") {
  const std::string dir = plugin_dir({kManifests + "/cpu.json"});
  Json cpu = Json::parse(std::ifstream(kManifests + "/cpu.json"));
  for (auto& k : cpu["kernels"]) {
    if (k["op"] == "layernorm.rmsnorm") k["constraints"] = {"H % 8 == 0", "dtype != float16"};
  }
  std::ofstream(dir + "/cpu.json") << cpu.dump();

  const ToolResult list = run_tool({"list", "--device", "cpu", "--plugin-path", dir});
  CHECK(list.exit_code == 0);
  CHECK(list.out.find("only for calls where H % 8 == 0, and dtype != float16") != std::string::npos);
  const Json listed = json_of(run_tool({"list", "--json", "--device", "cpu", "--plugin-path", dir}));
  bool found = false;
  for (const auto& op : listed["ops"]) {
    if (op["op"] != "layernorm.rmsnorm") continue;
    found = true;
    CHECK(op["backends"][0]["constraints"] == Json{"H % 8 == 0", "dtype != float16"});
  }
  CHECK(found);

  const ToolResult select = run_tool({"select", "layernorm.rmsnorm", "--device", "cpu", "--plugin-path", dir});
  CHECK(select.exit_code == 0);
  CHECK(select.out.find("backend 'cpu'") != std::string::npos);
  CHECK(select.out.find("  only for calls where H % 8 == 0\n  only for calls where dtype != float16\n") !=
        std::string::npos);
  const Json selected =
      json_of(run_tool({"select", "layernorm.rmsnorm", "--device", "cpu", "--json", "--plugin-path", dir}));
  CHECK(selected["constraints"] == Json{"H % 8 == 0", "dtype != float16"});
  fs::remove_all(dir);
}

TEST_CASE("several usable backends: KD-E004 until one is named or ordered") {
  const std::string dir = plugin_dir({kGpuManifests + "/cuda.json", kFixtures + "/cli/triton.json"});
  const std::vector<std::string> base{"select", "layernorm.rmsnorm", "--device", "cuda:9.0", "--plugin-path", dir};
  const ToolResult r = run_tool(base);
  CHECK(r.exit_code == 2);
  CHECK(r.out.empty());
  CHECK(r.err.find("error[KD-E004]: op 'layernorm.rmsnorm' has multiple backends usable on device 'cuda:9.0' "
                   "([cuda, triton]); pass --backend B to choose one\n") == 0);
  auto named = base;
  named.insert(named.end(), {"--backend", "triton", "--json"});
  const ToolResult n = run_tool(named);
  CHECK(n.exit_code == 0);
  CHECK(json_of(n)["backend"] == "triton");
  auto json = base;
  json.push_back("--json");
  CHECK(json_of(run_tool(json, {{"KDISPATCH_BACKEND_ORDER", "triton,cuda"}}))["backend"] == "triton");
  CHECK(json_of(run_tool(json, {{"KDISPATCH_FORCE_BACKEND", "cuda"}}))["backend"] == "cuda");
  // The dtype narrows the choice: triton declares no float32.
  auto f32 = json;
  f32.insert(f32.end(), {"--dtype", "float32"});
  CHECK(json_of(run_tool(f32))["backend"] == "cuda");
  fs::remove_all(dir);
}

TEST_CASE("KDISPATCH_PREFERENCE_FILE ranks an op's backends, and a bad file gets a KD code and changes nothing") {
  const std::string dir = plugin_dir({kGpuManifests + "/cuda.json", kFixtures + "/cli/triton.json"});
  const std::vector<std::string> json{"select", "layernorm.rmsnorm", "--device", "cuda:9.0",
                                      "--plugin-path", dir, "--json"};
  const fs::path file = fs::path(dir) / "preferences.json";
  const auto write = [&](const std::string& text) { std::ofstream(file) << text; };

  write(R"({"preferences": {"layernorm.rmsnorm": ["triton", "cuda"]}})");
  const ToolResult good = run_tool(json, {{"KDISPATCH_PREFERENCE_FILE", file.string()}});
  CHECK(good.exit_code == 0);
  const Json doc = json_of(good);
  CHECK(doc["backend"] == "triton");
  CHECK(doc["rule"] == "preference");
  CHECK(doc["ranked"] == Json{"triton", "cuda"});
  // The op's preference comes before the global order.
  CHECK(json_of(run_tool(json, {{"KDISPATCH_PREFERENCE_FILE", file.string()},
                                {"KDISPATCH_BACKEND_ORDER", "cuda"}}))["rule"] == "preference");
  const Json ordered = json_of(run_tool(json, {{"KDISPATCH_BACKEND_ORDER", "cuda"}}));
  CHECK(ordered["backend"] == "cuda");
  CHECK(ordered["rule"] == "order");

  // Each broken file is ignored whole, with its code and where: the call
  // is then selected as without it (KD-E004 here, a true tie).
  const std::vector<std::pair<std::string, std::string>> bad{
      {"{\"preferences\": {\"layernorm.rmsnorm\": [\"triton\"", "KD-E010"},
      {R"({"preferences": {"layernorm.rmsnorm": "triton"}})", "KD-E011"},
      {R"({"preferences": {"layernorm.rmsnorm": ["triton"], "Bad Op": ["cuda"]}})", "KD-E011"},
      {R"({"preferences": {"layernorm.rmsnorm": ["triton", 7]}})", "KD-E011"},
      {"{\"preferences\": {\"layernorm.rmsnorm\": [\"\xff\"]}}", "KD-E010"},
      {"[]", "KD-E011"},
  };
  for (const auto& [text, code] : bad) {
    CAPTURE(text);
    write(text);
    const ToolResult r = run_tool(json, {{"KDISPATCH_PREFERENCE_FILE", file.string()}});
    CHECK(r.exit_code == 2);
    CHECK(r.err.find("KDISPATCH_PREFERENCE_FILE: [" + code + "] " + file.string()) != std::string::npos);
    CHECK(r.err.find("the file is ignored") != std::string::npos);
    CHECK(json_of(r)["error"]["code"] == "KD-E004");
  }
  const ToolResult missing = run_tool(json, {{"KDISPATCH_PREFERENCE_FILE", (fs::path(dir) / "none.json").string()}});
  CHECK(missing.err.find("[KD-E010]") != std::string::npos);
  const ToolResult fifo = run_tool(json, {{"KDISPATCH_PREFERENCE_FILE", dir}});
  CHECK(fifo.err.find("a directory") != std::string::npos);
  fs::remove_all(dir);
}

TEST_CASE("errors: stderr format and --json document and exit code 2") {
  SUBCASE("KD-E002 unknown backend") {
    const ToolResult r = run_tool({"select", "layernorm.rmsnorm", "--backend", "nope", "--device", "cpu"});
    CHECK(r.exit_code == 2);
    CHECK(r.err.find("error[KD-E002]: No 'nope' backend registered for op 'layernorm.rmsnorm' (registered: [") ==
          0);
    const ToolResult j =
        run_tool({"select", "layernorm.rmsnorm", "--backend", "nope", "--device", "cpu", "--json"});
    CHECK(j.exit_code == 2);
    const Json doc = json_of(j);
    CHECK(doc["error"]["code"] == "KD-E002");
    CHECK(doc["error"]["message"].get<std::string>().find("No 'nope' backend registered") == 0);
  }
  SUBCASE("KD-E001 unknown op, with did-you-mean") {
    const ToolResult r = run_tool({"select", "layernorm.rmsnrom", "--device", "cpu"});
    CHECK(r.exit_code == 2);
    CHECK(r.err.find("error[KD-E001]: No kernels registered for op 'layernorm.rmsnrom'") == 0);
    CHECK(r.err.find("did you mean 'layernorm.rmsnorm'?") != std::string::npos);
  }
  SUBCASE("KD-E003: a CUDA-only op on cpu") {
    const std::string dir = plugin_dir({kGpuManifests + "/cuda.json"});
    const ToolResult r = run_tool({"select", "moe.topk_softmax", "--device", "cpu", "--plugin-path", dir});
    CHECK(r.exit_code == 2);
    CHECK(r.err.find("error[KD-E003]: op 'moe.topk_softmax' has no backend usable on device 'cpu' (registered: "
                     "[cuda]): cuda: targets cuda, not cpu") == 0);
    fs::remove_all(dir);
  }
  SUBCASE("KD-E006: a named backend not usable on the device") {
    const std::string dir = plugin_dir({kManifests + "/cpu.json", kGpuManifests + "/cuda.json"});
    const ToolResult r =
        run_tool({"select", "moe.topk_softmax", "--backend", "cuda", "--device", "cpu", "--plugin-path", dir});
    CHECK(r.exit_code == 2);
    CHECK(r.err.find("error[KD-E006]") == 0);
    fs::remove_all(dir);
  }
}

TEST_CASE("a plugin whose library is missing: KD-E002 says where it was looked for") {
  const std::string dir = plugin_dir({kManifests + "/cpu.json", kGpuManifests + "/cuda.json"}, {"libkdispatch-cuda.so"});
  const ToolResult r =
      run_tool({"select", "layernorm.rmsnorm", "--backend", "cuda", "--device", "cuda:9.0", "--plugin-path", dir});
  CHECK(r.exit_code == 2);
  // Discovery warns about the plugin first; the error line follows.
  const size_t at = r.err.find("error[");
  REQUIRE(at != std::string::npos);
  const std::string first_line = r.err.substr(at, r.err.find('\n', at) - at);
  CHECK(r.err.find("kdispatch: warn: skipping plugin 'cuda'") != std::string::npos);
  CHECK(first_line.find("error[KD-E002]: No 'cuda' backend registered for op 'layernorm.rmsnorm' (registered: "
                        "[cpu])") == 0);
  CHECK(first_line.find("plugin 'cuda'") != std::string::npos);
  CHECK(first_line.find("not found") != std::string::npos);
  CHECK(first_line.find(dir + "/libkdispatch-cuda.so") != std::string::npos);
  fs::remove_all(dir);
}

TEST_CASE("an invalid manifest: select, list and doctor name its plugin, backend and first problem") {
  // The shipped cuda manifest with every "float32" misspelt, beside valid
  // cpu and reference manifests.
  const std::string dir = plugin_dir({kManifests + "/cpu.json", kManifests + "/reference.json"});
  std::string text;
  {
    std::ifstream in(kGpuManifests + "/cuda.json");
    text.assign(std::istreambuf_iterator<char>(in), {});
  }
  size_t misspelt = 0;
  for (size_t at = text.find("\"float32\""); at != std::string::npos; at = text.find("\"float32\"", at)) {
    text.replace(at, 9, "\"floatt32\"");
    ++misspelt;
  }
  REQUIRE(misspelt > 1);
  std::ofstream(dir + "/cuda.json") << text;
  std::ofstream(dir + "/libkdispatch-cuda.so") << "stand-in";
  const std::string manifest = dir + "/cuda.json";
  const auto says_for = [&](const std::string& path) {
    return fmt::format(
        "plugin 'cuda' declares backend 'cuda' for this op but its manifest {} is invalid: [KD-E011] "
        "/kernels/0/dtypes/0: expected a dtype name (float32, float16, bfloat16, float64, int32, int64, uint8, "
        "bool, float8_e4m3fn or float8_e5m2), found \"floatt32\" (and {} more problems)",
        path, misspelt - 1);
  };
  const std::string says = says_for(manifest);
  const auto error_line = [](const ToolResult& r) {
    const size_t at = r.err.find("error[");
    return at == std::string::npos ? std::string() : r.err.substr(at, r.err.find('\n', at) - at);
  };

  SUBCASE("select with no backend named: KD-E003 names it beside the rejected ones") {
    const ToolResult r = run_tool({"select", "layernorm.rmsnorm", "--device", "cuda:9.0", "--plugin-path", dir});
    INFO(r.err);
    CHECK(r.exit_code == 2);
    CHECK(error_line(r) ==
          "error[KD-E003]: op 'layernorm.rmsnorm' has no backend usable on device 'cuda:9.0' (registered: [cpu, "
          "reference]): cpu: targets cpu, not cuda; reference: targets cpu, not cuda; " + says);
    CHECK(r.err.find("  hint: " + says + "\n") != std::string::npos);
  }
  SUBCASE("select --backend cuda: KD-E002 says why there is none") {
    const ToolResult r = run_tool(
        {"select", "layernorm.rmsnorm", "--backend", "cuda", "--device", "cuda:9.0", "--plugin-path", dir});
    INFO(r.err);
    CHECK(r.exit_code == 2);
    CHECK(error_line(r) ==
          "error[KD-E002]: No 'cuda' backend registered for op 'layernorm.rmsnorm' (registered: [cpu, reference]): " +
              says);
    CHECK(r.err.find("  hint: " + says + "\n") != std::string::npos);
  }
  SUBCASE("an op no valid manifest declares: KD-E001 says the invalid one does") {
    const std::string alone = make_temp_dir();
    fs::copy_file(manifest, alone + "/cuda.json");
    const ToolResult r = run_tool({"select", "layernorm.rmsnorm", "--device", "cuda:9.0", "--plugin-path", alone});
    INFO(r.err);
    CHECK(r.exit_code == 2);
    CHECK(error_line(r) == "error[KD-E001]: No kernels registered for op 'layernorm.rmsnorm': " +
                               says_for(alone + "/cuda.json"));
    fs::remove_all(alone);
  }
  SUBCASE("one warning line for the manifest; KDISPATCH_LOG=debug lists every problem") {
    const ToolResult r = run_tool({"list", "--plugin-path", dir});
    CHECK(r.exit_code == 0);
    const std::string warning =
        fmt::format("kdispatch: warn: skipping manifest {} (plugin 'cuda', backend 'cuda'): KD-E011: {}: "
                    "/kernels/0/dtypes/0: ",
                    manifest, manifest);
    const size_t at = r.err.find(warning);
    REQUIRE(at != std::string::npos);
    CHECK(r.err.find("skipping manifest", at + warning.size()) == std::string::npos);
    CHECK(r.err.find(fmt::format("(and {} more problems; `kdispatch validate` lists them all)\n", misspelt - 1),
                     at) != std::string::npos);
    const ToolResult debug = run_tool({"list", "--plugin-path", dir}, {{"KDISPATCH_LOG", "debug"}});
    size_t listed = 0;
    for (size_t p = debug.err.find("problem of manifest " + manifest); p != std::string::npos;
         p = debug.err.find("problem of manifest " + manifest, p + 1)) {
      ++listed;
    }
    CHECK(listed == misspelt);
  }
  SUBCASE("list and doctor show it under its name and backend, with its problems") {
    for (const std::vector<std::string>& args :
         {std::vector<std::string>{"list", "--json", "--plugin-path", dir},
          std::vector<std::string>{"doctor", "--json", "--no-load", "--plugin-path", dir}}) {
      INFO(args[0]);
      const Json doc = json_of(run_tool(args));
      const Json* cuda = nullptr;
      for (const auto& p : doc["plugins"]) {
        if (p["manifest"] == manifest) cuda = &p;
      }
      REQUIRE(cuda != nullptr);
      CHECK((*cuda)["name"] == "cuda");
      CHECK((*cuda)["backend"] == "cuda");
      CHECK((*cuda)["status"] == "error");
      CHECK((*cuda)["problems"].size() == misspelt);
    }
    const ToolResult list = run_tool({"list", "--plugin-path", dir});
    CHECK(list.out.find("  NAME       BACKEND    STATE     MANIFEST\n") != std::string::npos);
    CHECK(list.out.find("  cuda       cuda       error     " + manifest + "\n") != std::string::npos);
    const ToolResult doctor = run_tool({"doctor", "--no-load", "--plugin-path", dir});
    CHECK(doctor.out.find("  cuda [error]\n    backend:  cuda\n    manifest: " + manifest + "\n") !=
          std::string::npos);
    CHECK(doctor.out.find("found \"floatt32\"") != std::string::npos);
  }
  fs::remove_all(dir);
}

TEST_CASE("a disabled plugin: KD-E002 says it is disabled") {
  const std::string dir = plugin_dir({kManifests + "/cpu.json", kGpuManifests + "/cuda.json"});
  const ToolResult r =
      run_tool({"select", "layernorm.rmsnorm", "--backend", "cuda", "--device", "cuda:9.0", "--plugin-path", dir},
               {{"KDISPATCH_PLUGINS_DISABLE", "cu*"}});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("disabled by KDISPATCH_PLUGINS_DISABLE (matches 'cu*')") != std::string::npos);
  const ToolResult s = run_tool({"list", "--json", "--plugin-path", dir}, {{"KDISPATCH_PLUGINS_SELECT", "cuda"}});
  const Json selected = json_of(s);  // a range-for over a temporary's member would dangle
  for (const auto& p : selected["plugins"]) CHECK((p["name"] == "cuda") == (p["state"] == "found"));
  fs::remove_all(dir);
}

TEST_CASE("--plugin-path replaces the default path and --add-plugin-path goes in front") {
  const std::string dir = plugin_dir({kFixtures + "/cli/triton.json"});
  const Json replaced = json_of(run_tool({"list", "--json", "--plugin-path", dir}));
  REQUIRE(replaced["plugins"].size() == 1);
  CHECK(replaced["plugins"][0]["name"] == "triton");
  const Json env_replaced = json_of(run_tool({"list", "--json"}, {{"KDISPATCH_PLUGIN_PATH", dir}}));
  REQUIRE(env_replaced["plugins"].size() == 1);

  const Json added = json_of(run_tool({"list", "--json", "--add-plugin-path", dir}));
  REQUIRE(added["plugins"].size() >= 2);
  CHECK(added["plugins"][0]["name"] == "triton");
  bool cpu = false;
  for (const auto& p : added["plugins"]) cpu = cpu || p["name"] == "cpu";
  CHECK(cpu);
  fs::remove_all(dir);
}

TEST_CASE("the first plugin of a name wins and later ones are reported") {
  const std::string first = plugin_dir({kManifests + "/cpu.json"});
  const std::string second = plugin_dir({kManifests + "/cpu.json"});
  const Json doc = json_of(run_tool({"list", "--json", "--plugin-path", first, "--plugin-path", second}));
  REQUIRE(doc["plugins"].size() == 2);
  CHECK(doc["plugins"][0]["state"] == "found");
  CHECK(doc["plugins"][1]["state"] == "shadowed");
  CHECK(doc["plugins"][1]["note"].get<std::string>().find(first) != std::string::npos);
  fs::remove_all(first);
  fs::remove_all(second);
}

TEST_CASE("KDISPATCH_DEVICE sets the default device of list and select") {
  const std::string dir = plugin_dir({kManifests + "/cpu.json", kGpuManifests + "/cuda.json"});
  const Json doc = json_of(run_tool({"list", "--json", "--plugin-path", dir}, {{"KDISPATCH_DEVICE", "cuda:9.0"}}));
  CHECK(doc["device"] == "cuda:9.0");
  const ToolResult bad = run_tool({"list", "--plugin-path", dir}, {{"KDISPATCH_DEVICE", "tpu"}});
  CHECK(bad.exit_code == 1);
  CHECK(bad.err.find("invalid device 'tpu'") != std::string::npos);
  fs::remove_all(dir);
}

TEST_CASE("KDISPATCH_LOG=debug says what was searched") {
  const std::string dir = plugin_dir({kManifests + "/cpu.json"});
  const ToolResult r = run_tool({"list", "--plugin-path", dir, "--plugin-path", dir + "/missing"},
                                {{"KDISPATCH_LOG", "debug"}});
  CHECK(r.exit_code == 0);
  CHECK(r.err.find("searching plugin directory " + dir) != std::string::npos);
  CHECK(r.err.find(dir + "/missing (--plugin-path): does not exist") != std::string::npos);
  CHECK(r.err.find("found manifest " + dir + "/cpu.json") != std::string::npos);
  fs::remove_all(dir);
}

TEST_CASE("validate: shipped manifests are clean and broken ones print FILE: KD-Ennn: message and exit 2") {
  std::vector<std::string> args{"validate"};
  for (const char* f : {"cpu.json", "ops/layernorm.json", "ops/activation.json", "ops/embeddings.json",
                        "ops/moe.json"}) {
    args.push_back(kManifests + "/" + f);
  }
  for (const char* f : {"cuda.json", "hip.json"}) args.push_back(kGpuManifests + "/" + f);
  const ToolResult ok = run_tool(args);
  CHECK(ok.exit_code == 0);
  CHECK(ok.out.find("cpu.json: ok (plugin 'cpu', backend 'cpu', ") != std::string::npos);

  const std::string bad_dir = kFixtures + "/manifests/bad";
  int checked = 0;
  for (const auto& entry : fs::directory_iterator(bad_dir)) {
    if (entry.path().extension() != ".json") continue;
    const std::string file = entry.path().string();
    const ToolResult r = run_tool({"validate", file});
    INFO(file << "\n" << r.out << r.err);
    CHECK(r.exit_code == 2);
    CHECK(r.out.find(file + ": KD-E0") == 0);
    ++checked;
  }
  CHECK(checked >= 25);
}

TEST_CASE("validate reads no further than a manifest may be long: an endless file is an error, not a hang") {
  // A device is refused before it is read; a long regular file after 16 MiB.
  const std::string dir = make_temp_dir();
  { std::ofstream(dir + "/long.json") << std::string((size_t{16} << 20) + 1, ' '); }
  const ToolResult r = run_tool({"validate", "/dev/zero", dir + "/long.json", kManifests + "/cpu.json"});
  CHECK(r.exit_code == 2);
  CHECK(r.out.find("/dev/zero: KD-E010:") != std::string::npos);
  CHECK(r.out.find("a character device, not a regular file") != std::string::npos);
  CHECK(r.out.find("long.json: KD-E010:") != std::string::npos);
  CHECK(r.out.find("larger than the 16 MiB a manifest may have") != std::string::npos);
  CHECK(r.out.find("cpu.json: ok") != std::string::npos);
  fs::remove_all(dir);
}

TEST_CASE("doctor --json reports search path, plugins and problems") {
  const std::string dir = plugin_dir({kManifests + "/cpu.json"});
  std::ofstream(dir + "/broken.json") << "{\"kdispatch_manifest\": \"1.0\", \"plugin\": ";
  const ToolResult r = run_tool({"doctor", "--json", "--no-load", "--plugin-path", dir});
  CHECK(r.exit_code == 2);
  const Json doc = json_of(r);
  CHECK(doc["search_path"] == Json::array({dir}));
  CHECK(doc["plugins"].size() == 2);
  REQUIRE(doc["problems"].size() >= 1);
  CHECK(doc["problems"][0]["code"] == "KD-E010");
  CHECK(doc["problems"][0]["file"] == dir + "/broken.json");
  fs::remove_all(dir);
}

TEST_CASE("explain prints the catalogue entry and unknown codes are usage errors") {
  const ToolResult r = run_tool({"explain", "KD-E002"});
  CHECK(r.exit_code == 0);
  CHECK(r.out.find("KD-E002") == 0);
  CHECK(r.out.find("Fix:") != std::string::npos);
  CHECK(run_tool({"explain", "e4"}).out.find("KD-E004") == 0);
  const Json j = json_of(run_tool({"explain", "KD-E026", "--json"}));
  CHECK(j["code"] == "KD-E026");
  const ToolResult all = run_tool({"explain"});
  CHECK(all.exit_code == 0);
  CHECK(all.out.find("KD-E041") != std::string::npos);
  const ToolResult bad = run_tool({"explain", "KD-E999"});
  CHECK(bad.exit_code == 1);
  CHECK(bad.err.find("unknown error code 'KD-E999'") != std::string::npos);
}

TEST_CASE("usage errors exit 1 and --help exits 0") {
  const ToolResult bare = run_tool({});
  CHECK(bare.exit_code == 1);
  CHECK(bare.out.find("Subcommands:") != std::string::npos);  // no subcommand prints the help
  CHECK(bare.out.find("before or after the subcommand") != std::string::npos);
  CHECK(run_tool({"frobnicate"}).exit_code == 1);
  CHECK(run_tool({"select"}).exit_code == 1);
  CHECK(run_tool({"list", "--no-such-flag"}).exit_code == 1);
  CHECK(run_tool({"list", "--device", "cuda:nine"}).exit_code == 1);
  CHECK(run_tool({"select", "layernorm.rmsnorm", "--dtype", "float8"}).exit_code == 1);
  const ToolResult help = run_tool({"--help"});
  CHECK(help.exit_code == 0);
  CHECK(help.out.find("list") != std::string::npos);
  CHECK(run_tool({"select", "--help"}).exit_code == 0);
}

TEST_CASE("common options go before the subcommand too") {
  const ToolResult before = run_tool({"--json", "--plugin-path", KDISPATCH_PLUGIN_DIR, "list"});
  const ToolResult after = run_tool({"list", "--json", "--plugin-path", KDISPATCH_PLUGIN_DIR});
  REQUIRE(before.exit_code == 0);
  CHECK(before.out == after.out);
  CHECK(json_of(before)["plugins"].size() >= 1);
  CHECK(run_tool({"--json", "explain", "KD-E002"}).out.find("\"code\"") != std::string::npos);
}

TEST_CASE("--device cuda:N names a device by ordinal, and a device that is not here is skipped") {
  const ToolResult run = run_tool({"run", "layernorm.rmsnorm", "--device", "cuda:1", "--dtype", "float32"});
  CHECK(run.exit_code == 4);  // the op named ran no case: nothing was checked
  CHECK(run.out.find("skipped: layernorm.rmsnorm (backend cpu): no cuda:1 device here") != std::string::npos);
  CHECK(run.out.find("not run: layernorm.rmsnorm: ran no case: every kernel was skipped (above)") != std::string::npos);
  const ToolResult bad = run_tool({"run", "layernorm.rmsnorm", "--device", "cuda:x"});
  CHECK(bad.exit_code == 1);
  CHECK(bad.err.find("cuda:N") != std::string::npos);
}

TEST_CASE("usage errors with --json are one JSON document on stdout too") {
  const std::vector<std::vector<std::string>> cases{
      {"select", "--json"},                                        // a parse error: the op is missing
      {"list", "--device", "cuda:nine", "--json"},                 // a bad device
      {"run", "layernorm.rmsnorm", "--iters", "0", "--json"},      // a failed option check
      {"run", "layernorm.rmsnorm", "--shape", "H=abc", "--json"},  // a bad size
  };
  for (const auto& args : cases) {
    const ToolResult r = run_tool(args);
    CHECK(r.exit_code == 1);
    const Json j = json_of(r);
    CHECK(j.at("error").at("code") == "usage");
    CHECK(!j.at("error").at("message").get<std::string>().empty());
  }
}

TEST_CASE("run and bench: a bad --dtype, --shape, --attr, --iters or --save is a usage error naming it") {
  struct Case {
    std::vector<std::string> args;
    std::vector<std::string> says;  // in stderr
  };
  const std::string file = make_temp_dir() + "/a-file";
  std::ofstream(file) << "not a directory";
  const Case cases[] = {
      {{"run", "layernorm.rmsnorm", "--dtype", "float8"}, {"--dtype float8", "unknown dtype", "bfloat16"}},
      {{"run", "--all", "--dtype", "float8"}, {"--dtype float8", "unknown dtype"}},
      {{"bench", "layernorm.rmsnorm", "--dtype", "int32"},
       {"--dtype int32", "op 'layernorm.rmsnorm' takes float32, float16, bfloat16"}},
      // Sizes whose product wraps round 64 bits, and sizes past any memory.
      {{"run", "layernorm.rmsnorm", "--shape", "*=4294967296", "--shape", "H=4294967296"},
       {"layernorm.rmsnorm float32 at *=[4294967296] H=4294967296", "tensor 'out'", "too large to address"}},
      {{"run", "layernorm.rmsnorm", "--shape", "H=99999999999999"}, {"H=99999999999999", "of memory"}},
      {{"run", "embeddings.rotary_embedding", "--shape", "P=0"}, {"P=0", "tensor 'positions'", "empty range"}},
      {{"run", "layernorm.rmsnorm", "--iters", "0"}, {"--iters", "'0' is not a whole number of at least 1"}},
      {{"run", "layernorm.rmsnorm", "--iters", "-3"}, {"--iters", "'-3'"}},
      {{"run", "layernorm.rmsnorm", "--save", file + "/below"}, {"--save " + file + "/below", "cannot create"}},
      {{"run", "layernorm.rmsnorm", "--attr", "epsilon=1"},
       {"--attr epsilon=1", "op 'layernorm.rmsnorm' has no attribute 'epsilon' (attributes: eps)"}},
      {{"run", "layernorm.rmsnorm", "--attr", "eps=small"},
       {"--attr eps=small", "attribute 'eps' of op 'layernorm.rmsnorm' is a float; 'small' is not one"}},
      {{"run", "layernorm.rmsnorm", "--attr", "eps=1e-5x"}, {"attribute 'eps'", "'1e-5x' is not one"}},
      {{"bench", "moe.topk_softmax", "--attr", "renormalize=maybe"},
       {"attribute 'renormalize' of op 'moe.topk_softmax' is a bool; 'maybe' is not one"}},
      // An attribute takes the values it takes through every entry point: a
      // bool is true or false, as in Python and C++, not 1 or 0.
      {{"run", "moe.topk_softmax", "--attr", "renormalize=1"},
       {"attribute 'renormalize' of op 'moe.topk_softmax' is a bool; '1' is not one (true or false)"}},
      {{"run", "moe.topk_softmax", "--attr", "renormalize=0"}, {"'0' is not one (true or false)"}},
      {{"run", "embeddings.rotary_embedding", "--attr", "is_neox=True"}, {"'True' is not one (true or false)"}},
      {{"run", "--all", "--attr", "nope=1"}, {"--attr nope=1", "no op has an attribute 'nope'"}},
      {{"run", "layernorm.rmsnorm", "--attr", "eps"}, {"--attr 'eps': expected NAME=VALUE"}},
  };
  for (const Case& c : cases) {
    const ToolResult r = run_tool(c.args);
    INFO(fmt::format("{}\nstdout: {}\nstderr: {}", fmt::join(c.args, " "), r.out, r.err));
    CHECK(r.exit_code == 1);
    for (const std::string& s : c.says) CHECK_MESSAGE(r.err.find(s) != std::string::npos, s);
  }
}

TEST_CASE("run --attr sets an attribute, typed by the schema, and the check follows it") {
  for (const std::string value : {"true", "false"}) {
    const ToolResult r = run_tool({"run", "moe.topk_softmax", "--backend", "cpu", "--dtype", "float32", "--iters", "1",
                                   "--attr", "renormalize=" + value, "--save", make_temp_dir(), "--json"});
    INFO("stdout: " << r.out << "\nstderr: " << r.err);
    CHECK(r.exit_code == 0);
    CHECK(json_of(r).at("results")[0].at("status") == "passed");
  }
  const std::string dir = make_temp_dir();
  CHECK(run_tool({"run", "layernorm.rmsnorm", "--backend", "cpu", "--dtype", "float32", "--iters", "1", "--attr",
                  "eps=0.25", "--save", dir})
            .exit_code == 0);
  std::ifstream attrs(dir + "/layernorm.rmsnorm.cpu.float32.attrs.json");
  CHECK(Json::parse(attrs).at("eps") == 0.25);
}

TEST_CASE("run: a call that breaks the schema's requirements fails its result with KD-E030 naming the rule") {
  const ToolResult r =
      run_tool({"run", "moe.topk_softmax", "--backend", "cpu", "--dtype", "float32", "--shape", "E=16", "--shape",
                "K=17", "--json"});
  INFO("stdout: " << r.out << "\nstderr: " << r.err);
  CHECK(r.exit_code == 3);
  const Json j = json_of(r);
  REQUIRE(j.at("results").size() == 1);
  const Json& result = j.at("results")[0];
  CHECK(result.at("ok") == false);
  CHECK(result.at("error").get<std::string>().find("KD-E030") != std::string::npos);
  CHECK(result.at("error").get<std::string>().find("requirement K <= E: K = 17") != std::string::npos);
}

TEST_CASE("run --attr head_size=D: rotary's query and key flattened, checked against the reference") {
  const std::string dir = make_temp_dir();
  const ToolResult r = run_tool({"run", "embeddings.rotary_embedding", "--backend", "cpu", "--dtype", "float32",
                                 "--shape", "*=3,5", "--shape", "D=24", "--shape", "R=8", "--shape", "HQ=3", "--shape",
                                 "HK=2", "--iters", "1", "--attr", "head_size=24", "--save", dir, "--json"});
  INFO("stdout: " << r.out << "\nstderr: " << r.err);
  CHECK(r.exit_code == 0);
  CHECK(json_of(r).at("results")[0].at("status") == "passed");
  CHECK(json_of(r).at("results")[0].at("checked_against").get<std::string>().find("reference") != std::string::npos);
  // The tensors were given flattened: query [3, 5, 3*24].
  std::ifstream npy(dir + "/embeddings.rotary_embedding.cpu.float32.query.in.npy", std::ios::binary);
  const std::string header((std::istreambuf_iterator<char>(npy)), std::istreambuf_iterator<char>());
  CHECK(header.find("'shape': (3, 5, 72)") != std::string::npos);
  // A head_size that does not divide the flattened query: KD-E030 naming it.
  const ToolResult bad = run_tool({"run", "embeddings.rotary_embedding", "--backend", "cpu", "--dtype", "float32",
                                   "--shape", "D=24", "--shape", "R=8", "--shape", "HQ=3", "--attr", "head_size=7",
                                   "--json"});
  INFO("stdout: " << bad.out << "\nstderr: " << bad.err);
  CHECK(bad.exit_code == 3);
  const std::string error = json_of(bad).at("results")[0].at("error").get<std::string>();
  CHECK(error.find("KD-E030") != std::string::npos);
  CHECK(error.find("argument 1 'query': is given flattened") != std::string::npos);
  CHECK(error.find("must be a multiple of head_size = 7") != std::string::npos);
}

TEST_CASE("KDISPATCH_CPU_THREADS that is not a thread count is ignored with a warning") {
  const std::vector<std::string> args{"run", "layernorm.rmsnorm", "--backend", "cpu", "--dtype", "float32", "--iters", "1"};
  for (const std::string value : {"abc", "0", "4x", "100000"}) {
    const ToolResult r = run_tool(args, {{"KDISPATCH_CPU_THREADS", value}});
    INFO("KDISPATCH_CPU_THREADS=" << value << "\nstderr: " << r.err);
    CHECK(r.exit_code == 0);
    CHECK(r.err.find("kdispatch: warn: KDISPATCH_CPU_THREADS='" + value + "' is not a whole number from 1 to 1024") !=
          std::string::npos);
  }
  const ToolResult quiet = run_tool(args, {{"KDISPATCH_CPU_THREADS", "abc"}, {"KDISPATCH_LOG", "error"}});
  CHECK(quiet.exit_code == 0);
  CHECK(quiet.err.find("KDISPATCH_CPU_THREADS") == std::string::npos);
  const ToolResult good = run_tool(args, {{"KDISPATCH_CPU_THREADS", "3"}});
  CHECK(good.exit_code == 0);
  CHECK(good.err.find("KDISPATCH_CPU_THREADS") == std::string::npos);
}

TEST_CASE("the first call of a kernel opens exactly its plugin, and the check its reference") {
  // Plugin libraries are loaded through their checked descriptor: the
  // dynamic loader (LD_DEBUG) names each /proc/self/fd/N, and the core's log
  // says which library that is. No scan: the helper's loads are its own.
  const ToolResult r = run_tool({"run", "layernorm.rmsnorm", "--backend", "cpu", "--iters", "1", "--json"},
                                {{"LD_DEBUG", "files"}, {"KDISPATCH_LOG", "debug"}, {"KDISPATCH_SCAN", "off"}});
  CHECK(r.exit_code == 0);
  std::set<std::string> opened;  // library file names
  size_t loads = 0;
  std::istringstream lines(r.err);
  for (std::string line; std::getline(lines, line);) {
    if (line.find("file=/proc/self/fd/") != std::string::npos &&
        line.find("dynamically loaded by") != std::string::npos) {
      ++loads;
    }
    const std::string said = "opened plugin library ";
    if (const size_t at = line.find(said); at != std::string::npos) {
      const std::string rest = line.substr(at + said.size());
      opened.insert(std::filesystem::path(rest.substr(0, rest.find(' '))).filename().string());
    }
  }
  INFO("stderr: " << r.err);
  CHECK(opened == std::set<std::string>{"libkdispatch-cpu.so", "libkdispatch-reference.so"});
  CHECK(loads == opened.size());
}

TEST_CASE("run --all: every op and dtype on cpu checked against the reference, none unchecked") {
  const ToolResult r = run_tool({"run", "--all", "--device", "cpu", "--iters", "1", "--json"});
  INFO("stdout: " << r.out << "\nstderr: " << r.err);
  CHECK(r.exit_code == 0);
  const Json j = json_of(r);
  size_t cpu_results = 0;
  for (const Json& result : j.at("results")) {
    CHECK(result.at("backend") != "reference");  // the oracle is not a result of its own
    CHECK(result.at("status") == "passed");
    CHECK(result.at("checked_against") == "reference (reference)");
    cpu_results += result.at("backend") == "cpu";
  }
  // Every op of the cpu backend in each of its dtypes, as `list` counts them.
  size_t cpu_ops = 0;
  const Json listed = json_of(run_tool({"list", "--device", "cpu", "--json"}));
  for (const Json& op : listed.at("ops")) {
    for (const Json& b : op.at("backends")) cpu_ops += b.at("backend") == "cpu";
  }
  CHECK(cpu_ops >= 7);
  // One result per dtype each cpu kernel declares (an op's dtypes: three
  // float ones, or int32 and int64 ids).
  size_t cpu_kernel_dtypes = 0;
  std::ifstream manifest(std::string(KDISPATCH_PLUGIN_DIR) + "/cpu.json");
  const Json kernels = Json::parse(manifest).at("kernels");
  for (const Json& k : kernels) cpu_kernel_dtypes += k.at("dtypes").size();
  CHECK(kernels.size() == cpu_ops);
  CHECK(cpu_results == cpu_kernel_dtypes);
  CHECK(j.at("summary").at("passed") == j.at("results").size());
  CHECK(j.at("summary").at("failed") == 0);
  CHECK(j.at("summary").at("unchecked") == 0);
  CHECK(j.at("summary").at("skipped") == j.at("skipped").size());
  const ToolResult human = run_tool({"run", "--all", "--backend", "cpu", "--iters", "1"});
  CHECK(human.exit_code == 0);
  CHECK(human.out.find(fmt::format("\nrun: {} passed, 0 failed, 0 unchecked, 0 skipped, 0 not run\n", cpu_results)) !=
        std::string::npos);
  CHECK(j.at("not_run").empty());
  CHECK(j.at("exit_code") == 0);
}

TEST_CASE("run: a kernel 1% wrong fails in float32, float16 and bfloat16") {
  const std::string dir = std::string(KDISPATCH_BINARY_DIR) + "/tests/fixtures/plugins/fx_wrong";
  const ToolResult r = run_tool({"run", "activation.silu_and_mul", "--backend", "fx_wrong", "--add-plugin-path", dir,
                                 "--iters", "1", "--json"});
  INFO("stdout: " << r.out << "\nstderr: " << r.err);
  CHECK(r.exit_code == 3);
  const Json j = json_of(r);
  std::set<std::string> failed;
  for (const Json& result : j.at("results")) {
    CHECK(result.at("status") == "failed");
    failed.insert(result.at("dtype").get<std::string>());
  }
  CHECK(failed == std::set<std::string>{"float32", "float16", "bfloat16"});
  CHECK(j.at("summary").at("failed") == 3);
  // At an odd size too.
  const ToolResult odd = run_tool({"run", "activation.silu_and_mul", "--backend", "fx_wrong", "--add-plugin-path", dir,
                                   "--iters", "1", "--json", "--shape", "*=7", "--shape", "D=4097"});
  CHECK(json_of(odd).at("summary").at("failed") == 3);
}

TEST_CASE("run: an op without a reference kernel is unchecked, never passed, and exits 4 unless allowed") {
  const std::string dir = std::string(KDISPATCH_BINARY_DIR) + "/tests/fixtures/plugins/fx_no_reference";
  const ToolResult r =
      run_tool({"run", "fixture.scaled", "--add-plugin-path", dir, "--iters", "1", "--json"});
  INFO("stdout: " << r.out << "\nstderr: " << r.err);
  CHECK(r.exit_code == 4);
  const Json j = json_of(r);
  REQUIRE(j.at("results").size() == 1);
  CHECK(j.at("results")[0].at("status") == "unchecked");
  CHECK(j.at("results")[0].at("checked") == false);
  CHECK(j.at("summary") == Json{{"passed", 0}, {"failed", 0}, {"unchecked", 1}, {"skipped", 0}, {"not_run", 0}});
  CHECK(j.at("exit_code") == 4);
  const ToolResult human = run_tool({"run", "fixture.scaled", "--add-plugin-path", dir, "--iters", "1"});
  CHECK(human.exit_code == 4);
  CHECK(human.out.find("unchecked: fixture.scaled: not checked: the op has no reference kernel") != std::string::npos);
  CHECK(human.out.find("\nrun: 0 passed, 0 failed, 1 unchecked, 0 skipped, 0 not run\n"
                       "run: exit 4: nothing failed, but not everything asked for was checked: 1 unchecked (above); "
                       "--allow-unchecked accepts unchecked results\n") != std::string::npos);
  const ToolResult allowed =
      run_tool({"run", "fixture.scaled", "--add-plugin-path", dir, "--iters", "1", "--allow-unchecked"});
  CHECK(allowed.exit_code == 0);
  CHECK(allowed.out.find("\nrun: 0 passed, 0 failed, 1 unchecked, 0 skipped, 0 not run\n") != std::string::npos);
  CHECK(allowed.out.find("exit 4") == std::string::npos);
  // --no-check asks for unchecked results: it implies --allow-unchecked.
  CHECK(run_tool({"run", "fixture.scaled", "--add-plugin-path", dir, "--iters", "1", "--no-check"}).exit_code == 0);
  CHECK(run_tool({"bench", "fixture.scaled", "--add-plugin-path", dir}).exit_code == 4);
  CHECK(run_tool({"bench", "fixture.scaled", "--add-plugin-path", dir, "--allow-unchecked"}).exit_code == 0);
}

TEST_CASE("inspect reports the differences of manifest and binary that the loader refuses") {
  const std::string dir = std::string(KDISPATCH_BINARY_DIR) + "/tests/fixtures/plugins/fx_manifest_mismatch";
  const ToolResult r = run_tool({"inspect", dir + "/libfx_manifest_mismatch.so"});
  INFO("stdout: " << r.out << "\nstderr: " << r.err);
  CHECK(r.exit_code == 2);
  CHECK(r.out.find("kernels only in the file: [fixture.scale -> kd_fx_manifest_mismatch_scale]") != std::string::npos);
  CHECK(r.out.find("kernels only in the binary: [fixture.fill -> kd_fx_manifest_mismatch_fill, "
                   "fixture.scale -> kd_fx_manifest_mismatch_scale_v2]") != std::string::npos);
  CHECK(r.out.find("manifest and binary DISAGREE") != std::string::npos);
  const ToolResult good = run_tool({"inspect", kPluginDir + "/cpu.json"});
  CHECK(good.exit_code == 0);
  CHECK(good.out.find("manifest and binary agree") != std::string::npos);
}

TEST_CASE("validate and doctor say which ops have no reference kernel") {
  const std::string dir = std::string(KDISPATCH_BINARY_DIR) + "/tests/fixtures/plugins/fx_no_reference";
  const ToolResult v = run_tool({"validate", dir + "/fx_no_reference.json", kManifests + "/cpu.json"});
  CHECK(v.exit_code == 0);
  CHECK(v.out.find("fx_no_reference.json: warning: KD-E014: " + dir +
                   "/fx_no_reference.json: /kernels/0/op: op 'fixture.scaled' has no reference kernel") !=
        std::string::npos);
  CHECK(v.out.find("cpu.json: warning") == std::string::npos);
  const ToolResult vj = run_tool({"validate", dir + "/fx_no_reference.json", "--json"});
  CHECK(json_of(vj)["results"][0]["ops_without_reference"] == Json{"fixture.scaled"});
  const ToolResult d = run_tool({"doctor", "--add-plugin-path", dir, "--json"});
  CHECK(json_of(d)["ops_without_reference"] == Json{"fixture.scaled"});
  const ToolResult shipped = run_tool({"doctor"});
  CHECK(shipped.out.find("every op has a reference kernel") != std::string::npos);
}

TEST_CASE("the reference backend is chosen only when named or forced") {
  const ToolResult plain = run_tool({"select", "layernorm.rmsnorm", "--device", "cpu", "--json"});
  CHECK(json_of(plain)["backend"] == "cpu");
  const ToolResult named = run_tool({"select", "layernorm.rmsnorm", "--device", "cpu", "--backend", "reference", "--json"});
  CHECK(json_of(named)["backend"] == "reference");
  const ToolResult forced =
      run_tool({"select", "layernorm.rmsnorm", "--device", "cpu", "--json"}, {{"KDISPATCH_FORCE_BACKEND", "reference"}});
  CHECK(json_of(forced)["backend"] == "reference");
  // Alone, it is not the one usable backend.
  const ToolResult alone = run_tool({"select", "layernorm.rmsnorm", "--device", "cpu", "--json"},
                                    {{"KDISPATCH_PLUGINS_SELECT", "reference"}});
  CHECK(alone.exit_code == 2);
  CHECK(json_of(alone)["error"]["code"] == "KD-E003");
}

TEST_CASE("doctor --json over the broken fixture plugins: each with its code, the good ones loaded") {
  const std::string root = std::string(KDISPATCH_BINARY_DIR) + "/tests/fixtures/plugins";
  std::vector<std::string> args{"doctor", "--json"};
  for (const auto& entry : fs::directory_iterator(root)) {
    args.push_back("--plugin-path");
    args.push_back(entry.path().string());
  }
  const ToolResult r = run_tool(args);
  CHECK(r.exit_code == 2);
  const Json doc = json_of(r);
  const std::map<std::string, std::string> expected = {
      {"fx_no_entry", "KD-E021"},          {"fx_null_entry", "KD-E021"},     {"fx_abi_major", "KD-E022"},
      {"fx_small_struct", "KD-E022"},      {"fx_manifest_mismatch", "KD-E023"}, {"fx_missing_kernel", "KD-E023"},
      {"fx_probe_fails", "KD-E024"},       {"fx_missing_dep", "KD-E020"},    {"fx_undefined_symbol", "KD-E020"},
      {"fx_not_elf", "KD-E020"},           {"fx_truncated", "KD-E020"}};
  size_t seen = 0;
  for (const auto& p : doc["plugins"]) {
    const std::string name = p["name"];
    INFO(name);
    if (auto it = expected.find(name); it != expected.end()) {
      ++seen;
      CHECK(p["status"] == "error");
      REQUIRE(p["problems"].size() >= 1);
      CHECK(p["problems"].back()["code"] == it->second);
      CHECK(p["problems"].back()["message"].get<std::string>().find(p["library"].get<std::string>()) !=
            std::string::npos);
    } else {
      CHECK(p["loaded"] == true);
      // Fixtures are built against the current header (ABI 1.1), but for the ones that keep 1.0.
      CHECK(p["abi"] == (name == "fx_abi_1_0_exact" || name == "fx_untimed_gpu" ? "1.0" : "1.1"));
      CHECK(p["devices"].size() == (name.starts_with("fx_gpu_") ? 2 : 1));
    }
  }
  CHECK(seen == expected.size());
  // Demotions happen in a process that calls kernels: a fresh doctor has none.
  REQUIRE(doc["demotions"].is_array());
  CHECK(doc["demotions"].empty());
}

TEST_CASE("broken manifests beside a good one do not stop it from loading") {
  const std::string dir = plugin_dir({kManifests + "/cpu.json"});
  int copied = 0;
  for (const auto& entry : fs::directory_iterator(kFixtures + "/manifests/bad")) {
    if (entry.path().extension() != ".json") continue;
    fs::copy_file(entry.path(), dir + "/" + entry.path().filename().string());
    ++copied;
  }
  const Json doc = json_of(run_tool({"list", "--json", "--device", "cpu", "--plugin-path", dir}));
  int errors = 0;
  bool cpu = false;
  for (const auto& p : doc["plugins"]) {
    if (p["name"] == "cpu") cpu = p["status"] == "ok";
    if (p["status"] == "error") ++errors;
  }
  CHECK(cpu);
  CHECK(errors >= copied - 2);  // a bad file may still name plugin "cpu" and be shadowed
  const ToolResult sel = run_tool({"select", "layernorm.rmsnorm", "--device", "cpu", "--json", "--plugin-path", dir});
  CHECK(sel.exit_code == 0);
  CHECK(json_of(sel)["backend"] == "cpu");
  fs::remove_all(dir);
}

#ifndef KDISPATCH_HAVE_CUDA_PLUGIN
#define KDISPATCH_HAVE_CUDA_PLUGIN 0
#endif
#ifndef KDISPATCH_HAVE_HIP_PLUGIN
#define KDISPATCH_HAVE_HIP_PLUGIN 0
#endif

// The GPU plugins are built here (nvcc, hipcc) but this machine has no GPU:
// they load, probe zero devices, and their ops are registered but not usable
// on cpu, with the reason.
void check_gpu_plugin_without_device(const std::string& backend) {
  const Json doctor = json_of(run_tool({"doctor", "--json"}));
  bool seen = false;
  for (const auto& p : doctor["plugins"]) {
    if (p["name"] != backend) continue;
    seen = true;
    CHECK(p["loaded"] == true);
    CHECK(p["status"] == "ok");
    CHECK(p["devices"].empty());
  }
  CHECK(seen);
  const Json list = json_of(run_tool({"list", "--json", "--device", "cpu"}));
  int ops = 0;
  for (const auto& op : list["ops"]) {
    for (const auto& b : op["backends"]) {
      if (b["backend"] != backend) continue;
      ++ops;
      CHECK(b["eligible"] == false);
      CHECK(b["reason"] == "targets " + backend + ", not cpu");
    }
  }
  std::ifstream manifest(kGpuManifests + "/" + backend + ".json");
  CHECK(ops == static_cast<int>(Json::parse(manifest).at("kernels").size()));
  // Only the GPU plugin on the path: KD-E003 naming the device mismatch.
  const ToolResult r = run_tool({"select", "layernorm.rmsnorm", "--device", "cpu", "--plugin-path", kPluginDir},
                                {{"KDISPATCH_PLUGINS_SELECT", backend}});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("error[KD-E003]: op 'layernorm.rmsnorm' has no backend usable on device 'cpu' (registered: [" +
                   backend + "]): " + backend + ": targets " + backend + ", not cpu") == 0);
}

// Where the GPU is present these do not apply: the GPU check covers that case.
bool exists(const char* path) { return fs::exists(path); }

TEST_CASE("the cuda plugin here: loads, probes no device, registered but not usable on cpu" *
          doctest::skip(!KDISPATCH_HAVE_CUDA_PLUGIN || exists("/dev/nvidia0"))) {
  check_gpu_plugin_without_device("cuda");
}

TEST_CASE("the hip plugin here: loads, probes no device, registered but not usable on cpu" *
          doctest::skip(!KDISPATCH_HAVE_HIP_PLUGIN || exists("/dev/kfd"))) {
  check_gpu_plugin_without_device("hip");
}
