// Checking a call's tensors against an op schema (docs/op-schema.md).
// Internal: the dispatcher's checked call uses it, and OpHandle::check gives
// the same verdict and words to everyone else. The schema is compiled once
// per op into a plan of small integer slots, so the per-call check does no
// string work and no allocation.
#pragma once

#include <dlpack/dlpack.h>
#include <kdispatch/plugin_api.h>

#include <array>
#include <atomic>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "constraint.hpp"
#include "kdispatch/dtype.hpp"
#include "kdispatch/schema.hpp"

namespace kdispatch {

inline constexpr size_t kMaxSchemaSymbols = 16;
// The values constraints read: the shape symbols and "rows".
inline constexpr size_t kMaxConstraintSymbols = kMaxSchemaSymbols + 1;
inline constexpr size_t kMaxSchemaDims = 8;  // dims after "*" in one pattern
inline constexpr size_t kMaxSchemaDtypeVars = 8;
inline constexpr size_t kMaxFlattened = 4;       // tensors with "flattened" in one schema
inline constexpr size_t kMaxFlattenedDims = 16;  // dims of such a tensor once split

// The tensors of a call as the schema's patterns see them, where the call
// passes some "flattened" (CompiledSchema::unflatten): a copy of the call's
// DLTensors whose split ones point at the shapes and strides held here.
// Lives on the caller's stack for the call: no allocation.
struct UnflattenedCall {
  std::array<DLTensor, kMaxSchemaTensors> tensors;
  std::array<std::array<int64_t, kMaxFlattenedDims>, kMaxFlattened> shapes;
  std::array<std::array<int64_t, kMaxFlattenedDims>, kMaxFlattened> strides;
};

// An accepted call that a CompiledSchema remembers, as the words its
// verdict depends on: per tensor its
// device, ndim and dtype, which of its data, shape and strides pointers
// are null, its shape and (when given) its strides, each tensor in a row
// of its own. A call equal to one in these words, with no byte_offset,
// gets the same verdict from the plan except for the overlap of its
// written tensors, which depends on the data pointers: the row also keeps
// the tensor's byte range relative to its data pointer. Calls of an op
// mostly repeat (every layer of a model calls it with the same shapes, or
// alternates a few, as q and k norms do), so comparing with the last few
// accepted calls replaces the plan for most calls. A seqlock keeps readers
// lock-free: a reader that overlaps a writer sees the sequence change and
// takes the plan instead. Calls with more tensors or dims than the rows
// hold are not remembered.
struct AcceptedCall {
  static constexpr size_t kTensors = 8;
  static constexpr size_t kDims = 6;
  struct Row {
    std::atomic<uint64_t> device{0};    // the DLTensor's device, as one word
    std::atomic<uint64_t> header{0};    // its ndim and dtype, as one word
    std::atomic<uint64_t> pointers{0};  // CompiledSchema::null_pointers()
    // The bytes the tensor addresses: from data + low (wrapping: negative
    // strides reach below the first element) over `extent` bytes; 0 for a
    // tensor with no data or no element.
    std::atomic<uint64_t> low{0};
    std::atomic<uint64_t> extent{0};
    std::array<std::atomic<int64_t>, kDims> shape{};
    std::array<std::atomic<int64_t>, kDims> strides{};  // when the call gave strides
  };
  std::atomic<uint32_t> seq{0};  // odd: being written; 0: nothing recorded
  std::atomic<Dtype> dtype{Dtype::float32};
  std::atomic<const void*> tag{nullptr};  // attach()
  std::array<Row, kTensors> rows{};
};

// A remembered call that a call repeats (CompiledSchema::matches_remembered),
// with the value CompiledSchema::attach() gave it (null: none yet).
struct RememberedCall {
  AcceptedCall* entry;
  uint32_t seq;
  const void* tag;
};

class CompiledSchema {
 public:
  // Throws ManifestError (KD-E011) when the schema exceeds the limits above.
  explicit CompiledSchema(const OpSchema& schema);

