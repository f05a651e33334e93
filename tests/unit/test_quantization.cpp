// The fp8 quantisers on the cpu and reference backends: a worked example of
// per-token quantisation (scale absmax / 448, values multiplied by the
// float32 reciprocal of the stored scale and rounded once, an all-zero row
// scale 0 and output 0), per-tensor static and dynamic scales, the exact
// product x * (1.0f / s) rounded once on values planted where it differs
// from the float32 product rounded again (a tie of the peers) and from the
// exact quotient x / s, NaN and infinities, per-group scales written through
// the strides of a column-major scale tensor (SGLang's column_major_scales)
// with the padding untouched, and the group refusals: N not a multiple of G
// is KD-E030, a group_size other than N / G leaves no backend (KD-E003).
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <kdispatch/plugin_helpers.hpp>

#include "kdispatch/context.hpp"
#include "kdispatch/dispatcher.hpp"
#include "kdispatch/error.hpp"

using namespace kdispatch;

namespace {

std::unique_ptr<Context> quant_context() {
  ContextOptions options;
  options.search.replace = {KDISPATCH_PLUGIN_DIR};
  options.search.use_environment = false;
  options.search.select = {"cpu", "reference"};
  return std::make_unique<Context>(options);
}

constexpr DLDevice kCpu{kDLCPU, 0};
constexpr DLDataType kF32{kDLFloat, 32, 1};
constexpr DLDataType kE4M3{KD_DLPACK_FLOAT8_E4M3FN, 8, 1};

double e4m3(uint8_t bits) { return kd_plugin::to_float(kd_plugin::Float8E4M3FN{bits}); }

// x [rows, n] float32, q [rows, n] float8_e4m3fn (poisoned: 0x7f is NaN),
// s as the caller shapes it (poisoned -7).
struct QuantCall {
  std::vector<float> x;
  std::vector<uint8_t> q;
  std::vector<float> s;
  std::vector<int64_t> x_shape, s_shape, s_strides;
  std::vector<DLTensor> tensors;

  QuantCall(std::vector<float> values, int64_t rows, std::vector<int64_t> scale_shape, size_t scale_elems,
            std::vector<int64_t> scale_strides = {})
      : x(std::move(values)), q(x.size(), 0x7f), s(scale_elems, -7.0f), x_shape{rows, static_cast<int64_t>(x.size()) / rows},
        s_shape(std::move(scale_shape)), s_strides(std::move(scale_strides)) {
    tensors = {DLTensor{x.data(), kCpu, 2, kF32, x_shape.data(), nullptr, 0},
               DLTensor{q.data(), kCpu, 2, kE4M3, x_shape.data(), nullptr, 0},
               DLTensor{s.data(), kCpu, static_cast<int32_t>(s_shape.size()), kF32, s_shape.data(),
                        s_strides.empty() ? nullptr : s_strides.data(), 0}};
  }
};

std::vector<float> ramp(size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = std::sin(static_cast<float>(i) * 1.7f) * static_cast<float>(1 + i % 5);
  return v;
}

// v rounded to float8_e4m3fn by search over the codes: nearest, ties to the
// even code, saturating at 448, NaN kept, the sign of v kept on 0.
uint8_t round_e4m3(double v) {
  if (std::isnan(v)) return 0x7f;
  const uint8_t sign = std::signbit(v) ? 0x80 : 0x00;
  const double a = std::fabs(v);
  uint8_t best = 0;
  for (uint8_t c = 1; c <= 0x7e; ++c) {
    const double d = std::fabs(e4m3(c) - a);
    const double bd = std::fabs(e4m3(best) - a);
    if (d < bd || (d == bd && (c & 1) == 0)) best = c;
  }
  return static_cast<uint8_t>(best | sign);
}

// What every backend stores for x with scale s: the exact product of x and
// the float32 reciprocal of s, rounded once.
uint8_t expected_q(float x, float s) {
  const double inv = s == 0.0f ? 0.0 : static_cast<double>(1.0f / s);
  return round_e4m3(static_cast<double>(x) * inv);
}

// Values x whose float32 product p = x * (1.0f / s) lies exactly on the
// midpoint m of two float8_e4m3fn values while the exact product does not:
// the exact product rounds to the side of m it lies on, the peers' second
// rounding of p ties to even. `above`/`below` count the exact products on
// either side of m (the sign of the residual), `tie_differs` those where the
// tie goes the other way, `quotient_differs` those where the exact quotient
// x / s lies on the other side of m than the product.
struct Planted {
  std::mt19937 rng{20261203};
  int above = 0, below = 0, tie_differs = 0, quotient_differs = 0;

