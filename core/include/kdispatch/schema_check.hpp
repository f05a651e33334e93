// Checking a call's tensors against an op schema (DESIGN.md section 5). The
// schema is compiled once per op into a plan of small integer slots, so the
// per-call check does no string work and no allocation.
#pragma once

#include <dlpack/dlpack.h>

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

  // Symbol values implied by `tensors` (after check()), e.g. {"H": 4096}.
  std::vector<std::pair<std::string, int64_t>> bind_symbols(std::span<const DLTensor> tensors) const;

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

}  // namespace kdispatch
