// The fp8 quantisers on the cpu and reference backends: a worked example of
// per-token quantisation (scale absmax / 448, values divided by the stored
// scale and rounded once, an all-zero row scale 0 and output 0), per-tensor
// static and dynamic scales, per-group scales written through the strides
// of a column-major scale tensor (SGLang's column_major_scales) with the
// padding untouched, and the group refusals: N not a multiple of G is
// KD-E030, a group_size other than N / G leaves no backend (KD-E003).
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
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

}  // namespace

TEST_CASE("quantization.per_token_quant_fp8: scale absmax / 448, x / scale rounded once, a zero row 0") {
  auto ctx = quant_context();
  Dispatcher dispatch(*ctx);
  for (const char* backend : {"cpu", "reference"}) {
    INFO(backend);
    QuantCall call({1.0f, -2.0f, 0.5f, 4.0f, 0.0f, 0.0f, 0.0f, 0.0f}, 2, {2}, 2);
    dispatch.op("quantization.per_token_quant_fp8", backend)(call.tensors, std::vector<NamedAttr>{});
    const float s = 4.0f / 448.0f;
    CHECK(call.s[0] == s);
    CHECK(call.s[1] == 0.0f);
    // 1 / s, 2 / s, 0.5 / s and 4 / s lie within a float32 step of 112,
    // 224, 56 and 448, all exact in float8_e4m3fn.
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
