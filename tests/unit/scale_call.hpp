// One call of the fixture ops that scale a [rows, n] float32 tensor
// (out = x * factor, fixture.fallback and the kernels registered by the
// tests): random x, NaN-poisoned out, and the checks of what a kernel wrote.
#pragma once

#include <dlpack/dlpack.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace kdispatch::test {

struct ScaleCall {
  std::vector<float> out, x;
  std::vector<int64_t> shape;
  std::vector<DLTensor> tensors;

  ScaleCall(int64_t rows, int64_t n, unsigned seed = 7)
      : out(static_cast<size_t>(rows * n), std::nanf("")), x(static_cast<size_t>(rows * n)), shape{rows, n} {
    std::mt19937 gen(seed);
    std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
    for (float& v : x) v = dist(gen);
    const DLDevice cpu{kDLCPU, 0};
    const DLDataType f32{kDLFloat, 32, 1};
    tensors = {DLTensor{out.data(), cpu, 2, f32, shape.data(), nullptr, 0},
               DLTensor{x.data(), cpu, 2, f32, shape.data(), nullptr, 0}};
  }
  void poison() {
    for (float& v : out) v = std::nanf("");
  }
  // out == x * factor + offset, element for element.
  bool is(float factor, float offset = 0.0f) const {
    for (size_t i = 0; i < x.size(); ++i) {
      if (out[i] != x[i] * factor + offset) return false;
    }
    return true;
  }
  bool scaled_by(float factor) const { return is(factor); }
  bool untouched() const {
    for (float v : out) {
      if (!std::isnan(v)) return false;
    }
    return true;
  }
};

}  // namespace kdispatch::test
