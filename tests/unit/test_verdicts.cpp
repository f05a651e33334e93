// Conformance verdicts (docs/internals.md, Conformance verdicts) over the
// fixture.fallback plugins, ranked fx_fb_broken > fx_fb_good, with a
// reference beside them and fallback on: a backend whose kernel failed a
// conformance check is never a fallback target, one that passed is; the
// verdicts live in a per-user file keyed by the library's sha256, so an old
// library's verdict is ignored; a corrupt, huge, foreign-owned or
// group-writable file is ignored with a warning naming it and a KD code.
#include <doctest/doctest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <memory>
#include <optional>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "kdispatch/context.hpp"
#include "kdispatch/dispatcher.hpp"
#include "kdispatch/doctor.hpp"
#include "kdispatch/logging.hpp"
#include "scale_call.hpp"

using namespace kdispatch;
namespace fs = std::filesystem;

namespace {

constexpr const char* kOp = "fixture.fallback";

// XDG_CACHE_HOME set to a fresh private folder while it lives (and any
// KDISPATCH_VERDICTS / KDISPATCH_SCAN unset), so that the verdicts of a test
// are its own.
struct PrivateCache {
  std::string dir;
  std::optional<std::string> old;
  PrivateCache() {
    std::string pattern = (fs::temp_directory_path() / "kdispatch-verdicts-XXXXXX").string();
    REQUIRE(::mkdtemp(pattern.data()) != nullptr);
    dir = pattern;
    if (const char* v = std::getenv("XDG_CACHE_HOME")) old = v;
    setenv("XDG_CACHE_HOME", dir.c_str(), 1);
    unsetenv("KDISPATCH_VERDICTS");
    unsetenv("KDISPATCH_SCAN");
  }
  ~PrivateCache() {
    if (old) {
      setenv("XDG_CACHE_HOME", old->c_str(), 1);
    } else {
      unsetenv("XDG_CACHE_HOME");
    }
    unsetenv("KDISPATCH_VERDICTS");
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
  std::string file() const { return dir + "/kdispatch/conformance-verdicts-1.txt"; }
  std::string text() const {
    std::ifstream in(file());
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }
  void write(const std::string& text) const {
    fs::create_directories(dir + "/kdispatch");
    std::ofstream(file(), std::ios::trunc) << text;
    ::chmod(file().c_str(), 0600);
  }
};

std::unique_ptr<Context> fixture_context(std::initializer_list<const char*> plugins) {
  ContextOptions options;
  options.search.use_environment = false;
  for (const char* p : plugins) {
    options.search.replace.push_back(std::string(KDISPATCH_BINARY_DIR) + "/tests/fixtures/plugins/" + p);
  }
  SelectorOptions selector;
  selector.fallback = true;
  options.selector = selector;
  return std::make_unique<Context>(options);
}

std::unique_ptr<Context> three() { return fixture_context({"fx_fb_broken", "fx_fb_good", "fx_fb_reference"}); }

const KernelSpec& spec_of(Context& ctx, const char* backend) {
  const KernelSpec* spec = ctx.registry().get_backend(kOp, backend);
  REQUIRE(spec != nullptr);
  return *spec;
}

struct CaptureLog {
  std::vector<std::string> lines;
  CaptureLog() {
    set_log_sink([this](LogLevel level, std::string_view m) {
      if (level <= LogLevel::warn) lines.emplace_back(m);
    });
  }
  ~CaptureLog() { set_log_sink({}); }
  size_t count(std::string_view part) const {
    size_t n = 0;
    for (const auto& l : lines) n += l.find(part) != std::string::npos ? 1 : 0;
    return n;
  }
};

bool contains(const std::string& text, std::string_view part) { return text.find(part) != std::string::npos; }

using kdispatch::test::ScaleCall;

// One call through fallback: fx_fb_broken fails (internal) and is demoted;
// true when fx_fb_good ran it, false when the call failed naming why.
bool falls_back_to_good(Context& ctx, std::string* error = nullptr) {
  Dispatcher dispatch(ctx);
  ScaleCall call(3, 7, 41);
  try {
    dispatch.op(kOp)(call.tensors);
  } catch (const KernelError& e) {
    if (error != nullptr) *error = e.what();
    CHECK(call.untouched() == false);  // the broken kernel's garbage, nothing else
    for (float v : call.out) CHECK(v == -1.0e30f);
    return false;
  }
  CHECK(call.scaled_by(2.0f));
  return true;
}

}  // namespace

TEST_CASE("verdicts: a backend recorded as failed is never a fallback target, in this process and the next") {
  PrivateCache cache;
  CaptureLog log;
  {
    auto ctx = three();
    ctx->record_verdict(spec_of(*ctx, "fx_fb_good"), Device::host_cpu(), false, "a test",
                        "out[3]: 1.5 where the reference has 1.25");
    std::string error;
    CHECK_FALSE(falls_back_to_good(*ctx, &error));
    INFO(error);
    CHECK(contains(error, "'fx_fb_broken' internal (demoted)"));
    CHECK(contains(error, "'fx_fb_good' failed_conformance: failed conformance on cpu on "));
    CHECK(contains(error, "(a test: out[3]: 1.5 where the reference has 1.25)"));
    CHECK(log.count("backend 'fx_fb_good' is never a fallback: its kernel failed conformance on cpu") == 1);
    // Normal selection is unchanged: named or ranked first, it still runs.
    Dispatcher dispatch(*ctx);
    ScaleCall named(2, 5);
    dispatch.op(kOp, "fx_fb_good")(named.tensors);
    CHECK(named.scaled_by(2.0f));
  }
  // The file keeps it, keyed by the library's sha256.
  const std::string text = cache.text();
  INFO(text);
  CHECK(text.rfind("kdispatch-conformance-verdicts 1\n", 0) == 0);
  CHECK(std::regex_search(text, std::regex("\nfailed\t[0-9]+\tfx_fb_good\tfixture\\.fallback\tcpu\tsha256:[0-9a-f]{64}\t"
                                           "a test\tout\\[3\\]: 1\\.5 where the reference has 1\\.25\n")));
  {
    auto ctx = three();
    CHECK_FALSE(falls_back_to_good(*ctx));
    REQUIRE(ctx->failed_verdict(spec_of(*ctx, "fx_fb_good"), Device::host_cpu()));
    CHECK_FALSE(ctx->failed_verdict(spec_of(*ctx, "fx_fb_good"), Device::parse("cuda:9.0")));  // another kind
    const DoctorReport report = doctor_report(*ctx, /*open_plugins=*/false);
    REQUIRE(report.failed_verdicts.size() == 1);
    CHECK(report.failed_verdicts[0].backend == "fx_fb_good");
    CHECK(report.failed_verdicts[0].op == kOp);
    CHECK(report.failed_verdicts[0].device == "cpu");
    CHECK(report.failed_verdicts[0].source == "a test");
  }
  // A later process's pass replaces it; within that process a pass does not
  // undo its own failure.
  {
    auto ctx = three();
    ctx->record_verdict(spec_of(*ctx, "fx_fb_good"), Device::host_cpu(), true, "a test");
    CHECK(falls_back_to_good(*ctx));
    ctx->record_verdict(spec_of(*ctx, "fx_fb_good"), Device::host_cpu(), false, "a test", "dtype float32");
    ctx->record_verdict(spec_of(*ctx, "fx_fb_good"), Device::host_cpu(), true, "a test");
    CHECK(ctx->failed_verdict(spec_of(*ctx, "fx_fb_good"), Device::host_cpu()));
  }
}

TEST_CASE("verdicts: a backend recorded as passed is a fallback target, and doctor lists no failure") {
  PrivateCache cache;
  auto ctx = three();
  ctx->record_verdict(spec_of(*ctx, "fx_fb_good"), Device::host_cpu(), true, "a test");
  CHECK(contains(cache.text(), "\npassed\t"));
  CHECK(falls_back_to_good(*ctx));
  CHECK(doctor_report(*ctx, false).failed_verdicts.empty());
  auto next = three();
  CHECK(falls_back_to_good(*next));
}

TEST_CASE("verdicts: a rebuilt library's old verdict is ignored") {
  PrivateCache cache;
  {
    auto ctx = three();
    ctx->record_verdict(spec_of(*ctx, "fx_fb_good"), Device::host_cpu(), false, "a test", "wrong");
  }
  // The same verdict for another build of the library: its sha256 differs.
  const std::string text = cache.text();
  const std::string other = std::regex_replace(text, std::regex("sha256:[0-9a-f]{64}"), "sha256:" + std::string(64, 'a'));
  REQUIRE(other != text);
  cache.write(other);
  auto ctx = three();
  CHECK_FALSE(ctx->failed_verdict(spec_of(*ctx, "fx_fb_good"), Device::host_cpu()));
  CHECK(falls_back_to_good(*ctx));
  CHECK(doctor_report(*ctx, false).failed_verdicts.empty());
  // And the file as written by the first process still counts.
  cache.write(text);
  auto again = three();
  CHECK_FALSE(falls_back_to_good(*again));
}

TEST_CASE("verdicts: a corrupt, huge, foreign-owned or group-writable file is ignored with a warning naming it") {
  PrivateCache cache;
  std::string good;
  {
    auto ctx = three();
    ctx->record_verdict(spec_of(*ctx, "fx_fb_good"), Device::host_cpu(), false, "a test", "wrong");
    good = cache.text();
  }
  struct Case {
    const char* name;
    std::function<void()> spoil;
    const char* says;
  };
  const std::vector<Case> cases = {
      {"a line that does not parse", [&] { cache.write(good + "failed\tnot a time\n"); }, "[KD-E010]"},
      {"another file", [&] { cache.write("{\"not\": \"verdicts\"}\n"); }, "[KD-E010] it is not a conformance verdict file"},
      {"a cut line", [&] { cache.write(good.substr(0, good.size() - 20)); }, "[KD-E010]"},
      {"huge", [&] {
         cache.write(good);
         fs::resize_file(cache.file(), (uint64_t{4} << 20) + 1);
       }, "[KD-E010] it is 4194305 bytes, more than a verdict file holds (4 MiB)"},
      {"group-writable", [&] {
         cache.write(good);
         ::chmod(cache.file().c_str(), 0620);
       }, "[KD-E025] it is writable by its group or others (mode 620)"},
      {"a symbolic link", [&] {
         cache.write(good);
         fs::rename(cache.file(), cache.dir + "/elsewhere.txt");
         fs::create_symlink(cache.dir + "/elsewhere.txt", cache.file());
       }, "[KD-E010] cannot be read"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.name);
    std::error_code ec;
    fs::remove(cache.file(), ec);
    c.spoil();
    CaptureLog log;
    auto ctx = three();
    CHECK(falls_back_to_good(*ctx));
    CHECK(doctor_report(*ctx, false).failed_verdicts.empty());
    CHECK(log.count(std::string("conformance verdicts ") + cache.file() + ": " + c.says) == 1);
  }
  if (::geteuid() == 0) {
    fs::remove(cache.file());
    cache.write(good);
    REQUIRE(::chown(cache.file().c_str(), 65534, 65534) == 0);
    CaptureLog log;
    auto ctx = three();
    CHECK(falls_back_to_good(*ctx));
    CHECK(log.count("[KD-E025] it belongs to uid 65534, not to this user") == 1);
    // A verdict recorded now rebuilds the file as this user's.
    ctx->record_verdict(spec_of(*ctx, "fx_fb_good"), Device::host_cpu(), true, "a test");
    struct stat st {};
    REQUIRE(::stat(cache.file().c_str(), &st) == 0);
    CHECK(st.st_uid == 0);
    CHECK((st.st_mode & 077) == 0);
  }
}

TEST_CASE("verdicts: KDISPATCH_VERDICTS=0 turns the store off, KDISPATCH_SCAN=off keeps verdicts in the process") {
  PrivateCache cache;
  {
    auto ctx = three();
    ctx->record_verdict(spec_of(*ctx, "fx_fb_good"), Device::host_cpu(), false, "a test", "wrong");
  }
  const std::string recorded = cache.text();
  setenv("KDISPATCH_VERDICTS", "0", 1);
  {
    auto ctx = three();
    CHECK(falls_back_to_good(*ctx));
    CHECK(doctor_report(*ctx, false).failed_verdicts.empty());
    ctx->record_verdict(spec_of(*ctx, "fx_fb_good"), Device::host_cpu(), true, "a test");
    CHECK(cache.text() == recorded);  // nothing written
  }
  setenv("KDISPATCH_VERDICTS", "1", 1);
  setenv("KDISPATCH_SCAN", "off", 1);
  {
    auto ctx = three();
    CHECK(falls_back_to_good(*ctx));  // the file is not read
    ctx->record_verdict(spec_of(*ctx, "fx_fb_good"), Device::host_cpu(), true, "a test");
    CHECK(cache.text() == recorded);  // nor written
    ctx->record_verdict(spec_of(*ctx, "fx_fb_broken"), Device::host_cpu(), false, "a test");
    CHECK(ctx->failed_verdict(spec_of(*ctx, "fx_fb_broken"), Device::host_cpu()));  // in this process
  }
  unsetenv("KDISPATCH_SCAN");
  unsetenv("KDISPATCH_VERDICTS");
}

namespace {

// out = x * factor: a correct kernel registered at run time.
kd_status rt_scale(const kd_call_args* args) {
  const DLTensor& out = args->tensors[0];
  const DLTensor& x = args->tensors[1];
  int64_t n = 1;
  for (int32_t d = 0; d < x.ndim; ++d) n *= x.shape[d];
  const auto factor = static_cast<float>(args->attrs[0].value.f);
  for (int64_t i = 0; i < n; ++i) static_cast<float*>(out.data)[i] = static_cast<const float*>(x.data)[i] * factor;
  return KD_STATUS_OK;
}

const KernelSpec& register_rt(Context& ctx) {
  KernelSpec spec;
  spec.op = kOp;
  spec.backend = "rt";
  Target cpu;
  cpu.device = DeviceType::cpu;
  spec.targets = {cpu};
  spec.dtypes = {Dtype::float32};
  spec.function = rt_scale;
  ctx.register_kernel(spec);
  return spec_of(ctx, "rt");
}

bool falls_back_to_rt(Context& ctx) {
  Dispatcher dispatch(ctx);
  ScaleCall call(2, 6, 9);
  try {
    dispatch.op(kOp)(call.tensors);
  } catch (const KernelError& e) {
    CHECK(contains(e.what(), "'rt' failed_conformance: failed conformance on cpu on "));
    return false;
  }
  CHECK(call.scaled_by(2.0f));
  return true;
}

}  // namespace

TEST_CASE("verdicts: a kernel registered at run time has its verdict in its context only, never written") {
  PrivateCache cache;
  {
    auto ctx = fixture_context({"fx_fb_broken", "fx_fb_reference"});
    const KernelSpec& rt = register_rt(*ctx);
    ctx->record_verdict(rt, Device::host_cpu(), false, "a test", "wrong");
    const std::optional<Verdict> v = ctx->failed_verdict(rt, Device::host_cpu());
    REQUIRE(v);
    CHECK(v->library == "run-time");
    auto fresh = fixture_context({"fx_fb_broken", "fx_fb_reference"});
    register_rt(*fresh);
    CHECK(falls_back_to_rt(*fresh));  // another context: registered again, no verdict
    CHECK_FALSE(falls_back_to_rt(*ctx));
    const DoctorReport report = doctor_report(*ctx, false);
    REQUIRE(report.failed_verdicts.size() == 1);
    CHECK(report.failed_verdicts[0].backend == "rt");
  }
  CHECK_FALSE(fs::exists(cache.file()));  // never written
}

TEST_CASE("verdicts: the trace of a call that fell back names the backend skipped for its failed verdict") {
  PrivateCache cache;
  const std::string trace = cache.dir + "/trace.jsonl";
  setenv("KDISPATCH_TRACE", trace.c_str(), 1);
  {
    // Ranked fx_fb_broken (20) > rt (15) > fx_fb_good (10).
    auto ctx = three();
    KernelSpec spec;
    spec.op = kOp;
    spec.backend = "rt";
    Target cpu;
    cpu.device = DeviceType::cpu;
    spec.targets = {cpu};
    spec.dtypes = {Dtype::float32};
    spec.priority = 15;
    spec.function = rt_scale;
    ctx->register_kernel(spec);
    ctx->record_verdict(spec_of(*ctx, "rt"), Device::host_cpu(), false, "a test", "wrong");
    CHECK(falls_back_to_good(*ctx));
  }
  unsetenv("KDISPATCH_TRACE");
  std::ifstream in(trace);
  std::string line;
  REQUIRE(std::getline(in, line));
  INFO(line);
  CHECK(contains(line, "\"backend\":\"fx_fb_good\""));
  CHECK(contains(line, "\"fallback\":[{\"backend\":\"fx_fb_broken\",\"status\":\"internal\",\"demoted\":true,"));
  CHECK(contains(line, "{\"backend\":\"rt\",\"status\":\"failed_conformance\",\"demoted\":false,"
                       "\"error\":\"failed conformance on cpu on "));
}
