// Test and benchmark harness shared by `kdispatch run`/`bench`, the
// conformance suite and the benchmarks: tensors generated from an op schema,
// placed on any backend's device through its kd_memory_api, compared with
// the op's reference within the tolerances of its schema, and saved as .npy.
#pragma once

#include <dlpack/dlpack.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "kdispatch/dispatcher.hpp"
#include "kdispatch/dtype.hpp"
#include "kdispatch/kernel_spec.hpp"
#include "kdispatch/plugin.hpp"
#include "kdispatch/schema.hpp"
#include "dtype_codec.hpp"

namespace kdispatch::harness {

// --- elements -------------------------------------------------------------------
// An element as float64, and a float64 value stored rounded once to `dtype`
// (the dtype codec of the reference plugin).
double load(const void* data, Dtype dtype, size_t index);
void store(void* data, Dtype dtype, size_t index, double value);

// --- shapes ---------------------------------------------------------------------
using Shapes = Sizes;  // the "*" dims and each shape symbol
// The schema's "example" sizes, with defaults for whatever it leaves out.
Shapes example_shapes(const OpSchema& schema);
// Applies "NAME=N" (and "*=a,b") overrides; throws std::invalid_argument.
void apply_overrides(Shapes& shapes, const std::vector<std::string>& overrides, const OpSchema& schema);
std::vector<int64_t> tensor_shape(const TensorArg& arg, const Shapes& shapes);
// Sets attributes from "NAME=VALUE" texts, each value parsed as the type the
// schema gives NAME (float, int, bool: true/false/1/0, string). Names the
// schema lacks are skipped when `skip_unknown`, else, like a value that does
// not parse, a std::invalid_argument naming the attribute.
void apply_attr_overrides(std::vector<NamedAttr>& attrs, const std::vector<std::string>& overrides,
                          const OpSchema& schema, bool skip_unknown);
std::string shapes_str(const Shapes& shapes);  // "*=[64] H=4096"
// Bytes of a tensor of `shape`, and of all the tensors of a call in `dtype`;
// both throw std::invalid_argument, naming the tensor, where a size does not
// fit in 64 bits (rather than wrapping round to a small buffer).
size_t tensor_bytes(Dtype dtype, const std::vector<int64_t>& shape);
size_t call_bytes(const OpSchema& schema, Dtype dtype, const Shapes& shapes);

// --- buffers --------------------------------------------------------------------
// One tensor: always a host copy; a device copy when `memory` is given. Its
// data lies between guard regions of kGuardByte, at least kGuardBytes before
// and after it, on the host and on the device, so that a kernel writing
// outside the tensor (a schema's output smaller than what the kernel writes)
// is found by guard_damage() instead of corrupting other memory. On the host
// the data and guards are a mapping of their own, with a PROT_NONE page
// before and after them: an access further out faults there, and a
// GuardWatch reports that fault.
//
// A buffer may have strides (padded rows): its storage then holds the
// elements at their strided offsets and, between them, padding filled with
// kPadByte (NaN in every float dtype, -1 in integers), which no kernel may
// write (pad_damage()). An absent buffer stands for an optional tensor left
// out of a call: no storage, and a DLTensor with data == NULL, ndim == 0.
class Buffer {
 public:
  static constexpr size_t kGuardBytes = 4096;
  static constexpr unsigned char kGuardByte = 0xa5;
  static constexpr unsigned char kPadByte = 0xff;

  // `name` (the schema's name of the tensor) is what guard reports call it.
  // `strides` in elements, one per dim; empty: dense, row-major.
  Buffer(Dtype dtype, std::vector<int64_t> shape, DLDevice device, const kd_memory_api* memory,
         std::string name = {}, std::vector<int64_t> strides = {});
  // An optional tensor left out of a call on `device`.
  static Buffer absent(Dtype dtype, DLDevice device, std::string name = {});
  ~Buffer();
  Buffer(Buffer&&) noexcept;
  Buffer& operator=(Buffer&&) = delete;
  Buffer(const Buffer&) = delete;

