// Every deliberately broken fixture plugin, side by side with good ones in
// one Context: each fails with its own code, the KD-E002 message for its
// backend says why, and the good plugins still load and run.
#include <doctest/doctest.h>

#include <filesystem>
#include <map>

#include "kdispatch/context.hpp"

using namespace kdispatch;

namespace {

const std::map<std::string, ErrorCode> kBroken = {
    {"fx_no_entry", ErrorCode::plugin_no_entry},
    {"fx_null_entry", ErrorCode::plugin_no_entry},
    {"fx_abi_major", ErrorCode::plugin_abi_mismatch},
    {"fx_small_struct", ErrorCode::plugin_abi_mismatch},
    {"fx_manifest_mismatch", ErrorCode::plugin_manifest_mismatch},
    {"fx_missing_kernel", ErrorCode::plugin_manifest_mismatch},
    {"fx_probe_fails", ErrorCode::plugin_probe_failed},
    {"fx_missing_dep", ErrorCode::plugin_open_failed},
    {"fx_undefined_symbol", ErrorCode::plugin_open_failed},
    {"fx_not_elf", ErrorCode::plugin_open_failed},
    {"fx_truncated", ErrorCode::plugin_open_failed},
};

}  // namespace

TEST_CASE("broken plugins fail with their own code, beside good ones that still run") {
  const std::filesystem::path root = std::string(KDISPATCH_BINARY_DIR) + "/tests/fixtures/plugins";
  ContextOptions options;
  options.search.use_environment = false;
  for (const auto& entry : std::filesystem::directory_iterator(root)) options.search.replace.push_back(entry.path());
  Context ctx(options);
  const Device cpu = Device::host_cpu();

  for (const auto& [name, code] : kBroken) {
    INFO(name);
    std::string library;
    for (const auto& rec : ctx.discovery().plugins) {
      if (rec.name == name) library = rec.library_path;
    }
    REQUIRE_FALSE(library.empty());
    // Discovery alone registers it: listing and selecting open nothing.
    CHECK(ctx.select({"fixture.scale", name, cpu, std::nullopt}).plugin == name);
    try {
      ctx.load_plugin(name);
      FAIL("loaded");
    } catch (const PluginError& e) {
      CHECK_MESSAGE(e.code() == code, e.code_string() << ": " << e.what());
      CHECK(std::string(e.what()).find(library) != std::string::npos);
    }
    // Now withdrawn: KD-E002 for its backend, saying why.
    try {
      ctx.select({"fixture.scale", name, cpu, std::nullopt});
      FAIL("still selectable");
    } catch (const SelectionError& e) {
      const std::string what = e.what();
      CHECK(e.code() == ErrorCode::backend_not_registered);
      CHECK(what.find("No '" + name + "' backend registered for op 'fixture.scale'") == 0);
      CHECK(what.find("[" + code_string(code) + "]") != std::string::npos);
      CHECK(what.find(library) != std::string::npos);
    }
  }

  // The good plugins are untouched: they load, probe and their kernel runs.
  for (const char* good : {"fx_good", "fx_c_good"}) {
    INFO(good);
    const KernelSpec& spec = ctx.select({"fixture.scale", good, cpu, std::nullopt});
    const kd_kernel_fn fn = ctx.kernel(spec);
    float x[3] = {1.0f, -2.0f, 0.5f};
    float out[3] = {0, 0, 0};
    int64_t shape[1] = {3};
    DLTensor tensors[2] = {{out, {kDLCPU, 0}, 1, {kDLFloat, 32, 1}, shape, nullptr, 0},
                           {x, {kDLCPU, 0}, 1, {kDLFloat, 32, 1}, shape, nullptr, 0}};
    kd_attr factor{};
    factor.name = "factor";
    factor.type = KD_ATTR_TYPE_FLOAT;
    factor.value.f = 3.0;
    char error[256] = "";
    const kd_call_args args{sizeof(kd_call_args), tensors, 2, 1, &factor, nullptr, error, sizeof error, nullptr};
    REQUIRE(fn(&args) == KD_STATUS_OK);
    CHECK(out[1] == -6.0f);
  }
  // The op's error for no backend named lists the failures of every plugin
  // that declared it.
  const auto failures = ctx.registry().failures();
  CHECK(failures.size() == kBroken.size());
}

TEST_CASE("a plugin built for ABI 1.0 is refused for an op with an optional tensor, and kept for the others") {
  ContextOptions options;
  options.search.use_environment = false;
  options.search.replace.push_back(std::string(KDISPATCH_BINARY_DIR) + "/tests/fixtures/plugins/fx_abi_1_0_exact");
  Context ctx(options);
  const KernelSpec* plain = ctx.registry().get_backend("fixture.scale", "fx_abi_1_0_exact");
  const KernelSpec* optional = ctx.registry().get_backend("fixture.optional_scale", "fx_abi_1_0_exact");
  REQUIRE(plain != nullptr);
  REQUIRE(optional != nullptr);
  CHECK(reinterpret_cast<void*>(ctx.kernel(*plain)) != nullptr);
  try {
    ctx.kernel(*optional);
    FAIL("an ABI 1.0 kernel was given an op with an optional tensor");
  } catch (const PluginError& e) {
    CHECK(e.code() == ErrorCode::plugin_abi_mismatch);
    CHECK(std::string(e.what()).find("was built for ABI 1.0, which has no absent tensors, and op "
                                     "'fixture.optional_scale' has the optional tensor 'bias'") != std::string::npos);
  }
}
