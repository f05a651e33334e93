// A plugin author's mistakes, each made once on a manifest that is otherwise
// right: every one is named by `validate`, `doctor` or `run` (which exits
// non-zero), and none crashes the tool. Mistakes that only a build shows
// (an invalid manifest, a kernel table without a declared symbol) are the
// plugin_helper.* tests; a second implementation of a built-in op is the
// package test's opt-in step.
#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

#include "run_tool.hpp"

namespace fs = std::filesystem;
using Json = nlohmann::json;

namespace {

// A plugin with its own op, its fast kernel and its reference kernel, in
// float32 and float16: nothing for validate to warn about.
Json good_manifest() {
  return Json::parse(R"({
    "kdispatch_manifest": "1.0", "plugin": "fx_author", "backend": "fx_author",
    "library": "libfx_author.so", "abi": "1.0", "targets": [{"device": "cpu"}],
    "kernels": [
      {"op": "fixture.author_scale", "symbol": "fx_author_scale", "dtypes": ["float32", "float16"]},
      {"op": "fixture.author_scale", "symbol": "fx_author_scale_reference", "role": "reference",
       "dtypes": ["float32", "float16"]}],
    "ops": [
      {"op": "fixture.author_scale", "doc": "out = x * factor",
       "tensors": [{"name": "out", "shape": ["*", "N"], "dtype": "T", "written": true},
                   {"name": "x", "shape": ["*", "N"], "dtype": "T"}],
       "attrs": [{"name": "factor", "type": "float", "default": 2.0}],
       "dtypes": {"T": ["float32", "float16"]},
       "example": {"*": [3], "N": 7}}]})");
}

// A plugin folder holding `manifests` (file name: the plugin's name), each
// beside a stand-in library, and the path of the first manifest.
struct Folder {
  std::string dir;
  std::string first;
};
Folder folder_of(const std::vector<Json>& manifests) {
  Folder f{make_temp_dir(), ""};
  for (const Json& m : manifests) {
    const std::string path = f.dir + "/" + m.at("plugin").get<std::string>() + ".json";
    std::ofstream(path) << m.dump(2);
    std::ofstream(f.dir + "/" + m.at("library").get<std::string>()) << "stand-in";
    if (f.first.empty()) f.first = path;
  }
  return f;
}

ToolResult validate(const std::vector<Json>& manifests) {
  const Folder f = folder_of(manifests);
  std::vector<std::string> args{"validate"};
  for (const Json& m : manifests) args.push_back(f.dir + "/" + m.at("plugin").get<std::string>() + ".json");
  return run_tool(args);
}

bool has(const ToolResult& r, const std::string& text) { return r.out.find(text) != std::string::npos; }

}  // namespace

TEST_CASE("mistakes: the right manifest gets no warning") {
  const ToolResult r = validate({good_manifest()});
  INFO(r.out << r.err);
  CHECK(r.exit_code == 0);
  CHECK(has(r, "ok (plugin 'fx_author', backend 'fx_author', 2 kernel(s))\n"));
  CHECK_FALSE(has(r, "warning"));
}

TEST_CASE("mistakes: a typo in a kernel's op id is named, with the op it meant") {
  Json m = good_manifest();
  m["kernels"][0]["op"] = "fixture.autor_scale";
  const ToolResult r = validate({m});
  INFO(r.out << r.err);
  CHECK(r.exit_code == 0);
  CHECK(has(r, "warning: KD-E014: "));
  CHECK(has(r, "/kernels/0/op: op 'fixture.autor_scale' has no op schema"));
  CHECK(has(r, "did you mean 'fixture.author_scale'?"));
  // ... and run, asked for the op, says it ran nothing and exits 4.
  const Folder f = folder_of({m});
  const ToolResult run = run_tool({"run", "fixture.author_scale", "--add-plugin-path", f.dir});
  INFO(run.out << run.err);
  CHECK(run.exit_code == 4);
  CHECK(has(run, "not run: fixture.author_scale"));
  CHECK(has(run, "0 passed, 0 failed, 0 unchecked"));
}

TEST_CASE("mistakes: an output not marked written is named: nothing would be compared") {
  Json m = good_manifest();
  m["ops"][0]["tensors"][0].erase("written");
  const ToolResult r = validate({m});
  INFO(r.out << r.err);
  CHECK(has(r, "warning: KD-E014: "));
  CHECK(has(r, "op 'fixture.author_scale': no tensor is \"written\" or \"inplace\""));
}

