// The registry cache's manifests (core/src/registry_cache.hpp): a record
// decodes to exactly the manifest the parser gave; discovery over a warm
// cache gives the registry a cold parse gives; a changed manifest is read
// again; findings are reported every time; and a broken, unreadable or
// unwritable cache never changes what discovery finds. Each test case runs
// in its own process (doctest_discover_tests), with XDG_CACHE_HOME set to a
// private directory.
#include <doctest/doctest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "kdispatch/context.hpp"
#include "kdispatch/discovery.hpp"
#include "kdispatch/logging.hpp"
#include "kdispatch/manifest.hpp"
#include "kdispatch/registry.hpp"
#include "manifest_for_cache.hpp"
#include "manifest_record.hpp"
#include "kdispatch/plugin_security.hpp"
#include "registry_cache.hpp"
#include "scanner.hpp"

namespace fs = std::filesystem;
using namespace kdispatch;

namespace {

const fs::path kSource = KDISPATCH_SOURCE_DIR;
const fs::path kGpuManifests = KDISPATCH_GPU_MANIFEST_DIR;  // cuda.json, hip.json
const fs::path kGoodManifests = fs::path(KDISPATCH_FIXTURES_DIR) / "manifests" / "good";

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

void write_text(const fs::path& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

// A manifest that sets every field the record holds: a checksum, the
// reference role, targets of each kind, kernels with inherited, own and
// empty targets, a kernel of its own role, opt-in and with constraints, text that needs
// escaping, and op schemas (the built-in
// layernorm ones, which use ranges, tests, tolerances and examples).
std::string every_field_manifest() {
  return R"({"kdispatch_manifest": "1.0", "plugin": "every_field", "backend": "every_field",
    "library": "libevery-field.so.1", "abi": "1.0",
    "sha256": "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
    "description": "tab\there, newline\nhere, backslash\\here, unicode \u00e9",
    "role": "reference",
    "targets": [{"device": "cpu", "features": ["avx2", "fma"]},
                {"device": "cuda", "min_arch": "8.0", "max_arch": "12.0"},
                {"device": "cuda", "min_arch": "9.0"},
                {"device": "hip", "archs": ["gfx90a", "gfx1030"]}],
    "kernels": [
      {"op": "every.inherits", "symbol": "kd_inherits", "description": "the manifest's targets"},
      {"op": "every.own", "symbol": "kd_own", "dtypes": ["float32", "bfloat16", "int64", "bool"],
       "targets": [{"device": "cuda", "max_arch": "9.0"}], "description": "\\t is not a tab"},
      {"op": "every.anywhere", "symbol": "kd_anywhere", "targets": [], "priority": -7},
      {"op": "every.opt_in", "symbol": "kd_opt_in", "role": "backend", "opt_in": true, "priority": 1000,
       "constraints": ["H % 8 == 0", "T in [float16, bfloat16] and\tnot (K > 8 || renorm) and H > 0"]}],
    "ops": )" +
         read_text(kSource / "manifests" / "ops" / "layernorm.json") + "}";
}

// The manifest of `text` as the parser gives it, then through a record.
void check_round_trip(const std::string& text, const std::string& path) {
  INFO(path);
  std::string ops_json;
  const ManifestResult parsed = parse_manifest_for_cache(text, path, ops_json);
  for (const Problem& e : parsed.errors) INFO(e.message);
  REQUIRE(parsed.ok());
  CHECK(parsed.manifest->ops.empty() == ops_json.empty());
  const std::string record = encode_manifest_record(*parsed.manifest, ops_json);
  CHECK(record.find('\n') == std::string::npos);
  const std::optional<Manifest> decoded = decode_manifest_record(record, path);
  REQUIRE(decoded.has_value());
  CHECK(*decoded == *parsed.manifest);
  // The same through parse_manifest, which discovery without the cache uses.
  CHECK(*decoded == *parse_manifest(text, path).manifest);
}

// XDG_CACHE_HOME and KDISPATCH_SCAN for one test case, and a plugin folder.
struct CacheScope {
  fs::path root;
  fs::path plugins;
  fs::path cache_home;
  CacheScope() {
    std::string templ = (fs::temp_directory_path() / "kdispatch-cache-test-XXXXXX").string();
    REQUIRE(::mkdtemp(templ.data()) != nullptr);
    root = templ;
    plugins = root / "plugins";
    cache_home = root / "cache";
    fs::create_directories(plugins);
    fs::permissions(plugins, fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec |
                                 fs::perms::others_read | fs::perms::others_exec);
    ::setenv("XDG_CACHE_HOME", cache_home.c_str(), 1);
    ::unsetenv("KDISPATCH_SCAN");
  }
  ~CacheScope() {
    set_log_sink({});
    std::error_code ec;
    fs::permissions(root, fs::perms::owner_all, fs::perm_options::add, ec);
    fs::remove_all(root, ec);
  }
  // A manifest and a placeholder for its library (discovery only checks
  // where the library is and who may write it).
  void add(const std::string& file, const std::string& text, const std::string& library = "") const {
    write_text(plugins / file, text);
    if (!library.empty()) write_text(plugins / library, "placeholder, never opened\n");
  }
};

std::string small_manifest(const std::string& name, const std::string& symbol = "kd_a") {
  return R"({"kdispatch_manifest": "1.0", "plugin": ")" + name + R"(", "backend": ")" + name + R"(", "library": "lib)" +
         name + R"(.so", "abi": "1.0", "targets": [{"device": "cpu"}],
    "kernels": [{"op": ")" +
         name + R"(.a", "symbol": ")" + symbol + R"(", "dtypes": ["float32"]},
                {"op": ")" +
         name + R"(.b", "symbol": "kd_b", "description": "second"}]})";
}

