// The checked call path over the real cpu plugin: bad arguments are KD-E030
// naming the argument and never reach a kernel (the poisoned output stays
// poisoned); plugins open lazily, on the first call; tracing; rotary on
// views into a fused QKV buffer.
#include <doctest/doctest.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <kdispatch/plugin_helpers.hpp>

#include "harness.hpp"
#include "kdispatch/context.hpp"
#include "kdispatch/dispatcher.hpp"

using namespace kdispatch;

namespace {

std::unique_ptr<Context> cpu_context() {
  ContextOptions options;
  options.search.replace = {KDISPATCH_PLUGIN_DIR};
  options.search.use_environment = false;
  // A GPU backend, where present, must not serve these calls; the
  // reference backend checks them.
  options.search.select = {"cpu", "reference"};
  return std::make_unique<Context>(options);
}

// True when the outputs in `got` (a call of an op that writes only its
// outputs) are what the op's reference backend writes for the same inputs,
// within the schema's tolerances.
bool matches_reference(Dispatcher& dispatch, std::string_view op, std::span<const DLTensor> got,
                       std::span<const NamedAttr> attrs = {}) {
  std::vector<std::vector<char>> storage;
  std::vector<DLTensor> want(got.begin(), got.end());
  for (DLTensor& t : want) {
    size_t bytes = t.dtype.bits / 8;
    for (int d = 0; d < t.ndim; ++d) bytes *= static_cast<size_t>(t.shape[d]);
    storage.emplace_back(static_cast<const char*>(t.data), static_cast<const char*>(t.data) + bytes);
    t.data = storage.back().data();
  }
  const OpHandle reference = dispatch.op(op, "reference");
  reference(want, attrs);
  const harness::Comparison c = harness::compare(reference.schema(), got, want);
  if (!c.ok) MESSAGE(op << ": " << c.first_mismatch);
  return c.ok;
}

// A float32 rmsnorm call [rows, h] with random inputs and a NaN-poisoned output.
struct RmsnormCall {
  int64_t rows = 3, h = 7;
  std::vector<float> out, x, weight;
  std::vector<int64_t> shape2{3, 7}, shape1{7};
  std::vector<DLTensor> tensors;

