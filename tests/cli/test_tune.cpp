// kdispatch tune: backends checked against the reference before they are
// timed (a wrong or failing one is excluded and reported), the tuning file
// written, and followed by a later `select`. No assertion depends on which
// backend is faster.
#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "run_tool.hpp"

namespace fs = std::filesystem;
using Json = nlohmann::json;

namespace {

std::string fixture(const char* name) { return std::string(KDISPATCH_BINARY_DIR) + "/tests/fixtures/plugins/" + name; }

Json parse(const std::string& text) {
  REQUIRE_NOTHROW(Json::parse(text));
  return Json::parse(text);
}

// The device as the error names it: "cuda:1" by its type and ordinal.
std::string fmt_device(const std::string& device) { return "device '" + device + "'"; }

Json read_json(const std::string& path) {
  std::ifstream in(path);
  REQUIRE(in.good());
  return parse(std::string(std::istreambuf_iterator<char>(in), {}));
}

}  // namespace

TEST_CASE("tune: a backend with wrong results is excluded, and select follows the file written") {
  const std::string dir = make_temp_dir();
  const std::string out = dir + "/tuning.json";
  const ToolResult r =
      run_tool({"tune", "activation.silu_and_mul", "--device", "cpu", "--dtype", "float32", "--size", "D=64",
                "--add-plugin-path", fixture("fx_wrong"), "--budget", "10", "--out", out, "--json"});
  INFO("stdout: " << r.out << "\nstderr: " << r.err);
  CHECK(r.exit_code == 3);  // a result did not match
  const Json j = parse(r.out);
  REQUIRE(j.at("excluded").size() == 1);
  CHECK(j.at("excluded")[0].get<std::string>().find("fx_wrong") != std::string::npos);
  REQUIRE(j.at("measurements").size() == 1);
  CHECK(j.at("measurements")[0].at("us").contains("cpu"));
  CHECK_FALSE(j.at("measurements")[0].at("us").contains("fx_wrong"));
  CHECK(j.at("stopped_early") == false);

  const Json file = read_json(out);
  CHECK(file.at("kdispatch_tuning") == 1);
  CHECK(file.at("key").at("device") == "cpu");
  CHECK(file.at("key").at("threads").get<int64_t>() >= 1);
  CHECK(file.at("key").at("backends").at("cpu").get<std::string>().rfind("sha256:", 0) == 0);
  REQUIRE(file.at("choices").size() == 1);
  const Json& choice = file.at("choices")[0];
  CHECK(choice.at("op") == "activation.silu_and_mul");
  CHECK(choice.at("dtype") == "float32");
  CHECK(choice.at("when") == "");
  CHECK(choice.at("backend") == "cpu");
  CHECK(choice.at("measured")[0].at("sizes").at("D") == 64);

  // cpu and fx_wrong are both eligible and tied otherwise: the file decides.
  const std::map<std::string, std::string> env{{"KDISPATCH_TUNING_FILE", out}};
  const ToolResult s = run_tool({"select", "activation.silu_and_mul", "--device", "cpu", "--dtype", "float32",
                                 "--add-plugin-path", fixture("fx_wrong"), "--json"},
                                env);
  INFO("select: " << s.out << s.err);
  CHECK(s.exit_code == 0);
  const Json sel = parse(s.out);
  CHECK(sel.at("backend") == "cpu");
  CHECK(sel.at("rule") == "tuned");

  // Another machine's file: ignored, with one warning naming the field.
  Json other = file;
  other["key"]["name"] = "another cpu";
  const std::string other_path = dir + "/other.json";
  std::ofstream(other_path) << other.dump();
  const ToolResult o = run_tool({"select", "activation.silu_and_mul", "--device", "cpu", "--dtype", "float32",
                                 "--add-plugin-path", fixture("fx_wrong"), "--json"},
                                {{"KDISPATCH_TUNING_FILE", other_path}});
  INFO("other: " << o.out << o.err);
  // cpu and fx_wrong tie again: KD-E004, or whatever ranks them, never `tuned`.
  CHECK(o.out.find("\"tuned\"") == std::string::npos);
  CHECK(o.err.find("name: the file has 'another cpu'") != std::string::npos);
  fs::remove_all(dir);
}