// Lets the registry cache take files just written: it leaves out files
// changed within the last 100 ms.
void settle() { std::this_thread::sleep_for(std::chrono::milliseconds(150)); }

// Messages of the core at debug level while `f` runs.
template <class F>
std::vector<std::string> logged(F&& f) {
  std::vector<std::string> lines;
  set_log_level(LogLevel::debug);
  set_log_sink([&lines](LogLevel, std::string_view message) { lines.emplace_back(message); });
  f();
  set_log_sink({});
  set_log_level(LogLevel::warn);
  return lines;
}

bool any_contains(const std::vector<std::string>& lines, const std::string& text) {
  for (const auto& line : lines) {
    if (line.find(text) != std::string::npos) return true;
  }
  return false;
}

fs::path cache_file() { return registry_cache_path(); }

// What read() gives for every manifest of the folder, with this cache.
std::vector<ManifestResult> read_all(const CacheScope& scope, ManifestCache& cache) {
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(scope.plugins)) {
    if (entry.path().extension() == ".json") files.push_back(entry.path());
  }
  std::sort(files.begin(), files.end());
  std::vector<ManifestResult> out;
  for (const auto& f : files) out.push_back(cache.read(f));
  cache.save();
  return out;
}

void check_same(const std::vector<ManifestResult>& a, const std::vector<ManifestResult>& b) {
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    CHECK(a[i].manifest == b[i].manifest);
    CHECK(a[i].plugin == b[i].plugin);
    CHECK(a[i].backend == b[i].backend);
    CHECK(a[i].ops == b[i].ops);
    REQUIRE(a[i].errors.size() == b[i].errors.size());
    REQUIRE(a[i].warnings.size() == b[i].warnings.size());
    for (size_t j = 0; j < a[i].errors.size(); ++j) CHECK(a[i].errors[j].message == b[i].errors[j].message);
    for (size_t j = 0; j < a[i].warnings.size(); ++j) CHECK(a[i].warnings[j].message == b[i].warnings[j].message);
  }
}