  RmsnormCall() : out(21, std::nanf("")), x(21), weight(7) {
    for (size_t i = 0; i < x.size(); ++i) x[i] = 0.25f * static_cast<float>(i % 5) - 0.6f;
    for (size_t i = 0; i < weight.size(); ++i) weight[i] = 1.0f + 0.1f * static_cast<float>(i);
    const DLDevice cpu{kDLCPU, 0};
    const DLDataType f32{kDLFloat, 32, 1};
    tensors = {DLTensor{out.data(), cpu, 2, f32, shape2.data(), nullptr, 0},
               DLTensor{x.data(), cpu, 2, f32, shape2.data(), nullptr, 0},
               DLTensor{weight.data(), cpu, 1, f32, shape1.data(), nullptr, 0}};
  }
  bool output_untouched() const {
    for (float v : out) {
      if (!std::isnan(v)) return false;
    }
    return true;
  }
};

// Calls and expects KD-E030 whose message contains every one of `parts`.
void expect_bad_call(const OpHandle& op, RmsnormCall& call, std::vector<std::string> parts,
                     std::span<const NamedAttr> attrs = {}) {
  try {
    op(call.tensors, attrs);
    FAIL("the call was accepted");
  } catch (const CallError& e) {
    CHECK(e.code() == ErrorCode::bad_arguments);
    for (const auto& p : parts) CHECK_MESSAGE(std::string(e.what()).find(p) != std::string::npos, e.what());
  }
  CHECK_MESSAGE(call.output_untouched(), "the kernel ran");
}

// embeddings.rotary_embedding as real models call it, on the cpu and
// reference backends: q and k as views into a fused QKV buffer (token rows
// strided, heads strided, in any order), partial rotary (2R < D, the tail of
// each head untouched), a float32 cache beside 16-bit q/k, int32 and int64
// positions, and key absent. Every value outside the rotated part of q and k
// keeps its bits.
constexpr DLDevice kCpu{kDLCPU, 0};

// One rotary call on a buffer holding [T, HQ + 2 * HK, D] values (q, k, v of
// each token), tokens `token_pad` values apart beyond that; or, with
// heads_outer, [HQ + 2 * HK, T, D] (heads stride past the tokens').
struct RotaryCase {
  int64_t tokens, hq, hk, d, r, p;
  bool bf16 = false;  // q/k bfloat16 (cache float32), else all float32
  bool positions32 = false;
  bool with_key = true;
  bool heads_outer = false;
  int64_t token_pad = 3;
  bool neox = true;
  // q and k passed flattened, [T, HQ*D] and [T, HK*D] with head_size D
  // (column slices of the fused buffer; needs heads at stride D).
  bool flattened = false;
};

double read(const std::vector<uint16_t>& b16, const std::vector<float>& f32, bool bf16, int64_t i) {
  return bf16 ? static_cast<double>(kd_plugin::to_float(kd_plugin::BFloat16{b16[static_cast<size_t>(i)]}))
              : static_cast<double>(f32[static_cast<size_t>(i)]);
}

void run_case(const OpHandle& op, const RotaryCase& c) {
  const int64_t heads = c.hq + 2 * c.hk;
  const int64_t token_stride = c.heads_outer ? c.d : heads * c.d + c.token_pad;
  const int64_t head_stride = c.heads_outer ? c.tokens * c.d + c.token_pad : c.d;
  const int64_t size = c.heads_outer ? heads * head_stride : c.tokens * token_stride;
  std::vector<float> f32(static_cast<size_t>(size));
  std::vector<uint16_t> b16(static_cast<size_t>(size));
  for (int64_t i = 0; i < size; ++i) {
    const float v = std::sin(0.37f * static_cast<float>(i)) * 2.0f;
    f32[static_cast<size_t>(i)] = v;
    b16[static_cast<size_t>(i)] = kd_plugin::from_float<kd_plugin::BFloat16>(v).bits;
  }
  const std::vector<float> f32_before = f32;
  const std::vector<uint16_t> b16_before = b16;
  std::vector<float> cache(static_cast<size_t>(c.p * 2 * c.r));
  for (int64_t pos = 0; pos < c.p; ++pos) {
    for (int64_t j = 0; j < c.r; ++j) {
      const double freq = std::pow(10000.0, -static_cast<double>(j) / static_cast<double>(c.r));
      const double angle = static_cast<double>(pos) * freq;
      cache[static_cast<size_t>(pos * 2 * c.r + j)] = static_cast<float>(std::cos(angle));
      cache[static_cast<size_t>(pos * 2 * c.r + c.r + j)] = static_cast<float>(std::sin(angle));
    }
  }
  std::vector<int64_t> pos64(static_cast<size_t>(c.tokens));
  std::vector<int32_t> pos32(static_cast<size_t>(c.tokens));
  for (int64_t t = 0; t < c.tokens; ++t) {
    pos64[static_cast<size_t>(t)] = (t * 7 + 3) % c.p;
    pos32[static_cast<size_t>(t)] = static_cast<int32_t>((t * 7 + 3) % c.p);
  }
  void* base = c.bf16 ? static_cast<void*>(b16.data()) : static_cast<void*>(f32.data());
  const DLDataType dtype = c.bf16 ? DLDataType{kDLBfloat, 16, 1} : DLDataType{kDLFloat, 32, 1};
  const uint64_t elem = c.bf16 ? 2 : 4;
  std::vector<int64_t> pshape{c.tokens}, qshape{c.tokens, c.hq, c.d}, kshape{c.tokens, c.hk, c.d}, cshape{c.p, 2 * c.r},
      qkstrides{token_stride, head_stride, 1};
  if (c.flattened) {
    REQUIRE(head_stride == c.d);
    qshape = {c.tokens, c.hq * c.d};
    kshape = {c.tokens, c.hk * c.d};
    qkstrides = {token_stride, 1};
  }
  const auto rank = static_cast<int32_t>(qshape.size());
  std::vector<DLTensor> tensors{
      DLTensor{c.positions32 ? static_cast<void*>(pos32.data()) : static_cast<void*>(pos64.data()), kCpu, 1,
               DLDataType{kDLInt, static_cast<uint8_t>(c.positions32 ? 32 : 64), 1}, pshape.data(), nullptr, 0},
      DLTensor{base, kCpu, rank, dtype, qshape.data(), qkstrides.data(), 0},
      DLTensor{base, kCpu, rank, dtype, kshape.data(), qkstrides.data(),
               static_cast<uint64_t>(c.hq * head_stride) * elem},
      DLTensor{cache.data(), kCpu, 2, DLDataType{kDLFloat, 32, 1}, cshape.data(), nullptr, 0}};
  if (!c.with_key) tensors[2] = DLTensor{nullptr, kCpu, 0, DLDataType{0, 0, 0}, nullptr, nullptr, 0};
  op(tensors, std::vector<NamedAttr>{{"is_neox", c.neox}, {"head_size", c.flattened ? c.d : int64_t{0}}});
  // The caller's tensors are as they were given: the split is the core's own copy.
  CHECK(tensors[1].ndim == rank);
  CHECK(tensors[1].shape == qshape.data());

  const std::string what = std::string(op.backend()) + (c.bf16 ? " bf16" : " f32") + (c.neox ? " neox" : " gptj") +
                           " T=" + std::to_string(c.tokens) + " HQ=" + std::to_string(c.hq) +
                           " HK=" + std::to_string(c.hk) + " D=" + std::to_string(c.d) + " R=" + std::to_string(c.r) +
                           (c.with_key ? "" : " no key") + (c.heads_outer ? " heads outer" : "") +
                           (c.positions32 ? " int32" : " int64") + (c.flattened ? " flattened" : "");
  INFO(what);
  std::vector<bool> rotated(static_cast<size_t>(size), false);
  const double tol = c.bf16 ? 1.0 / 128 : 1e-5;
  int bad = 0;
  for (int64_t t = 0; t < c.tokens; ++t) {
    const int64_t pos = pos64[static_cast<size_t>(t)];
    for (int64_t h = 0; h < c.hq + (c.with_key ? c.hk : 0); ++h) {
      const int64_t head = t * token_stride + h * head_stride;
      for (int64_t j = 0; j < c.r; ++j) {
        const int64_t ia = head + (c.neox ? j : 2 * j);
        const int64_t ib = head + (c.neox ? j + c.r : 2 * j + 1);
        const double cs = cache[static_cast<size_t>(pos * 2 * c.r + j)];
        const double sn = cache[static_cast<size_t>(pos * 2 * c.r + c.r + j)];
        const double a = read(b16_before, f32_before, c.bf16, ia);
        const double b = read(b16_before, f32_before, c.bf16, ib);
        const double wa = a * cs - b * sn;
        const double wb = b * cs + a * sn;
        const double ga = read(b16, f32, c.bf16, ia);
        const double gb = read(b16, f32, c.bf16, ib);
        if (std::fabs(ga - wa) > tol * (1 + std::fabs(wa)) || std::fabs(gb - wb) > tol * (1 + std::fabs(wb))) ++bad;
        rotated[static_cast<size_t>(ia)] = rotated[static_cast<size_t>(ib)] = true;
      }
    }
  }
  CHECK(bad == 0);
  int64_t changed = 0;
  for (int64_t i = 0; i < size; ++i) {
    if (rotated[static_cast<size_t>(i)]) continue;
    const bool same = c.bf16 ? b16[static_cast<size_t>(i)] == b16_before[static_cast<size_t>(i)]
                             : std::memcmp(&f32[static_cast<size_t>(i)], &f32_before[static_cast<size_t>(i)], 4) == 0;
    if (!same) ++changed;
  }
  CHECK(changed == 0);  // head tails, v, an absent key's heads, the padding
}

}  // namespace