  float next(float s) {
    const float inv = 1.0f / s;
    for (;;) {
      const auto code = static_cast<uint8_t>(std::uniform_int_distribution<int>(0, 0x7d)(rng));
      const double lower = e4m3(code), upper = e4m3(static_cast<uint8_t>(code + 1));
      const double m = (lower + upper) / 2;
      float x = static_cast<float>(m / inv);
      uint32_t bits = 0;
      std::memcpy(&bits, &x, sizeof bits);
      bits += static_cast<uint32_t>(std::uniform_int_distribution<int>(-3, 3)(rng));
      std::memcpy(&x, &bits, sizeof x);
      const double d = static_cast<double>(x) * inv;  // exact
      if (static_cast<float>(d) != static_cast<float>(m) || d == m) continue;
      const bool up = d > m;
      (up ? above : below) += 1;
      if (((code & 1) == 0) == up) ++tie_differs;          // the tie goes to the even code
      if ((static_cast<double>(x) > m * s) != up) ++quotient_differs;  // m * s is exact
      return std::uniform_int_distribution<int>(0, 1)(rng) != 0 ? -x : x;
    }
  }
};

// Segments of `len` values: a random absmax a (so the computed scale is
// a / 448 in float32) then len - 1 values planted for that scale.
std::vector<float> planted_segments(Planted& planted, int segments, int len) {
  std::vector<float> x;
  std::uniform_real_distribution<float> absmax(0.3f, 40.0f);
  for (int k = 0; k < segments; ++k) {
    const float a = absmax(planted.rng);
    x.push_back(k % 2 == 0 ? a : -a);
    const float s = a / 448.0f;
    for (int i = 1; i < len; ++i) x.push_back(planted.next(s));
  }
  return x;
}

float f32(double v) { return static_cast<float>(v); }

// The same float8_e4m3fn value (any NaN equal to any NaN), the sign of 0
// included.
bool same_q(uint8_t a, uint8_t b) { return (a & 0x7f) == 0x7f ? (b & 0x7f) == 0x7f : a == b; }

}  // namespace

TEST_CASE("quantization.per_token_quant_fp8: scale absmax / 448, x * (1 / scale) rounded once, a zero row 0") {
  auto ctx = quant_context();
  Dispatcher dispatch(*ctx);
  for (const char* backend : {"cpu", "reference"}) {
    INFO(backend);
    QuantCall call({1.0f, -2.0f, 0.5f, 4.0f, 0.0f, 0.0f, 0.0f, 0.0f}, 2, {2}, 2);
    dispatch.op("quantization.per_token_quant_fp8", backend)(call.tensors, std::vector<NamedAttr>{});
    const float s = 4.0f / 448.0f;
    CHECK(call.s[0] == s);
    CHECK(call.s[1] == 0.0f);
    // 1, 2, 0.5 and 4 times 1 / s lie within a float32 step of 112, 224, 56
    // and 448, all exact in float8_e4m3fn.
    const std::vector<double> want{112, -224, 56, 448, 0, 0, 0, 0};
    for (size_t i = 0; i < want.size(); ++i) CHECK(e4m3(call.q[i]) == want[i]);
  }
}

