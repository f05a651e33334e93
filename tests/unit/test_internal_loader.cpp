// Plugin loading against real, deliberately broken shared libraries
// (tests/fixtures/plugins), plus the location/ownership/checksum checks and
// the ELF reader.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "kdispatch/elf_reader.hpp"
#include "kdispatch/error.hpp"
#include "kdispatch/manifest.hpp"
#include "kdispatch/plugin_loader.hpp"
#include "kdispatch/plugin_security.hpp"

namespace fs = std::filesystem;
using namespace kdispatch;

namespace {

const fs::path kBuiltFixtures = fs::path(KDISPATCH_BINARY_DIR) / "tests" / "fixtures" / "plugins";
const fs::path kFixtureSources = fs::path(KDISPATCH_FIXTURES_DIR) / "plugins";

Manifest fixture_manifest(const std::string& name, const fs::path& dir = {}) {
  const fs::path file = (dir.empty() ? kBuiltFixtures / name : dir) / (name + ".json");
  ManifestResult result = read_manifest(file);
  INFO("manifest " << file.string());
  for (const Problem& p : result.errors) INFO(code_string(p.code) << " " << p.message);
  REQUIRE(result.ok());
  return *result.manifest;
}

std::string library_of(const Manifest& manifest) {
  return fs::absolute(manifest.library_path()).string();
}

std::optional<PluginError> load_error(const Manifest& manifest) {
  try {
    load_plugin_binary(manifest);
  } catch (const PluginError& e) {
    return e;
  }
  return std::nullopt;
}

// Loads fixture `name` and checks it fails with `code`, naming the library
// file and the cause.
void expect_load_failure(const std::string& name, ErrorCode code, const std::string& cause) {
  const Manifest manifest = fixture_manifest(name);
  const std::optional<PluginError> error = load_error(manifest);
  INFO("fixture " << name);
  REQUIRE_MESSAGE(error.has_value(), "load_plugin accepted it");
  INFO(error->code_string() << ": " << error->message());
  CHECK(error->code() == code);
  CHECK(error->message().find(library_of(manifest)) != std::string::npos);
  CHECK(error->message().find(cause) != std::string::npos);
}

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

// A private directory for tests that change modes and owners; removed at the
// end whatever they did to it.
class TempDir {
 public:
  TempDir() {
    std::string pattern = (fs::temp_directory_path() / "kdispatch-loader-XXXXXX").string();
    REQUIRE(::mkdtemp(pattern.data()) != nullptr);
    path_ = pattern;
    fs::permissions(path_, fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec |
                               fs::perms::others_read | fs::perms::others_exec);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

// Copies a built fixture (manifest + library) into `dir`; returns the
// manifest as read from there.
Manifest copy_fixture(const std::string& name, const fs::path& dir) {
  fs::create_directories(dir);
  const Manifest original = fixture_manifest(name);
  fs::copy_file(original.path, dir / (name + ".json"));
  fs::copy_file(original.library_path(), dir / original.library);
  return fixture_manifest(name, dir);
}

void add_permissions(const fs::path& path, fs::perms perms) {
  fs::permissions(path, perms, fs::perm_options::add);
}

}  // namespace

TEST_CASE("loader: the good plugin loads, probes and its kernels run") {
  for (const std::string name : {"fx_good", "fx_c_good"}) {
    CAPTURE(name);
    const Manifest manifest = fixture_manifest(name);
    std::unique_ptr<PluginBinary> plugin = load_plugin_binary(manifest);
    REQUIRE(plugin != nullptr);
    CHECK(plugin->plugin == name);
    CHECK(plugin->backend == name);
    CHECK(plugin->version == "0.1.0");
    CHECK(plugin->abi_major == KDISPATCH_ABI_MAJOR);
    CHECK(plugin->library_path == library_of(manifest));
    REQUIRE(plugin->devices.size() == 1);
    CHECK(plugin->devices[0].device.type == DeviceType::cpu);
    CHECK(plugin->devices[0].name.starts_with("fixture host cpu"));
    CHECK(plugin->kernels.size() == manifest.kernels.size());

    const std::string symbol = "kd_" + name + "_scale";
    REQUIRE(plugin->kernels.contains(symbol));
    float x_data[3] = {1.0F, -2.0F, 3.5F};
    float out_data[3] = {0.0F, 0.0F, 0.0F};
    int64_t shape[1] = {3};
    DLTensor tensors[2] = {};
    for (DLTensor& t : tensors) {
      t.device = {kDLCPU, 0};
      t.ndim = 1;
      t.dtype = {kDLFloat, 32, 1};
      t.shape = shape;
    }
    tensors[0].data = out_data;
    tensors[1].data = x_data;
    kd_attr factor{};
    factor.name = "factor";
    factor.type = KD_ATTR_TYPE_FLOAT;
    factor.value.f = 2.0;
    char error[128] = {};
    kd_call_args args{};
    args.struct_size = sizeof args;
    args.tensors = tensors;
    args.num_tensors = 2;
    args.num_attrs = 1;
    args.attrs = &factor;
    args.error = error;
    args.error_capacity = sizeof error;
    args.kernel_data = nullptr;
    REQUIRE(plugin->kernels.at(symbol)(&args) == KD_STATUS_OK);
    CHECK(out_data[0] == 2.0F);
    CHECK(out_data[1] == -4.0F);
    CHECK(out_data[2] == 7.0F);

    // Opening it again reuses the mapped library: same table.
    CHECK(load_plugin_binary(manifest)->api == plugin->api);
  }
}

TEST_CASE("loader: the minor-version rule: a 1.0-sized table and a future 1.1 table both load") {
  CHECK(KD_PLUGIN_API_STRUCT_SIZE_1_0 == KD_STRUCT_SIZE(kd_plugin_api, memory));
  for (const std::string name : {"fx_abi_1_0_exact", "fx_abi_1_1_future"}) {
    CAPTURE(name);
    std::unique_ptr<PluginBinary> plugin = load_plugin_binary(fixture_manifest(name));
    REQUIRE(plugin != nullptr);
    CHECK(plugin->abi_major == 1);
    CHECK(plugin->kernels.contains("kd_" + name + "_scale"));
    REQUIRE(plugin->devices.size() == 1);
  }
  const auto exact = load_plugin_binary(fixture_manifest("fx_abi_1_0_exact"));
  CHECK(exact->api->struct_size == KD_PLUGIN_API_STRUCT_SIZE_1_0);
  CHECK(exact->abi_minor == 0);
  const auto future = load_plugin_binary(fixture_manifest("fx_abi_1_1_future"));
  CHECK(future->api->struct_size > KD_PLUGIN_API_STRUCT_SIZE_1_0);
  CHECK(future->abi_minor == 1);
}

TEST_CASE("loader: each broken fixture fails with its own code and cause") {
  expect_load_failure("fx_no_entry", ErrorCode::plugin_no_entry,
                      "does not export the entry symbol 'kdispatch_plugin_api'");
  expect_load_failure("fx_null_entry", ErrorCode::plugin_no_entry, "returned NULL");
  expect_load_failure("fx_abi_major", ErrorCode::plugin_abi_mismatch,
                      "was built for plugin ABI 2.0, this kdispatch uses ABI " +
                          std::to_string(KDISPATCH_ABI_MAJOR) + "." + std::to_string(KDISPATCH_ABI_MINOR));
  expect_load_failure("fx_small_struct", ErrorCode::plugin_abi_mismatch,
                      "struct_size " + std::to_string(KD_STRUCT_SIZE(kd_plugin_api, probe)) +
                          " is smaller than ABI 1.0's " + std::to_string(KD_PLUGIN_API_STRUCT_SIZE_1_0));
  expect_load_failure("fx_manifest_mismatch", ErrorCode::plugin_manifest_mismatch,
                      "kernels only in the file: [fixture.scale -> kd_fx_manifest_mismatch_scale]");
  expect_load_failure("fx_manifest_mismatch", ErrorCode::plugin_manifest_mismatch,
                      "kernels only in the binary: [fixture.fill -> kd_fx_manifest_mismatch_fill, "
                      "fixture.scale -> kd_fx_manifest_mismatch_scale_v2]");
  expect_load_failure("fx_probe_fails", ErrorCode::plugin_probe_failed,
                      "fixture runtime: device enumeration failed (error 999)");
  expect_load_failure("fx_missing_kernel", ErrorCode::plugin_manifest_mismatch,
                      "does not provide kernel symbol 'kd_fx_missing_kernel_fill' declared for op "
                      "'fixture.fill'");
  expect_load_failure("fx_missing_dep", ErrorCode::plugin_open_failed,
                      "missing dependency libkd_fixture_missing_dep.so");
  expect_load_failure("fx_undefined_symbol", ErrorCode::plugin_open_failed,
                      "undefined symbol kd_fixture_symbol_nobody_defines");
  expect_load_failure("fx_not_elf", ErrorCode::plugin_open_failed,
                      "wrong architecture or not a shared library (not an ELF file)");
  expect_load_failure("fx_truncated", ErrorCode::plugin_open_failed, "truncated");
}

TEST_CASE("loader: a missing library is refused before dlopen") {
  TempDir dir;
  Manifest manifest = copy_fixture("fx_good", dir.path());
  fs::remove(manifest.library_path());
  const std::optional<Problem> problem = check_library_location(manifest);
  REQUIRE(problem.has_value());
  CHECK(problem->code == ErrorCode::manifest_bad_library_path);
  CHECK(problem->message ==
        "library not found: " + library_of(manifest) + " (declared by " + manifest.path + ")");
  const std::optional<PluginError> error = load_error(manifest);
  REQUIRE(error.has_value());
  CHECK(error->code() == ErrorCode::manifest_bad_library_path);
}

TEST_CASE("security: a plugin in a safe private directory passes") {
  TempDir dir;
  const Manifest manifest = copy_fixture("fx_good", dir.path() / "plugins");
  CHECK_FALSE(check_library_location(manifest).has_value());
  CHECK_FALSE(verify_library_checksum(manifest).has_value());
}

TEST_CASE("security: world-writable plugin directory or file is refused") {
  TempDir dir;
  SUBCASE("directory") {
    const Manifest manifest = copy_fixture("fx_good", dir.path() / "plugins");
    add_permissions(dir.path() / "plugins", fs::perms::others_write);
    const std::optional<Problem> problem = check_library_location(manifest);
    REQUIRE(problem.has_value());
    CHECK(problem->code == ErrorCode::plugin_insecure);
    CHECK(problem->message.find("plugin directory " + fs::canonical(dir.path() / "plugins").string() +
                                " is world-writable (mode 0757") != std::string::npos);
    const std::optional<PluginError> error = load_error(manifest);
    REQUIRE(error.has_value());
    CHECK(error->code() == ErrorCode::plugin_insecure);
  }
  SUBCASE("file") {
    const Manifest manifest = copy_fixture("fx_good", dir.path() / "plugins");
    add_permissions(manifest.library_path(), fs::perms::others_write);
    const std::optional<Problem> problem = check_library_location(manifest);
    REQUIRE(problem.has_value());
    CHECK(problem->code == ErrorCode::plugin_insecure);
    CHECK(problem->message.find("plugin library " + fs::canonical(manifest.library_path()).string() +
                                " is world-writable") != std::string::npos);
  }
}

TEST_CASE("security: a group-writable plugin file or directory is refused like a world-writable one") {
  TempDir dir;
  const Manifest manifest = copy_fixture("fx_good", dir.path() / "plugins");
  SUBCASE("library") {
    add_permissions(manifest.library_path(), fs::perms::group_write);
    const std::optional<Problem> problem = check_library_location(manifest);
    REQUIRE(problem.has_value());
    CHECK(problem->code == ErrorCode::plugin_insecure);
    CHECK(problem->message.find("plugin library " + fs::canonical(manifest.library_path()).string() +
                                " is group-writable (mode 0775") != std::string::npos);
    CHECK(problem->message.find("chmod g-w") != std::string::npos);
    const std::optional<PluginError> error = load_error(manifest);
    REQUIRE(error.has_value());
    CHECK(error->code() == ErrorCode::plugin_insecure);
  }
  SUBCASE("manifest") {
    add_permissions(manifest.path, fs::perms::group_write);
    const std::optional<Problem> problem = check_manifest_security(manifest.path);
    REQUIRE(problem.has_value());
    CHECK(problem->code == ErrorCode::plugin_insecure);
    CHECK(problem->message.find("plugin manifest " + manifest.path + " is group-writable") != std::string::npos);
  }
  SUBCASE("directory") {
    add_permissions(dir.path() / "plugins", fs::perms::group_write);
    const std::optional<Problem> problem = check_library_location(manifest);
    REQUIRE(problem.has_value());
    CHECK(problem->code == ErrorCode::plugin_insecure);
    CHECK(problem->message.find("plugin directory " + fs::canonical(dir.path() / "plugins").string() +
                                " is group-writable") != std::string::npos);
  }
}

TEST_CASE("security: every directory above the plugin up to / is checked") {
  TempDir dir;
  const Manifest manifest = copy_fixture("fx_good", dir.path() / "a" / "b" / "plugins");
  CHECK_FALSE(check_library_location(manifest).has_value());
  SUBCASE("a writable directory two levels up") {
    add_permissions(dir.path() / "a", fs::perms::others_write);
    const std::optional<Problem> problem = check_library_location(manifest);
    REQUIRE(problem.has_value());
    CHECK(problem->code == ErrorCode::plugin_insecure);
    CHECK(problem->message.find("directory above the plugin, " + fs::canonical(dir.path() / "a").string() +
                                " is world-writable") != std::string::npos);
    CHECK(check_manifest_security(manifest.path).has_value());
    const std::optional<PluginError> error = load_error(manifest);
    REQUIRE(error.has_value());
    CHECK(error->code() == ErrorCode::plugin_insecure);
  }
  SUBCASE("a sticky world-writable directory owned by root is fine, as /tmp is") {
    if (::geteuid() != 0) {
      WARN_MESSAGE(false, "not root: a root-owned sticky directory cannot be made here");
      return;
    }
    add_permissions(dir.path() / "a", fs::perms::others_write | fs::perms::sticky_bit);
    CHECK_FALSE(check_library_location(manifest).has_value());
  }
  SUBCASE("a directory above owned by another user") {
    if (::geteuid() != 0) {
      WARN_MESSAGE(false, "not root: cannot chown, foreign-owner check not exercised");
      return;
    }
    REQUIRE(::chown((dir.path() / "a").c_str(), 65534, 65534) == 0);
    const std::optional<Problem> problem = check_library_location(manifest);
    REQUIRE(problem.has_value());
    CHECK(problem->code == ErrorCode::plugin_insecure);
    CHECK(problem->message.find(fs::canonical(dir.path() / "a").string() + " is owned by uid 65534") !=
          std::string::npos);
  }
}

// The library is checked and then loaded; a second thread exchanges it with
// a foreign one the checks refuse (world-writable), over and over. Each
// iteration uses a folder of its own, so every load opens its file afresh.
// Whatever file the load opened is the one that was checked: the foreign
// library is refused each time it is met, and its constructor (which would
// leave a marker file) never runs.
TEST_CASE("security: a library swapped between the check and the load is never run") {
  TempDir dir;
  const Manifest original = copy_fixture("fx_good", dir.path() / "source");
  const fs::path good = original.library_path();
  const fs::path foreign = dir.path() / "source" / "foreign.so";
  fs::copy_file(kBuiltFixtures / "fx_foreign" / "libfx_foreign.so", foreign);
  add_permissions(foreign, fs::perms::others_write);
  const fs::path marker = dir.path() / "foreign-ran";
  REQUIRE(::setenv("KD_FX_FOREIGN_MARKER", marker.c_str(), 1) == 0);

  constexpr int kIterations = 10000;
  std::vector<std::string> libraries(kIterations), others(kIterations);
  for (int i = 0; i < kIterations; ++i) {
    const fs::path folder = dir.path() / "plugins" / std::to_string(i);
    fs::create_directories(folder);
    libraries[i] = (folder / original.library).string();
    others[i] = (folder / "foreign.so").string();
    fs::create_hard_link(good, libraries[i]);
    fs::create_hard_link(foreign, others[i]);
  }

  std::atomic<int> current{0};
  std::atomic<bool> stop{false};
  std::atomic<long> swaps{0};
  std::thread swapper([&] {
    while (!stop.load()) {
      const int i = current.load();
      if (::renameat2(AT_FDCWD, libraries[i].c_str(), AT_FDCWD, others[i].c_str(), RENAME_EXCHANGE) == 0) ++swaps;
    }
  });
  int loaded = 0, refused = 0;
  std::vector<std::string> unexpected;
  for (int i = 0; i < kIterations; ++i) {
    current.store(i);
    Manifest manifest = original;
    manifest.path = (dir.path() / "plugins" / std::to_string(i) / "fx_good.json").string();
    try {
      load_plugin_binary(manifest);
      ++loaded;
    } catch (const PluginError& e) {
      if (e.code() == ErrorCode::plugin_insecure && e.message().find("is world-writable") != std::string::npos) {
        ++refused;
      } else if (unexpected.size() < 5) {
        unexpected.push_back(code_string(e.code()) + " " + e.message());
      }
    }
  }
  stop.store(true);
  swapper.join();
  ::unsetenv("KD_FX_FOREIGN_MARKER");

  INFO("loaded " << loaded << ", refused " << refused << ", swaps " << swaps.load());
  for (const std::string& u : unexpected) INFO(u);
  CHECK_MESSAGE(!fs::exists(marker), "the foreign library's constructor ran");
  CHECK(unexpected.empty());
  CHECK(loaded > 0);
  CHECK(refused > 0);
}

TEST_CASE("security: a library owned by another non-root user is refused") {
  TempDir dir;
  const Manifest manifest = copy_fixture("fx_good", dir.path() / "plugins");
  // Handing a file to another user needs root; the tests run as root in CI.
  if (::geteuid() != 0) {
    WARN_MESSAGE(false, "not root: cannot chown, foreign-owner check not exercised");
    return;
  }
  REQUIRE(::chown(manifest.library_path().c_str(), 65534, 65534) == 0);
  const std::optional<Problem> problem = check_library_location(manifest);
  REQUIRE(problem.has_value());
  CHECK(problem->code == ErrorCode::plugin_insecure);
  CHECK(problem->message.find("is owned by uid 65534") != std::string::npos);
  const std::optional<PluginError> error = load_error(manifest);
  REQUIRE(error.has_value());
  CHECK(error->code() == ErrorCode::plugin_insecure);
}

TEST_CASE("security: sha256 is verified when the manifest gives one") {
  TempDir dir;
  Manifest manifest = copy_fixture("fx_good", dir.path() / "plugins");
  const std::string actual = sha256_file(manifest.library_path());
  CHECK(actual.size() == 64);

  manifest.sha256 = std::string(64, '0');
  const std::optional<Problem> problem = verify_library_checksum(manifest);
  REQUIRE(problem.has_value());
  CHECK(problem->code == ErrorCode::plugin_checksum_mismatch);
  CHECK(problem->message == "sha256 mismatch for " + library_of(manifest) + ": manifest " +
                                manifest.path + " says " + std::string(64, '0') + ", file has " + actual);
  const std::optional<PluginError> error = load_error(manifest);
  REQUIRE(error.has_value());
  CHECK(error->code() == ErrorCode::plugin_checksum_mismatch);

  manifest.sha256 = actual;
  CHECK_FALSE(verify_library_checksum(manifest).has_value());
  CHECK(load_plugin_binary(manifest)->plugin == "fx_good");
}

TEST_CASE("security: sha256_file matches known digests") {
  TempDir dir;
  std::ofstream(dir.path() / "abc") << "abc";
  std::ofstream(dir.path() / "empty");
  CHECK(sha256_file(dir.path() / "abc") ==
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  CHECK(sha256_file(dir.path() / "empty") ==
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  CHECK_THROWS_AS(sha256_file(dir.path() / "missing"), std::runtime_error);
}

TEST_CASE("security: a library outside the manifest directory is refused") {
  TempDir dir;
  const fs::path plugins = dir.path() / "plugins";
  const fs::path elsewhere = dir.path() / "elsewhere";
  fs::create_directories(plugins);
  fs::create_directories(elsewhere);
  fs::copy_file(fixture_manifest("fx_good").library_path(), elsewhere / "real.so");

  Manifest manifest = fixture_manifest("fx_good");
  manifest.path = (plugins / "fx_good.json").string();

  SUBCASE("through a symlink") {
    manifest.library = "x.so";
    fs::create_symlink(elsewhere / "real.so", plugins / "x.so");
    const std::optional<Problem> problem = check_library_location(manifest);
    REQUIRE(problem.has_value());
    CHECK(problem->code == ErrorCode::manifest_bad_library_path);
    CHECK(problem->message.find("escapes the manifest directory") != std::string::npos);
    CHECK(problem->message.find(fs::canonical(elsewhere / "real.so").string()) != std::string::npos);
  }
  SUBCASE("through a relative symlink to a sibling directory") {
    manifest.library = "x.so";
    fs::create_symlink("../elsewhere/real.so", plugins / "x.so");
    const std::optional<Problem> problem = check_library_location(manifest);
    REQUIRE(problem.has_value());
    CHECK(problem->code == ErrorCode::manifest_bad_library_path);
    CHECK(problem->message.find("escapes the manifest directory") != std::string::npos);
  }
  SUBCASE("through ../ in the name (a hand-built manifest: the parser refuses it)") {
    manifest.library = "../elsewhere/real.so";
    const std::optional<Problem> problem = check_library_location(manifest);
    REQUIRE(problem.has_value());
    CHECK(problem->code == ErrorCode::manifest_bad_library_path);
    CHECK(problem->message.find("escapes the manifest directory") != std::string::npos);
  }
  SUBCASE("a symlink that stays inside is fine") {
    manifest.library = "x.so";
    fs::copy_file(elsewhere / "real.so", plugins / "real.so");
    fs::create_symlink("real.so", plugins / "x.so");
    CHECK_FALSE(check_library_location(manifest).has_value());
  }
}

TEST_CASE("elf: the good plugin exports only the entry symbol and embeds its manifest") {
  const Manifest manifest = fixture_manifest("fx_good");
  const ElfInfo info = read_elf(manifest.library_path());
  CHECK(info.exported_symbols == std::vector<std::string>{"kdispatch_plugin_api"});
  CHECK(info.elf_class == "ELF64");
#if defined(__x86_64__)
  CHECK(info.machine == "x86-64");
#elif defined(__aarch64__)
  CHECK(info.machine == "AArch64");
#endif
  REQUIRE(info.embedded_manifest.has_value());
  CHECK(*info.embedded_manifest == read_text(kFixtureSources / "fx_good" / "fx_good.json"));
}

TEST_CASE("elf: needed libraries and the embedded manifest of a mismatching build") {
  const ElfInfo dep = read_elf(fixture_manifest("fx_missing_dep").library_path());
  CHECK(std::find(dep.needed.begin(), dep.needed.end(), "libkd_fixture_missing_dep.so") != dep.needed.end());

  const ElfInfo mismatch = read_elf(fixture_manifest("fx_manifest_mismatch").library_path());
  REQUIRE(mismatch.embedded_manifest.has_value());
  CHECK(*mismatch.embedded_manifest == read_text(kFixtureSources / "fx_manifest_mismatch" / "embedded.json"));
}

TEST_CASE("elf: missing, non-ELF and truncated files are KD-E020 naming the file") {
  struct Case {
    fs::path path;
    std::string cause;
  };
  const Case cases[] = {
      {kBuiltFixtures / "fx_not_elf" / "libfx_not_elf.so", "not an ELF file"},
      {kBuiltFixtures / "fx_truncated" / "libfx_truncated.so", "truncated"},
      {kBuiltFixtures / "does_not_exist.so", "No such file or directory"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.path);
    try {
      read_elf(c.path);
      FAIL("read_elf accepted it");
    } catch (const PluginError& e) {
      CHECK(e.code() == ErrorCode::plugin_open_failed);
      CHECK(e.message().find(c.path.string()) != std::string::npos);
      CHECK(e.message().find(c.cause) != std::string::npos);
    }
  }
}
