// Tuning files (docs/tuning.md): the `tuned` rule in its place among the
// ranking rules, per-shape choices through the dispatcher, the key that
// ties a file to its machine, bad files, and the one function that turns
// measurements into choices.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kdispatch/context.hpp"
#include "kdispatch/dispatcher.hpp"
#include "kdispatch/error.hpp"
#include "kdispatch/logging.hpp"
#include "kdispatch/registry.hpp"
#include "kdispatch/selector.hpp"
#include "kdispatch/tuning.hpp"
#include "scale_call.hpp"

using namespace kdispatch;
namespace fs = std::filesystem;

namespace {

constexpr const char* kOp = "fixture.fallback";

KernelSpec spec(std::string op, std::string backend, int32_t priority = 0) {
  KernelSpec s;
  s.op = std::move(op);
  s.backend = backend;
  s.plugin = backend;
  s.symbol = "kd_" + backend + "_kernel";
  s.dtypes = {Dtype::float32, Dtype::bfloat16};
  s.manifest = backend + ".json";
  s.priority = priority;
  return s;
}

template <class F>
std::string error_of(F&& f, ErrorCode code) {
  try {
    f();
  } catch (const Error& e) {
    CHECK_MESSAGE(e.code() == code, "got " << e.code_string() << ": " << e.what());
    return e.what();
  }
  FAIL("no error thrown, expected " << code_string(code));
  return {};
}

struct CaptureLog {
  std::vector<std::string> lines;
  CaptureLog() {
    set_log_sink([this](LogLevel, std::string_view m) { lines.emplace_back(m); });
  }
  ~CaptureLog() { set_log_sink({}); }
  size_t count(std::string_view part) const {
    size_t n = 0;
    for (const auto& l : lines) n += l.find(part) != std::string::npos ? 1 : 0;
    return n;
  }
};

bool contains(const std::string& text, std::string_view part) { return text.find(part) != std::string::npos; }

// A file under the temp directory, removed at the end.
struct TempFile {
  fs::path path;
  TempFile(const char* name, const std::string& text) : path(fs::temp_directory_path() / name) {
    std::ofstream(path, std::ios::binary) << text;
  }
  ~TempFile() { fs::remove(path); }
};

// A tuning file's text with the given key fields and choices (JSON).
std::string tuning_text(const TuningKey& key, const std::string& choices) {
  TuningFile f;
  f.key = key;
  std::string text = tuning_file_text(f);
  const auto at = text.find("\"choices\": []");
  REQUIRE(at != std::string::npos);
  return text.replace(at, 13, "\"choices\": " + choices);
}

TuningKey cpu_key() {
  TuningKey key;
  key.kdispatch = "test";
  key.device = DeviceType::cpu;
  key.name = "fixture cpu";
  return key;
}

std::unique_ptr<Context> fixture_context(std::initializer_list<const char*> plugins, std::string tuning_file = {}) {
  ContextOptions options;
  options.search.use_environment = false;
  for (const char* p : plugins) {
    options.search.replace.push_back(std::string(KDISPATCH_BINARY_DIR) + "/tests/fixtures/plugins/" + p);
  }
  SelectorOptions selector;
  selector.tuning_file = std::move(tuning_file);
  options.selector = selector;
  return std::make_unique<Context>(options);
}

using kdispatch::test::ScaleCall;

// The machine key of a context for the fixture.fallback backends.
TuningKey machine_key(const Context& ctx) { return tuning_key(ctx, DeviceType::cpu, {"fx_fb_good", "fx_fb_picky"}); }

const std::string kPerShape =
    R"([{"op": "fixture.fallback", "dtype": "float32", "when": "N <= 100", "backend": "fx_fb_good"},
        {"op": "fixture.fallback", "dtype": "float32", "when": "N > 100", "backend": "fx_fb_picky"}])";

}  // namespace

