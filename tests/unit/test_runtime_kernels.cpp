// Kernels registered at run time (Context::register_kernel): a C++ function
// with a data pointer, registered as backend "rt" for fixture.fallback
// (out = x * factor) beside the fallback fixture plugins (fx_fb_picky,
// priority 30, declines rows of odd length; fx_fb_good, priority 10; a
// reference kernel). It is checked, selected, ranked and passed over like
// a plugin's kernel.
#include <doctest/doctest.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <initializer_list>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kdispatch/context.hpp"
#include "kdispatch/dispatcher.hpp"
#include "scale_call.hpp"

using namespace kdispatch;

namespace {

constexpr const char* kOp = "fixture.fallback";

std::unique_ptr<Context> fixture_context(std::initializer_list<const char*> plugins) {
  ContextOptions options;
  options.search.use_environment = false;
  for (const char* p : plugins) {
    options.search.replace.push_back(std::string(KDISPATCH_BINARY_DIR) + "/tests/fixtures/plugins/" + p);
  }
  options.selector = SelectorOptions{};
  return std::make_unique<Context>(options);
}

// What the "rt" kernel gets as kernel_data: it writes out = x * factor +
// offset (the offset shows the data reached it), counts its calls, and
// declines every call while `decline` is set.
struct RtData {
  float offset = 0.0f;
  bool decline = false;
  std::atomic<int> calls{0};
};

kd_status rt_kernel(const kd_call_args* args) {
  auto* data = static_cast<RtData*>(args->kernel_data);
  if (data == nullptr) {
    std::snprintf(args->error, args->error_capacity, "rt: no kernel data");
    return KD_STATUS_INTERNAL;
  }
  ++data->calls;
  if (data->decline) {
    std::snprintf(args->error, args->error_capacity, "rt: declined");
    return KD_STATUS_UNSUPPORTED;
  }
  const DLTensor& out = args->tensors[0];
  const DLTensor& x = args->tensors[1];
  int64_t n = 1;
  for (int32_t d = 0; d < x.ndim; ++d) n *= x.shape[d];
  const auto factor = static_cast<float>(args->attrs[0].value.f);
  for (int64_t i = 0; i < n; ++i) {
    static_cast<float*>(out.data)[i] = static_cast<const float*>(x.data)[i] * factor + data->offset;
  }
  return KD_STATUS_OK;
}

// Another function, for the conflicting registration.
kd_status other_kernel(const kd_call_args*) { return KD_STATUS_INTERNAL; }

KernelSpec rt_spec(RtData* data, int32_t priority = 0) {
  KernelSpec spec;
  spec.op = kOp;
  spec.backend = "rt";
  Target cpu;
  cpu.device = DeviceType::cpu;
  spec.targets = {cpu};
  spec.dtypes = {Dtype::float32};
  spec.priority = priority;
  spec.description = "the run-time kernel of the tests";
  spec.function = rt_kernel;
  spec.function_data = data;
  return spec;
}

using kdispatch::test::ScaleCall;

bool contains(const std::string& text, std::string_view part) { return text.find(part) != std::string::npos; }

template <class E, class F>
E thrown(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e;
  }
  FAIL("nothing was thrown");
  return E(ErrorCode::kernel_failed, "");
}

}  // namespace

TEST_CASE("run-time kernel: selected when named, its data reaches it, through the checked call and a handle") {
  auto ctx = fixture_context({"fx_fb_picky", "fx_fb_good", "fx_fb_reference"});
  RtData data;
  data.offset = 0.25f;
  ctx->register_kernel(rt_spec(&data));
  const KernelSpec* spec = ctx->registry().get_backend(kOp, "rt");
  REQUIRE(spec != nullptr);
  CHECK(spec->describe() == "kernel registered at run time (backend 'rt')");
  CHECK(spec->plugin.empty());
  const bool is_rt_kernel = ctx->kernel(*spec) == &rt_kernel;  // no plugin is opened
  CHECK(is_rt_kernel);

  Dispatcher dispatch(*ctx);
  const OpHandle named = dispatch.op(kOp, "rt");
  ScaleCall call(3, 7);
  named(call.tensors, std::vector<NamedAttr>{{"factor", 1.5}});
  CHECK(call.is(1.5f, 0.25f));
  CHECK(data.calls == 1);

  ScaleCall again(2, 9, 5);
  const KernelHandle handle = named.resolve(again.tensors);
  CHECK(handle.spec().backend == "rt");
  const kd_attr factor{"factor", KD_ATTR_TYPE_FLOAT, 0, {.f = 3.0}};
  handle(again.tensors, std::span<const kd_attr>(&factor, 1));
  CHECK(again.is(3.0f, 0.25f));
  CHECK(data.calls == 2);

  // Unnamed, the plugins' priorities (30, 10) beat its 0.
  CHECK(ctx->choose({kOp, {}, Device::host_cpu(), Dtype::float32}).spec->backend == "fx_fb_picky");
}