  struct CallInfo {
    Dtype dtype;      // the dtype that selects a kernel (first dtype variable)
    DLDevice device;  // shared by all tensors
  };
  // Checks count, dtypes, shapes, one device, non-null data and layout.
  // Throws CallError KD-E030 naming the argument, what was expected and what
  // was given. Three tiers: a call whose devices, dtypes, shapes and
  // strides equal those of a recently accepted call only has its data
  // pointers checked (null or not, and the overlap of written tensors); any
  // other walks the compiled plan (and becomes a remembered call); only
  // a refused call walks it a second time, building the message.
  CallInfo check(std::span<const DLTensor> tensors) const {
    CallInfo info;
    if (matches_remembered(tensors, &info)) [[likely]] return info;
    return check_plan(tensors);
  }
  using Remembered = RememberedCall;
  // The first tier alone: true (and `info` set, and `found` when given)
  // when the call passes by equality with one of the last accepted ones;
  // false says nothing, run check().
  bool matches_remembered(std::span<const DLTensor> tensors, CallInfo* info,
                          Remembered* found = nullptr) const noexcept;
  // The same for an op of N tensors (N = the size of `tensors`, which the
  // caller has checked, and at most kMaxRememberedTensors): every loop over
  // the tensors unrolled, their byte ranges kept in registers. The
  // dispatcher's checked call picks the one for its op once.
  template <size_t N>
  bool matches_remembered(const DLTensor* tensors, CallInfo* info, Remembered* found) const noexcept;
  size_t num_tensors() const { return num_tensors_; }
  // Gives the remembered call that `found` names a value (the dispatcher's:
  // the kernel for that call), which the calls that repeat it then find in
  // Remembered::tag. Nothing when that call has been replaced since; a call
  // newly remembered has none.
  void attach(const Remembered& found, const void* tag) const noexcept;
  // check() without the first tier, for a call that matches_remembered() refused.
  CallInfo check_plan(std::span<const DLTensor> tensors) const;
  // The rules that do not look at data: count, devices, dtypes, shapes and
  // strides; data pointers and byte offsets are not read. For tensors that
  // have no data (torch's meta and fake tensors). Same words as check().
  CallInfo check_layout(std::span<const DLTensor> tensors) const;

  // Whether a tensor of the schema is "flattened": then unflatten() must
  // see a call's attributes before its tensors are checked.
  bool has_flattened() const { return !flattened_.empty(); }
  // The call's tensors as the patterns see them (docs/op-schema.md,
  // "flattened"). `attrs` are every attribute in schema order
  // (OpHandle::pack_attrs). Where the attribute a tensor is flattened by is
  // N > 0 and the tensor is given with one dim less than its pattern has (the
  // leading dims counted as the tensor that binds "*" has them), its last dim
  // L is split into [L/N, N]: heads at stride N times the last dim's stride,
  // values as they were. Returns `tensors` itself when nothing is split,
  // else `storage->tensors`, which then point into `storage`. Throws
  // CallError KD-E030 for N < 0, an L that N does not divide, and a tensor
  // given in its pattern's rank whose last dim is not N; anything else
  // wrong (a rank that is neither) is left to check().
  std::span<DLTensor> unflatten(std::span<DLTensor> tensors, std::span<const kd_attr> attrs,
                                UnflattenedCall* storage) const;
  // check_plan() / check_layout() of the tensors `seen` that unflatten()
  // made of `given` with `attrs`: a refusal also says how the flattened
  // ones were split, or that one passed flattened lacks its attribute.
  CallInfo check_plan(std::span<const DLTensor> seen, std::span<const DLTensor> given,
                      std::span<const kd_attr> attrs) const;
  void check_layout(std::span<const DLTensor> seen, std::span<const DLTensor> given,
                    std::span<const kd_attr> attrs) const;

