// Fallback (docs/internals.md, Fallback) over the fixture.fallback plugins,
// ranked by priority fx_fb_picky > fx_fb_broken > fx_fb_good, with a
// reference kernel beside them: a kernel's KD_STATUS_UNSUPPORTED passes the
// call on; with fallback on, a device or internal error demotes its backend
// for the op and device (sticky, warned once, in doctor and the trace) and
// passes the call on; off, it is the call's error. Fallback never reaches
// the reference kernel.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kdispatch/context.hpp"
#include "kdispatch/dispatcher.hpp"
#include "kdispatch/doctor.hpp"
#include "kdispatch/logging.hpp"
#include "kdispatch/manifest.hpp"
#include "scale_call.hpp"

using namespace kdispatch;

namespace {

constexpr const char* kOp = "fixture.fallback";

std::unique_ptr<Context> fixture_context(std::initializer_list<const char*> plugins, bool fallback = false) {
  ContextOptions options;
  options.search.use_environment = false;
  for (const char* p : plugins) {
    options.search.replace.push_back(std::string(KDISPATCH_BINARY_DIR) + "/tests/fixtures/plugins/" + p);
  }
  SelectorOptions selector;
  selector.fallback = fallback;
  options.selector = selector;
  return std::make_unique<Context>(options);
}

using kdispatch::test::ScaleCall;

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

// KDISPATCH_TRACE for the dispatchers made while it lives.
struct TraceFile {
  std::string path;
  explicit TraceFile(const char* name) : path((std::filesystem::temp_directory_path() / name).string()) {
    std::filesystem::remove(path);
    setenv("KDISPATCH_TRACE", path.c_str(), 1);
  }
  ~TraceFile() {
    unsetenv("KDISPATCH_TRACE");
    std::filesystem::remove(path);
  }
  std::vector<std::string> lines() const {
    std::ifstream in(path);
    std::vector<std::string> out;
    for (std::string line; std::getline(in, line);) out.push_back(line);
    return out;
  }
};

bool contains(const std::string& text, std::string_view part) { return text.find(part) != std::string::npos; }

// The KernelError a call raises.
KernelError call_error(const OpHandle& op, ScaleCall& call, std::vector<NamedAttr> attrs = {}) {
  try {
    op(call.tensors, attrs);
  } catch (const KernelError& e) {
    return e;
  }
  FAIL("the call succeeded");
  return KernelError(ErrorCode::kernel_failed, "");
}

}  // namespace

TEST_CASE("fallback: a kernel's unsupported passes the call to the next ranked backend, reported once") {
  TraceFile trace("kdispatch-fallback-unsupported.jsonl");
  CaptureLog log;
  auto ctx = fixture_context({"fx_fb_picky", "fx_fb_good", "fx_fb_reference"});
  REQUIRE_FALSE(ctx->fallback());
  Dispatcher dispatch(*ctx);
  const OpHandle op = dispatch.op(kOp);

  ScaleCall even(3, 8);
  op(even.tensors);
  CHECK(even.scaled_by(2.0f));
  for (int i = 0; i < 3; ++i) {
    ScaleCall odd(4, 7, 11 + i);
    op(odd.tensors, std::vector<NamedAttr>{{"factor", 1.5}});
    CHECK(odd.scaled_by(1.5f));
  }
  CHECK(log.count("backend 'fx_fb_picky' returned unsupported") == 1);
  CHECK(log.count("fx_fb_picky: rows of odd length are not handled") == 1);
  CHECK(ctx->demotions().empty());  // unsupported demotes nothing

  const std::vector<std::string> lines = trace.lines();
  REQUIRE(lines.size() == 4);
  CHECK(contains(lines[0], "\"backend\":\"fx_fb_picky\",\"rule\":\"priority\",\"ranked\":[\"fx_fb_picky\",\"fx_fb_good\"]"));
  CHECK_FALSE(contains(lines[0], "\"fallback\""));
  for (size_t i = 1; i < 4; ++i) {
    INFO(lines[i]);
    CHECK(contains(lines[i], "\"backend\":\"fx_fb_good\",\"rule\":\"priority\""));
    CHECK(contains(lines[i], "\"fallback\":[{\"backend\":\"fx_fb_picky\",\"status\":\"unsupported\",\"demoted\":false,"
                             "\"error\":\"fx_fb_picky: rows of odd length are not handled\"}]"));
    CHECK_FALSE(contains(lines[i], "\"demoted\":["));
  }
}

