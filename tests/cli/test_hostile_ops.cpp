// One plugin's unusable op (a schema past the call checker's limits, a
// required attribute without default, example sizes that cannot be
// allocated) is reported, and run --all goes on.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <map>

#include "hostile_helpers.hpp"

using namespace hostile;

namespace {

// A copy of the fx_good fixture plugin whose manifest defines the schemas of
// its two ops: fixture.scale with a required attribute and no default,
// fixture.fill with example sizes no machine can allocate.
fs::path dir_with_unusable_ops() {
  const fs::path dir = dir_with_cpu_plugin();
  const std::string fx = std::string(KDISPATCH_BINARY_DIR) + "/tests/fixtures/plugins/fx_good";
  fs::copy_file(fx + "/libfx_good.so", dir / "libfx_good.so");
  write_file(dir / "fx_good.json", R"({
  "kdispatch_manifest": "1.0", "plugin": "fx_good", "backend": "fx_good", "library": "libfx_good.so", "abi": "1.0",
  "targets": [{"device": "cpu"}],
  "kernels": [
    {"op": "fixture.scale", "symbol": "kd_fx_good_scale", "dtypes": ["float32"]},
    {"op": "fixture.fill", "symbol": "kd_fx_good_fill", "dtypes": ["float32"]}],
  "ops": [
    {"op": "fixture.scale",
     "tensors": [{"name": "out", "shape": ["N"], "dtype": "float32", "written": true},
                 {"name": "x", "shape": ["N"], "dtype": "float32"}],
     "attrs": [{"name": "factor", "type": "float"}]},
    {"op": "fixture.fill",
     "tensors": [{"name": "out", "shape": ["*", "N"], "dtype": "float32", "written": true}],
     "attrs": [{"name": "value", "type": "float", "default": 1.0}],
     "example": {"*": [1048576], "N": 1099511627776}}]})");
  return dir;
}

}  // namespace

TEST_CASE("hostile ops: run --all reports ops it cannot run and goes on") {
  const fs::path dir = dir_with_unusable_ops();
  const ToolResult r = run_tool({"run", "--all", "--json", "--iters", "1", "--plugin-path", dir.string()});
  CHECK(r.exit_code == 3);
  const Json doc = json_of(r);
  std::map<std::string, Json> by_op;
  for (const auto& result : doc["results"]) {
    if (result["backend"] == "cpu" && result["dtype"] == "float32") by_op[result["op"]] = result;
    if (result["op"] == "fixture.scale") by_op["fixture.scale"] = result;
  }
  CHECK(by_op["layernorm.rmsnorm"]["ok"] == true);
  CHECK(by_op["moe.topk_softmax"]["ok"] == true);
  CHECK(by_op["fixture.scale"]["ok"] == false);
  CHECK(by_op["fixture.scale"]["error"].get<std::string>().find("[KD-E030]") == 0);
  CHECK(by_op["fixture.scale"]["error"].get<std::string>().find("'factor'") != std::string::npos);
  bool fill_skipped = false;
  for (const auto& s : doc["skipped"]) {
    if (s["op"] == "fixture.fill") {
      fill_skipped = true;
      CHECK(s["reason"].get<std::string>().find("fixture.fill float32 at") == 0);
    }
  }
  CHECK(fill_skipped);
  // Named, the op that cannot be allocated is a usage error as before.
  const ToolResult named = run_tool({"run", "fixture.fill", "--plugin-path", dir.string()});
  CHECK(named.exit_code == 1);
  fs::remove_all(dir.parent_path());
}

TEST_CASE("hostile ops: a schema past the call checker's limits is refused by validate and discovery") {
  const fs::path dir = dir_with_cpu_plugin();
  std::string tensors;
  for (int i = 0; i < 3; ++i) {
    tensors += fmt::format("{}{{\"name\": \"t{}\", \"shape\": [{}], \"dtype\": \"float32\"}}", i == 0 ? "" : ", ", i,
                           i == 0   ? "\"S0\", \"S1\", \"S2\", \"S3\", \"S4\", \"S5\""
                           : i == 1 ? "\"S6\", \"S7\", \"S8\", \"S9\", \"S10\", \"S11\""
                                    : "\"S12\", \"S13\", \"S14\", \"S15\", \"S16\"");
  }
  write_file(dir / "wide.json", fmt::format(R"({{"kdispatch_manifest": "1.0", "plugin": "wide", "backend": "wide",
    "library": "libwide.so", "abi": "1.0",
    "kernels": [{{"op": "fixture.wide", "symbol": "kd_wide"}}],
    "ops": [{{"op": "fixture.wide", "tensors": [{}]}}]}})",
                                            tensors));
  const ToolResult v = run_tool({"validate", (dir / "wide.json").string()});
  CHECK(v.exit_code == 2);
  CHECK(v.out.find("KD-E011") != std::string::npos);
  CHECK(v.out.find("/ops/0: the call checker cannot take it: op 'fixture.wide' has 17 shape symbols, at most 16") !=
        std::string::npos);
  const ToolResult r =
      run_tool({"run", "--all", "--json", "--iters", "1", "--dtype", "float32", "--plugin-path", dir.string()});
  CHECK(r.exit_code == 0);
  CHECK(json_of(r)["results"].size() >= 7);
  fs::remove_all(dir.parent_path());
}