  const OpSchema& schema() const { return schema_; }
  // The shape symbols by slot, and the dtype variable that selects the
  // kernel (empty when none does): the names of kernel constraints.
  std::span<const std::string> symbols() const { return symbols_; }
  // The names constraints and tuned choices read: the shape symbols, then,
  // for an op whose tensors have leading dims ("*") and no symbol called
  // so, "rows": the product of the leading dims (bind_constraint_values).
  std::span<const std::string> constraint_symbols() const { return constraint_symbols_; }
  std::string_view selecting_dtype_var() const { return var_names_.empty() ? std::string_view() : var_names_[0]; }
  // The shape symbols' values in a call that check() accepted, by slot (a
  // symbol that only an absent optional tensor binds reads 0). Reads one
  // dim per symbol.
  void bind_symbols(std::span<const DLTensor> tensors, int64_t* value) const noexcept;
  // bind_symbols(), then the value of "rows" where constraint_symbols()
  // has it: `value` holds kMaxConstraintSymbols.
  void bind_constraint_values(std::span<const DLTensor> tensors, int64_t* value) const noexcept;
  // The one value of bind_constraint_values() at `slot` (< the size of
  // constraint_symbols()), read alone.
  int64_t constraint_value(std::span<const DLTensor> tensors, size_t slot) const noexcept;
  // Where the dim that gives constraint symbol `slot` lies in an accepted
  // call: tensors[tensor].shape[dim], dim counted from the tensor's ndim
  // (negative) when `from_end`. The dim is the symbol's value times a fixed
  // factor, so equal dims mean equal values. Nullopt for "rows" and for a
  // symbol that an optional tensor binds (which may be absent).
  struct DimSource {
    uint8_t tensor;
    int8_t dim;
    bool from_end;
  };
  std::optional<DimSource> dim_source(size_t slot) const {
    if (slot >= symbols_.size()) return std::nullopt;
    const uint8_t owner = symbol_owner_[slot];
    const Tensor& spec = plan_[owner];
    if (spec.flags & kOptional) return std::nullopt;
    if (spec.flags & kLeading) return DimSource{owner, static_cast<int8_t>(symbol_dim_[slot] - spec.num_dims), true};
    return DimSource{owner, static_cast<int8_t>(symbol_dim_[slot]), false};
  }

 private:
  // The plan that walk() follows without branching on what a dim or dtype
  // is: every step reads and writes value slots, and whether it binds a
  // symbol (its first appearance in call order) or matches a bound one is
  // encoded in which slots it uses. Two extra slots of each kind hold 0 and
  // take writes that nobody reads.
  static constexpr uint8_t kZeroSymbol = kMaxSchemaSymbols;
  static constexpr uint8_t kScratchSymbol = kMaxSchemaSymbols + 1;
  static constexpr uint8_t kZeroVar = kMaxSchemaDtypeVars;
  static constexpr uint8_t kScratchVar = kMaxSchemaDtypeVars + 1;

  // A dim after "*": its size goes to slot `bind`, then must equal
  // constant + factor * value[match]. A binding dim reads back its own slot
  // (factor 1), a constant reads the zero slot (factor 0).
  struct Dim {
    int64_t constant;
    int64_t factor;
    uint8_t bind;
    uint8_t match;
    int64_t divisor;  // binds size / divisor (only for a first "2*D"-style dim; else 1)
  };
  enum TensorFlags : uint8_t {
    kLeading = 1,       // the pattern starts with "*"
    kBindsLeading = 2,  // the first tensor with "*": later ones match it
    kStrided = 4,       // any layout allowed
    kDivides = 8,       // one of its dims binds a symbol through a factor
    kRows = 16,         // "rows" layout: last dim contiguous, others any stride
    kOptional = 32,     // may be absent (data NULL, ndim 0)
  };
  struct Tensor {
    // ndim and the packed DLDataType as they lie in a DLTensor, with ndim 0
    // (masked out) after "*" and the dtype 0 when a variable gives it.
    uint64_t header;
    uint64_t header_mask;
    uint8_t var;       // slot whose code is the expected dtype (kZeroVar: concrete)
    uint8_t bind_var;  // slot this tensor's dtype is written to (kScratchVar: none)
    uint8_t flags;
    uint8_t num_dims;  // dims after "*"
    uint8_t first_dim; // index of the first in dims_
    uint8_t num_alts;  // dtypes it may take instead ("dtype": ["T", "float32"])
    std::array<uint32_t, 4> alt_codes;  // packed DLDataType
  };
  // "requires": conditions over the shape symbols, in the language of
  // kernel constraints (constraint.hpp) restricted to symbols and integers,
  // evaluated on the symbol slots of a walk.
  void compile_requirement(const std::string& text, uint64_t bound_symbols);
  // A dtype variable's allowed dtypes (each once, in schema order), flat for
  // the per-call check. Slot 0 is the first variable the tensors use: it
  // selects the kernel.
  struct VarCodes {
    std::array<uint32_t, std::size(kAllDtypes)> codes;  // packed DLDataType
    std::array<Dtype, std::size(kAllDtypes)> dtypes;
    uint32_t count = 0;
  };
  using Accepted = AcceptedCall;
  static constexpr size_t kRemembered = 4;
  // What walk() looks at: a call's data too, or only its layout.
  enum class Scope { call, layout };
  static constexpr size_t kWholeCall = ~size_t{0};  // a refusal about no one argument

