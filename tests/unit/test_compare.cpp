// The harness's comparison with an op's reference: rounding noise passes,
// a systematic 1% error fails in every float dtype, NaN where a number is
// expected fails, integer outputs compare exactly.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>

#include "harness.hpp"

using namespace kdispatch;

namespace {

// A one-output op: out [N] of dtype T, from x [N].
OpSchema unary_schema() {
  OpSchema s;
  s.op = "t.unary";
  ShapeToken n;
  n.symbol = "N";
  TensorArg out;
  out.name = "out";
  out.shape = {n};
  out.dtype = "T";
  out.written = true;
  TensorArg x = out;
  x.name = "x";
  x.written = false;
  s.tensors = {out, x};
  s.dtype_vars = {{"T", {Dtype::float32, Dtype::float16, Dtype::bfloat16, Dtype::float8_e4m3fn, Dtype::float8_e5m2}}};
  return s;
}

// Expected values, random and never zero, stored in `dtype`; `got` holds
// each one rounded through f (in float64) and stored again.
template <class F>
harness::Comparison compare_with(Dtype dtype, int64_t n, F f) {
  const OpSchema schema = unary_schema();
  harness::Shapes shapes{{}, {{"N", n}}};
  harness::CallData want = harness::make_call(schema, dtype, shapes, 99);
  harness::CallData got = harness::make_call(schema, dtype, shapes, 99);
  for (size_t i = 0; i < static_cast<size_t>(n); ++i) {
    const double v = want.tensors[1].at(i);  // the random input as the expected output
    harness::store(want.tensors[0].host(), dtype, i, v);
    harness::store(got.tensors[0].host(), dtype, i, f(v, i));
  }
  return harness::compare(schema, got, want);
}

}  // namespace

TEST_CASE("compare: one-ulp noise passes, 1% off fails, in float32, float16 and bfloat16") {
  for (Dtype dtype : {Dtype::float32, Dtype::float16, Dtype::bfloat16}) {
    INFO(dtype_name(dtype));
    for (int64_t n : {1, 7, 4097}) {
      INFO("n = " << n);
      // Every seventh element one ulp off: the noise of a correct kernel.
      const auto noisy =
          compare_with(dtype, n, [&](double v, size_t i) { return i % 7 == 3 ? v + harness::ulp(dtype, v) : v; });
      CHECK_MESSAGE(noisy.ok, noisy.first_mismatch);
      CHECK(noisy.max_ulps <= 1.0);
      const auto same = compare_with(dtype, n, [](double v, size_t) { return v; });
      CHECK(same.ok);
      CHECK(same.max_abs_err == 0);
      if (n < 7) continue;  // a mean over a handful of values says little
      const auto off = compare_with(dtype, n, [](double v, size_t) { return v * 1.01; });
      CHECK_FALSE(off.ok);
      CHECK(off.mean_ulps > 0.5);
    }
  }
}

TEST_CASE("compare: 8-bit float outputs in ulps of their format") {
  CHECK(harness::ulp(Dtype::float8_e4m3fn, 1.0) == 0.125);
  CHECK(harness::ulp(Dtype::float8_e4m3fn, -448.0) == 32.0);
  CHECK(harness::ulp(Dtype::float8_e4m3fn, 0.0) == std::ldexp(1.0, -9));
  CHECK(harness::ulp(Dtype::float8_e4m3fn, 1e-4) == std::ldexp(1.0, -9));
  CHECK(harness::ulp(Dtype::float8_e5m2, 1.0) == 0.25);
  CHECK(harness::ulp(Dtype::float8_e5m2, 57344.0) == 8192.0);
  CHECK(harness::ulp(Dtype::float8_e5m2, 0.0) == std::ldexp(1.0, -16));
  for (Dtype dtype : {Dtype::float8_e4m3fn, Dtype::float8_e5m2}) {
    INFO(dtype_name(dtype));
    CHECK(default_tolerance(dtype) == Tolerance{1, 0, 0.25});
    const auto same = compare_with(dtype, 4097, [](double v, size_t) { return v; });
    CHECK(same.ok);
    CHECK(same.max_abs_err == 0);
    const auto noisy =
        compare_with(dtype, 4097, [&](double v, size_t i) { return i % 7 == 3 ? v + harness::ulp(dtype, v) : v; });
    CHECK_MESSAGE(noisy.ok, noisy.first_mismatch);
    CHECK(noisy.max_ulps == 1.0);
    // Two ulps off in one element fails it.
    const auto two =
        compare_with(dtype, 7, [&](double v, size_t i) { return i == 4 ? v + 2 * harness::ulp(dtype, v) : v; });
    CHECK_FALSE(two.ok);
    CHECK(two.first_mismatch.find("out[flat 4]") != std::string::npos);
    // Every element one ulp up: each within the bound, the mean not.
    const auto biased = compare_with(dtype, 4097, [&](double v, size_t) { return v + harness::ulp(dtype, v); });
    CHECK_FALSE(biased.ok);
  }
}

TEST_CASE("save_npy: an 8-bit float tensor is its raw bytes, as uint8") {
  const OpSchema schema = unary_schema();
  const harness::CallData call =
      harness::make_call(schema, Dtype::float8_e4m3fn, harness::Shapes{{}, {{"N", 5}}}, 7);
  const harness::Buffer& x = call.tensors[1];
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("kdispatch-test-fp8-" + std::to_string(std::random_device{}()) + ".npy"))
                               .string();
  harness::save_npy(path, x);
  std::ifstream file(path, std::ios::binary);
  const std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  std::remove(path.c_str());
  CHECK(text.find("'descr': '|u1'") != std::string::npos);
  CHECK(text.find("'shape': (5,)") != std::string::npos);
  REQUIRE(text.size() % 64 == 5);  // the header pads to 64 bytes, then 5 one-byte elements
  const std::string data = text.substr(text.size() - 5);
  CHECK(std::equal(data.begin(), data.end(), static_cast<const char*>(x.host())));
}