  DLTensor& dl() { return tensor_; }
  const DLTensor& dl() const { return tensor_; }
  void* host() { return data_; }
  const void* host() const { return data_; }
  size_t bytes() const { return bytes_; }  // of the storage, padding included
  size_t numel() const { return numel_; }  // logical elements
  Dtype dtype() const { return dtype_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  const std::vector<int64_t>& strides() const { return strides_; }  // empty: dense
  bool present() const { return present_; }
  bool padded() const { return !strides_.empty(); }
  const std::string& name() const { return name_; }
  // Element offset in the storage of the element at row-major index i.
  size_t offset(size_t i) const;
  double at(size_t i) const { return load(host(), dtype_, offset(i)); }
  void set(size_t i, double value) { store(host(), dtype_, offset(i), value); }
  void upload();    // host -> device, guards included (no-op for host tensors)
  void download();  // device -> host, guards included

  // Changed bytes of the guards of the host copy (download() a device
  // tensor first): offsets of the first and last from the data's start,
  // negative before it.
  struct Damage {
    int64_t first = 0;
    int64_t last = 0;
  };
  std::optional<Damage> guard_damage() const;

  // The host mapping's PROT_NONE pages, [begin, end) each; empty for a
  // device tensor, whose host copy no kernel touches.
  struct Span {
    uintptr_t begin = 0, end = 0;
  };
  std::vector<Span> guard_pages() const;

  // Changed bytes of the padding between the elements of a padded buffer's
  // host copy: offsets of the first and last from the data's start.
  std::optional<Damage> pad_damage() const;

 private:
  Dtype dtype_;
  std::vector<int64_t> shape_;
  std::vector<int64_t> strides_;
  // The padded layout with adjacent dims that lie densely in each other
  // merged (padded rows: [rows, width]), which offset() walks.
  std::vector<size_t> runs_;
  std::vector<size_t> run_strides_;
  std::string name_;
  bool present_ = true;
  size_t numel_ = 0;
  size_t bytes_ = 0;
  unsigned char* mapping_ = nullptr;  // the host mapping: page, front guard, data, back guard, page
  size_t mapping_bytes_ = 0;
  size_t page_ = 0;
  unsigned char* data_ = nullptr;  // in the mapping
  void* device_ptr_ = nullptr;     // the device allocation: kGuardBytes, the data, kGuardBytes
  const kd_memory_api* memory_ = nullptr;
  DLTensor tensor_{};
};

// How the tensors of a call are laid out and which of the schema's choices
// it makes, beyond the call dtype.
struct Variant {
  // Tensors of layout "rows" or "any" have padded strides: each dim before
  // the last has a stride larger than the elements it spans (by an odd
  // number of elements), a dim of size 1 a stride beyond 2^31 elements;
  // the padding is poisoned and checked untouched after the call.
  bool padded = false;
  std::vector<Dtype> dtypes;  // per tensor, schema order; empty: each one's primary dtype
  std::vector<bool> absent;   // per tensor: an optional tensor left out; empty: all present
  // Tensors with "flattened" are given with their pattern's last two dims
  // as one ([*, H*D]), and the attribute they are flattened by is set to
  // the last dim's size (D), so that the core splits them back.
  bool flattened = false;
};
// The variants the conformance suite runs for calls in `dtype`: every
// combination of each tensor's dtype alternatives and, for each optional
// tensor, present and absent; each dense and, where a tensor may have
// padded rows, padded; each of those again flattened where a tensor may be
// given flattened. The first is the plain call (dense, primary dtypes,
// everything present, nothing flattened).
std::vector<Variant> variants(const OpSchema& schema, Dtype dtype);
// "padded rows, weight float32, key absent"; "dense" for the plain call.
std::string describe(const OpSchema& schema, const Variant& v);
// Whether a tensor of the schema may have padded rows (layout rows or any).
bool has_rows(const OpSchema& schema);
// Whether a tensor of the schema may be given "flattened".
bool has_flattened(const OpSchema& schema);
// Whether `attrs` give a nonzero value to an attribute that a tensor of the
// schema is "flattened" by: a call with them passes such tensors flattened.
bool flattens(const OpSchema& schema, std::span<const NamedAttr> attrs);
// The strides of a padded tensor of `shape`, in elements (see Variant).
std::vector<int64_t> padded_strides(const std::vector<int64_t>& shape);

// The tensors of one call, in schema order.
struct CallData {
  std::vector<Buffer> tensors;
  std::vector<NamedAttr> attrs;  // all schema attrs with their defaults
  Dtype dtype;                   // bound to the schema's first dtype variable
  Shapes shapes;