TEST_CASE("fallback: unsupported with no backend left is the first error naming each tried, never the reference") {
  auto ctx = fixture_context({"fx_fb_picky", "fx_fb_reference"}, /*fallback=*/true);
  Dispatcher dispatch(*ctx);
  const OpHandle op = dispatch.op(kOp);
  ScaleCall odd(2, 5);
  const KernelError e = call_error(op, odd);
  CHECK(e.code() == ErrorCode::kernel_failed);
  const std::string what = e.what();
  CHECK(what.find("kernel 'kd_fx_fb_picky_fallback' of backend 'fx_fb_picky' failed for op 'fixture.fallback' "
                  "(status 2): fx_fb_picky: rows of odd length are not handled") == 0);
  CHECK(contains(what, "the reference is never a fallback"));
  CHECK(contains(what, "tried: 'fx_fb_picky' unsupported"));
  CHECK(odd.untouched());  // the reference kernel did not run
  // The reference still runs when named.
  dispatch.op(kOp, "reference")(odd.tensors);
  CHECK(odd.scaled_by(2.0f));
}

TEST_CASE("fallback off: a kernel failing with an internal or device error is the call's error, every time") {
  CaptureLog log;
  auto ctx = fixture_context({"fx_fb_broken", "fx_fb_good", "fx_fb_reference"});
  Dispatcher dispatch(*ctx);
  const OpHandle op = dispatch.op(kOp);
  for (int i = 0; i < 2; ++i) {
    ScaleCall call(3, 6);
    const KernelError e = call_error(op, call);
    CHECK(e.code() == ErrorCode::kernel_failed);
    CHECK(std::string(e.what()) ==
          "kernel 'kd_fx_fb_broken_fallback' of backend 'fx_fb_broken' failed for op 'fixture.fallback' (status 4): "
          "fx_fb_broken: simulated internal failure");
  }
  ScaleCall call(3, 6);
  const KernelError device = call_error(op, call, {{"factor", -1.0}});
  CHECK(device.code() == ErrorCode::device_error);
  CHECK(contains(device.what(), "backend 'fx_fb_broken'"));
  CHECK(contains(device.what(), "simulated device fault"));
  CHECK(ctx->demotions().empty());
  CHECK(log.count("demoted") == 0);
  CHECK(ctx->choose({kOp, {}, Device::host_cpu(), Dtype::float32}).spec->backend == "fx_fb_broken");
}

TEST_CASE("fallback on: a failing backend is demoted for the op and device, sticky, warned once, in doctor and trace") {
  TraceFile trace("kdispatch-fallback-demoted.jsonl");
  CaptureLog log;
  auto ctx = fixture_context({"fx_fb_broken", "fx_fb_good", "fx_fb_reference"});
  Dispatcher dispatch(*ctx);
  // Resolved, and run once, before fallback is turned on: the handle follows
  // the demotion.
  const OpHandle op = dispatch.op(kOp);
  {
    ScaleCall call(2, 4);
    CHECK(call_error(op, call).code() == ErrorCode::kernel_failed);
  }
  ctx->set_fallback(true);
  REQUIRE(ctx->fallback());
  for (int i = 0; i < 4; ++i) {
    ScaleCall call(3, 6 + i, 21 + i);
    op(call.tensors, std::vector<NamedAttr>{{"factor", 0.75}});
    CHECK(call.scaled_by(0.75f));  // the good backend overwrote the broken one's garbage
  }
  CHECK(log.count("is demoted for op 'fixture.fallback' on cpu:0") == 1);
  CHECK(log.count("fx_fb_broken: simulated internal failure") == 1);

  const std::vector<Demotion> demotions = ctx->demotions();
  REQUIRE(demotions.size() == 1);
  CHECK(demotions[0].op == kOp);
  CHECK(demotions[0].backend == "fx_fb_broken");
  CHECK(demotions[0].device() == "cpu:0");
  CHECK(contains(demotions[0].error, "[KD-E040] kernel 'kd_fx_fb_broken_fallback' of backend 'fx_fb_broken' failed"));
  CHECK(contains(demotions[0].error, "simulated internal failure"));

  // doctor lists it.
  const DoctorReport report = doctor_report(*ctx, /*open_plugins=*/false);
  REQUIRE(report.demotions.size() == 1);
  CHECK(report.demotions[0].backend == "fx_fb_broken");
  CHECK(contains(report.demotions[0].error, "simulated internal failure"));

  // The trace: the first failed call wrote none; the call that demoted says
  // so, and each later one lists the demotion.
  const std::vector<std::string> lines = trace.lines();
  REQUIRE(lines.size() == 4);
  CHECK(contains(lines[0], "\"backend\":\"fx_fb_good\",\"rule\":\"priority\",\"ranked\":[\"fx_fb_broken\",\"fx_fb_good\"]"));
  CHECK(contains(lines[0], "\"fallback\":[{\"backend\":\"fx_fb_broken\",\"status\":\"internal\",\"demoted\":true,"
                           "\"error\":\"fx_fb_broken: simulated internal failure\"}]"));
  CHECK(contains(lines[0], "\"demoted\":[{\"backend\":\"fx_fb_broken\",\"error\":\"[KD-E040] kernel"));
  for (size_t i = 1; i < lines.size(); ++i) {
    INFO(lines[i]);
    CHECK(contains(lines[i], "\"backend\":\"fx_fb_good\",\"rule\":\"only\",\"ranked\":[\"fx_fb_good\"]"));
    CHECK_FALSE(contains(lines[i], "\"fallback\""));
    CHECK(contains(lines[i], "\"demoted\":[{\"backend\":\"fx_fb_broken\""));
  }

  // Sticky: selection leaves it out with the error as the reason, after
  // fallback is turned off too, and for a handle made later.
  ctx->set_fallback(false);
  const Selection s = ctx->choose({kOp, {}, Device::host_cpu(), Dtype::float32});
  CHECK(s.spec->backend == "fx_fb_good");
  CHECK(s.rule == SelectionRule::only);
  for (const Eligibility& e : ctx->selector().eligibility(kOp, Device::host_cpu(), Dtype::float32)) {
    if (e.spec->backend != "fx_fb_broken") continue;
    CHECK_FALSE(e.eligible);
    CHECK(contains(e.reason, "demoted for this op on cpu:0 after its kernel failed: [KD-E040]"));
  }
  ScaleCall later(2, 3);
  dispatch.op(kOp)(later.tensors);
  CHECK(later.scaled_by(2.0f));
  CHECK(log.count("is demoted") == 1);

  // Named, it still runs, and fails as it does.
  ScaleCall named(2, 3);
  CHECK(call_error(dispatch.op(kOp, "fx_fb_broken"), named).code() == ErrorCode::kernel_failed);

  // Another device of the type is not demoted.
  CHECK(ctx->selector().demotion(kOp, "fx_fb_broken", DeviceType::cpu, 1) == std::nullopt);
  SelectRequest other{kOp, {}, Device::host_cpu(), Dtype::float32};
  other.device_id = 1;
  CHECK(ctx->choose(other).spec->backend == "fx_fb_broken");
}