// The folder read with read_manifest, as discovery without a cache does.
std::vector<ManifestResult> parse_all(const CacheScope& scope) {
  ManifestCache off(ScanPolicy::off);
  return read_all(scope, off);
}

}  // namespace

TEST_CASE("registry cache: a record decodes to the manifest the parser gave") {
  for (const fs::path& path : {kSource / "manifests" / "cpu.json", kSource / "manifests" / "reference.json",
                               kGpuManifests / "cuda.json", kGpuManifests / "hip.json"}) {
    check_round_trip(read_text(path), path.string());
  }
  for (const auto& entry : fs::directory_iterator(kGoodManifests)) {
    check_round_trip(read_text(entry.path()), entry.path().string());
  }
  check_round_trip(every_field_manifest(), "/some/where/every_field.json");
  check_round_trip(small_manifest("relative"), "relative.json");
}

TEST_CASE("registry cache: a cut or malformed record never decodes") {
  std::string ops_json;
  const ManifestResult parsed = parse_manifest_for_cache(small_manifest("cut"), "cut.json", ops_json);
  REQUIRE(parsed.ok());
  const std::string record = encode_manifest_record(*parsed.manifest, ops_json);
  for (size_t n = 0; n < record.size(); ++n) {
    INFO("first " << n << " bytes");
    CHECK_FALSE(decode_manifest_record(record.substr(0, n), "cut.json").has_value());
  }
  for (const std::string& bad : {std::string(), std::string("\t\t\t\t"), record + "\textra", record + "x",
                                 std::string("1.0\tp\tb\tlibp.so\t1.0\t\t\tbackend\t99999999999999999999\t"),
                                 std::string("1.0\tp\tb\tlibp.so\t1.0\t\t\tbackend\t1\tnot-a-device\t\t\t0\t0\t0\t"),
                                 std::string("1.0\tp\tb\tlibp.so\t1.0\t\t\toracle\t0\t0\t"),
                                 std::string("1.0\tp\tb\tlibp.so\t1.0\t\t\tbackend\t0\t1\tp.a\tkd\t\t9\t=\t"),
                                 std::string("1.0\tp\\x\tb\tlibp.so\t1.0\t\t\tbackend\t0\t0\t"),
                                 std::string("1.0\tp\tb\tlibp.so\t1.0\t\t\tbackend\t0\t0\t[{\"op\": 1}]")}) {
    INFO(bad);
    CHECK_FALSE(decode_manifest_record(bad, "bad.json").has_value());
  }
}