TEST_CASE("dispatch: a good call runs the cpu kernel and opens its plugin on first use only") {
  auto ctx = cpu_context();
  Dispatcher dispatch(*ctx);
  const OpHandle op = dispatch.op("layernorm.rmsnorm");
  CHECK_FALSE(ctx->load_state("cpu").has_value());  // resolving the op opens nothing
  RmsnormCall call;
  op(call.tensors, std::vector<NamedAttr>{{"eps", 1e-5}});
  REQUIRE(ctx->load_state("cpu").has_value());
  CHECK(ctx->load_state("cpu")->binary != nullptr);
  const std::vector<NamedAttr> eps{{"eps", 1e-5}};
  CHECK(matches_reference(dispatch, "layernorm.rmsnorm", call.tensors, eps));
  // The unchecked handle runs the same kernel.
  const KernelHandle kernel = op.resolve(call.tensors);
  CHECK(kernel.spec().backend == "cpu");
  std::array<kd_attr, kMaxSchemaAttrs> storage;
  call.out.assign(call.out.size(), 0.0f);
  kernel(call.tensors, op.pack_attrs(eps, storage));
  CHECK(matches_reference(dispatch, "layernorm.rmsnorm", call.tensors, eps));
}

TEST_CASE("dispatch: a repeated call with an attribute runs with the value given, not the last one or the default") {
  auto ctx = cpu_context();
  Dispatcher dispatch(*ctx);
  const OpHandle op = dispatch.op("layernorm.rmsnorm");
  RmsnormCall call;
  double sum = 0;
  for (int64_t j = 0; j < call.h; ++j) sum += double(call.x[j]) * call.x[j];
  // The first call runs the compiled plan; the later ones take the
  // remembered signature and the cached kernel.
  for (const double eps : {1e-5, 4.0, 4.0, 0.5, 1e-6}) {
    call.out.assign(call.out.size(), std::nanf(""));
    op(call.tensors, std::vector<NamedAttr>{{"eps", eps}});
    const double inv = 1.0 / std::sqrt(sum / double(call.h) + eps);
    CHECK(call.out[2] == doctest::Approx(call.x[2] * inv * call.weight[2]).epsilon(1e-5));
  }
}

TEST_CASE("dispatch: attributes by name are packed in schema order, defaults filled in, whatever the name's length") {
  auto ctx = cpu_context();
  // An op of every attribute type, with names of each length class (up to
  // 3, 4 to 7, 8 to 16 characters, and longer ones alike at both ends).
  OpSchema schema;
  schema.op = "test.attrs";
  TensorArg x;
  x.name = "x";
  x.shape = {ShapeToken{ShapeToken::Kind::symbol, "N", 0}};
  x.dtype = "float32";
  schema.tensors = {x};
  schema.attrs = {AttrArg{"k", AttrType::int_, std::nullopt, ""},
                  AttrArg{"eps", AttrType::float_, AttrValue(1e-6), ""},
                  AttrArg{"mode", AttrType::string, AttrValue(std::string("fast")), ""},
                  AttrArg{"renormalize", AttrType::bool_, AttrValue(false), ""},
                  AttrArg{"attribute_one_of_many", AttrType::float_, AttrValue(1.0), ""},
                  AttrArg{"attribute_two_of_many", AttrType::float_, AttrValue(2.0), ""}};
  ctx->registry().add_schema(schema);
  KernelSpec spec;
  spec.op = "test.attrs";
  spec.backend = spec.plugin = "test_attrs";
  spec.symbol = "kd_test_attrs";
  ctx->registry().add(spec);
  Dispatcher dispatch(*ctx);
  const OpHandle op = dispatch.op("test.attrs");
  std::array<kd_attr, kMaxSchemaAttrs> storage;
  // A packed string attribute points into the NamedAttr it came from, so the
  // attributes outlive what pack returns.
  std::vector<NamedAttr> attrs;
  const auto pack = [&](std::vector<NamedAttr> given) {
    attrs = std::move(given);
    const std::span<const kd_attr> packed = op.pack_attrs(attrs, storage);
    REQUIRE(packed.size() == 6);
    for (size_t i = 0; i < packed.size(); ++i) CHECK(std::string(packed[i].name) == schema.attrs[i].name);
    CHECK(packed[0].type == KD_ATTR_TYPE_INT);
    CHECK(packed[1].type == KD_ATTR_TYPE_FLOAT);
    CHECK(packed[2].type == KD_ATTR_TYPE_STRING);
    CHECK(packed[3].type == KD_ATTR_TYPE_BOOL);
    return std::vector<kd_attr>(packed.begin(), packed.end());
  };

  SUBCASE("the required one alone") {
    const auto a = pack({{"k", int64_t{3}}});
    CHECK(a[0].value.i == 3);
    CHECK(a[1].value.f == 1e-6);
    CHECK(std::string(a[2].value.s) == "fast");
    CHECK(a[3].value.b == 0);
    CHECK(a[4].value.f == 1.0);
    CHECK(a[5].value.f == 2.0);
  }
  SUBCASE("all of them, in reverse order") {
    const auto a = pack({{"attribute_two_of_many", 20.0},
                         {"attribute_one_of_many", 10.0},
                         {"renormalize", true},
                         {"mode", std::string("exact")},
                         {"eps", 1e-5},
                         {"k", int64_t{8}}});
    CHECK(a[0].value.i == 8);
    CHECK(a[1].value.f == 1e-5);
    CHECK(std::string(a[2].value.s) == "exact");
    CHECK(a[3].value.b == 1);
    CHECK(a[4].value.f == 10.0);
    CHECK(a[5].value.f == 20.0);
  }
  SUBCASE("an int for a float attribute is converted") {
    const auto a = pack({{"k", int64_t{1}}, {"eps", int64_t{2}}});
    CHECK(a[1].value.f == 2.0);
  }
  const auto expect_error = [&](std::vector<NamedAttr> given, const std::string& part) {
    try {
      op.pack_attrs(given, storage);
      FAIL("the attributes were accepted");
    } catch (const CallError& e) {
      CHECK(e.code() == ErrorCode::bad_arguments);
      CHECK_MESSAGE(std::string(e.what()).find(part) != std::string::npos, e.what());
    }
  };
  SUBCASE("errors") {
    expect_error({}, "op 'test.attrs': attribute 'k' (int) is required");
    expect_error({{"eps", 1e-5}}, "op 'test.attrs': attribute 'k' (int) is required");
    expect_error({{"k", int64_t{1}}, {"k", int64_t{2}}}, "op 'test.attrs' has no attribute 'k'");
    // As long as two known names, alike at both ends.
    expect_error({{"k", int64_t{1}}, {"attribute_xyz_of_many", 1.0}},
                 "op 'test.attrs' has no attribute 'attribute_xyz_of_many' (attributes: [k, eps, mode, renormalize, "
                 "attribute_one_of_many, attribute_two_of_many])");
    expect_error({{"k", int64_t{1}}, {"eps_", 1.0}}, "has no attribute 'eps_'");
    expect_error({{"k", int64_t{1}}, {"eqs", 1.0}}, "has no attribute 'eqs'");
    expect_error({{"k", 1.5}}, "op 'test.attrs', attribute 'k': expected int, got float");
    expect_error({{"k", int64_t{1}}, {"renormalize", int64_t{1}}},
                 "op 'test.attrs', attribute 'renormalize': expected bool, got int");
    expect_error({{"k", int64_t{1}}, {"mode", true}}, "op 'test.attrs', attribute 'mode': expected string, got a number or bool");
  }
}