TEST_CASE("tuning: measurements become choices with boundaries at the geometric mean") {
  const auto m = [](int64_t t, double cpu, double torch) {
    return TuningMeasurement{"layernorm.rmsnorm", Dtype::bfloat16, {{"T", t}, {"H", 4096}}, {{"cpu", cpu}, {"torch", torch}}};
  };
  // Unsorted input; cpu wins small and large T, torch the middle.
  std::vector<TuningChoice> c = build_tuning_choices({m(512, 9, 3), m(1, 1, 5), m(65536, 10, 30), m(64, 1.2, 5.1),
                                                      m(4096, 50, 20)});
  REQUIRE(c.size() == 3);
  CHECK(c[0].when == "T <= 181");
  CHECK(c[0].backend == "cpu");
  CHECK(c[0].measured.size() == 2);
  CHECK(c[1].when == "T > 181 && T <= 16384");
  CHECK(c[1].backend == "torch");
  CHECK(c[2].when == "T > 16384");
  CHECK(c[2].backend == "cpu");
  // One winner overall: one choice for every call.
  c = build_tuning_choices({m(1, 1, 5), m(512, 2, 5)});
  REQUIRE(c.size() == 1);
  CHECK(c[0].when.empty());
  CHECK(c[0].backend == "cpu");
  // Several symbols vary: one exact match per shape.
  c = build_tuning_choices({m(1, 1, 5), TuningMeasurement{"layernorm.rmsnorm", Dtype::bfloat16, {{"T", 8}, {"H", 128}},
                                                          {{"cpu", 9}, {"torch", 2}}}});
  REQUIRE(c.size() == 2);
  CHECK(c[0].when == "H == 4096 && T == 1");
  CHECK(c[1].when == "H == 128 && T == 8");
  CHECK(c[1].backend == "torch");
  CHECK_THROWS_AS(build_tuning_choices({TuningMeasurement{"x.y", Dtype::float32, {{"T", 1}}, {}}}),
                  std::invalid_argument);
}

TEST_CASE("tuning: the tuned rule ranks after the preference and before order and priority") {
  KernelRegistry reg;
  reg.add(spec("x.y", "a", 5));
  reg.add(spec("x.y", "b", 1));
  reg.add(spec("x.y", "c", 1));
  TempFile file("kdispatch-tuning-rule.json",
                tuning_text(cpu_key(), R"([{"op": "x.y", "dtype": "float32", "when": "", "backend": "c"}])"));
  SelectorOptions ordered;
  ordered.backend_order = {"b"};
  Selector sel(reg, ordered);
  const SelectRequest request{"x.y", {}, Device::parse("cpu"), Dtype::float32};
  CHECK(sel.choose(request).rule == SelectionRule::order);
  sel.set_tuning_file(file.path);
  CHECK(sel.tuning_file() == file.path.string());
  Selection s = sel.choose(request);
  CHECK(s.spec->backend == "c");
  CHECK(s.rule == SelectionRule::tuned);
  CHECK(rule_name(s.rule) == "tuned");
  REQUIRE(s.ranked.size() == 3);
  CHECK(s.ranked[1]->backend == "b");  // then the order
  CHECK(s.ranked[2]->backend == "a");
  // Another dtype: no choice of it.
  CHECK(sel.choose({"x.y", {}, Device::parse("cpu"), Dtype::bfloat16}).rule == SelectionRule::order);
  // The preference beats it.
  sel.set_preference("x.y", {"a"});
  s = sel.choose(request);
  CHECK(s.spec->backend == "a");
  CHECK(s.rule == SelectionRule::preference);
  CHECK(s.ranked[1]->backend == "c");
  sel.set_preference("x.y", {});
  // It beats priority alone.
  Selector plain(reg);
  plain.set_tuning_file(file.path);
  s = plain.choose(request);
  CHECK(s.spec->backend == "c");
  CHECK(s.rule == SelectionRule::tuned);
  // Removed: the priority decides again.
  plain.set_tuning_file({});
  CHECK(plain.tuning() == nullptr);
  CHECK(plain.choose(request).spec->backend == "a");
}