TEST_CASE("registry cache: discovery over a warm cache gives the registry a cold parse gives") {
  CacheScope scope;
  // The shipped manifests, beside a manifest with every field, one with a
  // warning, one that does not parse, and many small ones.
  for (const char* name : {"cpu.json", "reference.json"}) {
    const std::string text = read_text(kSource / "manifests" / name);
    const ManifestResult parsed = parse_manifest(text, name);
    REQUIRE(parsed.ok());
    scope.add(name, text, parsed.manifest->library);
  }
  scope.add("every_field.json", every_field_manifest(), "libevery-field.so.1");
  scope.add("warns.json",
            R"({"kdispatch_manifest": "1.0", "plugin": "warns", "backend": "warns", "library": "libwarns.so",
                "abi": "1.0", "colour": "blue", "kernels": [{"op": "warns.a", "symbol": "kd_a"}]})",
            "libwarns.so");
  scope.add("broken.json", R"({"kdispatch_manifest": "1.0", "plugin": )");
  for (int i = 0; i < 40; ++i)
    scope.add("gen" + std::to_string(i) + ".json", small_manifest("gen" + std::to_string(i)),
              "libgen" + std::to_string(i) + ".so");
  settle();

  ContextOptions options;
  options.search.replace = {scope.plugins};
  options.search.use_environment = false;
  std::unique_ptr<Context> cold;
  const auto cold_log = logged([&] { cold = std::make_unique<Context>(options); });
  CHECK_FALSE(any_contains(cold_log, "from the registry cache"));
  REQUIRE(fs::exists(cache_file()));
  std::unique_ptr<Context> warm;
  const auto warm_log = logged([&] { warm = std::make_unique<Context>(options); });
  // Every manifest but the one with a warning and the broken one.
  CHECK(any_contains(warm_log, "43 manifest(s) from the registry cache"));
  // The warning is reported again, as the parser words it.
  CHECK(any_contains(warm_log, "/colour: unknown key"));

  const auto& a = cold->discovery().plugins;
  const auto& b = warm->discovery().plugins;
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    INFO(a[i].manifest_path);
    CHECK(a[i].name == b[i].name);
    CHECK(a[i].backend == b[i].backend);
    CHECK(a[i].manifest_path == b[i].manifest_path);
    CHECK(a[i].library_path == b[i].library_path);
    CHECK(a[i].state == b[i].state);
    CHECK(a[i].manifest == b[i].manifest);
    CHECK(a[i].ops == b[i].ops);
    CHECK(a[i].note == b[i].note);
    REQUIRE(a[i].problems.size() == b[i].problems.size());
    for (size_t j = 0; j < a[i].problems.size(); ++j) {
      CHECK(a[i].problems[j].code == b[i].problems[j].code);
      CHECK(a[i].problems[j].message == b[i].problems[j].message);
      CHECK(a[i].problems[j].warning == b[i].problems[j].warning);
    }
  }
  const KernelRegistry& ra = cold->registry();
  const KernelRegistry& rb = warm->registry();
  REQUIRE(ra.ops() == rb.ops());
  CHECK(ra.ops().size() > 80);
  for (const std::string& op : ra.ops()) {
    INFO(op);
    const auto sa = ra.get(op);
    const auto sb = rb.get(op);
    REQUIRE(sa.size() == sb.size());
    for (size_t i = 0; i < sa.size(); ++i) CHECK(*sa[i] == *sb[i]);
    CHECK((ra.schema(op) == nullptr) == (rb.schema(op) == nullptr));
    if (ra.schema(op) != nullptr && rb.schema(op) != nullptr) CHECK(*ra.schema(op) == *rb.schema(op));
  }
  REQUIRE(ra.schemas().size() == rb.schemas().size());
  CHECK(ra.failures().size() == rb.failures().size());
}

TEST_CASE("registry cache: an edited manifest is read again") {
  CacheScope scope;
  const fs::path file = scope.plugins / "m.json";
  scope.add("m.json", small_manifest("m", "kd_a"), "libm.so");
  {
    // Written just now: parsed, but not cached yet.
    ManifestCache cache(ScanPolicy::cache);
    read_all(scope, cache);
    ManifestCache again(ScanPolicy::cache);
    read_all(scope, again);
    CHECK(again.hits() == 0);
  }
  settle();
  {
    ManifestCache cache(ScanPolicy::cache);
    read_all(scope, cache);
    ManifestCache warm(ScanPolicy::cache);
    check_same(read_all(scope, warm), parse_all(scope));
    CHECK(warm.hits() == 1);
  }

  SUBCASE("same size, new content") { write_text(file, small_manifest("m", "kd_z")); }
  SUBCASE("new size") { write_text(file, small_manifest("m", "kd_longer_symbol")); }
  SUBCASE("replaced by another file with the old size and modification time") {
    const auto mtime = fs::last_write_time(file);
    write_text(scope.plugins / "m.json.new", small_manifest("m", "kd_y"));
    fs::rename(scope.plugins / "m.json.new", file);
    fs::last_write_time(file, mtime);
  }
  ManifestCache cache(ScanPolicy::cache);
  const std::vector<ManifestResult> edited = read_all(scope, cache);
  CHECK(cache.hits() == 0);
  REQUIRE(edited.size() == 1);
  REQUIRE(edited[0].ok());
  CHECK(edited[0].manifest->kernels[0].symbol != "kd_a");
  check_same(edited, parse_all(scope));
  // Once settled, the new content is cached in turn.
  settle();
  ManifestCache refill(ScanPolicy::cache);
  read_all(scope, refill);
  ManifestCache warm(ScanPolicy::cache);
  check_same(read_all(scope, warm), edited);
  CHECK(warm.hits() == 1);
}

