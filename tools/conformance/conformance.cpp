// The conformance suite: every op of every backend present, in every dtype
// its kernel serves (the schema's, for a kernel that declares none), with
// every dtype alternative of its tensors, each optional tensor present and
// absent, dense and (for tensors of layout "rows" or "any") with padded
// rows whose padding is poisoned and must stay untouched, tensors that may
// be given "flattened" given so, at
// the sizes and attribute values of the op schema's "tests", on random
// inputs and again with each set of the schema's special values planted
// (NaN, infinities, ties, far tails, every 16-bit value), against the op's
// reference kernel run on the same inputs, within the tolerances of the
// op's schema. Outputs are poisoned before each call and inputs are random,
// never all zeros; every tensor lies between guard bytes, and a kernel that
// writes outside one fails. Nothing here names an op: what to run comes from the
// schemas, and the expected results from the reference backend.
//
//   KDISPATCH_CONFORMANCE_BACKEND=cuda kdispatch-conformance   one backend
//   kdispatch-conformance                                      all present
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <optional>
#include <thread>

#include "harness.hpp"
#include "kdispatch/context.hpp"
#include "kdispatch/dispatcher.hpp"
#include "raw_call.hpp"

using namespace kdispatch;

namespace {

struct Backend {
  std::string name;
  const PluginBinary* binary;
  ProbedDevice device;
  DLDevice dl;
  const kd_memory_api* memory;  // null on the host
};

std::unique_ptr<Context> g_context;
std::unique_ptr<Dispatcher> g_dispatch;
std::vector<Backend> g_backends;

void synchronize(const Backend& b) {
  if (b.memory == nullptr) return;
  char error[256] = "";
  REQUIRE_MESSAGE(b.memory->synchronize(b.dl.device_id, error, sizeof error) == KD_STATUS_OK, error);
}

// The call `c` of the op on backend `b`, in the layout and with the dtypes
// and tensors of `variant`, checked against the reference run on the same
// inputs as the plain call: dense rows, nothing flattened (and, for padded
// rows or flattened tensors, the reference run on the variant's layout
// against its own plain result).
harness::Comparison run_case(const OpSchema& schema, const OpHandle& handle, const OpHandle& reference,
                             const Backend& b, Dtype dtype, const harness::TestCase& c, uint64_t seed,
                             const harness::Variant& variant) {
  const harness::CallData host = harness::make_case(schema, dtype, c, seed, variant);
  harness::CallData data = harness::clone_to(host, b.dl, b.memory);
  std::vector<DLTensor> tensors = data.dl();
  const std::string kernel = fmt::format("the kernel of backend '{}'", b.name);
  {
    harness::GuardWatch watch(kernel);
    watch.watch(data);
    REQUIRE_NOTHROW(handle(tensors, data.attrs));
    synchronize(b);
  }
  harness::download_all(data);
  harness::CallData want = harness::plain_copy(schema, host);
  std::vector<DLTensor> want_tensors = want.dl();
  {
    harness::GuardWatch watch("the reference kernel");
    watch.watch(want);
    REQUIRE_NOTHROW(reference(want_tensors, want.attrs));
  }
  // The reference on the variant's own layout: the core's split of
  // flattened tensors and the reference's strides, against the plain call.
  const std::string layout = variant.padded && variant.flattened ? "padded rows, flattened"
                             : variant.padded                     ? "padded rows"
                                                                  : "flattened tensors";
  std::optional<harness::CallData> want_padded;
  if (variant.padded || variant.flattened) {
    want_padded.emplace(harness::clone_to(host, DLDevice{kDLCPU, 0}, nullptr));
    std::vector<DLTensor> padded_tensors = want_padded->dl();
    harness::GuardWatch watch("the reference kernel on " + layout);
    watch.watch(*want_padded);
    try {
      reference(padded_tensors, want_padded->attrs);
    } catch (const Error& e) {
      harness::Comparison refused;
      refused.ok = false;
      refused.first_mismatch = "the reference kernel refused " + layout + ": " + e.what();
      return refused;
    }
  }
  // A kernel that wrote outside its tensors or into the padding between
  // their rows fails, whatever it computed.
  try {
    harness::check_guards(data, kernel);
    harness::check_guards(want, "the reference kernel");
    if (want_padded) harness::check_guards(*want_padded, "the reference kernel on " + layout);
  } catch (const harness::GuardViolation& e) {
    harness::Comparison outside;
    outside.ok = false;
    outside.first_mismatch = e.what();
    return outside;
  }
  const std::vector<std::string> none;
  const std::span<const std::string> unchecked = c.special != nullptr ? c.special->unchecked : none;
  if (want_padded) {
    harness::Comparison self = harness::compare(schema, *want_padded, want, unchecked);
    if (!self.ok) {
      self.first_mismatch = "the reference kernel on " + layout + " against itself on the plain call: " +
                            self.first_mismatch;
      return self;
    }
  }
  return harness::compare(schema, data, want, unchecked);
}

// Runs `schema`'s op on every backend under test for every case and dtype.
void conform(const OpSchema& schema) {
  const std::string& op = schema.op;
  const KernelSpec* reference_spec = g_context->registry().reference(op);
  REQUIRE_MESSAGE(reference_spec != nullptr, "no reference kernel for " << op);
  // Without an output every comparison would pass having compared nothing.
  REQUIRE_MESSAGE(schema.has_output(), op << ": no tensor of its schema is \"written\" or \"inplace\": nothing to compare");
  const OpHandle reference = g_dispatch->op(op, reference_spec->backend);
  const std::vector<harness::TestCase> cases = harness::test_cases(schema);
  // A dtype of the schema that no backend's kernel serves, on any device, is
  // never called by anyone.
  const std::vector<Dtype> takes = harness::call_dtypes(schema);
  for (Dtype d : takes) {
    bool served = false;
    for (const KernelSpec* s : g_context->registry().get(op)) served = served || (!s->is_reference() && s->supports(d));
    CHECK_MESSAGE(served, op << ": " << dtype_name(d) << ", a dtype of its schema, is served by no backend's kernel");
  }
  for (const Backend& b : g_backends) {
    const KernelSpec* spec = g_context->registry().get_backend(op, b.name);
    if (spec == nullptr || spec == reference_spec) continue;
    const std::vector<Dtype> dtypes = harness::kernel_dtypes(schema, *spec);
    CHECK_MESSAGE(!dtypes.empty(), op << " on " << b.name << ": the kernel declares no dtype the schema takes");
    for (Dtype d : spec->dtypes) {
      CHECK_MESSAGE(std::find(takes.begin(), takes.end(), d) != takes.end(),
                    op << " on " << b.name << ": the kernel declares " << dtype_name(d)
                       << ", which the op's schema does not take: never checked");
    }
    const OpHandle handle = g_dispatch->op(op, b.name);
    int runs = 0;
    int padded = 0;        // with padded rows
    int alternatives = 0;  // with a tensor in a dtype other than its primary one
    int absent = 0;        // with an optional tensor left out
    int flattened = 0;     // with tensors given flattened
    bool failed = false;   // a comparison failed: the kernel's verdict is recorded at once
    for (Dtype dtype : dtypes) {
      // The plain variant (dense rows, primary dtypes, every tensor present)
      // runs every case; the others share the cases in turn, each running
      // every (variants - 1)-th (one case each, in turn, when there are
      // fewer cases than variants), so that each runs on cases of every
      // kind while the suite's time grows by about one call per case, not by
      // the product of the variants.
      const std::vector<harness::Variant> variants = harness::variants(schema, dtype);
      const size_t others = variants.size() - 1;
      for (size_t vi = 0; vi < variants.size(); ++vi) {
        const harness::Variant& v = variants[vi];
        bool alternative = false;
        for (size_t i = 0; i < v.dtypes.size(); ++i) {
          const std::vector<Dtype> choices = schema.tensor_dtypes(schema.tensors[i], dtype);
          alternative = alternative || (!choices.empty() && v.dtypes[i] != choices.front());
        }
        const bool leaves_out = std::find(v.absent.begin(), v.absent.end(), true) != v.absent.end();
        for (size_t ci = 0; ci < cases.size(); ++ci) {
          if (vi != 0 && (cases.size() >= others ? ci % others != vi - 1 : ci != (vi - 1) % cases.size())) continue;
          const harness::TestCase& c = cases[ci];
          INFO(op << " on " << b.name << " " << dtype_name(dtype) << " " << harness::describe(c) << " ("
                  << harness::describe(schema, v) << ")");
          const harness::Comparison cmp =
              run_case(schema, handle, reference, b, dtype, c, 1234 + static_cast<uint64_t>(runs), v);
          CHECK_MESSAGE(cmp.ok, cmp.first_mismatch << " (max " << cmp.max_ulps << " ulps, mean " << cmp.mean_ulps
                                                   << " ulps)");
          if (!cmp.ok && !failed) {
            failed = true;
            g_context->record_verdict(*spec, b.device.device, false, "kdispatch-conformance",
                                      fmt::format("{} {}: {}", dtype_name(dtype), harness::describe(c),
                                                  cmp.first_mismatch));
          }
          ++runs;
          padded += v.padded;
          alternatives += alternative;
          absent += leaves_out;
          flattened += v.flattened;
        }
      }
    }
    if (!failed && runs > 0) g_context->record_verdict(*spec, b.device.device, true, "kdispatch-conformance");
    MESSAGE(op << " on " << b.name << ": " << runs << " calls checked (" << padded << " with padded rows, "
               << alternatives << " with a dtype alternative, " << absent << " with an optional tensor absent"
               << (harness::has_flattened(schema) ? fmt::format(", {} with tensors flattened", flattened) : "")
               << ")");
  }
}

// Four threads call the op at once, each on its own data (padded rows
// where the schema allows them): every result is still the reference's.
void conform_threads(const OpSchema& schema) {
  const KernelSpec* reference_spec = g_context->registry().reference(schema.op);
  REQUIRE(reference_spec != nullptr);
  const OpHandle reference = g_dispatch->op(schema.op, reference_spec->backend);
  const std::vector<harness::TestCase> cases = harness::test_cases(schema);
  // The largest random case: large enough for a backend's thread pool.
  const harness::TestCase* largest = &cases.front();
  for (const harness::TestCase& c : cases) {
    if (c.special == nullptr && harness::call_bytes(schema, Dtype::float32, c.shapes) >
                                    harness::call_bytes(schema, Dtype::float32, largest->shapes)) {
      largest = &c;
    }
  }
  for (const Backend& b : g_backends) {
    const KernelSpec* spec = g_context->registry().get_backend(schema.op, b.name);
    if (spec == nullptr || spec == reference_spec) continue;
    const std::vector<Dtype> dtypes = harness::kernel_dtypes(schema, *spec);
    if (dtypes.empty()) continue;
    const OpHandle handle = g_dispatch->op(schema.op, b.name);
    struct Job {
      harness::CallData host;
      harness::CallData data;
      bool ok = false;
      std::string error;
    };
    std::vector<std::unique_ptr<Job>> jobs;
    // Padded rows where the schema allows them, and tensors flattened where
    // it allows that: the layouts real callers pass.
    const harness::Variant variant{harness::has_rows(schema), {}, {}, harness::has_flattened(schema)};
    for (uint64_t t = 0; t < 4; ++t) {
      harness::CallData host = harness::make_case(schema, dtypes.back(), *largest, 77 + t, variant);
      harness::CallData data = harness::clone_to(host, b.dl, b.memory);
      jobs.push_back(std::make_unique<Job>(Job{std::move(host), std::move(data), false, {}}));
    }
    // Ops that only write their outputs run three times each; one that
    // updates a tensor in place runs once, as its result feeds the next call.
    const bool inplace = std::any_of(schema.tensors.begin(), schema.tensors.end(),
                                     [](const TensorArg& t) { return t.inplace; });
    const int repeats = inplace ? 1 : 3;
    const std::string kernel = fmt::format("the kernel of backend '{}'", b.name);
    harness::GuardWatch watch(kernel);
    for (auto& job : jobs) watch.watch(job->data);
    std::vector<std::thread> threads;
    for (auto& job : jobs) {
      threads.emplace_back([&handle, repeats, &job = *job] {
        try {
          std::vector<DLTensor> tensors = job.data.dl();
          for (int repeat = 0; repeat < repeats; ++repeat) handle(tensors, job.data.attrs);
          job.ok = true;
        } catch (const Error& e) {
          job.error = e.what();
        }
      });
    }
    for (std::thread& t : threads) t.join();
    synchronize(b);
    for (auto& job : jobs) {
      INFO(schema.op << " on " << b.name << " from four threads, " << harness::describe(*largest));
      REQUIRE_MESSAGE(job->ok, job->error);
      harness::download_all(job->data);
      CHECK_NOTHROW(harness::check_guards(job->data, kernel));
      harness::CallData want = harness::plain_copy(schema, job->host);
      std::vector<DLTensor> want_tensors = want.dl();
      REQUIRE_NOTHROW(reference(want_tensors, want.attrs));
      const harness::Comparison cmp = harness::compare(schema, job->data, want);
      CHECK_MESSAGE(cmp.ok, cmp.first_mismatch);
      if (!cmp.ok) {
        g_context->record_verdict(*spec, b.device.device, false, "kdispatch-conformance",
                                  fmt::format("from four threads: {}", cmp.first_mismatch));
      }
    }
  }
}

// Called directly through the C ABI with a tensor missing, or in a dtype it
// does not serve, a kernel refuses with a status and a message.
void conform_refusals(const OpSchema& schema) {
  const std::vector<harness::TestCase> cases = harness::test_cases(schema);
  for (const Backend& b : g_backends) {
    const KernelSpec* spec = g_context->registry().get_backend(schema.op, b.name);
    if (spec == nullptr || spec == g_context->registry().reference(schema.op)) continue;
    const std::vector<Dtype> dtypes = harness::kernel_dtypes(schema, *spec);
    if (dtypes.empty()) continue;
    const OpHandle handle = g_dispatch->op(schema.op, b.name);
    harness::CallData host = harness::make_case(schema, dtypes.front(), cases.front(), 5);
    harness::CallData data = harness::clone_to(host, b.dl, b.memory);
    std::vector<DLTensor> tensors = data.dl();
    std::array<kd_attr, kMaxSchemaAttrs> storage;
    harness::RawCall call;
    call.fn = handle.resolve(tensors).function();
    const std::span<const kd_attr> attrs = handle.pack_attrs(data.attrs, storage);
    call.attrs.assign(attrs.begin(), attrs.end());
    call.tensors.assign(tensors.begin(), tensors.end() - 1);
    INFO(schema.op << " on " << b.name << ", called with " << call.tensors.size() << " of " << tensors.size()
                   << " tensors");
    CHECK(call.run() != KD_STATUS_OK);
    CHECK(call.error[0] != '\0');
    // A float dtype the kernel does not serve, in every tensor of the
    // kernel-selecting dtype variable.
    for (Dtype other : {Dtype::float64, Dtype::float32, Dtype::float16, Dtype::bfloat16}) {
      if (std::find(dtypes.begin(), dtypes.end(), other) != dtypes.end()) continue;
      harness::CallData wrong = harness::clone_to(harness::make_case(schema, other, cases.front(), 5), b.dl, b.memory);
      std::vector<DLTensor> wrong_tensors = wrong.dl();
      call.tensors.assign(wrong_tensors.begin(), wrong_tensors.end());
      INFO("in " << dtype_name(other) << ", which it does not declare");
      CHECK(call.run() != KD_STATUS_OK);
      CHECK(call.error[0] != '\0');
      break;
    }
    synchronize(b);
  }
}

}  // namespace

