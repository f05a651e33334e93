#include "tensor.hpp"

#include <cstring>

namespace kdispatch::reference {

Tensor::Tensor(const DLTensor& t)
    : data_(static_cast<char*>(t.data) + t.byte_offset), shape_(t.shape), ndim_(t.ndim), numel_(1) {
  for (int i = 0; i < ndim_; ++i) numel_ *= shape_[i];
  if (t.dtype.lanes != 1) throw std::invalid_argument("vector dtypes are not supported");
  const int code = t.dtype.code;
  const int bits = t.dtype.bits;
  if (code == kDLFloat && bits == 32)
    kind_ = Kind::float32;
  else if (code == kDLFloat && bits == 16)
    kind_ = Kind::float16;
  else if (code == kDLBfloat && bits == 16)
    kind_ = Kind::bfloat16;
  else if (code == kDLFloat && bits == 64)
    kind_ = Kind::float64;
  else if (code == kDLInt && bits == 32)
    kind_ = Kind::int32;
  else if (code == kDLInt && bits == 64)
    kind_ = Kind::int64;
  else if (code == KD_DLPACK_FLOAT8_E4M3FN && bits == 8)
    kind_ = Kind::float8_e4m3fn;
  else if (code == KD_DLPACK_FLOAT8_E5M2 && bits == 8)
    kind_ = Kind::float8_e5m2;
  else
    throw std::invalid_argument("dtype code " + std::to_string(code) + " bits " + std::to_string(bits) +
                                " is not supported");
  if (t.strides != nullptr) {
    int64_t expected = 1;
    for (int i = ndim_ - 1; i >= 0; --i) {
      if (shape_[i] != 1 && t.strides[i] != expected) strides_ = t.strides;
      expected *= shape_[i];
    }
  }
}

// The element offset of row-major index i: i itself for a dense tensor,
// else the sum of each dim's index times its stride.
int64_t Tensor::offset(int64_t i) const {
  if (strides_ == nullptr) return i;
  int64_t off = 0;
  for (int d = ndim_ - 1; d >= 0; --d) {
    off += (i % shape_[d]) * strides_[d];
    i /= shape_[d];
  }
  return off;
}

int64_t Tensor::dim(int i) const { return shape_[i < 0 ? ndim_ + i : i]; }

int64_t Tensor::rows(int trailing) const {
  int64_t n = 1;
  for (int i = 0; i < ndim_ - trailing; ++i) n *= shape_[i];
  return n;
}

double Tensor::get(int64_t i) const {
  switch (kind_) {
    case Kind::float32: {
      float v;
      std::memcpy(&v, data_ + offset(i) * 4, 4);
      return v;
    }
    case Kind::float16:
    case Kind::bfloat16: {
      uint16_t bits;
      std::memcpy(&bits, data_ + offset(i) * 2, 2);
      return decode(kind_ == Kind::float16 ? Dtype::kFloat16 : Dtype::kBFloat16, bits);
    }
    case Kind::float64: {
      double v;
      std::memcpy(&v, data_ + offset(i) * 8, 8);
      return v;
    }
    case Kind::int32: {
      int32_t v;
      std::memcpy(&v, data_ + offset(i) * 4, 4);
      return v;
    }
    case Kind::int64: {
      int64_t v;
      std::memcpy(&v, data_ + offset(i) * 8, 8);
      return static_cast<double>(v);
    }
    case Kind::float8_e4m3fn:
    case Kind::float8_e5m2: {
      const auto bits = static_cast<uint8_t>(data_[offset(i)]);
      return decode(kind_ == Kind::float8_e4m3fn ? Dtype::kFloat8E4M3FN : Dtype::kFloat8E5M2, bits);
    }
  }
  return 0;
}

void Tensor::set(int64_t i, double value) const {
  switch (kind_) {
    case Kind::float32: {
      const auto v = static_cast<float>(value);
      std::memcpy(data_ + offset(i) * 4, &v, 4);
      return;
    }
    case Kind::float16:
    case Kind::bfloat16: {
      const auto bits =
          static_cast<uint16_t>(encode(kind_ == Kind::float16 ? Dtype::kFloat16 : Dtype::kBFloat16, value));
      std::memcpy(data_ + offset(i) * 2, &bits, 2);
      return;
    }
    case Kind::float64:
      std::memcpy(data_ + offset(i) * 8, &value, 8);
      return;
    case Kind::int32: {
      const auto v = static_cast<int32_t>(value);
      std::memcpy(data_ + offset(i) * 4, &v, 4);
      return;
    }
    case Kind::int64: {
      const auto v = static_cast<int64_t>(value);
      std::memcpy(data_ + offset(i) * 8, &v, 8);
      return;
    }
    case Kind::float8_e4m3fn:
    case Kind::float8_e5m2:
      data_[offset(i)] = static_cast<char>(
          encode(kind_ == Kind::float8_e4m3fn ? Dtype::kFloat8E4M3FN : Dtype::kFloat8E5M2, value));
      return;
  }
}

void expect_arity(const kd_call_args* args, int tensors, int attrs, const char* op) {
  if (args->num_tensors != tensors || args->num_attrs != attrs || args->tensors == nullptr) {
    throw std::invalid_argument(std::string(op) + ": expected " + std::to_string(tensors) + " tensors and " +
                                std::to_string(attrs) + " attributes, got " + std::to_string(args->num_tensors) +
                                " and " + std::to_string(args->num_attrs));
  }
}

}  // namespace kdispatch::reference