TEST_CASE("tuning: KD-E004 only for a true tie, and an opt-in kernel joins when a choice names it") {
  KernelRegistry reg;
  reg.add(spec("x.y", "a"));
  reg.add(spec("x.y", "b"));
  KernelSpec fast = spec("x.y", "fast");
  fast.opt_in = true;
  reg.add(fast);
  Selector sel(reg);
  const SelectRequest request{"x.y", {}, Device::parse("cpu"), Dtype::float32};
  const std::string message = error_of([&] { sel.select(request); }, ErrorCode::ambiguous_backend);
  CHECK(contains(message, "[a, b]"));
  TempFile file("kdispatch-tuning-optin.json",
                tuning_text(cpu_key(), R"([{"op": "x.y", "dtype": "float32", "when": "", "backend": "fast"}])"));
  sel.set_tuning_file(file.path);
  const Selection s = sel.choose(request);
  CHECK(s.spec->backend == "fast");
  CHECK(s.rule == SelectionRule::tuned);
  // The two left are still tied behind it, which is no error: the first decides.
  CHECK(s.ranked.size() == 3);
  // A choice for a backend that is not eligible ranks nothing.
  TempFile cuda("kdispatch-tuning-cuda.json",
                tuning_text(cpu_key(), R"([{"op": "x.y", "dtype": "float32", "when": "", "backend": "nope"}])"));
  sel.set_tuning_file(cuda.path);
  error_of([&] { sel.select(request); }, ErrorCode::ambiguous_backend);
}

TEST_CASE("tuning: bad files get KD codes naming the file and pointer, and change nothing") {
  KernelRegistry reg;
  reg.add(spec("x.y", "a", 2));
  reg.add(spec("x.y", "b", 1));
  Selector sel(reg);
  TempFile good("kdispatch-tuning-good.json",
                tuning_text(cpu_key(), R"([{"op": "x.y", "dtype": "float32", "when": "", "backend": "b"}])"));
  sel.set_tuning_file(good.path);
  const SelectRequest request{"x.y", {}, Device::parse("cpu"), Dtype::float32};
  REQUIRE(sel.select(request).backend == "b");
  const auto refused = [&](const char* name, const std::string& text, ErrorCode code, std::string_view part) {
    TempFile bad(name, text);
    const std::string message = error_of([&] { sel.set_tuning_file(bad.path); }, code);
    CHECK_MESSAGE(contains(message, bad.path.string()), message);
    CHECK_MESSAGE(contains(message, part), message);
    CHECK(sel.tuning_file() == good.path.string());
    CHECK(sel.select(request).backend == "b");
  };
  refused("kdispatch-tuning-bad1.json", "{not json", ErrorCode::manifest_bad_json, "not valid JSON");
  refused("kdispatch-tuning-bad2.json", std::string("{\"kdispatch_tuning\": 1, \"x\": \"\xff\xfe\"}"),
          ErrorCode::manifest_bad_json, "not valid JSON");
  refused("kdispatch-tuning-bad3.json", R"({"kdispatch_tuning": 2})", ErrorCode::manifest_bad_field,
          "/kdispatch_tuning");
  refused("kdispatch-tuning-bad4.json",
          tuning_text(cpu_key(), R"([{"op": "x.zz", "dtype": "float32", "when": "", "backend": "b"}])"),
          ErrorCode::manifest_bad_field, "/choices/0/op");
  refused("kdispatch-tuning-bad5.json",
          tuning_text(cpu_key(), R"([{"op": "x.y", "dtype": "float33", "when": "", "backend": "b"}])"),
          ErrorCode::manifest_bad_field, "/choices/0/dtype");
  refused("kdispatch-tuning-bad6.json",
          tuning_text(cpu_key(), R"([{"op": "x.y", "dtype": "float32", "when": 3, "backend": "b"}])"),
          ErrorCode::manifest_bad_field, "/choices/0/when");
  // x.y has no schema: a "when" has no names to read.
  refused("kdispatch-tuning-bad7.json",
          tuning_text(cpu_key(), R"([{"op": "x.y", "dtype": "float32", "when": "T > 1", "backend": "b"}])"),
          ErrorCode::manifest_bad_field, "/choices/0/when");
  refused("kdispatch-tuning-bad8.json", R"({"kdispatch_tuning": 1, "key": {"kdispatch": 1}})",
          ErrorCode::manifest_bad_field, "/key/kdispatch");
  // Integers beyond int64 are refused, not wrapped (2^64 - 1 would read as -1).
  std::string huge_threads = tuning_text(cpu_key(), "[]");
  const auto threads_at = huge_threads.find("\"threads\": 0");
  REQUIRE(threads_at != std::string::npos);
  huge_threads.replace(threads_at, 12, "\"threads\": 18446744073709551615");
  refused("kdispatch-tuning-bad9.json", huge_threads, ErrorCode::manifest_bad_field,
          "/key/threads: expected an integer of 64 bits, found 18446744073709551615");
  refused("kdispatch-tuning-bad10.json",
          tuning_text(cpu_key(), R"([{"op": "x.y", "dtype": "float32", "when": "", "backend": "b",
                                     "measured": [{"sizes": {"N": 9223372036854775808}, "us": {"b": 1.5}}]}])"),
          ErrorCode::manifest_bad_field, "/choices/0/measured/0/sizes/N: expected an integer of 64 bits");
  const TuningFile edges = parse_tuning_file(
      tuning_text(cpu_key(), R"([{"op": "x.y", "dtype": "float32", "when": "", "backend": "b", "measured":
                                 [{"sizes": {"M": -9223372036854775808, "N": 9223372036854775807}, "us": {"b": 1}}]}])"),
      "edges.json", reg);
  REQUIRE(edges.choices.size() == 1);
  REQUIRE(edges.choices[0].measured.size() == 1);
  CHECK(edges.choices[0].measured[0].sizes.at("M") == INT64_MIN);
  CHECK(edges.choices[0].measured[0].sizes.at("N") == INT64_MAX);
  const std::string missing = error_of([&] { sel.set_tuning_file("/nonexistent/kdispatch-tuning.json"); },
                                       ErrorCode::manifest_bad_json);
  CHECK(contains(missing, "/nonexistent/kdispatch-tuning.json"));
}