  // Whether the N tensors equal `accepted` in its words (with no
  // byte_offset) and no written one overlaps another; then `info` and
  // `found` set.
  template <size_t N>
  bool matches(Accepted& accepted, const DLTensor* tensors, CallInfo* info, Remembered* found) const noexcept;
  // Which of a tensor's data, shape and strides pointers are null, as bits
  // 0, 1 and 2 (a shape is read only when ndim > 0, strides only when given).
  static uint64_t null_pointers(uintptr_t data, const int64_t* shape, const int64_t* strides) {
    return uint64_t{data == 0} | uint64_t{shape == nullptr} << 1 | uint64_t{strides == nullptr} << 2;
  }
  // The ndim in the second of them.
  static int ndim_of(uint64_t header) {
    static_assert(std::endian::native == std::endian::little);
    return static_cast<int32_t>(static_cast<uint32_t>(header));
  }
  // Two 64-bit words of a DLTensor: its device, or its ndim and dtype.
  static uint64_t read_word(const DLTensor& t, size_t offset) {
    static_assert(offsetof(DLTensor, device) + sizeof(DLDevice) == offsetof(DLTensor, ndim) &&
                  offsetof(DLTensor, ndim) + 4 == offsetof(DLTensor, dtype) && sizeof(DLDevice) == 8 &&
                  sizeof(DLDataType) == 4);
    uint64_t w;
    std::memcpy(&w, reinterpret_cast<const char*>(&t) + offset, sizeof w);
    return w;
  }
  // `extents`: walk()'s, for each tensor.
  void remember(std::span<const DLTensor> tensors, Dtype dtype, const uint64_t* extents) const noexcept;
  // Symbol slot s's value in an accepted call; the product of the leading dims.
  int64_t symbol_value(std::span<const DLTensor> tensors, size_t s) const noexcept;
  int64_t rows_value(std::span<const DLTensor> tensors) const noexcept;
  // The rules, once. Each refusal calls refuse(argument, words): the quick
  // pass returns false without building the words, the diagnosing pass
  // throws them. `extents`, when given, receives for each tensor of an
  // accepted call the bytes from its lowest to one past its highest (0 for
  // one absent or without elements).
  template <Scope scope, class Refuse>
  bool walk(std::span<const DLTensor> tensors, CallInfo* info, Refuse&& refuse, uint64_t* extents = nullptr) const;
  template <Scope scope>
  [[noreturn]] void diagnose(std::span<const DLTensor> tensors) const;
  [[noreturn]] void fail(size_t tensor, const std::string& what) const;
  // The words of the refusals that need more than one argument's values.
  std::string header_problem(size_t i, std::span<const DLTensor> tensors) const;
  std::string dim_problem(size_t i, const DLTensor& t, size_t k, int64_t lead, int64_t expected) const;

  // A tensor with "flattened": its attribute, and its pattern's dims.
  struct Flattened {
    uint8_t tensor;
    uint8_t attr;      // index among the schema's attributes
    uint8_t num_dims;  // dims after "*"
    bool leading;      // the pattern starts with "*"
  };
  // " (given flattened: 'query' [7, 42] split by head_size = 14 into
  // [7, 3, 14])": what a refusal of a call with flattened tensors adds.
  std::string unflattened_note(std::span<const DLTensor> seen, std::span<const DLTensor> given,
                               std::span<const kd_attr> attrs) const;

