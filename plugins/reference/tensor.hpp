// A kernel argument seen as a flat array of float64 values in row-major
// order, whatever its strides: reading an element decodes it exactly,
// writing one rounds the float64 value once to the tensor's dtype. Slow on
// purpose and short enough to check by eye.
#pragma once

#include <kdispatch/plugin_api.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "dtype_codec.hpp"

namespace kdispatch::reference {

class Tensor {
 public:
  explicit Tensor(const DLTensor& t);

  int64_t numel() const { return numel_; }
  int ndim() const { return ndim_; }
  // Size of dimension `i`, counted from the end when negative.
  int64_t dim(int i) const;
  // Product of every dimension but the last `trailing`.
  int64_t rows(int trailing) const;

  double get(int64_t i) const;
  void set(int64_t i, double value) const;  // rounds once to the dtype

 private:
  int64_t offset(int64_t i) const;  // element offset of row-major index i

  enum class Kind { float32, float16, bfloat16, float64, int32, int64, float8_e4m3fn, float8_e5m2 };
  char* data_;
  const int64_t* shape_;
  const int64_t* strides_ = nullptr;  // NULL when dense
  int ndim_;
  int64_t numel_;
  Kind kind_;
};

// Throws std::invalid_argument unless the call has `tensors` tensors and
// `attrs` attributes.
void expect_arity(const kd_call_args* args, int tensors, int attrs, const char* op);

}  // namespace kdispatch::reference