TEST_CASE("tune: a failing backend is excluded, and a grid of sizes gives per-shape choices") {
  const std::string dir = make_temp_dir();
  const std::string out = dir + "/tuning.json";
  const ToolResult r =
      run_tool({"tune", "fixture.fallback", "--size", "N=8,512", "--plugin-path", fixture("fx_fb_picky"),
                "--plugin-path", fixture("fx_fb_good"), "--plugin-path", fixture("fx_fb_broken"), "--plugin-path",
                fixture("fx_fb_reference"), "--budget", "10", "--out", out, "--json"});
  INFO("stdout: " << r.out << "\nstderr: " << r.err);
  CHECK(r.exit_code == 3);
  const Json j = parse(r.out);
  std::set<std::string> excluded;
  for (const Json& e : j.at("excluded"))
    excluded.insert(e.get<std::string>().substr(0, e.get<std::string>().find(':')));
  CHECK(excluded == std::set<std::string>{"fixture.fallback fx_fb_broken float32 N=8",
                                          "fixture.fallback fx_fb_broken float32 N=512"});
  REQUIRE(j.at("measurements").size() == 2);
  for (const Json& m : j.at("measurements")) {
    CHECK(m.at("us").size() == 2);  // picky and good, never the reference
    CHECK_FALSE(m.at("us").contains("fx_fb_reference"));
  }
  const Json file = read_json(out);
  const Json& choices = file.at("choices");
  REQUIRE((choices.size() == 1 || choices.size() == 2));
  for (const Json& c : choices) CHECK(c.at("backend") != "fx_fb_broken");
  if (choices.size() == 1) {
    CHECK(choices[0].at("when") == "");
  } else {
    CHECK(choices[0].at("when") == "N <= 64");
    CHECK(choices[1].at("when") == "N > 64");
  }
  fs::remove_all(dir);
}

TEST_CASE("tune: usage errors") {
  const ToolResult device = run_tool({"tune", "layernorm.rmsnorm", "--device", "tpu"});
  CHECK(device.exit_code == 1);
  const ToolResult star = run_tool({"tune", "layernorm.rmsnorm", "--size", "T=1,512"});
  CHECK(star.exit_code == 1);
  CHECK(star.err.find("no shape symbol 'T'") != std::string::npos);
  const ToolResult bad = run_tool({"tune", "layernorm.rmsnorm", "--size", "H=1,x"});
  CHECK(bad.exit_code == 1);
  const ToolResult help = run_tool({"tune", "--help"});
  CHECK(help.exit_code == 0);
  CHECK(help.out.find("--from-trace") != std::string::npos);
}