TEST_CASE("compare: NaN where a number is expected fails, and the first mismatch is named") {
  const auto r = compare_with(Dtype::float32, 7, [](double v, size_t i) { return i == 5 ? std::nan("") : v; });
  CHECK_FALSE(r.ok);
  CHECK(r.first_mismatch.find("out[flat 5]: got nan") != std::string::npos);
}

TEST_CASE("ulp: the spacing of each dtype, subnormal near zero") {
  CHECK(harness::ulp(Dtype::float32, 1.0) == std::ldexp(1.0, -23));
  CHECK(harness::ulp(Dtype::float16, 1.5) == std::ldexp(1.0, -10));
  CHECK(harness::ulp(Dtype::bfloat16, -3.0) == std::ldexp(1.0, -6));
  CHECK(harness::ulp(Dtype::float16, 0.0) == std::ldexp(1.0, -24));
  CHECK(harness::ulp(Dtype::float16, 1e-7) == std::ldexp(1.0, -24));
  CHECK(harness::ulp(Dtype::int32, 5.0) == 1.0);
}

namespace {

// out [*, H, D] and x [*, H, D] of layout "rows", an optional output
// `extra` [*, H, D].
OpSchema rows_schema() {
  OpSchema s = unary_schema();
  ShapeToken lead;
  lead.kind = ShapeToken::Kind::leading;
  ShapeToken h;
  h.symbol = "H";
  ShapeToken d;
  d.symbol = "D";
  s.tensors[0].shape = s.tensors[1].shape = {lead, h, d};
  s.tensors[0].layout = s.tensors[1].layout = Layout::rows;
  TensorArg extra = s.tensors[0];
  extra.name = "extra";
  extra.optional = true;
  s.tensors.push_back(extra);
  return s;
}

}  // namespace

TEST_CASE("padded rows: odd pads above each dim, a size-1 dim a stride beyond 2^31, the padding poisoned") {
  CHECK(harness::padded_strides({3, 5, 8}) == std::vector<int64_t>{62, 11, 1});
  CHECK(harness::padded_strides({1, 8}) == std::vector<int64_t>{(int64_t{1} << 31) + 3, 1});
  CHECK(harness::padded_strides({8}) == std::vector<int64_t>{1});

  const OpSchema schema = rows_schema();
  const harness::Shapes shapes{{3}, {{"H", 5}, {"D", 8}}};
  const std::vector<harness::Variant> variants = harness::variants(schema, Dtype::bfloat16);
  // dense and padded, each with `extra` present and absent
  REQUIRE(variants.size() == 4);
  CHECK(harness::describe(schema, variants.front()) == "dense");
  CHECK(harness::describe(schema, variants.back()) == "padded rows, extra absent");

  const harness::CallData dense = harness::make_call(schema, Dtype::bfloat16, shapes, 7);
  const harness::CallData padded = harness::make_call(schema, Dtype::bfloat16, shapes, 7, harness::Variant{true, {}, {}});
  const harness::Buffer& x = padded.tensors[1];
  REQUIRE(x.padded());
  CHECK(x.strides() == std::vector<int64_t>{62, 11, 1});
  CHECK(x.dl().strides != nullptr);
  CHECK(x.numel() == 3 * 5 * 8);
  CHECK(x.bytes() == (2 * 62 + 4 * 11 + 7 + 1 + 3) * 2);
  for (size_t i = 0; i < x.numel(); ++i) CHECK(x.at(i) == dense.tensors[1].at(i));
  CHECK(std::isnan(harness::load(x.host(), Dtype::bfloat16, 8)));  // the first pad element
  CHECK_NOTHROW(harness::check_guards(padded, "k"));

  // The same logical values dense, and a comparison by logical index.
  const harness::CallData flat = harness::clone_to(padded, DLDevice{kDLCPU, 0}, nullptr, /*dense=*/true);
  CHECK(!flat.tensors[1].padded());
  for (size_t i = 0; i < x.numel(); ++i) CHECK(flat.tensors[1].at(i) == x.at(i));
  CHECK(harness::compare(schema, padded, flat).ok);

  // A kernel writing a padding element fails, naming the tensor.
  harness::CallData written = harness::clone_to(padded, DLDevice{kDLCPU, 0}, nullptr);
  static_cast<uint16_t*>(written.tensors[0].host())[9] = 0;
  CHECK_THROWS_WITH_AS(harness::check_guards(written, "k"), doctest::Contains("padding between the rows of tensor 'out'"),
                       harness::GuardViolation);
}

TEST_CASE("an optional tensor left out: the ABI's absent tensor, skipped by the comparison") {
  const OpSchema schema = rows_schema();
  const harness::Shapes shapes{{2}, {{"H", 3}, {"D", 4}}};
  harness::Variant v;
  v.absent = {false, false, true};
  const harness::CallData a = harness::make_call(schema, Dtype::float32, shapes, 3, v);
  const std::vector<DLTensor> dl = a.dl();
  CHECK(dl[2].data == nullptr);
  CHECK(dl[2].ndim == 0);
  CHECK(dl[2].shape == nullptr);
  CHECK(dl[2].strides == nullptr);
  CHECK(dl[2].dtype.bits == 0);
  CHECK(dl[2].device.device_type == kDLCPU);
  const harness::CallData b = harness::clone_to(a, DLDevice{kDLCPU, 0}, nullptr);
  CHECK(!b.tensors[2].present());
  CHECK_NOTHROW(harness::check_guards(b, "k"));
  CHECK(harness::compare(schema, a, b).ok);
}