TEST_CASE("tuning: per-shape choices through the dispatcher, and through handles resolved before") {
  auto ctx = fixture_context({"fx_fb_picky", "fx_fb_good", "fx_fb_reference"});
  Dispatcher dispatch(*ctx);
  const OpHandle op = dispatch.op(kOp);
  ScaleCall small(3, 8), large(2, 512);
  // Without a file: picky's priority (30) over good's (10).
  CHECK(op.resolve(small.tensors).spec().backend == "fx_fb_picky");
  TuningKey key = machine_key(*ctx);
  TempFile file("kdispatch-tuning-shapes.json", tuning_text(key, kPerShape));
  ctx->set_tuning_file(file.path);
  CHECK(op.resolve(small.tensors).spec().backend == "fx_fb_good");
  CHECK(op.resolve(large.tensors).spec().backend == "fx_fb_picky");
  for (int i = 0; i < 3; ++i) {  // again, from the cache
    CHECK(op.resolve(small.tensors).spec().backend == "fx_fb_good");
    CHECK(op.resolve(large.tensors).spec().backend == "fx_fb_picky");
  }
  op(small.tensors, std::vector<NamedAttr>{{"factor", 1.5}});
  CHECK(small.scaled_by(1.5f));
  op(large.tensors);
  CHECK(large.scaled_by(2.0f));
  const Selection s = ctx->choose({kOp, {}, Device::parse("cpu"), Dtype::float32});
  // Without the call's values only a choice for every call applies.
  CHECK(s.rule == SelectionRule::priority);
  for (const Problem& p : ctx->problems()) CHECK_MESSAGE(!contains(p.message, "tuning"), p.message);
  // Removed at run time: the priority again, through the same handle.
  ctx->set_tuning_file({});
  CHECK(op.resolve(small.tensors).spec().backend == "fx_fb_picky");
}

TEST_CASE("tuning: KDISPATCH_TUNING_FILE is read once the plugins are registered") {
  std::string text;
  {
    auto probe = fixture_context({"fx_fb_picky", "fx_fb_good"});
    text = tuning_text(machine_key(*probe), kPerShape);
  }
  TempFile file("kdispatch-tuning-env.json", text);
  auto ctx = fixture_context({"fx_fb_picky", "fx_fb_good"}, file.path.string());
  CHECK(ctx->selector().tuning_file() == file.path.string());
  Dispatcher dispatch(*ctx);
  ScaleCall small(2, 6);
  CHECK(dispatch.op(kOp).resolve(small.tensors).spec().backend == "fx_fb_good");

  // A bad one is a problem of the context and changes nothing.
  TempFile bad("kdispatch-tuning-env-bad.json", "[1, 2");
  CaptureLog log;
  auto ignored = fixture_context({"fx_fb_picky", "fx_fb_good"}, bad.path.string());
  CHECK(ignored->selector().tuning() == nullptr);
  CHECK(log.count("KDISPATCH_TUNING_FILE") == 1);
  bool listed = false;
  for (const Problem& p : ignored->problems()) listed |= p.code == ErrorCode::manifest_bad_json;
  CHECK(listed);
}