  OpSchema schema_;
  std::vector<Tensor> plan_;
  std::vector<Flattened> flattened_;
  size_t num_tensors_ = 0;  // plan_.size()
  std::vector<Dim> dims_;
  std::vector<Constraint> requirements_;
  std::array<VarCodes, kMaxSchemaDtypeVars> var_codes_{};
  Dtype fixed_dtype_ = Dtype::float32;  // the call's dtype when no variable selects it
  std::vector<std::string> symbols_;
  std::vector<std::string> constraint_symbols_;  // symbols_, then "rows" where the op has leading dims
  std::vector<std::string> var_names_;  // by slot
  // The argument that binds each symbol slot, each dtype variable slot, and
  // the leading dims: the "from 'x'" of a refusal.
  std::array<uint8_t, kMaxSchemaSymbols> symbol_owner_{};
  std::array<uint8_t, kMaxSchemaSymbols> symbol_dim_{};       // its dim in the owner, after "*"
  std::array<int64_t, kMaxSchemaSymbols> symbol_divisor_{};  // that dim is divisor * symbol
  // Bit s: symbol_divisor_[s] != 1. A test of the divisor itself compiles
  // to the division (x / 1 is x), which costs more than the rest of the read.
  uint32_t symbol_divides_ = 0;
  std::array<uint8_t, kMaxSchemaDtypeVars> var_owner_{};
  uint8_t leading_owner_ = 0;
  uint32_t written_ = 0;  // bit i: the op writes tensor i ("written" or "inplace")
  mutable std::array<Accepted, kRemembered> accepted_;
  mutable std::atomic<uint32_t> next_accepted_{0};  // the entry the next new signature replaces
};

// DLDevice as one word (type in the low half), for cheap comparisons.
inline uint64_t device_word(DLDevice d) {
  return static_cast<uint32_t>(d.device_type) | uint64_t{static_cast<uint32_t>(d.device_id)} << 32;
}

// DLDataType packed into one word, for cheap comparisons.
inline uint32_t pack_dtype(DLDataType t) {
  return static_cast<uint32_t>(t.code) | static_cast<uint32_t>(t.bits) << 8 | static_cast<uint32_t>(t.lanes) << 16;
}

// True when `t` has no element: it addresses no memory, whatever its strides.
inline bool is_empty(const DLTensor& t) {
  for (int i = 0; i < t.ndim; ++i) {
    if (t.shape[i] == 0) return true;
  }
  return false;
}

// True when `t` is laid out densely in row-major order (strides NULL or
// matching; dims of size 1 may have any stride, and so may every dim of a
// tensor with no element, as torch's own is_contiguous() says).
inline bool is_contiguous(const DLTensor& t) {
  if (t.strides == nullptr) return true;
  int64_t expected = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    if (t.shape[i] != 1 && t.strides[i] != expected) return is_empty(t);
    expected *= t.shape[i];
  }
  return true;
}
// True when an op schema's optional tensor is absent: no data, no dims.
inline bool is_absent(const DLTensor& t) { return t.data == nullptr && t.ndim == 0; }

// True when `t` fits the "rows" layout: its last dim contiguous (stride 1,
// or size 1), every dim of size > 1 before it a stride >= 1, and at most 8
// leading dims (kd_plugin::RowLayout's limit).
inline bool fits_rows(const DLTensor& t) {
  if (t.strides == nullptr || t.ndim == 0) return true;
  if (t.ndim > 9) return false;
  if (t.shape[t.ndim - 1] > 1 && t.strides[t.ndim - 1] != 1) return false;
  for (int i = 0; i < t.ndim - 1; ++i) {
    if (t.shape[i] > 1 && t.strides[i] < 1) return false;
  }
  return true;
}

// Bytes of the tensor's elements, or nullopt when a dim is negative or the
// element or byte count overflows int64.
std::optional<uint64_t> checked_bytes(const DLTensor& t) noexcept;
// Bytes from the first element to one past the last, following the strides
// (checked_bytes for a tensor without strides), or nullopt on overflow.
std::optional<uint64_t> checked_extent(const DLTensor& t) noexcept;
// Why the tensor's byte_offset is unusable, or empty: not a multiple of the
// element size, overflowing with the data pointer and `bytes`, or (cpu)
// putting the data outside mapped memory.
std::string byte_offset_problem(const DLTensor& t, uint64_t bytes);
// Whether two tensors may share a byte of memory: false when they are
// absent, empty, or proven apart (slices of one buffer that interleave, such
// as q and k of a fused QKV output, are told apart exactly); true when they
// share one, or their layouts do not nest so that this can be proven.
bool may_overlap(const DLTensor& a, const DLTensor& b) noexcept;
// The bytes below a tensor's first element that its negative strides reach,
// for one whose extent does not overflow (checked_extent).
inline uint64_t bytes_below(const DLTensor& t) noexcept {
  if (t.strides == nullptr) return 0;
  uint64_t below = 0;
  for (int k = 0; k < t.ndim; ++k) {
    if (t.strides[k] < 0) below += static_cast<uint64_t>(-t.strides[k]) * static_cast<uint64_t>(t.shape[k] - 1);
  }
  return below * static_cast<uint64_t>((int64_t{t.dtype.bits} * t.dtype.lanes + 7) / 8);
}
// The first pair (`writer`, `other`) of a call's tensors, `writer` one whose
// bit is set in `written`, whose memory may overlap (may_overlap); false
// when there is none. No allocation: the byte range of each tensor first,
// the finer test only for pairs whose ranges meet.
bool find_written_overlap(std::span<const DLTensor> tensors, uint32_t written, size_t* writer, size_t* other) noexcept;