// Every bad call, either on a fresh op or after an accepted call of the same
// shapes (which the check remembers: a bad call must not pass for it).
void bad_argument_cases(const OpHandle& op) {
  SUBCASE("wrong arity") {
    RmsnormCall call;
    call.tensors.pop_back();
    expect_bad_call(op, call, {"takes 3 tensors (out, x, weight), got 2"});
  }
  SUBCASE("wrong dtype") {
    RmsnormCall call;
    call.tensors[2].dtype = DLDataType{kDLFloat, 16, 1};
    expect_bad_call(op, call, {"argument 2 'weight'", "expected dtype T = float32 (as 'out') or float32, got float16"});
  }
  SUBCASE("unsupported dtype") {
    RmsnormCall call;
    for (auto& t : call.tensors) t.dtype = DLDataType{kDLFloat, 64, 1};
    expect_bad_call(op, call, {"'out'", "expected dtype T in [float32, float16, bfloat16], got float64"});
  }
  SUBCASE("an 8-bit float where the schema allows none") {
    RmsnormCall call;
    for (auto& t : call.tensors) t.dtype = to_dlpack(Dtype::float8_e4m3fn);
    expect_bad_call(op, call, {"'out'", "expected dtype T in [float32, float16, bfloat16], got float8_e4m3fn"});
  }
  SUBCASE("an 8-bit float weight beside float32") {
    RmsnormCall call;
    call.tensors[2].dtype = to_dlpack(Dtype::float8_e5m2);
    expect_bad_call(op, call, {"argument 2 'weight'", "got float8_e5m2"});
  }
  SUBCASE("a DLPack 1.1 8-bit float kdispatch does not handle (float8_e4m3fnuz, code 11)") {
    RmsnormCall call;
    for (auto& t : call.tensors) t.dtype = DLDataType{11, 8, 1};
    expect_bad_call(op, call,
                    {"'out'", "got a DLPack 1.1 8-, 6- or 4-bit float kdispatch does not handle (code 11, 8 bits, "
                              "1 lanes)"});
  }
  SUBCASE("mismatched shapes") {
    RmsnormCall call;
    call.shape1[0] = 8;
    expect_bad_call(op, call, {"'weight'", "dim 0 is H = 7 (from 'out'), got 8"});
  }
  SUBCASE("mismatched leading dims") {
    RmsnormCall call;
    std::vector<int64_t> other{1, 21};
    call.tensors[1].shape = other.data();
    call.tensors[1].ndim = 2;
    expect_bad_call(op, call, {"'x'"});
  }
  SUBCASE("wrong rank") {
    RmsnormCall call;
    call.tensors[2].ndim = 2;
    call.tensors[2].shape = call.shape2.data();
    expect_bad_call(op, call, {"'weight'", "expected shape [H] (1 dims), got [3, 7]"});
  }
  SUBCASE("mixed devices") {
    RmsnormCall call;
    call.tensors[1].device = DLDevice{kDLCUDA, 0};
    expect_bad_call(op, call, {"'x'", "is on cuda:0, but 'out' is on cpu:0"});
  }
  SUBCASE("null data") {
    RmsnormCall call;
    call.tensors[1].data = nullptr;
    expect_bad_call(op, call, {"'x'", "null data"});
  }
  SUBCASE("non-contiguous") {
    RmsnormCall call;
    std::vector<int64_t> strides{1, 3};  // column-major: rows need a contiguous last dim
    call.tensors[1].strides = strides.data();
    expect_bad_call(op, call, {"'x'", "must have a contiguous last dim", "got strides [1, 3] for shape [3, 7]"});
  }
  SUBCASE("unknown attribute") {
    RmsnormCall call;
    const NamedAttr attrs[] = {{"epsilon", 1e-5}};
    expect_bad_call(op, call, {"has no attribute 'epsilon' (attributes: [eps])"}, attrs);
  }
  SUBCASE("mistyped attribute") {
    RmsnormCall call;
    const NamedAttr attrs[] = {{"eps", std::string("small")}};
    expect_bad_call(op, call, {"attribute 'eps': expected float, got string"}, attrs);
  }
}

