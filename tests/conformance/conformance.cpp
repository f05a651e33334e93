// The conformance suite: every op of every backend present, in every dtype
// it declares, at odd and large sizes, against the op's reference kernel
// run on the same inputs, within the tolerances of the op's schema. Outputs
// are poisoned before each call and inputs are random, never all zeros.
//
//   KDISPATCH_CONFORMANCE_BACKEND=cuda kdispatch-conformance   one backend
//   kdispatch-conformance                                      all present
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <cstdlib>
#include <memory>

#include "harness.hpp"
#include "kdispatch/context.hpp"
#include "kdispatch/dispatcher.hpp"

using namespace kdispatch;

namespace {

struct Backend {
  std::string name;
  const PluginBinary* binary;
  ProbedDevice device;
};

std::unique_ptr<Context> g_context;
std::unique_ptr<Dispatcher> g_dispatch;
std::vector<Backend> g_backends;

struct Case {
  std::vector<int64_t> leading;
  std::map<std::string, int64_t> symbols;
  std::vector<NamedAttr> attrs;
};

std::string describe(const Case& c) {
  std::string s = fmt::format("*=[{}]", fmt::join(c.leading, ","));
  for (const auto& [k, v] : c.symbols) s += fmt::format(" {}={}", k, v);
  for (const auto& a : c.attrs) {
    s += fmt::format(" {}={}", a.name, std::visit([](const auto& v) { return fmt::format("{}", v); }, a.value));
  }
  return s;
}

// Runs `op` on every backend under test for every case and dtype.
void conform(const std::string& op, const std::vector<Case>& cases) {
  const OpSchema* schema = g_context->registry().schema(op);
  REQUIRE_MESSAGE(schema != nullptr, "no schema for " << op);
  const KernelSpec* reference_spec = g_context->registry().reference(op);
  REQUIRE_MESSAGE(reference_spec != nullptr, "no reference kernel for " << op);
  const OpHandle reference = g_dispatch->op(op, reference_spec->backend);
  int runs = 0;
  for (const Backend& b : g_backends) {
    const KernelSpec* spec = g_context->registry().get_backend(op, b.name);
    if (spec == nullptr || spec == reference_spec) continue;
    const OpHandle handle = g_dispatch->op(op, b.name);
    const kd_memory_api* memory =
        b.device.device.type == DeviceType::cpu || !KD_STRUCT_HAS_FIELD(kd_plugin_api, memory, b.binary->api->struct_size)
            ? nullptr
            : b.binary->api->memory;
    const DLDevice dl{static_cast<DLDeviceType>(to_dlpack_device_type(b.device.device.type)), b.device.id};
    for (Dtype dtype : spec->dtypes) {
      for (const Case& c : cases) {
        harness::Shapes shapes{c.leading, c.symbols};
        const harness::CallData host = harness::make_call(*schema, dtype, shapes, 1234 + static_cast<uint64_t>(runs));
        harness::CallData data = harness::clone_to(host, dl, memory);
        data.attrs = c.attrs;
        std::vector<DLTensor> tensors = data.dl();
        INFO(op << " on " << b.name << " " << dtype_name(dtype) << " " << describe(c));
        REQUIRE_NOTHROW(handle(tensors, data.attrs));
        if (memory != nullptr) {
          char error[256] = "";
          REQUIRE(memory->synchronize(dl.device_id, error, sizeof error) == KD_STATUS_OK);
        }
        harness::download_all(data);
        harness::CallData want = harness::clone_to(host, DLDevice{kDLCPU, 0}, nullptr);
        want.attrs = c.attrs;
        std::vector<DLTensor> want_tensors = want.dl();
        REQUIRE_NOTHROW(reference(want_tensors, want.attrs));
        const harness::Comparison cmp = harness::compare(*schema, data, want);
        CHECK_MESSAGE(cmp.ok, cmp.first_mismatch << " (max " << cmp.max_ulps << " ulps, mean " << cmp.mean_ulps
                                                 << " ulps)");
        ++runs;
      }
    }
  }
  MESSAGE(op << ": " << runs << " calls checked");
}

std::vector<Case> rows_by(const std::string& symbol, std::vector<int64_t> sizes, std::vector<NamedAttr> attrs = {}) {
  std::vector<Case> cases;
  for (int64_t rows : {1, 3, 33}) {
    for (int64_t n : sizes) cases.push_back({{rows}, {{symbol, n}}, attrs});
  }
  return cases;
}

}  // namespace