TEST_CASE("run-time kernel: a priority above the plugins' wins by rule priority") {
  auto ctx = fixture_context({"fx_fb_picky", "fx_fb_good", "fx_fb_reference"});
  RtData data;
  ctx->register_kernel(rt_spec(&data, 50));
  const Selection s = ctx->choose({kOp, {}, Device::host_cpu(), Dtype::float32});
  CHECK(s.spec->backend == "rt");
  CHECK(s.rule == SelectionRule::priority);
  REQUIRE(s.ranked.size() == 3);
  CHECK(s.ranked[1]->backend == "fx_fb_picky");

  Dispatcher dispatch(*ctx);
  ScaleCall call(4, 6);
  dispatch.op(kOp)(call.tensors, std::vector<NamedAttr>{{"factor", -0.5}});
  CHECK(call.is(-0.5f, 0.0f));
  CHECK(data.calls == 1);
}

TEST_CASE("run-time kernel: unsupported passes the call to the next ranked backend") {
  auto ctx = fixture_context({"fx_fb_picky", "fx_fb_good", "fx_fb_reference"});
  RtData data;
  data.decline = true;
  ctx->register_kernel(rt_spec(&data, 50));
  Dispatcher dispatch(*ctx);
  ScaleCall call(3, 8);  // rows of even length: fx_fb_picky takes it
  dispatch.op(kOp)(call.tensors, std::vector<NamedAttr>{{"factor", 0.75}});
  CHECK(call.is(0.75f, 0.0f));
  CHECK(data.calls == 1);
  ScaleCall odd(3, 5);  // odd: fx_fb_picky declines too, fx_fb_good runs it
  dispatch.op(kOp)(odd.tensors, std::vector<NamedAttr>{{"factor", 0.75}});
  CHECK(odd.is(0.75f, 0.0f));
  CHECK(data.calls == 2);

  // Named, it is the only one tried: its message is the error.
  ScaleCall named(2, 4);
  const KernelError e = thrown<KernelError>([&] { dispatch.op(kOp, "rt")(named.tensors); });
  CHECK(contains(e.message(), "kernel registered at run time of backend 'rt' failed for op 'fixture.fallback'"));
  CHECK(contains(e.message(), "rt: declined"));
}

TEST_CASE("run-time kernel: a false constraint is in KD-E003's words") {
  auto ctx = fixture_context({"fx_fb_reference"});
  RtData data;
  KernelSpec spec = rt_spec(&data);
  spec.constraints = {"N % 4 == 0"};
  ctx->register_kernel(spec);
  Dispatcher dispatch(*ctx);
  ScaleCall fits(2, 8);
  dispatch.op(kOp)(fits.tensors);
  CHECK(fits.is(2.0f, 0.0f));  // the schema's default factor
  ScaleCall refused(2, 5);
  const SelectionError e = thrown<SelectionError>([&] { dispatch.op(kOp)(refused.tensors); });
  CHECK(e.code() == ErrorCode::no_usable_backend);
  CHECK(contains(e.message(), "constraint 'N % 4 == 0' is false (N = 5)"));
  CHECK(data.calls == 1);
}