// An op whose kernels have no schema (a broken schema file, a plugin's
// kernel for an op nobody defined) would be left out of every check below.
TEST_CASE("every op with a kernel has a schema") {
  for (const std::string& op : g_context->registry().ops()) {
    CHECK_MESSAGE(g_context->registry().schema(op) != nullptr, op << " has kernels but no schema: nothing checks it");
  }
}

// Every op with a schema and a kernel, one subcase each.
TEST_CASE("every op against its reference") {
  for (const OpSchema* schema : g_context->registry().schemas()) {
    if (!g_context->registry().has(schema->op)) continue;
    SUBCASE(schema->op.c_str()) { conform(*schema); }
  }
}

TEST_CASE("every op called from four threads at once") {
  for (const OpSchema* schema : g_context->registry().schemas()) {
    if (!g_context->registry().has(schema->op)) continue;
    SUBCASE(schema->op.c_str()) { conform_threads(*schema); }
  }
}

TEST_CASE("every kernel refuses a missing tensor and a dtype it does not serve") {
  for (const OpSchema* schema : g_context->registry().schemas()) {
    if (!g_context->registry().has(schema->op)) continue;
    SUBCASE(schema->op.c_str()) { conform_refusals(*schema); }
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
      const ProbedDevice& device = binary.devices.front();
      const DLDevice dl{static_cast<DLDeviceType>(to_dlpack_device_type(device.device.type)), device.id};
      const bool host = device.device.type == DeviceType::cpu;
      const kd_memory_api* memory =
          host || !KD_STRUCT_HAS_FIELD(kd_plugin_api, memory, binary.api->struct_size) ? nullptr : binary.api->memory;
      g_backends.push_back({rec.backend, &binary, device, dl, memory});
      fmt::print("conformance: testing backend '{}' on {} ({})\n", rec.backend, device.device.str(), device.name);
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