TEST_CASE("quantization.per_tensor_quant_fp8: a static scale is read and kept, a dynamic one written") {
  auto ctx = quant_context();
  Dispatcher dispatch(*ctx);
  for (const char* backend : {"cpu", "reference"}) {
    INFO(backend);
    QuantCall fixed({1.0f, -3.0f, 1000.0f, 0.03125f}, 2, {1}, 1);
    fixed.s[0] = 0.5f;
    dispatch.op("quantization.per_tensor_quant_fp8", backend)(fixed.tensors, std::vector<NamedAttr>{{"is_static", true}});
    CHECK(fixed.s[0] == 0.5f);
    const std::vector<double> want_fixed{2, -6, 448, 0.0625};  // 2000 saturates
    for (size_t i = 0; i < want_fixed.size(); ++i) CHECK(e4m3(fixed.q[i]) == want_fixed[i]);

    QuantCall dynamic({1.0f, -3.0f, 7.0f, 0.25f}, 2, {1}, 1);
    dispatch.op("quantization.per_tensor_quant_fp8", backend)(dynamic.tensors, std::vector<NamedAttr>{{"is_static", false}});
    CHECK(dynamic.s[0] == 7.0f / 448.0f);
    CHECK(e4m3(dynamic.q[2]) == 448);
    CHECK(e4m3(dynamic.q[0]) == 64);
  }
}

TEST_CASE("quantization: the exact product x * (1.0f / s) rounded once, on values planted on fp8 midpoints") {
  auto ctx = quant_context();
  Dispatcher dispatch(*ctx);
  Planted planted;
  constexpr int kLen = 64;
  const std::vector<float> one = planted_segments(planted, 1, 8 * kLen);  // one segment: the whole tensor
  const std::vector<float> rows = planted_segments(planted, 6, kLen);     // a segment a row, or a group
  // The planted values tell the three roundings apart, with residuals of
  // both signs.
  CHECK(planted.above > 20);
  CHECK(planted.below > 20);
  CHECK(planted.tie_differs > 20);
  CHECK(planted.quotient_differs > 0);
  const float s_one = one[0] / 448.0f;
  for (const char* backend : {"cpu", "reference"}) {
    INFO(backend);
    for (const bool is_static : {true, false}) {
      QuantCall t(one, 8, {1}, 1);
      t.s[0] = s_one;
      dispatch.op("quantization.per_tensor_quant_fp8", backend)(t.tensors, std::vector<NamedAttr>{{"is_static", is_static}});
      CHECK(t.s[0] == s_one);
      int wrong = 0;
      for (size_t i = 0; i < one.size(); ++i) wrong += !same_q(t.q[i], expected_q(one[i], s_one));
      CHECK(wrong == 0);
    }
    QuantCall token(rows, 6, {6}, 6);
    dispatch.op("quantization.per_token_quant_fp8", backend)(token.tensors, std::vector<NamedAttr>{});
    QuantCall group(rows, 3, {3, 2}, 6);
    dispatch.op("quantization.per_token_group_quant_fp8", backend)(group.tensors, std::vector<NamedAttr>{});
    int wrong = 0;
    for (int k = 0; k < 6; ++k) {
      const float s = std::fabs(rows[static_cast<size_t>(k * kLen)]) / 448.0f;
      CHECK(token.s[static_cast<size_t>(k)] == s);
      CHECK(group.s[static_cast<size_t>(k)] == s);
      for (int i = 0; i < kLen; ++i) {
        const size_t j = static_cast<size_t>(k * kLen + i);
        wrong += !same_q(token.q[j], expected_q(rows[j], s));
        wrong += !same_q(group.q[j], expected_q(rows[j], s));
      }
    }
    CHECK(wrong == 0);
  }
}