inline constexpr size_t kMaxRememberedTensors = AcceptedCall::kTensors;

// Whether the byte range [low[i], high[i]) of each of the N tensors whose
// bit is set in `written` (none at or above N) meets no other tensor's: the
// common call, decided without branches on the data and without
// find_written_overlap(). False says nothing (an empty range that lies
// inside a written one takes the long way).
template <size_t N>
[[gnu::always_inline]] inline bool ranges_apart(uint32_t written, const uint64_t* low, const uint64_t* high) noexcept {
  uint64_t meet = 0;
#pragma GCC unroll 8
  for (size_t i = 0; i < N; ++i) {
    if ((written >> i & 1) == 0) continue;
#pragma GCC unroll 8
    for (size_t j = 0; j < N; ++j) {
      if (j != i) meet |= uint64_t{low[i] < high[j]} & uint64_t{low[j] < high[i]};
    }
  }
  return meet == 0;
}

// The first `ndim` (at most 6) values of `given` against `remembered`: zero
// when they are equal. Unrolled: a loop whose trip count changes from
// tensor to tensor costs branch mispredictions on every call. Compares on
// ndim rather than a switch, which became a jump table (an indirect branch
// per tensor).
template <size_t N>
[[gnu::always_inline]] inline uint64_t dims_differ(const int64_t* given,
                                                   const std::array<std::atomic<int64_t>, N>& remembered,
                                                   int ndim) noexcept {
  static_assert(N == 6);
  const auto dim = [&](int k) {
    return static_cast<uint64_t>(given[k] ^ remembered[k].load(std::memory_order_acquire));
  };
  uint64_t diff = 0;
  if (ndim >= 1) diff |= dim(0);
  if (ndim >= 2) diff |= dim(1);
  if (ndim >= 3) diff |= dim(2);
  if (ndim >= 4) diff |= dim(3);
  if (ndim >= 5) diff |= dim(4);
  if (ndim >= 6) diff |= dim(5);
  return diff;
}

// Inline: the whole per-call cost of a checked call's validation.
template <size_t N>
[[gnu::always_inline]] inline bool CompiledSchema::matches(Accepted& accepted, const DLTensor* tensors, CallInfo* info,
                                                           Remembered* found) const noexcept {
  const uint32_t seq = accepted.seq.load(std::memory_order_acquire);
  if ((seq & 1) != 0 || seq == 0) return false;
  std::array<uint64_t, N> low;
  std::array<uint64_t, N> high;
#pragma GCC unroll 8
  for (size_t i = 0; i < N; ++i) {
    // The call's words first: after an acquire load of the entry the
    // compiler reads memory again rather than reuse what it read before.
    const DLTensor& t = tensors[i];
    const uint64_t device = read_word(t, offsetof(DLTensor, device));
    const uint64_t header = read_word(t, offsetof(DLTensor, ndim));
    const int ndim = ndim_of(header);
    const int64_t* shape = t.shape;
    const int64_t* strides = t.strides;
    const auto data = reinterpret_cast<uintptr_t>(t.data);
    const uint64_t byte_offset = t.byte_offset;
    const uint64_t pointers = null_pointers(data, shape, strides);
    const Accepted::Row& row = accepted.rows[i];
    // A byte_offset is checked against the data pointer, so only the plan
    // can pass it.
    if (((device ^ row.device.load(std::memory_order_acquire)) | (header ^ row.header.load(std::memory_order_acquire)) |
         (pointers ^ row.pointers.load(std::memory_order_acquire)) | byte_offset) != 0) {
      return false;
    }
    // ndim and the null pointers now equal those of an accepted call (each
    // word is stored whole, so even from a torn read): ndim is at most
    // kDims, and the shape is not null when ndim > 0.
    uint64_t diff = dims_differ(shape, row.shape, ndim);
    if (strides != nullptr) diff |= dims_differ(strides, row.strides, ndim);
    if (diff != 0) return false;
    low[i] = data + row.low.load(std::memory_order_acquire);
    high[i] = low[i] + row.extent.load(std::memory_order_acquire);
  }
  info->dtype = accepted.dtype.load(std::memory_order_acquire);
  info->device = tensors[0].device;
  found->entry = &accepted;
  found->seq = seq;
  found->tag = accepted.tag.load(std::memory_order_acquire);
  // The words are loaded with acquire and stored with release (plain moves
  // on x86): a word from a write in progress makes its odd sequence visible
  // here, so a torn read is never taken. No fences, which ThreadSanitizer
  // cannot follow.
  if (accepted.seq.load(std::memory_order_relaxed) != seq) return false;
  // Memory is not part of the remembered words: a written tensor that
  // overlaps another argument goes on to the plan, which refuses it.
  if (written_ == 0 || ranges_apart<N>(written_, low.data(), high.data())) [[likely]] return true;
  size_t writer = 0;
  size_t other = 0;
  return !find_written_overlap(std::span<const DLTensor>(tensors, N), written_, &writer, &other);
}