TEST_CASE("fallback on: a device error is demoted too, and with no backend left the error names each one tried") {
  CaptureLog log;
  auto ctx = fixture_context({"fx_fb_picky", "fx_fb_broken", "fx_fb_reference"}, /*fallback=*/true);
  Dispatcher dispatch(*ctx);
  const OpHandle op = dispatch.op(kOp);
  ScaleCall odd(3, 5);
  const KernelError e = call_error(op, odd, {{"factor", -2.0}});
  CHECK(e.code() == ErrorCode::kernel_failed);  // the first kernel's: unsupported
  const std::string what = e.what();
  INFO(what);
  CHECK(what.find("kernel 'kd_fx_fb_picky_fallback' of backend 'fx_fb_picky' failed") == 0);
  CHECK(contains(what, "tried: 'fx_fb_picky' unsupported: fx_fb_picky: rows of odd length are not handled; "
                       "'fx_fb_broken' device_error (demoted): fx_fb_broken: simulated device fault"));
  // The broken kernel's garbage is there: the reference did not run after it.
  for (float v : odd.out) CHECK(v == -1.0e30f);
  const std::vector<Demotion> demotions = ctx->demotions();
  REQUIRE(demotions.size() == 1);
  CHECK(contains(demotions[0].error, "[KD-E041]"));

  // The demoted backend is skipped from now on.
  odd.poison();
  const KernelError again = call_error(op, odd);
  CHECK(contains(again.what(), "tried: 'fx_fb_picky' unsupported: fx_fb_picky: rows of odd length are not handled"));
  CHECK_FALSE(contains(again.what(), "fx_fb_broken"));
  CHECK(odd.untouched());
  ScaleCall even(3, 4);
  op(even.tensors);
  CHECK(even.scaled_by(2.0f));
  CHECK(ctx->choose({kOp, {}, Device::host_cpu(), Dtype::float32}).ranked.size() == 1);
}

TEST_CASE("fallback: every backend demoted leaves KD-E003 naming the demotions, and no reference") {
  auto ctx = fixture_context({"fx_fb_broken", "fx_fb_reference"}, /*fallback=*/true);
  Dispatcher dispatch(*ctx);
  const OpHandle op = dispatch.op(kOp);
  ScaleCall call(2, 2);
  CHECK(call_error(op, call).code() == ErrorCode::kernel_failed);
  try {
    op(call.tensors);
    FAIL("accepted");
  } catch (const SelectionError& e) {
    CHECK(e.code() == ErrorCode::no_usable_backend);
    CHECK(contains(e.what(), "fx_fb_broken: demoted for this op on cpu:0 after its kernel failed"));
  }
}