  std::vector<DLTensor> dl() const;
  size_t bytes_moved(const OpSchema& schema) const;  // read + written
};

// Random inputs as each tensor's "values" says, never all zeros (uniform in
// [-2, 2), integers in their range, or the cos and sin of random angles);
// outputs poisoned with NaN (or an out-of-range integer). Host only:
// clone_to() copies them to a device.
// `variant` picks the layout, the dtype of each tensor and the tensors left
// out.
CallData make_call(const OpSchema& schema, Dtype dtype, const Shapes& shapes, uint64_t seed,
                   const Variant& variant = {});
// The same values on another device (for checking one backend against
// another), in the same layout, or dense where `dense`.
CallData clone_to(const CallData& data, DLDevice device, const kd_memory_api* memory, bool dense = false);
// The same values on the host as the plain call: dense, each tensor in the
// shape of its pattern (a flattened one given split, [*, H, D]) and the
// attributes tensors are flattened by at 0. The call the reference runs to
// check any variant of it: elements compare by logical index, which is the
// same in both forms.
CallData plain_copy(const OpSchema& schema, const CallData& data);
void download_all(CallData& data);

// --- guards ---------------------------------------------------------------------

// A kernel wrote outside a tensor of its call.
class GuardViolation : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
// Throws GuardViolation naming `kernel`, the first tensor of `data` whose
// guards or padding changed, and the offsets changed, from its data's start.
// The host copies are checked: download_all() a device call first.
void check_guards(const CallData& data, const std::string& kernel);

// While it lives, a fault in a guard page of the host tensors it watches
// (an access far outside a tensor, past its guard region) prints
// "kdispatch: <kernel> ... tensor '<name>' ... at byte offset N ..." on
// stderr and ends the process with exit status kGuardFaultExit, instead of
// a crash that says nothing. Any other fault keeps its default action.
// Several may live at once, on several threads.
inline constexpr int kGuardFaultExit = 3;  // the tool's exit status for a kernel failure
class GuardWatch {
 public:
  explicit GuardWatch(std::string kernel) : kernel_(std::move(kernel)) {}
  ~GuardWatch();
  GuardWatch(const GuardWatch&) = delete;
  GuardWatch& operator=(const GuardWatch&) = delete;
  GuardWatch& watch(const Buffer& buffer);
  GuardWatch& watch(const CallData& data);

 private:
  std::string kernel_;
  std::vector<size_t> slots_;
};

// --- cases ----------------------------------------------------------------------

// The dtypes a call of the op may have: those of its first dtype variable
// used by a tensor (which selects the kernel), else its first tensor's.
std::vector<Dtype> call_dtypes(const OpSchema& schema);
// Those of them a kernel serves; a kernel declared without "dtypes" serves
// them all.
std::vector<Dtype> kernel_dtypes(const OpSchema& schema, const KernelSpec& spec);

// One call the schema's "tests" ask for: sizes, the attribute values given
// (the others keep their defaults) and, for a call with special values,
// which set is planted.
struct TestCase {
  Shapes shapes;
  std::vector<NamedAttr> attrs;
  const SpecialValues* special = nullptr;  // points into the schema
};
// Every test size with every combination of the test attribute values (the
// example size when the schema lists none), then each set of special values
// at its sizes (the test sizes where it lists none) with the same
// combinations.
std::vector<TestCase> test_cases(const OpSchema& schema);
// "*=[3] D=67 is_neox=true (special: NaN and infinities)"
std::string describe(const TestCase& c);
// The inputs and poisoned outputs of `c` in `dtype` (make_call), its
// attributes applied and its special values planted.
CallData make_case(const OpSchema& schema, Dtype dtype, const TestCase& c, uint64_t seed,
                   const Variant& variant = {});
// Replaces elements of the inputs `special.tensors` of `data` as the set says.
void plant_special(CallData& data, const OpSchema& schema, const SpecialValues& special, uint64_t seed);

// --- checking -------------------------------------------------------------------

// Spacing of `dtype` at |value| (subnormal spacing near zero; 1 for integers).
double ulp(Dtype dtype, double value);

struct Comparison {
  bool ok = true;
  double max_abs_err = 0;
  double max_rel_err = 0;
  // Errors beyond the tolerance's absolute floor, in ulps of the output
  // dtype: the largest, and the largest mean over one output.
  double max_ulps = 0;
  double mean_ulps = 0;
  std::string first_mismatch;  // "out[flat 17]: got 1.25, expected 1.5 (...)"
};
// Compares the written tensors of `got` with those of `want` (the same call
// run by the op's reference), host tensors in schema order, any strides,
// with the schema's tolerances: a float output within its dtype's
// tolerance, NaN where the reference has NaN, infinities equal; integer,
// bool and "exact" outputs bit for bit. The outputs named in `unchecked`
// are skipped, and so is an output absent (data == NULL) from both calls.
// Elements are compared by logical index, whatever the layout of each
// side. This is every check's comparison: run, bench, the
// conformance suite and (through the Python module) the Python tests.
Comparison compare(const OpSchema& schema, std::span<const DLTensor> got, std::span<const DLTensor> want,
                   std::span<const std::string> unchecked = {});
Comparison compare(const OpSchema& schema, const CallData& got, const CallData& want,
                   std::span<const std::string> unchecked = {});

// --- .npy -----------------------------------------------------------------------
// Writes `buffer` as NumPy .npy; bfloat16 is stored as float32 (exact),
// float8_e4m3fn and float8_e5m2 as their raw bytes (uint8), which NumPy
// has no dtype for.
void save_npy(const std::string& path, const Buffer& buffer);

}  // namespace kdispatch::harness
