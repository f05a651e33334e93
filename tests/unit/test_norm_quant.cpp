// layernorm.rmsnorm_quant_fp8 and layernorm.fused_add_rmsnorm_quant_fp8 on
// the cpu and reference backends, worked by hand: the normalised row is
// multiplied by 1 / scale and rounded once to out's fp8 type, to nearest
// even, saturating at 448 (float8_e4m3fn) or 57344 (float8_e5m2), NaN
// staying NaN; the fused op updates the residual in place, leaves x alone
// and normalises the sum.
#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include "harness.hpp"
#include "kdispatch/context.hpp"
#include "kdispatch/dispatcher.hpp"

using namespace kdispatch;

namespace {

std::unique_ptr<Context> norm_context() {
  ContextOptions options;
  options.search.replace = {KDISPATCH_PLUGIN_DIR};
  options.search.use_environment = false;
  options.search.select = {"cpu", "reference"};
  return std::make_unique<Context>(options);
}

// One row of H = 4, out in `out_dtype`, x (and residual) in `dtype`, a unit
// weight in float32 and `scale`; x = `x`, residual = `residual` if given.
harness::CallData quant_call(const OpSchema& schema, Dtype dtype, Dtype out_dtype, const std::vector<double>& x,
                             const std::vector<double>& residual, double scale) {
  const bool fused = !residual.empty();
  harness::Variant variant;
  variant.dtypes = fused ? std::vector<Dtype>{out_dtype, dtype, dtype, Dtype::float32, Dtype::float32}
                         : std::vector<Dtype>{out_dtype, dtype, Dtype::float32, Dtype::float32};
  harness::CallData data = harness::make_call(schema, dtype, harness::Shapes{{1}, {{"H", 4}}}, 5, variant);
  const size_t weight = fused ? 3 : 2;
  for (size_t j = 0; j < 4; ++j) {
    data.tensors[1].set(j, x[j]);
    if (fused) data.tensors[2].set(j, residual[j]);
    data.tensors[weight].set(j, 1.0);
  }
  data.tensors[weight + 1].set(0, scale);
  return data;
}

void check_row(const harness::Buffer& out, const std::vector<double>& want) {
  for (size_t j = 0; j < want.size(); ++j) {
    INFO("element " << j);
    if (std::isnan(want[j])) {
      CHECK(std::isnan(out.at(j)));
    } else {
      CHECK(out.at(j) == want[j]);
    }
  }
}

}  // namespace

TEST_CASE("layernorm.rmsnorm_quant_fp8: x / rms * weight / scale rounded to fp8, saturating") {
  auto ctx = norm_context();
  Dispatcher dispatch(*ctx);
  // rms of (1, 2, 3, 4) = sqrt(7.5): the row normalised is (0.365, 0.730, 1.095, 1.461).
  struct Case {
    Dtype out;
    double scale;
    std::vector<double> want;
  };
  const Case cases[] = {
      // 36.5, 73.0, 109.5, 146.1: steps of 4, 8, 8 and 16
      {Dtype::float8_e4m3fn, 0.01, {36, 72, 112, 144}},
      // 365.1 (steps of 32), then beyond 448
      {Dtype::float8_e4m3fn, 0.001, {352, 448, 448, 448}},
      {Dtype::float8_e5m2, 0.001, {384, 768, 1024, 1536}},
      // 36515 (steps of 8192), then beyond 57344
      {Dtype::float8_e5m2, 1e-5, {32768, 57344, 57344, 57344}},
      // a negative scale flips the sign
      {Dtype::float8_e4m3fn, -0.01, {-36, -72, -112, -144}},
  };
  for (const char* backend : {"cpu", "reference"}) {
    const OpHandle op = dispatch.op("layernorm.rmsnorm_quant_fp8", backend);
    for (Dtype dtype : {Dtype::float32, Dtype::bfloat16}) {
      for (const Case& c : cases) {
        INFO(backend << " " << dtype_name(dtype) << " -> " << dtype_name(c.out) << ", scale " << c.scale);
        harness::CallData data = quant_call(op.schema(), dtype, c.out, {1, 2, 3, 4}, {}, c.scale);
        std::vector<DLTensor> tensors = data.dl();
        op(tensors, data.attrs);
        check_row(data.tensors[0], c.want);
      }
      INFO(backend << " " << dtype_name(dtype) << ": NaN in the row");
      harness::CallData data = quant_call(op.schema(), dtype, Dtype::float8_e4m3fn, {1, NAN, 3, 4}, {}, 0.01);
      std::vector<DLTensor> tensors = data.dl();
      op(tensors, data.attrs);
      check_row(data.tensors[0], {NAN, NAN, NAN, NAN});
    }
  }
}

TEST_CASE("layernorm.fused_add_rmsnorm_quant_fp8: residual += x in place, out normalises the sum, x unchanged") {
  auto ctx = norm_context();
  Dispatcher dispatch(*ctx);
  for (const char* backend : {"cpu", "reference"}) {
    const OpHandle op = dispatch.op("layernorm.fused_add_rmsnorm_quant_fp8", backend);
    for (Dtype dtype : {Dtype::float32, Dtype::float16}) {
      INFO(backend << " " << dtype_name(dtype));
      // sum (2, 2, 2, 4), rms sqrt(7): normalised (0.756, 0.756, 0.756, 1.512), / 0.01
      // = 75.6 (steps of 8) and 151.2 (steps of 16)
      harness::CallData data =
          quant_call(op.schema(), dtype, Dtype::float8_e4m3fn, {1, 2, 3, 4}, {1, 0, -1, 0}, 0.01);
      std::vector<DLTensor> tensors = data.dl();
      op(tensors, data.attrs);
      check_row(data.tensors[0], {72, 72, 72, 144});
      check_row(data.tensors[1], {1, 2, 3, 4});
      check_row(data.tensors[2], {2, 2, 2, 4});
    }
  }
}
