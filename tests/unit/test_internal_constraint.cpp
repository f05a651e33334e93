// Kernel eligibility constraints (docs/manifest.md, Constraints): the
// expression language's syntax and names (KD-E011 naming the field), each
// operator's value, overflow and division by zero, and selection: a call
// goes to a constrained kernel only when its constraints hold, else to
// another backend, else KD-E003 with the failed constraint's text.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <functional>
#include <iterator>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "constraint.hpp"
#include "kdispatch/context.hpp"
#include "kdispatch/dispatcher.hpp"
#include "kdispatch/error.hpp"
#include "kdispatch/manifest.hpp"
#include "schema_check.hpp"

using namespace kdispatch;

namespace {

// Names of a made-up op: shape symbols H, K, N; dtype variable T; an int,
// a bool and a float attribute.
struct Names {
  std::vector<std::string> symbols{"H", "K", "N"};
  std::vector<AttrArg> attrs{{"topk", AttrType::int_, AttrValue{int64_t{2}}, ""},
                             {"renorm", AttrType::bool_, AttrValue{false}, ""},
                             {"eps", AttrType::float_, AttrValue{1e-6}, ""}};
  ConstraintNames names() const { return {symbols, "T", attrs}; }
};

struct Values {
  std::array<int64_t, 3> symbols{12, 4, 100};
  std::array<kd_attr, 3> attrs{};
  Dtype dtype = Dtype::bfloat16;
  Values() {
    attrs[0].type = KD_ATTR_TYPE_INT;
    attrs[0].value.i = 2;
    attrs[1].type = KD_ATTR_TYPE_BOOL;
    attrs[1].value.b = 1;
    attrs[2].type = KD_ATTR_TYPE_FLOAT;
    attrs[2].value.f = 1e-6;
  }
  ConstraintInput input() const { return {symbols.data(), dtype, attrs.data()}; }
};

Constraint::Result eval(std::string_view text, const Values& v = Values()) {
  const Names n;
  const ConstraintNames names = n.names();
  return Constraint::compile(text, &names).evaluate(v.input());
}

bool holds(std::string_view text, const Values& v = Values()) {
  const Constraint::Result r = eval(text, v);
  REQUIRE_MESSAGE((r == Constraint::Result::holds || r == Constraint::Result::fails), text);
  return r == Constraint::Result::holds;
}

std::string refusal(std::string_view text) {
  const Names n;
  const ConstraintNames names = n.names();
  try {
    Constraint::compile(text, &names);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  FAIL("compiled: " << text);
  return {};
}

}  // namespace

TEST_CASE("constraint: syntax and names are checked when compiled") {
  CHECK(refusal("H %% 8 == 0").find("column 4") != std::string::npos);
  CHECK(refusal("H in 1").find("'[' after 'in'") != std::string::npos);
  CHECK(refusal("(H == 1").find("expected ')'") != std::string::npos);
  CHECK(refusal("H +").find("found the end") != std::string::npos);
  CHECK(refusal("H == 99999999999999999999").find("fits in 64 bits") != std::string::npos);
  CHECK(refusal("H $ 2").find("unexpected character '$'") != std::string::npos);
  CHECK(refusal("Q <= 8").find("'Q' is not a shape symbol ([H, K, N]), dtype (dtype, T) or attribute ([topk, "
                               "renorm, eps])") != std::string::npos);
  CHECK(refusal("eps < 1").find("attribute 'eps' is a float") != std::string::npos);
  CHECK(refusal("H and K").find("'and' takes a truth value, got an integer") != std::string::npos);
  CHECK(refusal("dtype < float32").find("'<' takes an integer, got a dtype") != std::string::npos);
  CHECK(refusal("H == renorm").find("compares an integer with a truth value") != std::string::npos);
  CHECK(refusal("T in [float32, 4]").find("'in' compares a dtype with an integer") != std::string::npos);
  CHECK(refusal("H + 1").find("not a condition") != std::string::npos);
  CHECK(refusal(std::string(600, '(')).find("longer than 512 characters") != std::string::npos);
  CHECK(refusal(std::string(40, '(') + "H > 0" + std::string(40, ')')).find("nested deeper than 32 levels") !=
        std::string::npos);
  std::string not_not = "H > 0";
  for (int i = 0; i < 40; ++i) not_not = "not " + not_not;
  CHECK(refusal(not_not).find("nested deeper than 32 levels") != std::string::npos);
  std::string long_list = "H in [0";
  for (int i = 1; i < 40; ++i) long_list += ", " + std::to_string(i);
  CHECK(refusal(long_list + "]").find("needs more than 32 values at once") != std::string::npos);

  // Without names (a manifest read before its op's schema) only the syntax counts.
  CHECK_NOTHROW(Constraint::compile("Q % 8 == 0 and dtype in [float16, bfloat16]", nullptr));
  CHECK_THROWS_AS(Constraint::compile("Q %", nullptr), std::invalid_argument);
}

TEST_CASE("constraint: each operator") {
  // H = 12, K = 4, N = 100, topk = 2, renorm = true, dtype bfloat16.
  CHECK(holds("H % 8 == 4"));
  CHECK(holds("H / 5 == 2 and -H / 5 == -2 and -H % 5 == -2"));
  CHECK(holds("H + K * 2 - 1 == 19"));
  CHECK(holds("(H + K) * 2 == 32"));
  CHECK(holds("K <= 8 && K < 5 && K >= 4 && K > 3 && K != 5"));
  CHECK_FALSE(holds("K < 4"));
  CHECK(holds("H in [64, 12, 256]"));
  CHECK_FALSE(holds("H in [64, 128, 256]"));
  CHECK(holds("not H in [64, 128]"));
  CHECK(holds("!(K > 8) || H == 0"));
  CHECK(holds("K > 8 or N == 100"));
  CHECK_FALSE(holds("K > 8 or N != 100"));
  CHECK(holds("topk == 2 and renorm"));
  CHECK(holds("renorm == true and not false"));
  CHECK(holds("dtype == bfloat16 and T in [float16, bfloat16] and dtype != float32"));
  CHECK_FALSE(holds("T == float32"));
}

TEST_CASE("constraint: overflow and division by zero are refusals, not values") {
  Values v;
  v.symbols = {int64_t{1} << 40, 0, 100};
  CHECK(eval("H * H > 0", v) == Constraint::Result::overflow);
  CHECK(eval("H * 1000000 + 9223372036854775807 > 0", v) == Constraint::Result::overflow);
  CHECK(eval("0 - 9223372036854775807 - 2 < 0", v) == Constraint::Result::overflow);
  CHECK(eval("(0 - 9223372036854775807 - 1) / -1 > 0", v) == Constraint::Result::overflow);
  CHECK(eval("(0 - 9223372036854775807 - 1) % -1 == 0", v) == Constraint::Result::overflow);
  CHECK(eval("-(0 - 9223372036854775807 - 1) > 0", v) == Constraint::Result::overflow);
  CHECK(eval("N / K > 2", v) == Constraint::Result::division_by_zero);
  CHECK(eval("N % K == 0", v) == Constraint::Result::division_by_zero);
  // `and` and `or` stop at the first operand that decides.
  CHECK(eval("K != 0 and N / K > 2", v) == Constraint::Result::fails);
  CHECK(eval("K == 0 or N / K > 2", v) == Constraint::Result::holds);

  const Names n;
  const ConstraintNames names = n.names();
  const Constraint c = Constraint::compile("N / K > 2 and renorm", &names);
  CHECK(c.explain(c.evaluate(v.input()), v.input()) ==
        "constraint 'N / K > 2 and renorm' cannot be evaluated: division by zero (N = 100, K = 0, renorm = true)");
  const Constraint d = Constraint::compile("H % 8 == 0 and T == float32", &names);
  Values w;
  CHECK(d.explain(d.evaluate(w.input()), w.input()) ==
        "constraint 'H % 8 == 0 and T == float32' is false (H = 12, T = bfloat16)");
}

namespace {

// A manifest of the plugin directory, parsed from its JSON after `edit`;
// its path stays in that directory, so its library is found.
Manifest edited_manifest(const std::string& name, const std::function<void(nlohmann::json&)>& edit) {
  const std::string path = std::string(KDISPATCH_PLUGIN_DIR) + "/" + name;
  std::ifstream in(path);
  REQUIRE(in);
  nlohmann::json j = nlohmann::json::parse(in);
  edit(j);
  ManifestResult parsed = parse_manifest(j.dump(), path);
  REQUIRE_MESSAGE(parsed.manifest, (parsed.errors.empty() ? "" : parsed.errors[0].message));
  return *parsed.manifest;
}

void constrain(nlohmann::json& manifest, std::string_view op, std::vector<std::string> constraints) {
  for (auto& k : manifest["kernels"]) {
    if (k["op"] == op) k["constraints"] = constraints;
  }
}

// rmsnorm float32 [rows, H].
struct Rmsnorm {
  std::vector<int64_t> shape2, shape1;
  std::vector<float> out, x, weight;
  std::vector<DLTensor> tensors;
  explicit Rmsnorm(int64_t h) : shape2{2, h}, shape1{h}, out(2 * h), x(2 * h, 0.5f), weight(h, 1.0f) {
    const DLDevice cpu{kDLCPU, 0};
    const DLDataType f32{kDLFloat, 32, 1};
    tensors = {DLTensor{out.data(), cpu, 2, f32, shape2.data(), nullptr, 0},
               DLTensor{x.data(), cpu, 2, f32, shape2.data(), nullptr, 0},
               DLTensor{weight.data(), cpu, 1, f32, shape1.data(), nullptr, 0}};
  }
};

// The cpu plugin (its rmsnorm constrained as given) and the reference
// plugin made an ordinary backend (rmsnorm constrained as given), in the
// order cpu, reference.
std::unique_ptr<Context> constrained_context(std::vector<std::string> cpu, std::vector<std::string> reference) {
  ContextOptions options;
  options.search.use_environment = false;
  options.search.use_default_path = false;
  SelectorOptions selector;
  selector.backend_order = {"cpu", "reference"};
  options.selector = selector;
  auto context = std::make_unique<Context>(options);
  const auto cpu_problems = context->add_manifest(
      edited_manifest("cpu.json", [&](nlohmann::json& j) { constrain(j, "layernorm.rmsnorm", cpu); }));
  CHECK(cpu_problems.empty());
  const auto ref_problems = context->add_manifest(edited_manifest("reference.json", [&](nlohmann::json& j) {
    j["role"] = "backend";
    constrain(j, "layernorm.rmsnorm", reference);
  }));
  CHECK(ref_problems.empty());
  return context;
}

}  // namespace

TEST_CASE("constraint: manifest fields are checked, syntax on reading and names on registration") {
  const std::string path = std::string(KDISPATCH_PLUGIN_DIR) + "/cpu.json";
  std::ifstream in(path);
  REQUIRE(in);
  nlohmann::json j = nlohmann::json::parse(in);
  j["kernels"][0]["constraints"] = {"H > 0", "H %"};
  ManifestResult parsed = parse_manifest(j.dump(), path);
  REQUIRE(!parsed.errors.empty());
  CHECK(parsed.errors[0].code == ErrorCode::manifest_bad_field);
  CHECK(parsed.errors[0].message.find("/kernels/0/constraints/1") != std::string::npos);
  CHECK(parsed.errors[0].message.find("constraint \"H %\"") != std::string::npos);

  ContextOptions options;
  options.search.use_environment = false;
  options.search.use_default_path = false;
  Context context(options);
  const auto problems = context.add_manifest(
      edited_manifest("cpu.json", [](nlohmann::json& m) { constrain(m, "layernorm.rmsnorm", {"Q % 8 == 0"}); }));
  REQUIRE(problems.size() == 1);
  CHECK(problems[0].code == ErrorCode::manifest_bad_field);
  CHECK(problems[0].message.find("cpu.json: kernel of op 'layernorm.rmsnorm' (symbol 'kd_cpu_rmsnorm'), "
                                 "\"constraints\"[0] \"Q % 8 == 0\": at column 1: 'Q' is not a shape symbol") !=
        std::string::npos);
  CHECK(context.registry().get_backend("layernorm.rmsnorm", "cpu") == nullptr);
  CHECK(context.registry().get_backend("layernorm.fused_add_rmsnorm", "cpu") != nullptr);
}

TEST_CASE("constraint: a call goes to a kernel only when its constraints hold") {
  auto context = constrained_context({"H % 8 == 0", "dtype == float32"}, {"H <= 64"});
  Dispatcher dispatch(*context);
  const OpHandle op = dispatch.op("layernorm.rmsnorm");

  Rmsnorm eligible(16);
  CHECK(op.resolve(eligible.tensors).spec().backend == "cpu");
  op(eligible.tensors);
  CHECK(eligible.out[0] == doctest::Approx(1.0f));

  Rmsnorm other(12);  // the cpu kernel is not eligible: the reference backend runs it
  CHECK(op.resolve(other.tensors).spec().backend == "reference");
  op(other.tensors);
  CHECK(other.out[0] == doctest::Approx(1.0f));
  // Both verdicts stay cached side by side.
  CHECK(op.resolve(eligible.tensors).spec().backend == "cpu");
  CHECK(op.resolve(other.tensors).spec().backend == "reference");

  Rmsnorm none(100);  // neither: KD-E003 says why for each
  try {
    op(none.tensors);
    FAIL("no error");
  } catch (const SelectionError& e) {
    CHECK(e.code() == ErrorCode::no_usable_backend);
    CHECK(e.message().find("cpu: constraint 'H % 8 == 0' is false (H = 100)") != std::string::npos);
    CHECK(e.message().find("reference: constraint 'H <= 64' is false (H = 100)") != std::string::npos);
  }

  // A named backend whose constraint fails is KD-E003 too.
  const OpHandle named = dispatch.op("layernorm.rmsnorm", "cpu");
  CHECK(named.resolve(eligible.tensors).spec().backend == "cpu");
  try {
    named(other.tensors);
    FAIL("no error");
  } catch (const SelectionError& e) {
    CHECK(e.code() == ErrorCode::no_usable_backend);
    CHECK(e.message().find("cpu: constraint 'H % 8 == 0' is false (H = 12)") != std::string::npos);
  }

  // Without a call's values (`kdispatch list`, `select`) constraints are
  // not evaluated: both kernels count as eligible.
  for (const Eligibility& e : context->selector().eligibility("layernorm.rmsnorm", Device::host_cpu(), Dtype::float32)) {
    CHECK(e.eligible);
  }
}

TEST_CASE("ranking: a preference set at run time redirects calls through handles resolved before") {
  auto context = constrained_context({}, {});
  Dispatcher dispatch(*context);
  const OpHandle op = dispatch.op("layernorm.rmsnorm");
  Rmsnorm call(16);
  CHECK(op.resolve(call.tensors).spec().backend == "cpu");  // KDISPATCH_BACKEND_ORDER cpu, reference
  context->set_preference("layernorm.rmsnorm", {"reference"});
  CHECK(op.resolve(call.tensors).spec().backend == "reference");
  call.out.assign(call.out.size(), -7.0f);
  op(call.tensors);
  CHECK(call.out[0] == doctest::Approx(1.0f));
  CHECK(context->choose({"layernorm.rmsnorm", {}, Device::host_cpu(), Dtype::float32}).rule ==
        SelectionRule::preference);
  // A refused preference changes nothing.
  CHECK_THROWS_AS(context->set_preference("layernorm.rmsnorm", {"cdua"}), SelectionError);
  CHECK(op.resolve(call.tensors).spec().backend == "reference");
  context->set_preference("layernorm.rmsnorm", {});
  CHECK(op.resolve(call.tensors).spec().backend == "cpu");
}

namespace {

// An op of its own ("memo.shift": out = x + offset over [*, N], an int and a
// bool attribute) and two kernels registered at run time that write their
// own offset and count their calls: "even" (priority 50) with constraints
// over N, rows and both attributes, "any" (priority 10) without.
struct ShiftKernel {
  float offset;
  std::atomic<int> calls{0};
  explicit ShiftKernel(float o) : offset(o) {}
};

kd_status shift_kernel(const kd_call_args* args) {
  auto* k = static_cast<ShiftKernel*>(args->kernel_data);
  ++k->calls;
  const DLTensor& out = args->tensors[0];
  const DLTensor& x = args->tensors[1];
  int64_t n = 1;
  for (int32_t d = 0; d < x.ndim; ++d) n *= x.shape[d];
  for (int64_t i = 0; i < n; ++i) static_cast<float*>(out.data)[i] = static_cast<const float*>(x.data)[i] + k->offset;
  return KD_STATUS_OK;
}

KernelSpec shift_spec(std::string backend, ShiftKernel* k, int32_t priority, std::vector<std::string> constraints) {
  KernelSpec spec;
  spec.op = "memo.shift";
  spec.backend = std::move(backend);
  Target cpu;
  cpu.device = DeviceType::cpu;
  spec.targets = {cpu};
  spec.dtypes = {Dtype::float32};
  spec.priority = priority;
  spec.description = "a kernel of the constraint tests";
  spec.function = shift_kernel;
  spec.function_data = k;
  spec.constraints = std::move(constraints);
  return spec;
}

const std::vector<std::string> kEvenConstraints = {"N % 2 == 0", "rows <= 4", "block >= 4 or wide"};
// The same without the attributes: then the shapes of a call decide its
// kernel, which the dispatcher keeps with the call's remembered signature.
const std::vector<std::string> kEvenShapeConstraints = {"N % 2 == 0", "rows <= 4"};

std::unique_ptr<Context> shift_context() {
  const nlohmann::json manifest = {
      {"kdispatch_manifest", "1.0"},
      {"plugin", "memo_ops"},
      {"backend", "memo_ops"},
      {"library", "libkdispatch-memo-ops.so"},
      {"abi", "1.0"},
      {"kernels", nlohmann::json::array()},
      {"ops",
       {{{"op", "memo.shift"},
         {"doc", "out = x + offset"},
         {"tensors",
          {{{"name", "out"}, {"shape", {"*", "N"}}, {"dtype", "float32"}, {"written", true}},
           {{"name", "x"}, {"shape", {"*", "N"}}, {"dtype", "float32"}}}},
         {"attrs",
          {{{"name", "block"}, {"type", "int"}, {"default", 4}},
           {{"name", "wide"}, {"type", "bool"}, {"default", false}}}}}}}};
  ManifestResult parsed = parse_manifest(manifest.dump(), "/nonexistent/memo_ops.json");
  REQUIRE_MESSAGE(parsed.manifest, (parsed.errors.empty() ? "" : parsed.errors[0].message));
  ContextOptions options;
  options.search.use_environment = false;
  options.search.use_default_path = false;
  options.selector = SelectorOptions{};
  auto context = std::make_unique<Context>(options);
  CHECK(context->add_manifest(*parsed.manifest).empty());
  return context;
}

// One call's tensors: random x, NaN-poisoned out.
struct ShiftCall {
  std::vector<float> out, x;
  std::vector<int64_t> shape;
  std::vector<DLTensor> tensors;
  ShiftCall(int64_t rows, int64_t n, unsigned seed) : out(static_cast<size_t>(rows * n)), x(out.size()), shape{rows, n} {
    std::mt19937 gen(seed);
    std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
    for (float& v : x) v = dist(gen);
    const DLDevice cpu{kDLCPU, 0};
    const DLDataType f32{kDLFloat, 32, 1};
    tensors = {DLTensor{out.data(), cpu, 2, f32, shape.data(), nullptr, 0},
               DLTensor{x.data(), cpu, 2, f32, shape.data(), nullptr, 0}};
  }
  // Calls `op` on poisoned output; true when it wrote x + offset.
  bool shifted_by(const OpHandle& op, std::span<const NamedAttr> attrs, float offset) {
    std::fill(out.begin(), out.end(), std::nanf(""));
    op(tensors, attrs);
    for (size_t i = 0; i < x.size(); ++i) {
      if (out[i] != x[i] + offset) return false;
    }
    return true;
  }
};

// memo.shift with two kernels, "even" (adds 1, priority 50, under
// `constraints`) and "any" (adds 2, priority 10), and a handle to the op.
struct EvenOrAny {
  std::unique_ptr<Context> context = shift_context();
  ShiftKernel even{1.0f};
  ShiftKernel any{2.0f};
  Dispatcher dispatch;
  OpHandle op;
  explicit EvenOrAny(const std::vector<std::string>& constraints)
      : dispatch(with_kernels(constraints)), op(dispatch.op("memo.shift")) {}