TEST_CASE("fallback on: threads failing at once all get their results, one demotion, one warning") {
  CaptureLog log;
  auto ctx = fixture_context({"fx_fb_broken", "fx_fb_good", "fx_fb_reference"}, /*fallback=*/true);
  Dispatcher dispatch(*ctx);
  const OpHandle op = dispatch.op(kOp);
  std::vector<int> ok(8, 0);
  std::vector<std::thread> threads;
  for (size_t t = 0; t < ok.size(); ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 20; ++i) {
        ScaleCall call(2, 3 + static_cast<int64_t>(t), static_cast<unsigned>(100 * t + i));
        op(call.tensors);
        if (call.scaled_by(2.0f)) ++ok[t];
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int n : ok) CHECK(n == 20);
  CHECK(ctx->demotions().size() == 1);
  CHECK(log.count("is demoted") == 1);
}

TEST_CASE("fallback: a KernelHandle runs its one kernel, with no fallback") {
  auto ctx = fixture_context({"fx_fb_picky", "fx_fb_good", "fx_fb_reference"}, /*fallback=*/true);
  Dispatcher dispatch(*ctx);
  ScaleCall odd(2, 3);
  const KernelHandle kernel = dispatch.op(kOp).resolve(odd.tensors);
  CHECK(kernel.spec().backend == "fx_fb_picky");
  kd_attr factor{};
  factor.name = "factor";
  factor.type = KD_ATTR_TYPE_FLOAT;
  factor.value.f = 2.0;
  CHECK_THROWS_AS(kernel(odd.tensors, std::span<const kd_attr>(&factor, 1)), KernelError);
  CHECK(odd.untouched());
}

TEST_CASE("fallback: KDISPATCH_FALLBACK=1 turns it on, and another value warns and leaves it off") {
  CaptureLog log;
  setenv("KDISPATCH_FALLBACK", "1", 1);
  CHECK(SelectorOptions::from_environment().fallback);
  setenv("KDISPATCH_FALLBACK", "0", 1);
  CHECK_FALSE(SelectorOptions::from_environment().fallback);
  setenv("KDISPATCH_FALLBACK", "yes", 1);
  CHECK_FALSE(SelectorOptions::from_environment().fallback);
  CHECK(log.count("KDISPATCH_FALLBACK=yes: expected 1 (on) or 0 (off)") == 1);
  unsetenv("KDISPATCH_FALLBACK");
  CHECK_FALSE(SelectorOptions::from_environment().fallback);
}

TEST_CASE("fallback: a kernel's supports function declines a call before the kernel runs, and the next backend runs it") {
  CaptureLog log;
  auto ctx = fixture_context({"fx_fb_choosy", "fx_fb_picky", "fx_fb_good", "fx_fb_reference"});
  Dispatcher dispatch(*ctx);
  const OpHandle op = dispatch.op(kOp);
  for (int i = 0; i < 4; ++i) {
    ScaleCall call(3, 8, 20 + i);
    call.x[0] = std::abs(call.x[0]);  // supported
    op(call.tensors);
    CHECK(call.is(2.0f, 1.0f));  // fx_fb_choosy's kernel ran
    ScaleCall declined(3, 8, 30 + i);
    declined.x[0] = -std::abs(declined.x[0]) - 0.5f;
    op(declined.tensors);
    CHECK(declined.scaled_by(2.0f));  // fx_fb_picky: the supports function wrote nothing
  }
  CHECK(log.count("fx_fb_choosy: a call whose first value is negative") == 1);
  CHECK(ctx->demotions().empty());
  // Named, the declined call has no other backend to go to: the refusal is the error.
  const OpHandle named = dispatch.op(kOp, "fx_fb_choosy");
  ScaleCall declined(2, 4);
  declined.x[0] = -1.0f;
  CHECK_THROWS_WITH_AS(named(declined.tensors), doctest::Contains("fx_fb_choosy: a call whose first value is negative"),
                       KernelError);
  CHECK(declined.untouched());
}

TEST_CASE("fallback: a supports symbol that is not a C identifier is KD-E011 naming the field") {
  const std::string text = R"({"kdispatch_manifest": "1.0", "plugin": "p", "backend": "p", "library": "libp.so",
    "abi": "1.1", "targets": [{"device": "cpu"}],
    "kernels": [{"op": "fixture.fallback", "symbol": "kd_p", "supports": "1 bad"}]})";
  const ManifestResult parsed = parse_manifest(text, "inline.json");
  REQUIRE_FALSE(parsed.manifest);
  REQUIRE_FALSE(parsed.errors.empty());
  CHECK(parsed.errors[0].code == ErrorCode::manifest_bad_field);
  CHECK(contains(parsed.errors[0].message, "/kernels/0/supports"));
}