TEST_CASE("registry cache: manifests with findings are parsed every time") {
  CacheScope scope;
  scope.add("newer.json", read_text(kGoodManifests / "newer_minor.json"));
  scope.add("unknown.json", read_text(kGoodManifests / "unknown_keys.json"));
  scope.add("bad.json", R"({"kdispatch_manifest": "1.0", "plugin": "UPPER"})");
  settle();
  ManifestCache cold(ScanPolicy::cache);
  const std::vector<ManifestResult> first = read_all(scope, cold);
  ManifestCache warm(ScanPolicy::cache);
  const std::vector<ManifestResult> second = read_all(scope, warm);
  CHECK(warm.hits() == 0);
  check_same(first, second);
  check_same(first, parse_all(scope));
  for (const auto& r : first) CHECK(r.warnings.size() + r.errors.size() > 0);
}

TEST_CASE("registry cache: a corrupt, truncated or unreadable cache never changes what is read") {
  CacheScope scope;
  for (int i = 0; i < 5; ++i) scope.add("m" + std::to_string(i) + ".json", small_manifest("m" + std::to_string(i)));
  scope.add("every_field.json", every_field_manifest());
  settle();
  const std::vector<ManifestResult> truth = parse_all(scope);
  {
    ManifestCache fill(ScanPolicy::cache);
    read_all(scope, fill);
  }
  const std::string good = read_text(cache_file());
  REQUIRE(good.find("\nmanifest\t") != std::string::npos);
  const size_t record = good.find("every_field");
  REQUIRE(record != std::string::npos);

  std::string flipped = good;
  flipped[record + 3] ^= 0x01;
  std::string cut_in_record = good.substr(0, record + 40);
  std::string other_build = good;
  other_build.replace(good.find(" core "), 6, " core 0:0 ");
  for (const auto& [what, text] : std::vector<std::pair<std::string, std::string>>{
           {"garbage",
            "\x7f"
            "ELF\0\1\2 not a cache\n\t\t\n"},
           {"empty", ""},
           {"cut in half", good.substr(0, good.size() / 2)},
           {"cut inside a record", cut_in_record},
           {"a flipped byte", flipped},
           {"another build's", other_build},
           {"lines of nothing", good.substr(0, good.find('\n') + 1) + "manifest\t\t\t\n\\\\\t\nscan\tx\n"}}) {
    INFO(what);
    write_text(cache_file(), text);
    ManifestCache cache(ScanPolicy::cache);
    check_same(read_all(scope, cache), truth);
    // Rebuilt: the next process reads every manifest from it.
    ManifestCache warm(ScanPolicy::cache);
    check_same(read_all(scope, warm), truth);
    CHECK(warm.hits() == truth.size());
  }

  SUBCASE("the cache is a directory") {
    fs::remove(cache_file());
    fs::create_directories(cache_file());
    ManifestCache cache(ScanPolicy::cache);
    std::vector<ManifestResult> results;
    const auto log = logged([&] { results = read_all(scope, cache); });
    check_same(results, truth);
    CHECK(any_contains(log, "cannot be written"));
  }
  SUBCASE("the cache cannot be read") {
    if (::geteuid() == 0) return;  // root reads it anyway
    ::chmod(cache_file().c_str(), 0);
    ManifestCache cache(ScanPolicy::cache);
    check_same(read_all(scope, cache), truth);
  }
}