TEST_CASE("quantization.per_tensor_quant_fp8: NaN kept, infinities saturate, a scale of 0 gives 0") {
  auto ctx = quant_context();
  Dispatcher dispatch(*ctx);
  const float inf = INFINITY;
  const std::vector<float> x{f32(NAN), inf, -inf, 3.0f, -5.5f, 0.0f, 1e-30f, -1e30f};
  for (const char* backend : {"cpu", "reference"}) {
    INFO(backend);
    // s = 0.5, 0 (x * 0: 0 for finite x, NaN for NaN and infinities) and
    // 1e-40 (a subnormal whose float32 reciprocal overflows to infinity:
    // nonzero values saturate, 0 * inf is NaN).
    for (const float s : {0.5f, 0.0f, 1e-40f}) {
      INFO(s);
      QuantCall call(x, 2, {1}, 1);
      call.s[0] = s;
      dispatch.op("quantization.per_tensor_quant_fp8", backend)(call.tensors, std::vector<NamedAttr>{{"is_static", true}});
      for (size_t i = 0; i < x.size(); ++i) {
        INFO(i);
        CHECK(same_q(call.q[i], expected_q(x[i], s)));
      }
    }
    QuantCall half(x, 2, {1}, 1);
    half.s[0] = 0.5f;
    dispatch.op("quantization.per_tensor_quant_fp8", backend)(half.tensors, std::vector<NamedAttr>{{"is_static", true}});
    CHECK((half.q[0] & 0x7f) == 0x7f);  // NaN
    CHECK(half.q[1] == 0x7e);           // 448
    CHECK(half.q[2] == 0xfe);           // -448
    CHECK(e4m3(half.q[4]) == -11.0);
  }
}

TEST_CASE("quantization.per_token_group_quant_fp8: column-major scales are written through their strides") {
  auto ctx = quant_context();
  Dispatcher dispatch(*ctx);
  const std::vector<float> x = ramp(3 * 8);
  // The reference's scales, [3, 2] dense.
  QuantCall dense(x, 3, {3, 2}, 6);
  dispatch.op("quantization.per_token_group_quant_fp8", "reference")(dense.tensors, std::vector<NamedAttr>{});
  for (const char* backend : {"cpu", "reference"}) {
    INFO(backend);
    // A [2, 4] buffer (rows padded from 3 to 4), seen transposed: [3, 2]
    // with strides (1, 4).
    QuantCall column(x, 3, {3, 2}, 8, {1, 4});
    dispatch.op("quantization.per_token_group_quant_fp8", backend)(column.tensors, std::vector<NamedAttr>{{"group_size", int64_t{4}}});
    for (int r = 0; r < 3; ++r) {
      for (int g = 0; g < 2; ++g) CHECK(column.s[static_cast<size_t>(g * 4 + r)] == dense.s[static_cast<size_t>(r * 2 + g)]);
    }
    CHECK(column.s[3] == -7.0f);  // the padding
    CHECK(column.s[7] == -7.0f);
    CHECK(column.q == dense.q);
    CHECK(dense.s[0] > 0.0f);
  }
}

TEST_CASE("quantization.per_token_group_quant_fp8: groups that do not divide the row are refused") {
  auto ctx = quant_context();
  Dispatcher dispatch(*ctx);
  QuantCall uneven(ramp(8), 1, {1, 3}, 3);
  try {
    dispatch.op("quantization.per_token_group_quant_fp8")(uneven.tensors, std::vector<NamedAttr>{});
    FAIL("the call was accepted");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::bad_arguments);
    CHECK_MESSAGE(std::string(e.what()).find("N % G == 0") != std::string::npos, e.what());
  }
  QuantCall mismatch(ramp(8), 1, {1, 2}, 2);
  try {
    dispatch.op("quantization.per_token_group_quant_fp8")(mismatch.tensors, std::vector<NamedAttr>{{"group_size", int64_t{2}}});
    FAIL("the call was accepted");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::no_usable_backend);
    CHECK_MESSAGE(std::string(e.what()).find("group_size") != std::string::npos, e.what());
  }
  CHECK(mismatch.s[0] == -7.0f);
}