TEST_CASE("tune: --from-trace takes the ops, dtypes and shapes of a trace's CPU calls") {
  const std::string dir = make_temp_dir();
  const std::string trace = dir + "/trace.jsonl";
  std::ofstream(trace)
      << R"({"op":"fixture.fallback","backend":"fx_fb_picky","rule":"priority","ranked":["fx_fb_picky","fx_fb_good"],)"
      << R"("device":"cpu:0","dtypes":["float32","float32"],"shapes":[[5,24],[5,24]],"us":1.5})"
      << "\n"
      << R"({"op":"fixture.fallback","backend":"fx_fb_picky","rule":"priority","ranked":["fx_fb_picky"],)"
      << R"("device":"cuda:0","dtypes":["float32","float32"],"shapes":[[2,4096],[2,4096]],"us":1.5})"
      << "\n";
  const std::string out = dir + "/tuning.json";
  const ToolResult r = run_tool({"tune", "--from-trace", trace, "--plugin-path", fixture("fx_fb_picky"),
                                 "--plugin-path", fixture("fx_fb_good"), "--plugin-path", fixture("fx_fb_reference"),
                                 "--budget", "10", "--out", out, "--json"});
  INFO("stdout: " << r.out << "\nstderr: " << r.err);
  CHECK(r.exit_code == 0);
  const Json j = parse(r.out);
  REQUIRE(j.at("measurements").size() == 1);  // the cuda call is not timed here
  CHECK(j.at("measurements")[0].at("op") == "fixture.fallback");
  CHECK(j.at("measurements")[0].at("sizes") == "N=24 rows=5");  // rows: the leading dims
  const Json file = read_json(out);
  REQUIRE(file.at("choices").size() == 1);
  CHECK(file.at("choices")[0].at("measured")[0].at("sizes").at("N") == 24);
  CHECK(file.at("choices")[0].at("measured")[0].at("sizes").at("rows") == 5);

  std::ofstream(trace) << "not a trace\n";
  const ToolResult bad = run_tool({"tune", "--from-trace", trace});
  CHECK(bad.exit_code == 1);
  CHECK(bad.err.find("line 1 is not a trace line") != std::string::npos);
  fs::remove_all(dir);
}