template <size_t N>
[[gnu::always_inline]] inline bool CompiledSchema::matches_remembered(const DLTensor* tensors, CallInfo* info,
                                                                      Remembered* found) const noexcept {
  for (Accepted& accepted : accepted_) {
    if (matches<N>(accepted, tensors, info, found)) return true;
  }
  return false;
}

inline bool CompiledSchema::matches_remembered(std::span<const DLTensor> tensors, CallInfo* info,
                                               Remembered* found) const noexcept {
  if (tensors.size() != num_tensors_) return false;
  Remembered ignored;
  Remembered* out = found != nullptr ? found : &ignored;
  const DLTensor* t = tensors.data();
  static_assert(kMaxRememberedTensors == 8);
  switch (tensors.size()) {
    case 1: return matches_remembered<1>(t, info, out);
    case 2: return matches_remembered<2>(t, info, out);
    case 3: return matches_remembered<3>(t, info, out);
    case 4: return matches_remembered<4>(t, info, out);
    case 5: return matches_remembered<5>(t, info, out);
    case 6: return matches_remembered<6>(t, info, out);
    case 7: return matches_remembered<7>(t, info, out);
    case 8: return matches_remembered<8>(t, info, out);
    default: return false;
  }
}

inline int64_t CompiledSchema::symbol_value(std::span<const DLTensor> tensors, size_t s) const noexcept {
  const DLTensor& t = tensors[symbol_owner_[s]];
  const Tensor& spec = plan_[symbol_owner_[s]];
  if ((spec.flags & kOptional) && is_absent(t)) return 0;
  const int64_t lead = (spec.flags & kLeading) ? t.ndim - spec.num_dims : 0;
  const int64_t dim = t.shape[lead + symbol_dim_[s]];
  return (symbol_divides_ >> s & 1) != 0 ? dim / symbol_divisor_[s] : dim;  // most symbols: no division
}

inline void CompiledSchema::bind_symbols(std::span<const DLTensor> tensors, int64_t* value) const noexcept {
  for (size_t s = 0; s < symbols_.size(); ++s) value[s] = symbol_value(tensors, s);
}

inline int64_t CompiledSchema::rows_value(std::span<const DLTensor> tensors) const noexcept {
  const DLTensor& owner = tensors[leading_owner_];
  const int64_t lead = int64_t{owner.ndim} - plan_[leading_owner_].num_dims;
  int64_t rows = 1;
  for (int64_t d = 0; d < lead; ++d) rows *= owner.shape[d];  // the check bounded the sizes' product
  return rows;
}

inline int64_t CompiledSchema::constraint_value(std::span<const DLTensor> tensors, size_t slot) const noexcept {
  return slot < symbols_.size() ? symbol_value(tensors, slot) : rows_value(tensors);
}

inline void CompiledSchema::bind_constraint_values(std::span<const DLTensor> tensors, int64_t* value) const noexcept {
  bind_symbols(tensors, value);
  if (constraint_symbols_.size() == symbols_.size()) return;
  value[symbols_.size()] = rows_value(tensors);
}

}  // namespace kdispatch