TEST_CASE("layernorm.rmsnorm") {
  auto cases = rows_by("H", {1, 7, 64, 4097}, {{"eps", 1e-6}});
  cases.push_back({{2, 5}, {{"H", 128}}, {{"eps", 1e-5}}});  // several leading dims
  cases.push_back({{256}, {{"H", 8192}}, {{"eps", 1e-6}}});   // large
  conform("layernorm.rmsnorm", cases);
}

TEST_CASE("layernorm.fused_add_rmsnorm") {
  auto cases = rows_by("H", {1, 7, 64, 4097}, {{"eps", 1e-6}});
  cases.push_back({{256}, {{"H", 8192}}, {{"eps", 1e-5}}});
  conform("layernorm.fused_add_rmsnorm", cases);
}

TEST_CASE("activation.*_and_mul") {
  for (const char* op : {"activation.silu_and_mul", "activation.gelu_and_mul", "activation.gelu_tanh_and_mul"}) {
    auto cases = rows_by("D", {1, 7, 64, 4097});
    cases.push_back({{256}, {{"D", 8192}}, {}});
    conform(op, cases);
  }
}

TEST_CASE("embeddings.rotary_embedding") {
  std::vector<Case> cases;
  for (bool neox : {true, false}) {
    for (int64_t tokens : {1, 7, 33}) {
      cases.push_back({{tokens}, {{"HQ", 1}, {"HK", 1}, {"R", 1}, {"P", 5}}, {{"is_neox", neox}}});
      cases.push_back({{tokens}, {{"HQ", 3}, {"HK", 1}, {"R", 7}, {"P", 97}}, {{"is_neox", neox}}});
      cases.push_back({{tokens}, {{"HQ", 32}, {"HK", 8}, {"R", 64}, {"P", 4096}}, {{"is_neox", neox}}});
    }
    cases.push_back({{2, 9}, {{"HQ", 4}, {"HK", 2}, {"R", 40}, {"P", 300}}, {{"is_neox", neox}}});
    cases.push_back({{1024}, {{"HQ", 32}, {"HK", 8}, {"R", 64}, {"P", 8192}}, {{"is_neox", neox}}});
  }
  conform("embeddings.rotary_embedding", cases);
}

TEST_CASE("moe.topk_softmax") {
  std::vector<Case> cases;
  for (bool renormalize : {false, true}) {
    for (int64_t rows : {1, 7, 33}) {
      for (auto [e, k] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {7, 3}, {64, 6}, {128, 8}, {256, 8}, {1000, 4}}) {
        cases.push_back({{rows}, {{"E", e}, {"K", k}}, {{"renormalize", renormalize}}});
      }
    }
    cases.push_back({{4096}, {{"E", 256}, {"K", 8}}, {{"renormalize", renormalize}}});
  }
  conform("moe.topk_softmax", cases);
}

int main(int argc, char** argv) {
  const char* only = std::getenv("KDISPATCH_CONFORMANCE_BACKEND");
  g_context = std::make_unique<Context>();
  g_dispatch = std::make_unique<Dispatcher>(*g_context);
  std::vector<std::string> skipped;
  for (const auto& rec : g_context->discovery().plugins) {
    if (rec.state != PluginState::found) continue;
    if (only != nullptr && rec.backend != only) continue;
    try {
      const PluginBinary& binary = g_context->load_plugin(rec.name);
      if (binary.devices.empty()) {
        skipped.push_back(fmt::format("{}: its plugin reports no device here", rec.backend));
        continue;
      }
      g_backends.push_back({rec.backend, &binary, binary.devices.front()});
      fmt::print("conformance: testing backend '{}' on {} ({})\n", rec.backend, binary.devices.front().device.str(),
                 binary.devices.front().name);
    } catch (const Error& e) {
      fmt::print("conformance: backend '{}' failed to load: [{}] {}\n", rec.backend, e.code_string(), e.message());
      return 1;
    }
  }
  for (const auto& s : skipped) fmt::print("conformance: SKIPPED {}\n", s);
  if (g_backends.empty()) {
    fmt::print("conformance: no backend to test{}\n", only ? fmt::format(" (asked for '{}')", only) : "");
    return 77;  // ctest: SKIP_RETURN_CODE
  }
  doctest::Context context(argc, argv);
  const int result = context.run();
  g_dispatch.reset();
  g_context.reset();
  return result;
}