TEST_CASE("run: a backend whose results differ from the reference gets a failed verdict, which doctor lists") {
  const std::string dir = make_temp_dir();
  const std::map<std::string, std::string> env{{"XDG_CACHE_HOME", dir}};
  const std::string file = dir + "/kdispatch/conformance-verdicts-1.txt";
  const auto read_text = [&file] {
    std::ifstream in(file);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  const ToolResult r = run_tool({"run", "activation.silu_and_mul", "--backend", "fx_wrong", "--device", "cpu", "--dtype",
                                 "float32", "--add-plugin-path", fixture("fx_wrong"), "--json"},
                                env);
  INFO("run: " << r.out << r.err);
  CHECK(r.exit_code == 3);
  const std::string text = read_text();
  INFO("verdicts: " << text);
  CHECK(text.rfind("kdispatch-conformance-verdicts 1\n", 0) == 0);
  CHECK(text.find("\nfailed\t") != std::string::npos);
  CHECK(text.find("\tfx_wrong\tactivation.silu_and_mul\tcpu\tsha256:") != std::string::npos);
  CHECK(text.find("\tkdispatch run\tfloat32 ") != std::string::npos);

  const ToolResult d = run_tool({"doctor", "--json", "--add-plugin-path", fixture("fx_wrong")}, env);
  INFO("doctor: " << d.out << d.err);
  const Json j = parse(d.out);
  REQUIRE(j.at("failed_verdicts").size() == 1);
  const Json& v = j.at("failed_verdicts")[0];
  CHECK(v.at("backend") == "fx_wrong");
  CHECK(v.at("op") == "activation.silu_and_mul");
  CHECK(v.at("device") == "cpu");
  CHECK(v.at("source") == "kdispatch run");
  CHECK(v.at("library").get<std::string>().rfind("sha256:", 0) == 0);
  CHECK_FALSE(v.at("detail").get<std::string>().empty());
  const ToolResult t = run_tool({"doctor", "--add-plugin-path", fixture("fx_wrong")}, env);
  CHECK(t.out.find("kernels that failed conformance") != std::string::npos);
  CHECK(t.out.find("fx_wrong for activation.silu_and_mul: failed conformance on cpu on ") != std::string::npos);

  // The cpu backend matches: a passed verdict, and doctor lists only fx_wrong's failure.
  const ToolResult c = run_tool(
      {"run", "activation.silu_and_mul", "--backend", "cpu", "--device", "cpu", "--dtype", "float32", "--json"}, env);
  INFO("cpu: " << c.out << c.err);
  CHECK(c.exit_code == 0);
  CHECK(read_text().find("\tcpu\tactivation.silu_and_mul\tcpu\tsha256:") != std::string::npos);
  CHECK(parse(run_tool({"doctor", "--json", "--add-plugin-path", fixture("fx_wrong")}, env).out)
            .at("failed_verdicts")
            .size() == 1);

  // KDISPATCH_VERDICTS=0 records nothing and doctor lists nothing.
  const std::string off = make_temp_dir();
  const std::map<std::string, std::string> off_env{{"XDG_CACHE_HOME", off}, {"KDISPATCH_VERDICTS", "0"}};
  CHECK(run_tool({"run", "activation.silu_and_mul", "--backend", "fx_wrong", "--device", "cpu", "--dtype", "float32",
                  "--add-plugin-path", fixture("fx_wrong"), "--json"},
                 off_env)
            .exit_code == 3);
  CHECK_FALSE(fs::exists(off + "/kdispatch/conformance-verdicts-1.txt"));
  fs::remove_all(dir);
  fs::remove_all(off);
}

// Without the GPU plugins no plugin reports a CUDA or HIP device, whatever
// the machine: nothing can be timed, and the error names the device.
TEST_CASE("tune --device cuda: without a device, a KD error naming it") {
  const std::map<std::string, std::string> no_gpu{{"KDISPATCH_PLUGINS_DISABLE", "cuda,hip"}};
  for (const char* device : {"cuda", "hip", "cuda:1"}) {
    INFO(device);
    const ToolResult r = run_tool({"tune", "layernorm.rmsnorm", "--device", device, "--dtype", "bfloat16"}, no_gpu);
    INFO("stdout: " << r.out << "\nstderr: " << r.err);
    CHECK(r.exit_code == 2);
    CHECK(r.err.find("error[KD-E003]") != std::string::npos);
    CHECK(r.err.find(fmt_device(device)) != std::string::npos);
  }
  const ToolResult j = run_tool({"tune", "layernorm.rmsnorm", "--device", "cuda", "--json"}, no_gpu);
  CHECK(j.exit_code == 2);
  CHECK(parse(j.out).at("error").at("code") == "KD-E003");
}

// fx_timed_gpu and its kin: a fake CUDA device over host memory whose
// plugin times the calls with the host's clock, so that the GPU path runs
// end to end here: rotated inputs placed through kd_memory_api, the check
// against the reference, time_calls with the calls on its stream, the
// graph and eager columns, and the file for the cuda device.
TEST_CASE("tune --device cuda: backends timed by their plugin, a wrong one excluded, a 1.0 one not timed") {
  const std::string dir = make_temp_dir();
  const std::string out = dir + "/tuning-cuda.json";
  const std::map<std::string, std::string> env{{"KDISPATCH_PLUGINS_DISABLE", "cuda,hip"}};
  const std::vector<std::string> plugins{"--add-plugin-path", fixture("fx_timed_gpu"),
                                         "--add-plugin-path", fixture("fx_timed_gpu_wrong"),
                                         "--add-plugin-path", fixture("fx_untimed_gpu")};
  std::vector<std::string> args{"tune",     "activation.silu_and_mul",
                                "--device", "cuda",
                                "--dtype",  "float32",
                                "--size",   "rows=1,7",
                                "--size",   "D=65",
                                "--out",    out};
  args.insert(args.end(), plugins.begin(), plugins.end());
  std::vector<std::string> json_args = args;
  json_args.push_back("--json");
  const ToolResult r = run_tool(json_args, env);
  INFO("stdout: " << r.out << "\nstderr: " << r.err);
  CHECK(r.exit_code == 3);  // fx_timed_gpu_wrong's results do not match
  const Json j = parse(r.out);
  CHECK(j.at("device") == "cuda");
  REQUIRE(j.at("excluded").size() == 2);
  for (const Json& e : j.at("excluded"))
    CHECK(e.get<std::string>().rfind("activation.silu_and_mul fx_timed_gpu_wrong", 0) == 0);
  REQUIRE(j.at("not_timed").size() == 1);
  CHECK(j.at("not_timed")[0] ==
        "activation.silu_and_mul fx_untimed_gpu: the fx_untimed_gpu plugin cannot time calls (ABI 1.0)");
  REQUIRE(j.at("measurements").size() == 2);
  for (const Json& m : j.at("measurements")) {
    INFO(m.dump());
    CHECK(m.at("dtype") == "float32");
    REQUIRE(m.at("us").size() == 1);
    CHECK(m.at("us").at("fx_timed_gpu").get<double>() > 0);
    REQUIRE(m.at("eager_us").size() == 1);
    CHECK(m.at("eager_us").at("fx_timed_gpu").get<double>() > 0);
  }
  const Json file = read_json(out);
  CHECK(file.at("key").at("device") == "cuda");
  CHECK(file.at("key").at("name") == "fixture timed gpu (sm_90)");
  CHECK(file.at("key").at("arch") == "9.0");
  CHECK(file.at("key").at("backends").at("fx_timed_gpu").get<std::string>().rfind("sha256:", 0) == 0);
  REQUIRE(file.at("choices").size() == 1);
  CHECK(file.at("choices")[0].at("backend") == "fx_timed_gpu");
  CHECK(file.at("choices")[0].at("when") == "");

  // The table: a graph and an eager column per backend timed.
  const ToolResult t = run_tool(args, env);
  INFO("table: " << t.out << t.err);
  CHECK(t.exit_code == 3);
  CHECK(t.out.find("fx_timed_gpu graph") != std::string::npos);
  CHECK(t.out.find("fx_timed_gpu eager") != std::string::npos);
  CHECK(t.out.find("not timed: activation.silu_and_mul fx_untimed_gpu: the fx_untimed_gpu plugin cannot time calls "
                   "(ABI 1.0)") != std::string::npos);
  CHECK(t.out.find("excluded (result does not match the reference): activation.silu_and_mul fx_timed_gpu_wrong") !=
        std::string::npos);

  // Only a backend that cannot time calls: nothing measured, a dispatch failure.
  const ToolResult none =
      run_tool({"tune", "activation.silu_and_mul", "--device", "cuda", "--dtype", "float32", "--size", "D=8",
                "--add-plugin-path", fixture("fx_untimed_gpu"), "--out", dir + "/none.json", "--json"},
               env);
  INFO("none: " << none.out << none.err);
  CHECK(none.exit_code == 2);
  CHECK(parse(none.out).at("measurements").empty());
  fs::remove_all(dir);
}

TEST_CASE("select: without the call's sizes, the tuned choices that depend on them are listed apart") {
  const std::string dir = make_temp_dir();
  const std::string out = dir + "/tuning.json";
  const std::vector<std::string> plugins{"--plugin-path", fixture("fx_fb_picky"), "--plugin-path",
                                         fixture("fx_fb_good"), "--plugin-path", fixture("fx_fb_reference")};
  std::vector<std::string> tune{"tune", "fixture.fallback", "--size", "N=8", "--budget", "5", "--out", out};
  tune.insert(tune.end(), plugins.begin(), plugins.end());
  const ToolResult r = run_tool(tune);
  INFO("tune: " << r.out << r.err);
  REQUIRE(r.exit_code == 0);
  // The file's key as tune wrote it; choices that hold for some sizes only.
  Json file = read_json(out);
  REQUIRE_FALSE(file.at("key").at("backends").empty());
  const std::string backend = file.at("key").at("backends").begin().key();
  const auto choice = [&](const char* when) {
    return Json{{"op", "fixture.fallback"}, {"dtype", "float32"}, {"when", when}, {"backend", backend}};
  };
  file["choices"] = Json::array({choice("N <= 64"), choice("N > 64 and N % 2 == 0")});
  std::ofstream(out) << file.dump();

  const std::map<std::string, std::string> env{{"KDISPATCH_TUNING_FILE", out}};
  std::vector<std::string> select{"select", "fixture.fallback", "--device", "cpu", "--dtype", "float32"};
  select.insert(select.end(), plugins.begin(), plugins.end());
  const ToolResult text = run_tool(select, env);
  INFO("select: " << text.out << text.err);
  CHECK(text.exit_code == 0);
  CHECK(text.out.find("decided by: priority") != std::string::npos);  // no choice for every call
  CHECK(text.out.find("tuned: float32 calls where N <= 64 run '" + backend + "'") != std::string::npos);
  CHECK(text.out.find("tuned: float32 calls where N > 64 and N % 2 == 0 run '" + backend + "'") != std::string::npos);

  select.push_back("--json");
  const ToolResult json = run_tool(select, env);
  INFO("select --json: " << json.out << json.err);
  CHECK(json.exit_code == 0);
  const Json sel = parse(json.out);
  CHECK(sel.at("rule") == "priority");
  REQUIRE(sel.at("conditional").size() == 2);
  CHECK(sel.at("conditional")[0] == Json{{"dtype", "float32"}, {"when", "N <= 64"}, {"backend", backend}});
  CHECK(sel.at("conditional")[1].at("when") == "N > 64 and N % 2 == 0");

  // Without a tuning file there is nothing to list.
  const ToolResult plain = run_tool(select);
  CHECK(plain.exit_code == 0);
  CHECK_FALSE(parse(plain.out).contains("conditional"));

  // With the call's sizes the choices are evaluated: the first that holds
  // decides, and none holding leaves the other rules.
  for (const auto& [size, rule] : std::vector<std::pair<std::string, std::string>>{
           {"N=8", "tuned"}, {"N=100", "tuned"}, {"N=101", "priority"}}) {
    std::vector<std::string> sized = select;
    sized.insert(sized.end(), {"--size", size, "--size", "rows=5"});
    const ToolResult s = run_tool(sized, env);
    INFO(size << ": " << s.out << s.err);
    CHECK(s.exit_code == 0);
    const Json j = parse(s.out);
    CHECK(j.at("rule") == rule);
    if (rule == "tuned") CHECK(j.at("backend") == backend);
    CHECK_FALSE(j.contains("conditional"));
  }
  fs::remove_all(dir);
}

TEST_CASE("select --size/--attr: the call's constraints are evaluated, and bad sizes are usage errors") {
  const std::string op = "quantization.per_token_group_quant_fp8";
  const ToolResult ok = run_tool({"select", op, "--device", "cpu", "--dtype", "bfloat16", "--size", "N=256",
                                  "--size", "G=2", "--attr", "group_size=128", "--json"});
  INFO(ok.out << ok.err);
  CHECK(ok.exit_code == 0);
  CHECK(parse(ok.out).at("backend") == "cpu");

  const ToolResult rejected =
      run_tool({"select", op, "--device", "cpu", "--dtype", "bfloat16", "--attr", "group_size=7"});
  INFO(rejected.out << rejected.err);
  CHECK(rejected.exit_code == 2);
  CHECK(rejected.err.find("KD-E003") != std::string::npos);
  CHECK(rejected.err.find("cpu: constraint 'group_size == 0 or group_size * G == N' is false (group_size = 7") !=
        std::string::npos);

  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {"select", op, "--size", "N=256"},                                  // no dtype
           {"select", op, "--dtype", "bfloat16", "--size", "Q=3"},             // no such symbol
           {"select", op, "--dtype", "bfloat16", "--size", "N=x"},             // not a number
           {"select", "moe.topk_softmax", "--dtype", "float32", "--attr", "renormalize=1"}}) {  // bools are true/false
    const ToolResult r = run_tool(args);
    INFO(r.out << r.err);
    CHECK(r.exit_code == 1);
    CHECK(r.err.find("error") != std::string::npos);
  }
  const ToolResult q = run_tool({"select", op, "--dtype", "bfloat16", "--size", "Q=3"});
  CHECK(q.err.find("--size Q=3: op 'quantization.per_token_group_quant_fp8' has no shape symbol 'Q'") !=
        std::string::npos);
}