TEST_CASE("registry cache: an unwritable cache place is only warned about") {
  CacheScope scope;
  scope.add("m.json", small_manifest("m"));
  settle();
  const fs::path blocked = scope.root / "not-a-directory";
  write_text(blocked, "x");
  ::setenv("XDG_CACHE_HOME", blocked.c_str(), 1);
  ManifestCache cache(ScanPolicy::cache);
  std::vector<ManifestResult> results;
  const auto log = logged([&] { results = read_all(scope, cache); });
  check_same(results, parse_all(scope));
  CHECK(any_contains(log, "cannot be written"));
}

TEST_CASE("registry cache: KDISPATCH_SCAN=off neither reads nor writes it, always parses and rewrites it") {
  CacheScope scope;
  scope.add("m.json", small_manifest("m"));
  settle();
  {
    ManifestCache off(ScanPolicy::off);
    read_all(scope, off);
    CHECK_FALSE(fs::exists(cache_file()));
  }
  {
    ManifestCache fill(ScanPolicy::cache);
    read_all(scope, fill);
    REQUIRE(fs::exists(cache_file()));
  }
  ManifestCache always(ScanPolicy::always);
  check_same(read_all(scope, always), parse_all(scope));
  CHECK(always.hits() == 0);
  ManifestCache cache(ScanPolicy::cache);
  read_all(scope, cache);
  CHECK(cache.hits() == 1);
}

TEST_CASE("registry cache: a scan outcome is keyed by the sha256 of the library's content too") {
  const CacheScope scope;
  scope.add("p.json", small_manifest("p"), "libp.so");
  const ManifestResult parsed = parse_manifest(small_manifest("p"), (scope.plugins / "p.json").string());
  REQUIRE(parsed.ok());
  const Manifest& manifest = *parsed.manifest;
  REQUIRE(manifest.library_path() == scope.plugins / "libp.so");

  cache_store(manifest, ScanOutcome{ScanVerdict::crashed, 11, "signal 11", true});
  const std::optional<ScanOutcome> stored = cache_lookup(manifest);
  REQUIRE(stored.has_value());
  CHECK(stored->verdict == ScanVerdict::crashed);

  // The entry carries the digest of the library it was made for; one whose
  // digest is not the file's (a rewrite that kept size and every time stamp
  // leaves that) is stale.
  const std::string digest = sha256_file(scope.plugins / "libp.so");
  const std::string text = read_text(registry_cache_path());
  const size_t at = text.find(":" + digest + "\t");
  REQUIRE_MESSAGE(at != std::string::npos, text);
  std::string edited = text;
  edited.replace(at + 1, digest.size(), std::string(64, '0'));
  write_text(registry_cache_path(), edited);
  CHECK_FALSE(cache_lookup(manifest).has_value());
}

TEST_CASE("registry cache: a broken cache is warned about once per process") {
  CacheScope scope;
  for (int i = 0; i < 3; ++i) scope.add("m" + std::to_string(i) + ".json", small_manifest("m" + std::to_string(i)));
  settle();
  const auto count = [](const std::vector<std::string>& lines, const std::string& text) {
    return std::count_if(lines.begin(), lines.end(),
                         [&text](const std::string& line) { return line.find(text) != std::string::npos; });
  };
  std::vector<std::string> warnings;
  const auto warned = [&warnings](LogLevel level, std::string_view message) {
    if (level == LogLevel::warn) warnings.emplace_back(message);
  };

  SUBCASE("a file of another format") {
    fs::create_directories(cache_file().parent_path());
    write_text(cache_file(), "not a cache\n");
    set_log_sink(warned);
    ManifestCache cache(ScanPolicy::cache);
    read_all(scope, cache);
    set_log_sink({});
    CHECK(count(warnings, "not a cache of this format") == 1);
  }
  SUBCASE("a folder where the file goes, read by two discoveries") {
    fs::create_directories(cache_file());
    set_log_sink(warned);
    for (int run = 0; run < 2; ++run) {
      ManifestCache cache(ScanPolicy::cache);
      read_all(scope, cache);
    }
    set_log_sink({});
    CHECK(count(warnings, "rebuilding it") == 1);
    CHECK(count(warnings, "cannot be written") == 1);
  }
}