TEST_CASE("run-time kernel: registration is checked like a manifest's kernel") {
  auto ctx = fixture_context({"fx_fb_good", "fx_fb_reference"});
  RtData data;
  RtData other;
  ctx->register_kernel(rt_spec(&data));
  const uint64_t generation = ctx->registry().generation();
  ctx->register_kernel(rt_spec(&data));  // the same function and data: a no-op
  CHECK(ctx->registry().generation() == generation);

  SUBCASE("another function or data for the pair is KD-E005") {
    KernelSpec spec = rt_spec(&data);
    spec.function = other_kernel;
    const RegistrationError e = thrown<RegistrationError>([&] { ctx->register_kernel(spec); });
    CHECK(e.code() == ErrorCode::conflicting_registration);
    CHECK(contains(e.message(), "Conflicting kernel registration for op 'fixture.fallback', backend 'rt': "
                                "kernel registered at run time (backend 'rt') != kernel registered at run time "
                                "(backend 'rt')"));
    CHECK(thrown<RegistrationError>([&] { ctx->register_kernel(rt_spec(&other)); }).code() ==
          ErrorCode::conflicting_registration);
    CHECK(ctx->registry().get_backend(kOp, "rt")->function_data == &data);
  }
  SUBCASE("a constraint naming nothing of the op is KD-E011") {
    KernelSpec spec = rt_spec(&other);
    spec.backend = "rt2";
    spec.constraints = {"Q > 0"};
    const ManifestError e = thrown<ManifestError>([&] { ctx->register_kernel(spec); });
    CHECK(e.code() == ErrorCode::manifest_bad_field);
    CHECK(contains(e.message(), "kernel registered at run time for op 'fixture.fallback', backend 'rt2', "
                                "\"constraints\"[0] \"Q > 0\""));
    CHECK(ctx->registry().get_backend(kOp, "rt2") == nullptr);
  }
  SUBCASE("an op without a schema is KD-E001") {
    KernelSpec spec = rt_spec(&other);
    spec.op = "fixture.nothing";
    const SelectionError e = thrown<SelectionError>([&] { ctx->register_kernel(spec); });
    CHECK(e.code() == ErrorCode::unknown_op);
    CHECK(contains(e.message(), "'fixture.nothing'"));
  }
  SUBCASE("bad fields are KD-E011") {
    KernelSpec spec = rt_spec(&other);
    spec.backend = "rt3";
    KernelSpec no_function = spec;
    no_function.function = nullptr;
    KernelSpec reference = spec;
    reference.role = KernelRole::reference;
    KernelSpec priority = spec;
    priority.priority = 1001;
    KernelSpec dtype = spec;
    dtype.dtypes = {Dtype::float16};
    KernelSpec symbol = spec;
    symbol.symbol = "kd_rt";
    KernelSpec backend = spec;
    backend.backend = "Bad Name";
    for (const auto& [bad, words] : std::vector<std::pair<KernelSpec, const char*>>{
             {no_function, "no function given"},
             {reference, "never an op's reference"},
             {priority, "priority 1001 is outside [-1000, 1000]"},
             {dtype, "dtype float16 is not one the op's schema takes (float32)"},
             {symbol, "plugin, symbol and manifest are for a plugin's kernels"},
             {backend, "the backend name must match [a-z0-9_]+"}}) {
      const ManifestError e = thrown<ManifestError>([&] { ctx->register_kernel(bad); });
      INFO(e.message());
      CHECK(e.code() == ErrorCode::manifest_bad_field);
      CHECK(contains(e.message(), words));
    }
    CHECK(ctx->registry().get_backend(kOp, "rt3") == nullptr);
  }
}

TEST_CASE("run-time kernel: unregistered, calls go elsewhere, handles resolved before included, and registered again it is back") {
  auto ctx = fixture_context({"fx_fb_good", "fx_fb_reference"});
  RtData data;
  data.offset = 1.0f;
  ctx->register_kernel(rt_spec(&data, 50));
  Dispatcher dispatch(*ctx);
  const OpHandle op = dispatch.op(kOp);
  ScaleCall first(2, 6);
  op(first.tensors);
  CHECK(first.is(2.0f, 1.0f));

  ctx->unregister_kernel(kOp, "rt");
  CHECK(ctx->registry().get_backend(kOp, "rt") == nullptr);
  ScaleCall after(2, 6, 3);
  op(after.tensors);
  CHECK(after.is(2.0f, 0.0f));  // fx_fb_good
  CHECK(data.calls == 1);
  CHECK(thrown<SelectionError>([&] { ctx->unregister_kernel(kOp, "rt"); }).code() ==
        ErrorCode::backend_not_registered);
  const RegistrationError plugin = thrown<RegistrationError>([&] { ctx->unregister_kernel(kOp, "fx_fb_good"); });
  CHECK(contains(plugin.message(), "only kernels registered at run time can be unregistered"));
  CHECK(ctx->registry().get_backend(kOp, "fx_fb_good") != nullptr);

  // Another function and data for the pair now replace the withdrawn one.
  RtData second;
  second.offset = -1.0f;
  ctx->register_kernel(rt_spec(&second, 50));
  ScaleCall back(3, 4, 9);
  op(back.tensors, std::vector<NamedAttr>{{"factor", 0.5}});
  CHECK(back.is(0.5f, -1.0f));
  CHECK(second.calls == 1);
  CHECK(data.calls == 1);
}