 private:
  // The context, once both kernels are registered (a handle needs them).
  Context& with_kernels(const std::vector<std::string>& constraints) {
    context->register_kernel(shift_spec("even", &even, 50, constraints));
    context->register_kernel(shift_spec("any", &any, 10, {}));
    return *context;
  }
};

}  // namespace

TEST_CASE("constraint: calls whose shapes and attributes change back and forth each run the kernel their values choose") {
  EvenOrAny shift(kEvenConstraints);
  auto& [context, even, any, dispatch, op] = shift;

  ShiftCall fits(2, 8, 1);    // every constraint holds
  ShiftCall odd(2, 5, 2);     // N odd
  ShiftCall tall(8, 8, 3);    // rows > 4
  ShiftCall other(3, 6, 4);   // holds, another N and rows
  const NamedAttr small_block[] = {{"block", int64_t{2}}};
  const NamedAttr small_wide[] = {{"block", int64_t{2}}, {"wide", true}};
  const NamedAttr large_block[] = {{"block", int64_t{16}}};
  struct Step {
    ShiftCall* call;
    std::span<const NamedAttr> attrs;
    bool even;
  };
  const std::vector<Step> steps = {
      {&fits, {}, true},         {&odd, {}, false},         {&fits, {}, true},          {&odd, {}, false},
      {&tall, {}, false},        {&fits, {}, true},         {&other, {}, true},         {&fits, small_block, false},
      {&fits, {}, true},         {&fits, small_wide, true}, {&fits, small_block, false}, {&fits, large_block, true},
      {&odd, large_block, false}, {&other, {}, true},       {&tall, {}, false},         {&other, small_block, false},
  };
  int expected_even = 0;
  int expected_any = 0;
  for (int round = 0; round < 3; ++round) {
    for (size_t i = 0; i < steps.size(); ++i) {
      const Step& s = steps[i];
      CAPTURE(round);
      CAPTURE(i);
      CHECK(s.call->shifted_by(op, s.attrs, s.even ? 1.0f : 2.0f));
      (s.even ? expected_even : expected_any) += 1;
      CHECK(even.calls == expected_even);
      CHECK(any.calls == expected_any);
      if (s.attrs.empty()) CHECK(op.resolve(s.call->tensors).spec().backend == (s.even ? "even" : "any"));
    }
  }
}

TEST_CASE("constraint: calls whose shapes change back and forth each run the kernel their shapes choose") {
  EvenOrAny shift(kEvenShapeConstraints);
  auto& [context, even, any, dispatch, op] = shift;
  ShiftCall fits(2, 8, 1);   // every constraint holds
  ShiftCall odd(2, 5, 2);    // N odd
  ShiftCall tall(8, 8, 3);   // rows > 4
  ShiftCall other(3, 6, 4);  // holds, another N and rows
  // Attributes the constraints do not read change nothing.
  const NamedAttr small_block[] = {{"block", int64_t{2}}};
  const std::vector<std::pair<ShiftCall*, bool>> steps = {{&fits, true},  {&odd, false}, {&fits, true},  {&tall, false},
                                                          {&other, true}, {&odd, false}, {&tall, false}, {&fits, true}};
  int expected_even = 0;
  int expected_any = 0;
  for (int round = 0; round < 3; ++round) {
    for (size_t i = 0; i < steps.size(); ++i) {
      CAPTURE(round);
      CAPTURE(i);
      const auto [call, fits_even] = steps[i];
      const float offset = fits_even ? 1.0f : 2.0f;
      CHECK(call->shifted_by(op, {}, offset));
      CHECK(call->shifted_by(op, small_block, offset));
      (fits_even ? expected_even : expected_any) += 2;
      CHECK(even.calls == expected_even);
      CHECK(any.calls == expected_any);
    }
  }
}

TEST_CASE("constraint: a registry change is seen by the next call of a repeated shape") {
  // With constraints that read an attribute, and with ones that read shapes only.
  for (const std::vector<std::string>& constraints : {kEvenConstraints, kEvenShapeConstraints}) {
    CAPTURE(constraints.size());
    EvenOrAny shift(constraints);
    auto& [context, even, any, dispatch, op] = shift;
    ShiftCall fits(2, 8, 5);
    ShiftCall six(2, 6, 6);
    for (int i = 0; i < 3; ++i) CHECK(fits.shifted_by(op, {}, 1.0f));

    // A preference, then none.
    context->set_preference("memo.shift", {"any"});
    for (int i = 0; i < 3; ++i) CHECK(fits.shifted_by(op, {}, 2.0f));
    context->set_preference("memo.shift", {});
    CHECK(fits.shifted_by(op, {}, 1.0f));

    // The constrained kernel withdrawn, then registered again with other
    // constraints: N = 8 no longer fits it, N = 6 does.
    context->unregister_kernel("memo.shift", "even");
    for (int i = 0; i < 2; ++i) CHECK(fits.shifted_by(op, {}, 2.0f));
    ShiftKernel thirds(3.0f);
    context->register_kernel(shift_spec("even", &thirds, 50, {"N % 3 == 0"}));
    for (int i = 0; i < 2; ++i) {
      CHECK(fits.shifted_by(op, {}, 2.0f));
      CHECK(six.shifted_by(op, {}, 3.0f));
    }
    CHECK(even.calls == 4);
    CHECK(thirds.calls == 2);
    CHECK(any.calls == 3 + 2 + 2);

    // No constrained kernel left: the plain cache takes over.
    context->unregister_kernel("memo.shift", "even");
    CHECK(six.shifted_by(op, {}, 2.0f));
    CHECK(thirds.calls == 2);
  }
}

TEST_CASE("constraint: threads calling a constrained op with alternating shapes each run the right kernel") {
  // With constraints that read an attribute, and with ones that read shapes only.
  for (const std::vector<std::string>& constraints : {kEvenConstraints, kEvenShapeConstraints}) {
    CAPTURE(constraints.size());
    EvenOrAny shift(constraints);
    auto& [context, even, any, dispatch, op] = shift;
    constexpr int kThreads = 4;
    constexpr int kCalls = 200;
    std::atomic<int> wrong{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        ShiftCall fits(2, 8, 10 + t);
        ShiftCall odd(2, 5 + 2 * t, 20 + t);
        ShiftCall tall(8, 4, 30 + t);
        for (int i = 0; i < kCalls; ++i) {
          const bool ok = (i % 3 == 0)   ? fits.shifted_by(shift.op, {}, 1.0f)
                          : (i % 3 == 1) ? odd.shifted_by(shift.op, {}, 2.0f)
                                         : tall.shifted_by(shift.op, {}, 2.0f);
          if (!ok) ++wrong;
        }
      });
    }
    for (auto& th : threads) th.join();
    CHECK(wrong == 0);
    const int fits_calls = kThreads * ((kCalls + 2) / 3);
    CHECK(even.calls == fits_calls);
    CHECK(any.calls == kThreads * kCalls - fits_calls);
  }
}