TEST_CASE("tuning: a file made for another machine is ignored with one warning") {
  auto ctx = fixture_context({"fx_fb_picky", "fx_fb_good"});
  Dispatcher dispatch(*ctx);
  const OpHandle op = dispatch.op(kOp);
  ScaleCall small(3, 8);
  const TuningKey machine = machine_key(*ctx);
  CHECK(contains(machine.backends.at("fx_fb_good"), "sha256:"));
  CHECK(machine.threads >= 1);

  const auto ignored = [&](const TuningKey& key, std::string_view field) {
    CaptureLog log;
    TempFile file("kdispatch-tuning-other.json", tuning_text(key, kPerShape));
    ctx->set_tuning_file(file.path);  // read and checked for ops now; the key when consulted
    for (int i = 0; i < 3; ++i) CHECK(op.resolve(small.tensors).spec().backend == "fx_fb_picky");
    ScaleCall other(2, 4, 9);
    CHECK(op.resolve(other.tensors).spec().backend == "fx_fb_picky");
    CHECK(log.count("the tuning file is ignored") == 1);
    CHECK_MESSAGE(log.count(field) == 1, field);
    bool listed = false;
    for (const Problem& p : ctx->problems()) listed |= contains(p.message, field);
    CHECK(listed);
  };
  TuningKey other = machine;
  other.name = "another cpu";
  ignored(other, "name: the file has 'another cpu'");
  other = machine;
  other.backends["fx_fb_good"] = "sha256:" + std::string(64, '0');
  ignored(other, "backends/fx_fb_good");
  // The machine's own key applies.
  TempFile file("kdispatch-tuning-same.json", tuning_text(machine, kPerShape));
  ctx->set_tuning_file(file.path);
  CHECK(op.resolve(small.tensors).spec().backend == "fx_fb_good");
}

TEST_CASE("tuning: a library that changed after tuning no longer matches the key") {
  // A copy of a fixture plugin, tuned, then rebuilt (here: a byte appended).
  const fs::path dir = fs::temp_directory_path() / "kdispatch-tuning-lib";
  fs::remove_all(dir);
  fs::create_directories(dir);
  const fs::path from = fs::path(KDISPATCH_BINARY_DIR) / "tests/fixtures/plugins/fx_fb_good";
  for (const auto& entry : fs::directory_iterator(from)) fs::copy(entry.path(), dir / entry.path().filename());
  const auto context = [&] {
    ContextOptions options;
    options.search.use_environment = false;
    options.search.replace = {dir, fs::path(KDISPATCH_BINARY_DIR) / "tests/fixtures/plugins/fx_fb_picky"};
    options.selector = SelectorOptions{};
    return std::make_unique<Context>(options);
  };
  std::string text;
  {
    auto ctx = context();
    text = tuning_text(machine_key(*ctx), kPerShape);
  }
  TempFile file("kdispatch-tuning-lib.json", text);
  {
    auto ctx = context();
    ctx->set_tuning_file(file.path);
    ScaleCall small(3, 8);
    CHECK(Dispatcher(*ctx).op(kOp).resolve(small.tensors).spec().backend == "fx_fb_good");
  }
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().extension() == ".so") std::ofstream(entry.path(), std::ios::app | std::ios::binary) << '\0';
  }
  {
    CaptureLog log;
    auto ctx = context();
    ctx->set_tuning_file(file.path);
    ScaleCall small(3, 8);
    CHECK(Dispatcher(*ctx).op(kOp).resolve(small.tensors).spec().backend == "fx_fb_picky");
    CHECK(log.count("backends/fx_fb_good") == 1);
  }
  fs::remove_all(dir);
}
