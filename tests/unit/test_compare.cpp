// The harness's comparison with an op's reference: rounding noise passes,
// a systematic 1% error fails in every float dtype, NaN where a number is
// expected fails, integer outputs compare exactly.
#include <doctest/doctest.h>

#include <cmath>
#include <random>

#include "harness.hpp"

using namespace kdispatch;

namespace {

// A one-output op: out [N] of dtype T, from x [N].
OpSchema unary_schema() {
  OpSchema s;
  s.op = "t.unary";
  ShapeToken n;
  n.symbol = "N";
  s.tensors = {TensorArg{"out", {n}, "T", true}, TensorArg{"x", {n}, "T"}};
  s.dtype_vars = {{"T", {Dtype::float32, Dtype::float16, Dtype::bfloat16}}};
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