TEST_CASE("dispatch: bad arguments are KD-E030 naming the argument, and never reach the kernel") {
  auto ctx = cpu_context();
  Dispatcher dispatch(*ctx);
  bad_argument_cases(dispatch.op("layernorm.rmsnorm"));
}

TEST_CASE("dispatch: bad arguments after an accepted call of the same shapes are still KD-E030") {
  auto ctx = cpu_context();
  Dispatcher dispatch(*ctx);
  const OpHandle op = dispatch.op("layernorm.rmsnorm");
  RmsnormCall good;
  op(good.tensors);
  op(good.tensors);  // the second one takes the remembered signature
  CHECK_FALSE(good.output_untouched());
  bad_argument_cases(op);
}

TEST_CASE("dispatch: a tensor with no element is contiguous whatever its strides, as torch lays it out") {
  auto ctx = cpu_context();
  Dispatcher dispatch(*ctx);
  const OpHandle op = dispatch.op("layernorm.rmsnorm");
  // torch gives a [2, 0, 7] tensor the strides [7, 7, 1] and a [3, 0] one
  // [1, 1]: what a dense layout would have if each zero dim were 1.
  std::vector<int64_t> shape3{2, 0, 7}, strides3{7, 7, 1}, shape1{7};
  std::vector<float> weight(7, 1.0f);
  float none = std::nanf("");
  const DLDevice cpu{kDLCPU, 0};
  const DLDataType f32{kDLFloat, 32, 1};
  std::vector<DLTensor> empty_rows{DLTensor{&none, cpu, 3, f32, shape3.data(), strides3.data(), 0},
                                   DLTensor{&none, cpu, 3, f32, shape3.data(), strides3.data(), 0},
                                   DLTensor{weight.data(), cpu, 1, f32, shape1.data(), nullptr, 0}};
  CHECK_NOTHROW(op(empty_rows));
  CHECK(std::isnan(none));  // nothing was written
  CHECK_NOTHROW(op.check(empty_rows, OpHandle::CheckScope::call));
  // A tensor with elements and the same kind of strides is still refused.
  std::vector<int64_t> shape_full{2, 1, 7}, strides_bad{14, 7, 2};
  std::vector<float> data(2 * 7 * 2, 0.5f);
  std::vector<DLTensor> strided{DLTensor{data.data(), cpu, 3, f32, shape_full.data(), strides_bad.data(), 0},
                                DLTensor{data.data(), cpu, 3, f32, shape_full.data(), nullptr, 0},
                                DLTensor{weight.data(), cpu, 1, f32, shape1.data(), nullptr, 0}};
  CHECK_THROWS_AS(op(strided), CallError);
}

TEST_CASE("dispatch: calls alternating between shapes each get their own result") {
  auto ctx = cpu_context();
  Dispatcher dispatch(*ctx);
  const OpHandle op = dispatch.op("layernorm.rmsnorm");
  RmsnormCall small;
  RmsnormCall large;
  large.h = 9;
  large.shape2 = {2, 9};
  large.shape1 = {9};
  large.out.assign(18, std::nanf(""));
  large.x.resize(18);
  for (size_t i = 0; i < large.x.size(); ++i) large.x[i] = 0.1f * static_cast<float>(i) - 0.7f;
  large.weight.assign(9, 1.5f);
  large.tensors[0].data = large.out.data();
  large.tensors[1].data = large.x.data();
  large.tensors[2].data = large.weight.data();
  for (int round = 0; round < 3; ++round) {
    for (RmsnormCall* call : {&small, &large}) {
      call->out.assign(call->out.size(), std::nanf(""));
      op(call->tensors);
      CHECK(matches_reference(dispatch, "layernorm.rmsnorm", call->tensors));
    }
  }
}