TEST_CASE("mistakes: a typo in the reference's op id is named on both kernels") {
  Json m = good_manifest();
  m["kernels"][1]["op"] = "fixture.author_scal";
  const ToolResult r = validate({m});
  INFO(r.out << r.err);
  CHECK(has(r, "/kernels/0/op: op 'fixture.author_scale' has no reference kernel"));
  CHECK(has(r, "a reference is declared for op 'fixture.author_scal': a typo?"));
  CHECK(has(r, "/kernels/1/op: op 'fixture.author_scal' has no op schema"));
}

TEST_CASE("mistakes: a reference plugin without \"role\": \"reference\" is named") {
  Json fast = good_manifest();
  fast["kernels"].erase(1);
  Json ref = good_manifest();
  ref["plugin"] = "fx_author_ref";
  ref["backend"] = "fx_author_ref";
  ref["library"] = "libfx_author_ref.so";
  ref["kernels"].erase(0);
  ref["kernels"][0].erase("role");
  ref.erase("ops");
  const ToolResult r = validate({fast, ref});
  INFO(r.out << r.err);
  CHECK(has(r, "op 'fixture.author_scale' has no reference kernel"));
  CHECK(has(r, "plugin 'fx_author_ref'"));
  CHECK(has(r, "lacks \"role\": \"reference\""));
  // In one manifest, a second kernel of the op without its role is a
  // second kernel of the same backend: an error.
  Json one = good_manifest();
  one["kernels"][1].erase("role");
  const ToolResult e = validate({one});
  INFO(e.out << e.err);
  CHECK(e.exit_code == 2);
  CHECK(has(e, "KD-E005"));
}

TEST_CASE("mistakes: a dtype left out of the kernel's list, or outside the schema's, is named") {
  Json m = good_manifest();
  m["kernels"][0]["dtypes"] = Json{"float32"};
  const ToolResult r = validate({m});
  INFO(r.out << r.err);
  CHECK(has(r, "/kernels/0/dtypes: op 'fixture.author_scale' takes float16 (its schema: float32, float16), which no "
               "backend's kernel serves"));
  m["kernels"][0]["dtypes"] = Json{"float32", "float16", "bfloat16"};
  const ToolResult outside = validate({m});
  INFO(outside.out << outside.err);
  CHECK(has(outside, "/kernels/0/dtypes: bfloat16 is not among the dtypes op 'fixture.author_scale' takes"));
}

TEST_CASE("mistakes: a library with no manifest beside it is named by doctor") {
  const Folder f = folder_of({good_manifest()});
  std::ofstream(f.dir + "/libfx_author_forgotten.so") << "stand-in";
  const ToolResult r = run_tool({"doctor", "--no-load", "--plugin-path", f.dir});
  INFO(r.out << r.err);
  CHECK(has(r, "KD-E028"));
  CHECK(has(r, "libfx_author_forgotten.so"));
  CHECK_FALSE(has(r, "no problems found"));
}

TEST_CASE("mistakes: a kernel that writes past its output fails run, naming the kernel, the tensor and the offsets") {
  const std::string dir = std::string(KDISPATCH_BINARY_DIR) + "/tests/fixtures/plugins/fx_overrun";
  const ToolResult r = run_tool({"run", "fixture.overrun", "--add-plugin-path", dir, "--iters", "1"});
  INFO(r.out << r.err);
  CHECK(r.exit_code == 3);
  // out is 3 x 7 float32: 84 bytes, and the kernel wrote 84 more.
  CHECK(has(r, "kernel 'kd_fx_overrun_scale' of backend 'fx_overrun' wrote outside tensor 'out' (84 bytes): the "
               "guard bytes at offsets 84 to 167 from its start, past its end, changed"));
  CHECK(has(r, "0 passed, 1 failed"));
  // The reference, run by name, writes only its output.
  const ToolResult ref =
      run_tool({"run", "fixture.overrun", "--add-plugin-path", dir, "--iters", "1", "--backend", "reference"});
  INFO(ref.out << ref.err);
  CHECK(ref.out.find("wrote outside") == std::string::npos);
}
