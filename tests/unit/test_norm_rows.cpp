// The norm ops on row-strided tensors over the real cpu and reference
// plugins: float16 rows with padding between them (the leading dims with
// strides of their own), float32 weights; the cpu kernel agrees with the
// reference kernel, and the pads stay as they were.
#include <doctest/doctest.h>

#include <kdispatch/plugin_helpers.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "kdispatch/context.hpp"
#include "kdispatch/dispatcher.hpp"

using namespace kdispatch;

namespace {

using kd_plugin::Float16;

std::unique_ptr<Context> norm_context() {
  ContextOptions options;
  options.search.replace = {KDISPATCH_PLUGIN_DIR};
  options.search.use_environment = false;
  options.search.select = {"cpu", "reference"};
  return std::make_unique<Context>(options);
}

constexpr uint16_t kPad = 0x7e5a;  // a float16 NaN of a payload no kernel writes

// A float16 tensor [2, 3, H] whose rows have padding after them: the middle
// dim has stride H + 3 and the outer one 3 * (H + 3) + 5, so the leading
// dims cannot merge. Every element of the pads holds kPad.
struct RowTensor {
  static constexpr int64_t kH = 37;
  std::vector<int64_t> shape{2, 3, kH};
  std::vector<int64_t> strides{3 * (kH + 3) + 5, kH + 3, 1};
  std::vector<uint16_t> bits;

  explicit RowTensor(int seed) : bits(static_cast<size_t>(2 * strides[0]), kPad) {
    for (int64_t r = 0; r < 6; ++r) {
      for (int64_t j = 0; j < kH; ++j) {
        const double v = std::sin(0.37 * static_cast<double>(seed * 1000 + r * kH + j)) * (1.0 + 0.5 * seed);
        const Float16 h = kd_plugin::from_double<Float16>(v);
        std::memcpy(&bits[static_cast<size_t>(at(r, j))], &h, 2);
      }
    }
  }
  int64_t at(int64_t row, int64_t j) const { return (row / 3) * strides[0] + (row % 3) * strides[1] + j; }
  double get(int64_t row, int64_t j) const {
    Float16 h;
    std::memcpy(&h, &bits[static_cast<size_t>(at(row, j))], 2);
    return kd_plugin::to_double(h);
  }
  bool pads_untouched() const {
    std::vector<bool> in_row(bits.size(), false);
    for (int64_t r = 0; r < 6; ++r) {
      for (int64_t j = 0; j < kH; ++j) in_row[static_cast<size_t>(at(r, j))] = true;
    }
    for (size_t i = 0; i < bits.size(); ++i) {
      if (!in_row[i] && bits[i] != kPad) return false;
    }
    return true;
  }
  DLTensor tensor() {
    return DLTensor{bits.data(), DLDevice{kDLCPU, 0}, 3, DLDataType{kDLFloat, 16, 1}, shape.data(), strides.data(), 0};
  }
};

struct Weight {
  std::vector<int64_t> shape{RowTensor::kH};
  std::vector<float> values;
  Weight() {
    for (int64_t j = 0; j < RowTensor::kH; ++j) values.push_back(0.75f + 0.01f * static_cast<float>(j));
  }
  DLTensor tensor() {
    return DLTensor{values.data(), DLDevice{kDLCPU, 0}, 1, DLDataType{kDLFloat, 32, 1}, shape.data(), nullptr, 0};
  }
};

// float16 results of cpu and reference: at most one step apart.
void check_close(const RowTensor& cpu, const RowTensor& ref, const char* what) {
  for (int64_t r = 0; r < 6; ++r) {
    for (int64_t j = 0; j < RowTensor::kH; ++j) {
      const double a = cpu.get(r, j), b = ref.get(r, j);
      CHECK_MESSAGE(std::fabs(a - b) <= std::ldexp(std::fabs(b), -10) + 1e-6,
                    what << " row " << r << " element " << j << ": cpu " << a << ", reference " << b);
    }
  }
}

void call(Dispatcher& dispatch, const char* op, const char* backend, std::vector<DLTensor> tensors,
          std::span<const NamedAttr> attrs) {
  dispatch.op(op, backend)(tensors, attrs);
}

}  // namespace

TEST_CASE("norm rows: rmsnorm and gemma_rmsnorm on padded float16 rows with a float32 weight") {
  auto ctx = norm_context();
  Dispatcher dispatch(*ctx);
  const std::vector<NamedAttr> eps{{"eps", 1e-6}};
  for (const char* op : {"layernorm.rmsnorm", "layernorm.gemma_rmsnorm"}) {
    CAPTURE(op);
    RowTensor x(1);
    Weight w;
    RowTensor out_cpu(0), out_ref(0);
    out_cpu.bits.assign(out_cpu.bits.size(), kPad);
    out_ref.bits.assign(out_ref.bits.size(), kPad);
    call(dispatch, op, "cpu", {out_cpu.tensor(), x.tensor(), w.tensor()}, eps);
    call(dispatch, op, "reference", {out_ref.tensor(), x.tensor(), w.tensor()}, eps);
    check_close(out_cpu, out_ref, "out");
    CHECK(out_cpu.pads_untouched());
    CHECK(out_ref.pads_untouched());
  }
}

TEST_CASE("norm rows: fused_add_rmsnorm normalises the unrounded sum, on padded rows, residual exact") {
  auto ctx = norm_context();
  Dispatcher dispatch(*ctx);
  const std::vector<NamedAttr> eps{{"eps", 1e-6}};
  for (const char* op : {"layernorm.fused_add_rmsnorm", "layernorm.gemma_fused_add_rmsnorm"}) {
    CAPTURE(op);
    Weight w;
    RowTensor x_cpu(2), r_cpu(3), x_ref(2), r_ref(3);
    const RowTensor x0(2), r0(3);
    call(dispatch, op, "cpu", {x_cpu.tensor(), r_cpu.tensor(), w.tensor()}, eps);
    call(dispatch, op, "reference", {x_ref.tensor(), r_ref.tensor(), w.tensor()}, eps);
    check_close(x_cpu, x_ref, "x");
    CHECK(r_cpu.bits == r_ref.bits);
    CHECK(x_cpu.pads_untouched());
    CHECK(r_cpu.pads_untouched());
    // The reference normalises the float64 sum, not the float16 one stored.
    const double offset = std::string(op).find("gemma") != std::string::npos ? 1.0 : 0.0;
    for (int64_t r = 0; r < 6; ++r) {
      double sum_sq = 0;
      for (int64_t j = 0; j < RowTensor::kH; ++j) {
        const double s = x0.get(r, j) + r0.get(r, j);
        sum_sq += s * s;
      }
      const double inv = 1.0 / std::sqrt(sum_sq / RowTensor::kH + 1e-6);
      for (int64_t j = 0; j < RowTensor::kH; ++j) {
        const double s = x0.get(r, j) + r0.get(r, j);
        const double want = kd_plugin::to_double(
            kd_plugin::from_double<Float16>(s * inv * (offset + static_cast<double>(w.values[j]))));
        CHECK(x_ref.get(r, j) == want);
        CHECK(r_ref.get(r, j) == kd_plugin::to_double(kd_plugin::from_double<Float16>(s)));
      }
    }
  }
}
