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
  harness::Shapes shapes;
  std::vector<NamedAttr> attrs;
};

std::string describe(const Case& c) {
  std::string s = harness::shapes_str(c.shapes);
  for (const auto& a : c.attrs) {
    s += fmt::format(" {}={}", a.name, std::visit([](const auto& v) { return fmt::format("{}", v); }, a.value));
  }
  return s;
}

// The schema's test sizes (its example where it lists none), each with every
// combination of its test attribute values; other attributes keep their
// defaults, which the harness fills in.
std::vector<Case> cases_of(const OpSchema& schema) {
  std::vector<harness::Shapes> sizes = schema.test_sizes;
  if (sizes.empty()) sizes.push_back(harness::example_shapes(schema));
  std::vector<std::vector<NamedAttr>> combos{{}};
  for (const auto& [name, values] : schema.test_attrs) {
    std::vector<std::vector<NamedAttr>> next;
    for (const auto& combo : combos) {
      for (const AttrValue& v : values) {
        next.push_back(combo);
        next.back().push_back({name, v});
      }
    }
    combos = std::move(next);
  }
  std::vector<Case> cases;
  for (const auto& s : sizes) {
    for (const auto& combo : combos) cases.push_back({s, combo});
  }
  return cases;
}

// Runs `op` on every backend under test for every case and dtype, against
// the op's reference kernel.
void conform(const OpSchema& schema) {
  const std::string& op = schema.op;
  const KernelSpec* reference_spec = g_context->registry().reference(op);
  REQUIRE_MESSAGE(reference_spec != nullptr, "no reference kernel for " << op);
  const OpHandle reference = g_dispatch->op(op, reference_spec->backend);
  const std::vector<Case> cases = cases_of(schema);
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
        harness::CallData host = harness::make_call(schema, dtype, c.shapes, 1234 + static_cast<uint64_t>(runs));
        for (const NamedAttr& a : c.attrs) {
          for (NamedAttr& have : host.attrs) {
            if (have.name == a.name) have.value = a.value;
          }
        }
        harness::CallData data = harness::clone_to(host, dl, memory);
        std::vector<DLTensor> tensors = data.dl();
        INFO(op << " on " << b.name << " " << dtype_name(dtype) << " " << describe(c));
        REQUIRE_NOTHROW(handle(tensors, data.attrs));
        if (memory != nullptr) {
          char error[256] = "";
          REQUIRE(memory->synchronize(dl.device_id, error, sizeof error) == KD_STATUS_OK);
        }
        harness::download_all(data);
        harness::CallData want = harness::clone_to(host, DLDevice{kDLCPU, 0}, nullptr);
        std::vector<DLTensor> want_tensors = want.dl();
        REQUIRE_NOTHROW(reference(want_tensors, want.attrs));
        const harness::Comparison cmp = harness::compare(schema, data, want);
        CHECK_MESSAGE(cmp.ok, cmp.first_mismatch << " (max " << cmp.max_ulps << " ulps, mean " << cmp.mean_ulps
                                                 << " ulps)");
        ++runs;
      }
    }
  }
  MESSAGE(op << ": " << runs << " calls checked");
}

}  // namespace

// Every op with a schema and a kernel, one subcase each.
TEST_CASE("every op against its reference") {
  for (const OpSchema* schema : g_context->registry().schemas()) {
    if (!g_context->registry().has(schema->op)) continue;
    SUBCASE(schema->op.c_str()) { conform(*schema); }
  }
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