TEST_CASE("dispatch: threads calling one op with different shapes (the remembered signature is shared)") {
  auto ctx = cpu_context();
  Dispatcher dispatch(*ctx);
  const OpHandle op = dispatch.op("layernorm.rmsnorm");
  constexpr int kThreads = 4;
  std::vector<std::thread> threads;
  std::atomic<int> wrong{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const int64_t rows = 1 + t, h = 5 + 2 * t;
      std::vector<float> out(static_cast<size_t>(rows * h)), x(out.size()), weight(static_cast<size_t>(h), 1.0f);
      for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>((i * 7 + static_cast<size_t>(t)) % 11) - 5.0f;
      std::vector<int64_t> shape2{rows, h}, shape1{h};
      const DLDevice cpu{kDLCPU, 0};
      const DLDataType f32{kDLFloat, 32, 1};
      std::vector<DLTensor> tensors{DLTensor{out.data(), cpu, 2, f32, shape2.data(), nullptr, 0},
                                    DLTensor{x.data(), cpu, 2, f32, shape2.data(), nullptr, 0},
                                    DLTensor{weight.data(), cpu, 1, f32, shape1.data(), nullptr, 0}};
      std::vector<DLTensor> bad = tensors;
      bad[2].shape = &shape2[0];  // weight of size rows, not h
      op(tensors);
      if (!matches_reference(dispatch, "layernorm.rmsnorm", tensors)) ++wrong;
      const std::vector<float> want = out;
      for (int i = 0; i < 300; ++i) {
        out.assign(out.size(), std::nanf(""));
        op(tensors);
        if (out != want) ++wrong;
        try {
          op(bad);
          ++wrong;  // accepted a weight of the wrong size
        } catch (const CallError&) {
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  CHECK(wrong.load() == 0);
}

TEST_CASE("dispatch: unknown ops and devices") {
  auto ctx = cpu_context();
  Dispatcher dispatch(*ctx);
  CHECK_THROWS_WITH_AS(dispatch.op("layernorm.rmsnrom"), "No kernels registered for op 'layernorm.rmsnrom'",
                       SelectionError);
  RmsnormCall call;
  for (auto& t : call.tensors) t.device = DLDevice{kDLCUDA, 0};
  // Valid arguments on a device no registered backend can use: KD-E003.
  try {
    dispatch.op("layernorm.rmsnorm")(call.tensors);
    FAIL("accepted");
  } catch (const SelectionError& e) {
    CHECK(e.code() == ErrorCode::no_usable_backend);
  }
}

TEST_CASE("dispatch: a kernel failure is KD-E040 with the plugin's message") {
  auto ctx = cpu_context();
  Dispatcher dispatch(*ctx);
  std::vector<int64_t> positions{0, 99};  // 99 is outside the cache of 5 positions
  std::vector<float> q(2 * 1 * 2, 1.0f), k(2 * 1 * 2, 1.0f), cache(5 * 2, 0.5f);
  std::vector<int64_t> ps{2}, qs{2, 1, 2}, cs{5, 2};
  const DLDevice cpu{kDLCPU, 0};
  const DLDataType f32{kDLFloat, 32, 1};
  std::vector<DLTensor> tensors{DLTensor{positions.data(), cpu, 1, {kDLInt, 64, 1}, ps.data(), nullptr, 0},
                                DLTensor{q.data(), cpu, 3, f32, qs.data(), nullptr, 0},
                                DLTensor{k.data(), cpu, 3, f32, qs.data(), nullptr, 0},
                                DLTensor{cache.data(), cpu, 2, f32, cs.data(), nullptr, 0}};
  try {
    dispatch.op("embeddings.rotary_embedding")(tensors);
    FAIL("accepted");
  } catch (const KernelError& e) {
    CHECK(e.code() == ErrorCode::kernel_failed);
    CHECK(std::string(e.what()).find("kernel 'kd_cpu_rotary_embedding' of backend 'cpu' failed") == 0);
    CHECK(std::string(e.what()).find("99") != std::string::npos);
  }
}

TEST_CASE(
    "dispatch: rotary with q and k as views into a fused QKV buffer, partial rotary, float32 cache, optional key") {
  auto ctx = cpu_context();
  Dispatcher dispatch(*ctx);
  for (const char* backend : {"cpu", "reference"}) {
    const OpHandle op = dispatch.op("embeddings.rotary_embedding", backend);
    for (const bool neox : {true, false}) {
      for (const bool bf16 : {false, true}) {
        run_case(op, {.tokens = 5, .hq = 4, .hk = 2, .d = 128, .r = 32, .p = 40, .bf16 = bf16, .neox = neox});
        run_case(
            op,
            {.tokens = 3, .hq = 3, .hk = 1, .d = 19, .r = 7, .p = 11, .bf16 = bf16, .positions32 = true, .neox = neox});
        run_case(
            op,
            {.tokens = 4, .hq = 2, .hk = 2, .d = 64, .r = 32, .p = 9, .bf16 = bf16, .with_key = false, .neox = neox});
        run_case(op, {.tokens = 6,
                      .hq = 3,
                      .hk = 2,
                      .d = 24,
                      .r = 8,
                      .p = 13,
                      .bf16 = bf16,
                      .positions32 = true,
                      .heads_outer = true,
                      .neox = neox});
        run_case(op,
                 {.tokens = 1, .hq = 1, .hk = 1, .d = 2, .r = 1, .p = 2, .bf16 = bf16, .token_pad = 0, .neox = neox});
        // Flattened, as SGLang, FlashInfer and vLLM pass them: column slices
        // [T, H*D] of the fused buffer with head_size D.
        run_case(op, {.tokens = 5, .hq = 4, .hk = 2, .d = 128, .r = 32, .p = 40, .bf16 = bf16, .neox = neox,
                      .flattened = true});
        run_case(op, {.tokens = 7, .hq = 3, .hk = 1, .d = 19, .r = 7, .p = 11, .bf16 = bf16, .positions32 = true,
                      .token_pad = 5, .neox = neox, .flattened = true});
        run_case(op, {.tokens = 4, .hq = 2, .hk = 2, .d = 64, .r = 32, .p = 9, .bf16 = bf16, .with_key = false,
                      .neox = neox, .flattened = true});
        run_case(op, {.tokens = 1, .hq = 1, .hk = 1, .d = 2, .r = 1, .p = 2, .bf16 = bf16, .token_pad = 0,
                      .neox = neox, .flattened = true});
      }
    }
  }
}

namespace {

// A float32 rotary call on random values: positions [T], query and key
// given as `qshape` / `kshape` with `qstrides` (empty: dense), a cache
// [P, 2R]. Keeps the tensors' storage.
struct FlatRotary {
  int64_t tokens = 3, hq = 3, hk = 2, d = 8, r = 2, p = 7;
  std::vector<int64_t> positions, pshape, qshape, kshape, cshape, qstrides, kstrides;
  std::vector<float> q, k, cache;

  FlatRotary() {
    positions = {4, 0, 6};
    pshape = {tokens};
    cshape = {p, 2 * r};
    q.resize(static_cast<size_t>(tokens * hq * d));
    k.resize(static_cast<size_t>(tokens * hk * d));
    cache.resize(static_cast<size_t>(p * 2 * r));
    uint64_t state = 12345;
    const auto next = [&] {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      return static_cast<float>(static_cast<double>(state >> 11) / 9007199254740992.0 * 4.0 - 2.0);
    };
    for (float& v : q) v = next();
    for (float& v : k) v = next();
    for (float& v : cache) v = next();
    flat();
  }
  void flat() {
    qshape = {tokens, hq * d};
    kshape = {tokens, hk * d};
  }
  void plain() {
    qshape = {tokens, hq, d};
    kshape = {tokens, hk, d};
  }
  std::vector<DLTensor> tensors() {
    const DLDataType f32{kDLFloat, 32, 1};
    return {DLTensor{positions.data(), kCpu, 1, {kDLInt, 64, 1}, pshape.data(), nullptr, 0},
            DLTensor{q.data(), kCpu, static_cast<int32_t>(qshape.size()), f32, qshape.data(),
                     qstrides.empty() ? nullptr : qstrides.data(), 0},
            DLTensor{k.data(), kCpu, static_cast<int32_t>(kshape.size()), f32, kshape.data(),
                     kstrides.empty() ? nullptr : kstrides.data(), 0},
            DLTensor{cache.data(), kCpu, 2, f32, cshape.data(), nullptr, 0}};
  }
};

// The KD-E030 words of a refused call, and that the kernel did not run.
std::string rotary_refusal(const OpHandle& op, FlatRotary& call, int64_t head_size) {
  const std::vector<float> q = call.q;
  const std::vector<float> k = call.k;
  std::vector<DLTensor> tensors = call.tensors();
  try {
    op(tensors, std::vector<NamedAttr>{{"head_size", head_size}});
  } catch (const CallError& e) {
    CHECK(e.code() == ErrorCode::bad_arguments);
    CHECK(std::memcmp(q.data(), call.q.data(), q.size() * 4) == 0);
    CHECK(std::memcmp(k.data(), call.k.data(), k.size() * 4) == 0);
    return e.message();
  }
  FAIL("accepted");
  return {};
}

}  // namespace

TEST_CASE("dispatch: rotary flattened [T, H*D] with head_size gives the results of [T, H, D]") {
  auto ctx = cpu_context();
  Dispatcher dispatch(*ctx);
  for (const char* backend : {"cpu", "reference"}) {
    const OpHandle op = dispatch.op("embeddings.rotary_embedding", backend);
    for (const bool neox : {true, false}) {
      FlatRotary flat;
      FlatRotary plain;
      FlatRotary plain_sized;  // [T, H, D] with head_size D: the same call
      plain.plain();
      plain_sized.plain();
      std::vector<DLTensor> a = flat.tensors();
      std::vector<DLTensor> b = plain.tensors();
      std::vector<DLTensor> c = plain_sized.tensors();
      op(a, std::vector<NamedAttr>{{"is_neox", neox}, {"head_size", flat.d}});
      op(b, std::vector<NamedAttr>{{"is_neox", neox}});
      op(c, std::vector<NamedAttr>{{"head_size", plain.d}, {"is_neox", neox}});
      INFO(backend << (neox ? " neox" : " gptj"));
      CHECK(flat.q != FlatRotary().q);  // rotated
      CHECK(std::memcmp(flat.q.data(), plain.q.data(), flat.q.size() * 4) == 0);
      CHECK(std::memcmp(flat.k.data(), plain.k.data(), flat.k.size() * 4) == 0);
      CHECK(std::memcmp(plain_sized.q.data(), plain.q.data(), flat.q.size() * 4) == 0);
      CHECK(std::memcmp(plain_sized.k.data(), plain.k.data(), flat.k.size() * 4) == 0);
      // The same split call again takes the remembered signature.
      FlatRotary again;
      std::vector<DLTensor> d = again.tensors();
      op(d, std::vector<NamedAttr>{{"is_neox", neox}, {"head_size", flat.d}});
      CHECK(again.q == flat.q);
    }
  }
}

TEST_CASE("dispatch: bad flattened rotary calls are KD-E030 naming the argument and the numbers") {
  auto ctx = cpu_context();
  Dispatcher dispatch(*ctx);
  const OpHandle op = dispatch.op("embeddings.rotary_embedding", "cpu");
  FlatRotary call;
  const auto has = [](const std::string& message, const std::string& part) {
    CHECK_MESSAGE(message.find(part) != std::string::npos, message << "\n  lacks: " << part);
  };
  // A negative head_size.
  has(rotary_refusal(op, call, -8), "op 'embeddings.rotary_embedding', attribute 'head_size': must be >= 0");
  has(rotary_refusal(op, call, -8), "got -8");
  // A flattened last dim that head_size does not divide: 24 and 5.
  std::string m = rotary_refusal(op, call, 5);
  has(m, "argument 1 'query': is given flattened, shape [3, 24]: its last dim 24 must be a multiple of head_size = 5");
  // Divides query's 24 but not key's 16.
  m = rotary_refusal(op, call, 12);
  has(m, "argument 2 'key': is given flattened, shape [3, 16]: its last dim 16 must be a multiple of head_size = 12");
  // [T, H, D] with a head_size other than D.
  call.plain();
  m = rotary_refusal(op, call, 4);
  has(m, "argument 1 'query': has the shape [3, 3, 8] of its pattern [*, HQ, D], so its last dim must be head_size "
         "= 4, got 8");
  // Splits into heads of 2, narrower than the cache's 2*R = 4.
  call.flat();
  m = rotary_refusal(op, call, 2);
  has(m, "the call breaks the schema's requirement 2*R <= D: R = 2 (from 'cos_sin_cache'), D = 2 (from 'query')");
  has(m, "(given flattened: 'query' [3, 24] split by head_size = 2 into [3, 12, 2]; 'key' [3, 16] split by "
         "head_size = 2 into [3, 8, 2])");
  // A rank that is neither form.
  call.qshape = {3, 1, 3, 8};
  m = rotary_refusal(op, call, 8);
  has(m, "argument 1 'query': with head_size = 8, expected [*, HQ*D] (flattened) or [*, HQ, D], * being the 1 "
         "leading dims of 'positions' [3], got shape [3, 1, 3, 8]");
  // Values not contiguous: the split keeps the last dim's stride.
  call.flat();
  call.q.resize(call.q.size() * 2);
  call.qshape = {3, 24};
  call.qstrides = {48, 2};
  m = rotary_refusal(op, call, 8);
  has(m, "argument 1 'query': must have a contiguous last dim");
  has(m, "got strides [48, 16, 2] for shape [3, 3, 8] (given flattened: 'query' [3, 24] split by head_size = 8 into "
         "[3, 3, 8]; 'key' [3, 16] split by head_size = 8 into [3, 2, 8])");
  // Flattened without head_size, with other attributes or none.
  call.q.resize(call.q.size() / 2);
  call.qstrides.clear();
  for (const bool with_attrs : {true, false}) {
    std::vector<DLTensor> given = call.tensors();
    try {
      if (with_attrs) {
        op(given, std::vector<NamedAttr>{{"is_neox", false}});
      } else {
        op(given);
      }
      FAIL("accepted");
    } catch (const CallError& e) {
      has(e.message(), "argument 1 'query'");
      has(e.message(), "('query' [3, 24] has one dim less than its pattern [*, HQ, D]: given flattened, it needs "
                       "head_size; 'key' [3, 16] has one dim less than its pattern [*, HK, D]: given flattened, it "
                       "needs head_size)");
    }
  }
  // head_size is an int.
  std::vector<DLTensor> tensors = call.tensors();
  CHECK_THROWS_WITH_AS(op(tensors, std::vector<NamedAttr>{{"head_size", 8.0}}),
                       doctest::Contains("attribute 'head_size': expected int, got float"), CallError);
}

TEST_CASE("dispatch: OpHandle::check with attributes sees flattened tensors as a call does") {
  auto ctx = cpu_context();
  Dispatcher dispatch(*ctx);
  const OpHandle op = dispatch.op("embeddings.rotary_embedding");
  FlatRotary call;
  const std::vector<DLTensor> tensors = call.tensors();
  const std::vector<NamedAttr> attrs{{"head_size", call.d}};
  CHECK_NOTHROW(op.check(tensors, attrs));
  CHECK_NOTHROW(op.check(tensors, attrs, OpHandle::CheckScope::layout));
  // Without head_size the flattened query has one dim too few for its pattern.
  CHECK_THROWS_AS(op.check(tensors), CallError);
  CHECK_THROWS_WITH_AS(op.check(tensors, std::vector<NamedAttr>{{"head_size", int64_t{5}}}),
                       doctest::Contains("must be a multiple of head_size = 5"), CallError);
}

TEST_CASE("dispatch: a rotary cache wider than the head is KD-E030 naming it") {
  auto ctx = cpu_context();
  Dispatcher dispatch(*ctx);
  std::vector<int64_t> positions{0, 1};
  std::vector<float> q(2 * 1 * 4, 1.0f), cache(5 * 6, 0.5f);
  std::vector<int64_t> ps{2}, qs{2, 1, 4}, cs{5, 6};
  const DLDataType f32{kDLFloat, 32, 1};
  std::vector<DLTensor> tensors{DLTensor{positions.data(), kCpu, 1, {kDLInt, 64, 1}, ps.data(), nullptr, 0},
                                DLTensor{q.data(), kCpu, 3, f32, qs.data(), nullptr, 0},
                                DLTensor{nullptr, kCpu, 0, DLDataType{0, 0, 0}, nullptr, nullptr, 0},
                                DLTensor{cache.data(), kCpu, 2, f32, cs.data(), nullptr, 0}};
  try {
    dispatch.op("embeddings.rotary_embedding")(tensors);
    FAIL("accepted");
  } catch (const CallError& e) {
    CHECK(e.code() == ErrorCode::bad_arguments);
    CHECK(std::string(e.what()).find("cos_sin_cache") != std::string::npos);
  }
}

TEST_CASE("dispatch: KDISPATCH_TRACE appends one JSON line per call") {
  const std::string path = (std::filesystem::temp_directory_path() / "kdispatch-trace-test.jsonl").string();
  std::filesystem::remove(path);
  setenv("KDISPATCH_TRACE", path.c_str(), 1);
  {
    auto ctx = cpu_context();
    Dispatcher dispatch(*ctx);
    RmsnormCall call;
    dispatch.call("layernorm.rmsnorm", call.tensors);
    dispatch.call("layernorm.rmsnorm", call.tensors);
  }
  unsetenv("KDISPATCH_TRACE");
  std::ifstream in(path);
  std::string line;
  int lines = 0;
  while (std::getline(in, line)) {
    ++lines;
    CHECK(line.find("{\"op\":\"layernorm.rmsnorm\",\"backend\":\"cpu\",\"rule\":\"only\",\"ranked\":[\"cpu\"],"
                    "\"device\":\"cpu:0\","
                    "\"dtypes\":[\"float32\",\"float32\",\"float32\"],\"shapes\":[[3,7],[3,7],[7]],\"us\":") == 0);
  }
  CHECK(lines == 2);
  std::filesystem::remove(path);
}

TEST_CASE("dispatch: backend names an op does not have are refused at lookup and never interned") {
  auto ctx = cpu_context();
  Dispatcher dispatch(*ctx);
  RmsnormCall call;
  const std::vector<NamedAttr> eps{{"eps", 1e-5}};
  dispatch.call("layernorm.rmsnorm", call.tensors, eps, "cpu");
  const size_t known = dispatch.interned();
  CHECK(known == 1);
  int refused = 0;
  for (int i = 0; i < 5000; ++i) {
    try {
      dispatch.call("layernorm.rmsnorm", call.tensors, eps, "no_such_backend_" + std::to_string(i));
    } catch (const SelectionError& e) {
      if (e.code() == ErrorCode::backend_not_registered) ++refused;
    }
  }
  CHECK(refused == 5000);
  CHECK(dispatch.interned() == known);
  CHECK_THROWS_WITH_AS(dispatch.op("layernorm.rmsnorm", "no_such_backend"),
                       doctest::Contains("No 'no_such_backend' backend registered for op 'layernorm.rmsnorm'"),
                       SelectionError);
  // The names the op has are interned once each, "reference" too.
  dispatch.call("layernorm.rmsnorm", call.tensors, eps, "cpu");
  dispatch.call("layernorm.rmsnorm", call.tensors, eps, "reference");
  dispatch.call("layernorm.rmsnorm", call.tensors, eps, "reference");
  CHECK(dispatch.interned() == known + 1);
}
