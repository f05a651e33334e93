// Checking a call's tensors against an op schema (DESIGN.md section 5). The
// schema is compiled once per op into a plan of small integer slots, so the
// per-call check does no string work and no allocation.
#pragma once

#include <dlpack/dlpack.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kdispatch/dtype.hpp"
#include "kdispatch/schema.hpp"

namespace kdispatch {

inline constexpr size_t kMaxSchemaSymbols = 16;
inline constexpr size_t kMaxSchemaTensors = 32;
inline constexpr size_t kMaxSchemaAttrs = 32;
inline constexpr size_t kMaxSchemaDims = 8;        // dims after "*" in one pattern
inline constexpr size_t kMaxSchemaDtypeVars = 8;

class CompiledSchema {
 public:
  // Throws ManifestError (KD-E011) when the schema exceeds the limits above.
  explicit CompiledSchema(const OpSchema& schema);

  struct CallInfo {
    Dtype dtype;            // the dtype that selects a kernel (first dtype variable)
    int32_t device_type;    // DLDeviceType shared by all tensors
    int32_t device_id;
  };
  // Checks count, dtypes, shapes, one device, non-null data and layout.
  // Throws CallError KD-E030 naming the argument, what was expected and what
  // was given. The common case (all good) runs a lean pass over flat data;
  // only a failing call pays for the detailed diagnosis.
  CallInfo check(std::span<const DLTensor> tensors) const {
    CallInfo info;
    if (check_fast(tensors, &info)) [[likely]] return info;
    diagnose(tensors);
  }


  const OpSchema& schema() const { return schema_; }

 private:
  struct Dim {
    enum class Kind : uint8_t { symbol, constant, multiple } kind;
    // Whether this is the symbol's first appearance in call order (it binds
    // the symbol) or a later one (it must match): known when compiling, so
    // the per-call check needs no bookkeeping.
    bool binds;
    uint8_t symbol;  // slot
    int64_t value;   // constant size or factor (1 for a plain symbol)
  };
  struct Tensor {
    bool leading = false;        // starts with "*"
    bool binds_leading = false;  // the first tensor with "*": later ones match it
    bool strided = false;
    bool binds_var = false;      // first tensor of its dtype variable
    int dtype_var = -1;          // slot in vars_, or -1 for a concrete dtype
    Dtype dtype = Dtype::float32;
    uint32_t dtype_code = 0;     // packed DLDataType of a concrete dtype
    uint32_t num_dims = 0;
    std::array<Dim, kMaxSchemaDims> dims{};  // after "*"
  };
  struct DtypeVar {
    std::string name;
    std::vector<Dtype> allowed;
    std::vector<uint32_t> codes;  // packed DLDataType of each allowed dtype
  };
  bool check_fast(std::span<const DLTensor> tensors, CallInfo* info) const noexcept;
  [[noreturn]] void diagnose(std::span<const DLTensor> tensors) const;
  [[noreturn]] void fail(size_t tensor, const std::string& what) const;

  OpSchema schema_;
  std::vector<Tensor> tensors_;
  std::vector<std::string> symbols_;
  std::vector<DtypeVar> vars_;
  int selecting_var_ = -1;  // dtype variable that selects the kernel
};

// DLDataType packed into one word, for cheap comparisons.
inline uint32_t pack_dtype(DLDataType t) {
  return static_cast<uint32_t>(t.code) | static_cast<uint32_t>(t.bits) << 8 | static_cast<uint32_t>(t.lanes) << 16;
}

// True when `t` is laid out densely in row-major order (strides NULL or
// matching; dims of size 1 may have any stride).
bool is_contiguous(const DLTensor& t);
int64_t numel(const DLTensor& t);

// Inline: the whole per-call cost of a checked call's validation.
inline bool CompiledSchema::check_fast(std::span<const DLTensor> tensors, CallInfo* info) const noexcept {
  const size_t n = tensors_.size();
  if (tensors.size() != n || n == 0) return false;
  const DLDevice device = tensors[0].device;
  std::array<int64_t, kMaxSchemaSymbols> bound;
  std::array<uint32_t, kMaxSchemaDtypeVars> var_code;
  const int64_t* leading = nullptr;
  int64_t leading_count = 0;

  for (size_t i = 0; i < n; ++i) {
    const Tensor& spec = tensors_[i];
    const DLTensor& t = tensors[i];
    if (t.device.device_type != device.device_type || t.device.device_id != device.device_id) return false;
    const uint32_t code = pack_dtype(t.dtype);
    if (spec.dtype_var < 0) {
      if (code != spec.dtype_code) return false;
    } else if (!spec.binds_var) {
      if (code != var_code[static_cast<size_t>(spec.dtype_var)]) return false;
    } else {
      const auto& codes = vars_[static_cast<size_t>(spec.dtype_var)].codes;
      if (std::find(codes.begin(), codes.end(), code) == codes.end()) return false;
      var_code[static_cast<size_t>(spec.dtype_var)] = code;
    }
    const int64_t lead = t.ndim - static_cast<int64_t>(spec.num_dims);
    if (lead < 0 || (lead != 0 && !spec.leading) || (t.shape == nullptr && t.ndim > 0)) return false;
    if (spec.binds_leading) {
      leading = t.shape;
      leading_count = lead;
      for (int64_t k = 0; k < lead; ++k) {
        if (t.shape[k] < 0) return false;
      }
    } else if (spec.leading) {
      if (lead != leading_count) return false;
      for (int64_t k = 0; k < lead; ++k) {
        if (t.shape[k] != leading[k]) return false;
      }
    }
    const int64_t* dims = t.shape + lead;
    for (uint32_t k = 0; k < spec.num_dims; ++k) {
      const Dim& d = spec.dims[k];
      const int64_t size = dims[k];
      if (d.kind == Dim::Kind::constant) {
        if (size != d.value) return false;
      } else if (!d.binds) {
        if (size != d.value * bound[d.symbol]) return false;
      } else if (d.value == 1) {  // a plain symbol: no division (tens of cycles)
        if (size < 0) return false;
        bound[d.symbol] = size;
      } else {
        if (size < 0 || size % d.value != 0) return false;
        bound[d.symbol] = size / d.value;
      }
    }
    // Null data is fine only for an empty tensor: count elements only then.
    if (t.data == nullptr && numel(t) != 0) return false;
    if (t.strides != nullptr && !spec.strided && !is_contiguous(t)) return false;
  }
  info->device_type = static_cast<int32_t>(device.device_type);
  info->device_id = device.device_id;
  if (selecting_var_ >= 0) {
    const DtypeVar& var = vars_[static_cast<size_t>(selecting_var_)];
    const uint32_t code = var_code[static_cast<size_t>(selecting_var_)];
    info->dtype = var.allowed[static_cast<size_t>(std::find(var.codes.begin(), var.codes.end(), code) - var.codes.begin())];
  } else {
    info->dtype = tensors_[0].dtype;
  }
  return true;
}

}  // namespace kdispatch
