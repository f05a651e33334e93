#include "schema_check.hpp"

#include <fmt/format.h>

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <limits>

#include "kdispatch/device.hpp"
#include "kdispatch/error.hpp"

namespace kdispatch {

namespace {

std::string shape_str(const DLTensor& t) {
  std::vector<int64_t> dims(t.shape, t.shape + t.ndim);
  return fmt::format("[{}]", fmt::join(dims, ", "));
}

std::string pattern_str(const TensorArg& arg) {
  std::vector<std::string> tokens;
  for (const auto& tok : arg.shape) tokens.push_back(tok.str());
  return fmt::format("[{}]", fmt::join(tokens, ", "));
}

std::string dtype_str(DLDataType t) {
  if (auto d = from_dlpack(t)) return std::string(dtype_name(*d));
  return describe_unknown_dlpack(t);
}

std::string device_str(DLDevice d) {
  if (auto type = from_dlpack_device_type(d.device_type)) {
    return fmt::format("{}:{}", device_type_name(*type), d.device_id);
  }
  return fmt::format("<dlpack device type {}>:{}", static_cast<int>(d.device_type), d.device_id);
}

}  // namespace

std::optional<uint64_t> checked_bytes(const DLTensor& t) noexcept {
  int64_t n = 1;
  for (int i = 0; i < t.ndim; ++i) {
    if (t.shape[i] < 0 || __builtin_mul_overflow(n, t.shape[i], &n)) return std::nullopt;
  }
  const int64_t item = (int64_t{t.dtype.bits} * t.dtype.lanes + 7) / 8;
  int64_t bytes = 0;
  if (__builtin_mul_overflow(n, item, &bytes)) return std::nullopt;
  return static_cast<uint64_t>(bytes);
}

std::optional<uint64_t> checked_extent(const DLTensor& t) noexcept {
  if (t.strides == nullptr || is_empty(t)) return checked_bytes(t);
  int64_t last = 0;  // offset of the last element, in elements
  for (int i = 0; i < t.ndim; ++i) {
    if (t.shape[i] < 0) return std::nullopt;
    int64_t step = 0;
    if (__builtin_mul_overflow(t.shape[i] - 1, t.strides[i] < 0 ? -t.strides[i] : t.strides[i], &step) ||
        __builtin_add_overflow(last, step, &last)) {
      return std::nullopt;
    }
  }
  const int64_t item = (int64_t{t.dtype.bits} * t.dtype.lanes + 7) / 8;
  int64_t bytes = 0;
  if (__builtin_add_overflow(last, 1, &last) || __builtin_mul_overflow(last, item, &bytes)) return std::nullopt;
  return static_cast<uint64_t>(bytes);
}

namespace {

// Where a tensor's bytes lie: from `base` (its lowest byte) over `extent`
// bytes, through the dims of size > 1 and stride != 0, strides in bytes made
// positive and sorted from the largest down. Dims of stride 0 add no memory.
struct Footprint {
  uint64_t base = 0;
  uint64_t extent = 0;
  int num_dims = 0;
  std::array<int64_t, 2 * 16> dims;  // size, stride in bytes; per dim
};

// False on overflow: the caller then takes the tensors as overlapping.
bool footprint(const DLTensor& t, Footprint* f) noexcept {
  const int64_t item = (int64_t{t.dtype.bits} * t.dtype.lanes + 7) / 8;
  uint64_t base = 0;
  if (__builtin_add_overflow(reinterpret_cast<uintptr_t>(t.data), t.byte_offset, &base)) return false;
  if (t.ndim > 16) return false;
  int64_t extent = item;
  int64_t dense = item;  // the stride of a dense dim, for tensors without strides
  int n = 0;
  for (int i = t.ndim - 1; i >= 0; --i) {
    const int64_t size = t.shape[i];
    int64_t stride = 0;
    if (t.strides == nullptr) {
      stride = dense;
      if (__builtin_mul_overflow(dense, size, &dense)) return false;
    } else if (__builtin_mul_overflow(t.strides[i], item, &stride)) {
      return false;
    }
    if (size <= 1 || stride == 0) continue;
    int64_t span = 0;
    if (stride == std::numeric_limits<int64_t>::min() || __builtin_mul_overflow(size - 1, stride < 0 ? -stride : stride, &span) ||
        __builtin_add_overflow(extent, span, &extent)) {
      return false;
    }
    if (stride < 0) {
      if (base < static_cast<uint64_t>(span)) return false;
      base -= static_cast<uint64_t>(span);
      stride = -stride;
    }
    // Insertion by stride, largest first.
    int at = n;
    while (at > 0 && f->dims[2 * (at - 1) + 1] < stride) {
      f->dims[2 * at] = f->dims[2 * (at - 1)];
      f->dims[2 * at + 1] = f->dims[2 * (at - 1) + 1];
      --at;
    }
    f->dims[2 * at] = size;
    f->dims[2 * at + 1] = stride;
    ++n;
  }
  f->base = base;
  f->extent = static_cast<uint64_t>(extent);
  f->num_dims = n;
  return base + f->extent >= base;
}

int64_t floor_div(int64_t a, int64_t b) { return a / b - (a % b != 0 && (a < 0) != (b < 0)); }

// Whether two footprints may share a byte. Both are walked from their
// largest stride down: at each level, where the rows (the tensor below the
// dim of the largest stride S) of each fit in S bytes and one tensor's
// rows start at a fixed offset from the other's, a row of one can only meet
// the row of the other that starts less than S before it, and that pair
// stands for all: the walk goes down into it. Slices of one parent tensor
// (q and k of a fused QKV output, even and odd columns) are told apart
// exactly; layouts that do not nest that way count as overlapping.
bool footprints_overlap(const Footprint& a, const Footprint& b) noexcept {
  if (a.base + a.extent <= b.base || b.base + b.extent <= a.base) return false;
  // b's base relative to a's, and the extents below the dims walked so far.
  int64_t offset = static_cast<int64_t>(b.base - a.base);
  int64_t extent_a = static_cast<int64_t>(a.extent);
  int64_t extent_b = static_cast<int64_t>(b.extent);
  int ia = 0;
  int ib = 0;
  while (true) {
    if (offset >= extent_a || offset + extent_b <= 0) return false;
    if (ia == a.num_dims && ib == b.num_dims) return true;
    const int64_t stride_a = ia < a.num_dims ? a.dims[2 * ia + 1] : 0;
    const int64_t stride_b = ib < b.num_dims ? b.dims[2 * ib + 1] : 0;
    const int64_t s = std::max(stride_a, stride_b);
    const int64_t rows_a = stride_a == s ? a.dims[2 * ia] : 1;
    const int64_t rows_b = stride_b == s ? b.dims[2 * ib] : 1;
    const int64_t row_a = extent_a - (rows_a - 1) * s;
    const int64_t row_b = extent_b - (rows_b - 1) * s;
    if (row_a > s || row_b > s) return true;
    // b's row j starts at a's row (shift + j) plus `within`.
    int64_t shift = floor_div(offset, s);
    int64_t within = offset - shift * s;
    if (within + row_b > s) {
      if (row_a > within) return true;
      within -= s;
      ++shift;
    }
    if (shift >= rows_a || shift + rows_b <= 0) return false;
    if (stride_a == s) ++ia;
    if (stride_b == s) ++ib;
    offset = within;
    extent_a = row_a;
    extent_b = row_b;
  }
}

bool present_with_data(const DLTensor& t) { return t.data != nullptr && !is_empty(t); }

}  // namespace

bool may_overlap(const DLTensor& a, const DLTensor& b) noexcept {
  if (!present_with_data(a) || !present_with_data(b)) return false;
  Footprint fa;
  Footprint fb;
  if (!footprint(a, &fa) || !footprint(b, &fb)) return true;
  return footprints_overlap(fa, fb);
}

namespace {

// The bytes a present tensor with elements addresses, relative to its
// first element: `below` bytes before it (reached through negative strides)
// and `extent` bytes from there to one past its last. False on overflow.
bool byte_span(const DLTensor& t, uint64_t* below, uint64_t* extent) noexcept {
  const std::optional<uint64_t> bytes = t.strides == nullptr ? checked_bytes(t) : checked_extent(t);
  if (!bytes) return false;
  // Negative strides reach below the first element.
  *below = bytes_below(t);
  *extent = *bytes;
  return true;
}

}  // namespace

bool find_written_overlap(std::span<const DLTensor> tensors, uint32_t written, size_t* writer, size_t* other) noexcept {
  // The byte ranges first, without strides sorted: most pairs end there.
  std::array<uint64_t, 2 * kMaxSchemaTensors> range;
  const size_t n = std::min(tensors.size(), kMaxSchemaTensors);
  for (size_t i = 0; i < n; ++i) {
    const DLTensor& t = tensors[i];
    range[2 * i] = range[2 * i + 1] = 0;
    if (!present_with_data(t)) continue;
    const uint64_t start = reinterpret_cast<uintptr_t>(t.data) + t.byte_offset;
    uint64_t below = 0;
    uint64_t extent = 0;
    if (!byte_span(t, &below, &extent)) {
      range[2 * i + 1] = ~uint64_t{0};  // unknown: overlapping everything
      continue;
    }
    range[2 * i] = start - below;
    range[2 * i + 1] = start - below + extent;
  }
  for (size_t i = 0; i < n; ++i) {
    if (((written >> i) & 1u) == 0 || range[2 * i] == range[2 * i + 1]) continue;
    for (size_t j = 0; j < n; ++j) {
      if (j == i || range[2 * j] == range[2 * j + 1]) continue;
      if (range[2 * i + 1] <= range[2 * j] || range[2 * j + 1] <= range[2 * i]) continue;
      if (!may_overlap(tensors[i], tensors[j])) continue;
      *writer = i;
      *other = j;
      return true;
    }
  }
  return false;
}

namespace {

// Highest user-space address plus one: a tensor ending above it cannot be
// memory of this process.
#if defined(__x86_64__) || defined(__aarch64__)
constexpr uint64_t kAddressSpaceEnd = uint64_t{1} << 47;
#else
constexpr uint64_t kAddressSpaceEnd = ~uint64_t{0};
#endif

// Whether the page holding `address` is mapped in this process. msync on a
// page that is not mapped fails with ENOMEM, and on one that is mapped
// with MS_ASYNC writes nothing back: the cheapest probe there is.
bool page_mapped(uint64_t address) noexcept {
  const auto page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  void* start = reinterpret_cast<void*>(address & ~(page - 1));
  return ::msync(start, page, MS_ASYNC) == 0 || errno != ENOMEM;
}

}  // namespace

std::string byte_offset_problem(const DLTensor& t, uint64_t bytes) {
  if (t.byte_offset == 0) return {};
  const uint64_t item = (uint64_t{t.dtype.bits} * t.dtype.lanes + 7) / 8;
  if (item > 1 && t.byte_offset % item != 0) {
    return fmt::format("byte_offset {} is not a multiple of the element size ({} bytes)", t.byte_offset, item);
  }
  const auto data = reinterpret_cast<uintptr_t>(t.data);
  uint64_t start = 0;
  uint64_t end = 0;
  if (__builtin_add_overflow(uint64_t{data}, t.byte_offset, &start) || __builtin_add_overflow(start, bytes, &end) ||
      t.byte_offset > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return fmt::format("byte_offset {} with {} bytes of data overflows 64 bits", t.byte_offset, bytes);
  }
  if (t.device.device_type != kDLCPU || bytes == 0) return {};
  if (end > kAddressSpaceEnd || !page_mapped(start) || !page_mapped(end - 1)) {
    return fmt::format("byte_offset {} puts the tensor's {} bytes outside this process's memory", t.byte_offset,
                       bytes);
  }
  return {};
}

CompiledSchema::CompiledSchema(const OpSchema& schema) : schema_(schema) {
  const auto limit = [&](size_t n, size_t max, const char* what) {
    if (n > max) {
      throw ManifestError(ErrorCode::manifest_bad_field,
                          fmt::format("{}: op '{}' has {} {}, at most {} are supported", schema.source, schema.op, n,
                                      what, max));
    }
  };
  limit(schema.tensors.size(), kMaxSchemaTensors, "tensors");
  limit(schema.attrs.size(), kMaxSchemaAttrs, "attributes");
  const auto symbol_slot = [&](const std::string& name) {
    auto it = std::find(symbols_.begin(), symbols_.end(), name);
    if (it != symbols_.end()) return static_cast<uint8_t>(it - symbols_.begin());
    symbols_.push_back(name);
    limit(symbols_.size(), kMaxSchemaSymbols, "shape symbols");
    return static_cast<uint8_t>(symbols_.size() - 1);
  };
  limit(schema.dtype_vars.size(), kMaxSchemaDtypeVars, "dtype variables");
  // Variables get slots in the order tensors use them; the first one used
  // selects the kernel. Declared but unused ones constrain nothing.
  const auto var_slot = [&](const std::string& name) -> std::optional<uint8_t> {
    for (size_t v = 0; v < var_names_.size(); ++v) {
      if (var_names_[v] == name) return static_cast<uint8_t>(v);
    }
    auto it = std::find_if(schema.dtype_vars.begin(), schema.dtype_vars.end(),
                           [&](const auto& var) { return var.first == name; });
    if (it == schema.dtype_vars.end()) return std::nullopt;
    VarCodes& codes = var_codes_[var_names_.size()];
    for (Dtype d : it->second) {
      const auto end = codes.dtypes.begin() + codes.count;
      if (std::find(codes.dtypes.begin(), end, d) != end) continue;
      codes.codes[codes.count] = pack_dtype(to_dlpack(d));
      codes.dtypes[codes.count] = d;
      ++codes.count;
    }
    var_names_.push_back(name);
    return static_cast<uint8_t>(var_names_.size() - 1);
  };
  bool seen_leading = false;
  uint64_t bound_symbols = 0;
  for (const TensorArg& arg : schema.tensors) {
    Tensor t{};
    t.header_mask = ~uint64_t{0};
    t.var = kZeroVar;
    t.bind_var = kScratchVar;
    t.first_dim = static_cast<uint8_t>(dims_.size());
    if (arg.layout == Layout::any) t.flags |= kStrided;
    if (arg.layout == Layout::rows) t.flags |= kRows;
    if (arg.optional) t.flags |= kOptional;
    if (arg.written || arg.inplace) written_ |= uint32_t{1} << plan_.size();
    const auto refuse_schema = [&](const std::string& why) {
      throw ManifestError(ErrorCode::manifest_bad_field,
                          fmt::format("{}: op '{}', tensor '{}': {}", schema.source, schema.op, arg.name, why));
    };
    if (arg.optional && plan_.empty()) refuse_schema("the first tensor cannot be optional: it gives the call's device");
    const size_t vars_before = var_names_.size();
    if (auto slot = var_slot(arg.dtype)) {
      t.var = *slot;
      if (var_names_.size() > vars_before) {  // the variable's first tensor
        if (arg.optional || !arg.dtype_alternatives.empty()) {
          refuse_schema(fmt::format("the first tensor of dtype variable {} binds it: it cannot be optional or "
                                    "list other dtypes",
                                    arg.dtype));
        }
        t.bind_var = *slot;
        var_owner_[*slot] = static_cast<uint8_t>(plan_.size());
      }
    } else if (auto d = parse_dtype(arg.dtype)) {
      t.header = uint64_t{pack_dtype(to_dlpack(*d))} << 32;
      if (plan_.empty()) fixed_dtype_ = *d;
    }
    if (arg.dtype_alternatives.size() > t.alt_codes.size()) refuse_schema("lists more than 4 other dtypes");
    for (const std::string& name : arg.dtype_alternatives) {
      if (auto d = parse_dtype(name)) t.alt_codes[t.num_alts++] = pack_dtype(to_dlpack(*d));
    }
    const auto push = [&](Dim d) {
      limit(t.num_dims + 1u, kMaxSchemaDims, "dims in one shape pattern");
      dims_.push_back(d);
      ++t.num_dims;
    };
    const auto symbol_dim = [&](const std::string& name, int64_t factor) {
      const uint8_t slot = symbol_slot(name);
      if (bound_symbols & (uint64_t{1} << slot)) {
        if (schema.tensors[symbol_owner_[slot]].optional) {
          refuse_schema(fmt::format("uses shape symbol {}, which only the optional tensor '{}' binds", name,
                                    schema.tensors[symbol_owner_[slot]].name));
        }
        push({0, factor, kScratchSymbol, slot, 1});
        return;
      }
      bound_symbols |= uint64_t{1} << slot;
      symbol_owner_[slot] = static_cast<uint8_t>(plan_.size());
      symbol_dim_[slot] = t.num_dims;
      symbol_divisor_[slot] = factor;
      if (factor != 1) {
        t.flags |= kDivides;
        symbol_divides_ |= uint32_t{1} << slot;
      }
      push({0, factor, slot, slot, factor});
    };
    for (const ShapeToken& tok : arg.shape) {
      switch (tok.kind) {
        case ShapeToken::Kind::leading:
          t.flags |= kLeading;
          if (!seen_leading && arg.optional) refuse_schema("an optional tensor cannot be the first with \"*\"");
          if (!seen_leading) {
            t.flags |= kBindsLeading;
            leading_owner_ = static_cast<uint8_t>(plan_.size());
          }
          seen_leading = true;
          break;
        case ShapeToken::Kind::symbol: symbol_dim(tok.symbol, 1); break;
        case ShapeToken::Kind::constant: push({tok.value, 0, kScratchSymbol, kZeroSymbol, 1}); break;
        case ShapeToken::Kind::multiple: symbol_dim(tok.symbol, tok.value); break;
      }
    }
    if (t.flags & kLeading) {
      t.header_mask = ~uint64_t{0} << 32;  // ndim varies; checked against num_dims apart
    } else {
      t.header |= t.num_dims;
    }
    plan_.push_back(t);
  }
  num_tensors_ = plan_.size();
  for (const std::string& text : schema.requirements) compile_requirement(text, bound_symbols);
  // "flattened": the attribute that lets a call pass the tensor with its
  // last two dims as one.
  for (size_t i = 0; i < schema.tensors.size(); ++i) {
    const TensorArg& arg = schema.tensors[i];
    if (arg.flattened.empty()) continue;
    const auto refuse_schema = [&](const std::string& why) {
      throw ManifestError(ErrorCode::manifest_bad_field,
                          fmt::format("{}: op '{}', tensor '{}', \"flattened\": {}", schema.source, schema.op,
                                      arg.name, why));
    };
    const auto attr = std::find_if(schema.attrs.begin(), schema.attrs.end(),
                                   [&](const AttrArg& a) { return a.name == arg.flattened; });
    if (attr == schema.attrs.end()) refuse_schema(fmt::format("the op has no attribute '{}'", arg.flattened));
    const AttrValue zero = int64_t{0};
    if (attr->type != AttrType::int_ || attr->default_value != zero) {
      refuse_schema(fmt::format("attribute '{}' must be an int with default 0 (0: the tensor has its pattern's "
                                "shape)",
                                arg.flattened));
    }
    const Tensor& t = plan_[i];
    if (t.num_dims < 2) refuse_schema("the shape pattern needs two dims after \"*\" to flatten into one");
    if ((t.flags & kBindsLeading) != 0) {
      refuse_schema("the first tensor with \"*\" cannot be flattened: its rank gives the leading dims that tell "
                    "the flattened form of the others from the plain one");
    }
    if (flattened_.size() == kMaxFlattened) refuse_schema(fmt::format("at most {} tensors of an op", kMaxFlattened));
    flattened_.push_back({static_cast<uint8_t>(i), static_cast<uint8_t>(attr - schema.attrs.begin()), t.num_dims,
                          (t.flags & kLeading) != 0});
  }
  constraint_symbols_ = symbols_;
  const bool has_leading = std::any_of(plan_.begin(), plan_.end(), [](const Tensor& t) {
    return (t.flags & kBindsLeading) != 0;
  });
  if (has_leading && std::find(symbols_.begin(), symbols_.end(), "rows") == symbols_.end()) {
    constraint_symbols_.push_back("rows");
  }
}

// "2*R <= D": a condition over shape symbols that tensors other than
// optional ones bind (docs/op-schema.md).
void CompiledSchema::compile_requirement(const std::string& text, uint64_t bound_symbols) {
  const auto refuse = [&](const std::string& why) {
    throw ManifestError(ErrorCode::manifest_bad_field, fmt::format("{}: op '{}', requirement \"{}\": {}",
                                                                   schema_.source, schema_.op, text, why));
  };
  ConstraintNames names{symbols_, {}, {}};
  names.symbols_only = true;
  std::optional<Constraint> req;
  try {
    req = Constraint::compile(text, &names);
  } catch (const std::invalid_argument& e) {
    refuse(e.what());
  }
  for (const Constraint::Name& n : req->names()) {
    const auto s = static_cast<uint8_t>(n.slot);
    if (!(bound_symbols & (uint64_t{1} << s)) || schema_.tensors[symbol_owner_[s]].optional) {
      refuse(fmt::format("symbol {} is bound only by an optional tensor", n.name));
    }
  }
  requirements_.push_back(std::move(*req));
}

// Records an accepted call for matches_remembered(), over the oldest entry. A
// writer that finds another one at work on that entry leaves it be: the
// entries are a cache, and either call is fine.
void CompiledSchema::remember(std::span<const DLTensor> tensors, Dtype dtype,
                              const uint64_t* extents) const noexcept {
  if (tensors.size() > Accepted::kTensors) return;
  for (const DLTensor& t : tensors) {
    if (static_cast<uint32_t>(t.ndim) > Accepted::kDims) return;
  }
  const uint32_t entry = next_accepted_.load(std::memory_order_relaxed);
  next_accepted_.store((entry + 1) % kRemembered, std::memory_order_relaxed);
  Accepted& accepted = accepted_[entry % kRemembered];
  uint32_t seq = accepted.seq.load(std::memory_order_relaxed);
  if ((seq & 1) != 0 || !accepted.seq.compare_exchange_strong(seq, seq + 1, std::memory_order_relaxed)) return;
  // Release stores: each one publishes the odd sequence before itself.
  for (size_t i = 0; i < tensors.size(); ++i) {
    const DLTensor& t = tensors[i];
    Accepted::Row& row = accepted.rows[i];
    const uint64_t pointers = null_pointers(reinterpret_cast<uintptr_t>(t.data), t.shape, t.strides);
    row.device.store(read_word(t, offsetof(DLTensor, device)), std::memory_order_release);
    row.header.store(read_word(t, offsetof(DLTensor, ndim)), std::memory_order_release);
    row.pointers.store(pointers, std::memory_order_release);
    // The range find_written_overlap() takes for the tensor (byte_span),
    // less its data pointer; empty for one absent or without elements.
    row.low.store(extents[i] != 0 ? uint64_t{0} - bytes_below(t) : 0, std::memory_order_release);
    row.extent.store(extents[i], std::memory_order_release);
    for (int k = 0; k < t.ndim; ++k) row.shape[k].store(t.shape[k], std::memory_order_release);
    if (t.strides != nullptr) {
      for (int k = 0; k < t.ndim; ++k) row.strides[k].store(t.strides[k], std::memory_order_release);
    }
  }
  accepted.dtype.store(dtype, std::memory_order_release);
  accepted.tag.store(nullptr, std::memory_order_release);
  // seq + 2 wraps to 0 ("nothing recorded") once in 2^31 writes: harmless.
  accepted.seq.store(seq + 2, std::memory_order_release);
}

// The same protocol as remember(): the entry changes only from the sequence
// `found` read, so a value never lands on another call's words.
void CompiledSchema::attach(const Remembered& found, const void* tag) const noexcept {
  uint32_t seq = found.seq;
  if (!found.entry->seq.compare_exchange_strong(seq, seq + 1, std::memory_order_relaxed)) {
    return;
  }
  found.entry->tag.store(tag, std::memory_order_release);
  found.entry->seq.store(seq + 2, std::memory_order_release);
}

// The compiled plan: see the comment on Dim. `refuse(argument, words)`
// returns false in the quick pass, which never builds the words, and
// throws them in the diagnosing one; the rules and their order are this
// function's, for both.
template <CompiledSchema::Scope scope, class Refuse>
bool CompiledSchema::walk(std::span<const DLTensor> tensors, CallInfo* info, Refuse&& refuse,
                          uint64_t* extents) const {
  const size_t n = plan_.size();
  if (tensors.size() != n || n == 0) [[unlikely]] {
    return refuse(kWholeCall, [&] {
      std::vector<std::string_view> names;
      for (const auto& a : schema_.tensors) names.push_back(a.name);
      return fmt::format("op '{}' takes {} tensors ({}), got {}", schema_.op, n, fmt::join(names, ", "),
                         tensors.size());
    });
  }
  const Tensor* plan = plan_.data();
  const uint64_t device = read_word(tensors[0], offsetof(DLTensor, device));
  std::array<int64_t, kMaxSchemaSymbols + 2> value;
  std::array<uint32_t, kMaxSchemaDtypeVars + 2> code;
  value[kZeroSymbol] = 0;
  code[kZeroVar] = 0;
  Dtype dtype = fixed_dtype_;
  const int64_t* leading = nullptr;
  int64_t leading_count = 0;

  for (size_t i = 0; i < n; ++i) {
    const Tensor& spec = plan[i];
    const DLTensor& t = tensors[i];
    if ((spec.flags & kOptional) && is_absent(t)) {
      if (extents != nullptr) extents[i] = 0;
      continue;
    }
    if (read_word(t, offsetof(DLTensor, device)) != device) [[unlikely]] {
      return refuse(i, [&] {
        return fmt::format("is on {}, but '{}' is on {}: all tensors of a call must be on one device",
                           device_str(t.device), schema_.tensors[0].name, device_str(tensors[0].device));
      });
    }
    const uint64_t header = read_word(t, offsetof(DLTensor, ndim));
    const auto got_code = static_cast<uint32_t>(header >> 32);
    if (spec.bind_var != kScratchVar) {
      // The first tensor of its dtype variable: its dtype must be allowed.
      const VarCodes& var = var_codes_[spec.bind_var];
      uint32_t j = 0;
      while (j < var.count && var.codes[j] != got_code) ++j;
      if (j == var.count) [[unlikely]] {
        return refuse(i, [&] {
          std::vector<std::string_view> allowed;
          for (uint32_t k = 0; k < var.count; ++k) allowed.push_back(dtype_name(var.dtypes[k]));
          return fmt::format("expected dtype {} in [{}], got {}", var_names_[spec.bind_var], fmt::join(allowed, ", "),
                             dtype_str(t.dtype));
        });
      }
      if (spec.bind_var == 0) dtype = var.dtypes[j];  // the first variable selects the kernel
    }
    code[spec.bind_var] = got_code;
    if (const uint64_t diff = (header ^ (spec.header | uint64_t{code[spec.var]} << 32)) & spec.header_mask;
        diff != 0) [[unlikely]] {
      // Only the dtype differs, and it is one the tensor may take instead.
      const bool alternative = (diff & 0xffffffffu) == 0 &&
                               std::find(spec.alt_codes.begin(), spec.alt_codes.begin() + spec.num_alts, got_code) !=
                                   spec.alt_codes.begin() + spec.num_alts;
      if (!alternative) return refuse(i, [&] { return header_problem(i, tensors); });
    }
    const int64_t* sizes = t.shape;
    if ((sizes == nullptr && t.ndim != 0) || t.ndim < 0) [[unlikely]] {
      return refuse(i, [&] { return fmt::format("has {}", t.ndim < 0 ? "a negative ndim" : "a null shape"); });
    }
    int64_t lead = 0;
    if (spec.flags & kLeading) {
      lead = static_cast<int64_t>(t.ndim) - spec.num_dims;
      if (lead < 0) [[unlikely]] return refuse(i, [&] { return header_problem(i, tensors); });
      for (int64_t k = 0; k < lead; ++k) {
        if (sizes[k] < 0) [[unlikely]] {
          return refuse(i, [&] { return fmt::format("has a negative dim in {}", shape_str(t)); });
        }
      }
      if (spec.flags & kBindsLeading) {
        leading = sizes;
        leading_count = lead;
      } else if (lead != leading_count || !std::equal(sizes, sizes + lead, leading)) [[unlikely]] {
        return refuse(i, [&] {
          const DLTensor& owner = tensors[leading_owner_];
          return fmt::format("leading dims of {} differ from those of '{}' {}", shape_str(t),
                             schema_.tensors[leading_owner_].name, shape_str(owner));
        });
      }
      sizes += lead;
    }
    const Dim* dims = dims_.data() + spec.first_dim;
    for (uint32_t k = 0; k < spec.num_dims; ++k) {
      const int64_t size = sizes[k];
      const Dim& d = dims[k];
      if (size < 0) [[unlikely]] {
        return refuse(i, [&] { return fmt::format("has a negative dim in {}", shape_str(t)); });
      }
      if (!(spec.flags & kDivides)) [[likely]] {
        value[d.bind] = size;
      } else {
        if (size % d.divisor != 0) [[unlikely]] {
          return refuse(i, [&] {
            return fmt::format("dim {} must be a multiple of {} ({}*{}), got {}", lead + k, d.divisor, d.divisor,
                               symbols_[d.match], size);
          });
        }
        value[d.bind] = size / d.divisor;
      }
      const int64_t expected = d.constant + d.factor * value[d.match];
      if (size != expected) [[unlikely]] {
        return refuse(i, [&] { return dim_problem(i, t, k, lead, expected); });
      }
    }
    // Sizes whose element or byte count overflows are refused before null
    // data is allowed for an empty tensor: an overflow can read as zero.
    const std::optional<uint64_t> bytes = checked_bytes(t);
    if (!bytes) [[unlikely]] {
      return refuse(i, [&] {
        return fmt::format("shape {} of {} has more elements or bytes than 64 bits count", shape_str(t),
                           dtype_str(t.dtype));
      });
    }
    const auto strides_str = [&] {
      return fmt::format("[{}]", fmt::join(std::span<const int64_t>(t.strides, static_cast<size_t>(t.ndim)), ", "));
    };
    const bool dense = t.strides == nullptr || is_contiguous(t);
    if (!dense && !(spec.flags & kStrided)) [[unlikely]] {
      if (!(spec.flags & kRows)) {
        return refuse(i, [&] {
          return fmt::format("must be contiguous, got strides {} for shape {}", strides_str(), shape_str(t));
        });
      }
      if (!fits_rows(t)) {
        return refuse(i, [&] {
          return fmt::format("must have a contiguous last dim and strides >= 1 before it (layout \"rows\", at most 8 "
                             "leading dims), got strides {} for shape {}",
                             strides_str(), shape_str(t));
        });
      }
    }
    // A strided tensor spans more than its elements: the check of its data
    // covers every byte it addresses.
    const std::optional<uint64_t> extent = dense ? bytes : checked_extent(t);
    if (extents != nullptr && extent) extents[i] = *extent;
    if (!extent) [[unlikely]] {
      return refuse(i, [&] {
        return fmt::format("shape {} with strides {} addresses more bytes than 64 bits count", shape_str(t),
                           strides_str());
      });
    }
    if constexpr (scope == Scope::call) {
      if (t.data == nullptr && *bytes != 0) [[unlikely]] return refuse(i, [] { return std::string("has null data"); });
      if (t.byte_offset != 0) [[unlikely]] {
        if (std::string why = byte_offset_problem(t, *extent); !why.empty()) {
          return refuse(i, [&] { return why; });
        }
      }
    }
  }
  for (const Constraint& req : requirements_) {
    const ConstraintInput input{value.data(), dtype, nullptr};
    if (const Constraint::Result result = req.evaluate(input); result != Constraint::Result::holds) [[unlikely]] {
      return refuse(kWholeCall, [&] {
        std::vector<std::string> bound;
        for (const Constraint::Name& read : req.names()) {
          bound.push_back(fmt::format("{} = {} (from '{}')", read.name, value[static_cast<size_t>(read.slot)],
                                      schema_.tensors[symbol_owner_[static_cast<size_t>(read.slot)]].name));
        }
        return fmt::format("op '{}': the call breaks the schema's requirement {}{}: {}", schema_.op, req.text(),
                           result == Constraint::Result::fails                ? ""
                           : result == Constraint::Result::division_by_zero ? " (division by zero)"
                                                                            : " (integer overflow)",
                           fmt::join(bound, ", "));
      });
    }
  }
  if constexpr (scope == Scope::call) {
    // A written tensor sharing memory with another argument reads values
    // the kernel has already overwritten (or writes one place twice): the
    // in-place tensors of a schema are read and written as one argument,
    // never as two.
    size_t writer = 0;
    size_t other = 0;
    if (written_ != 0 && find_written_overlap(tensors, written_, &writer, &other)) [[unlikely]] {
      return refuse(writer, [&] {
        return fmt::format("is written by the op, and its memory overlaps that of argument {} '{}'; a written "
                           "tensor may share no byte with another argument (pass separate tensors)",
                           other, schema_.tensors[other].name);
      });
    }
  }
  info->dtype = dtype;
  info->device = tensors[0].device;
  return true;
}

// A tensor whose dtype or rank differs from its pattern's: the dtype is
// named first, as the walk checks it first.
std::string CompiledSchema::header_problem(size_t i, std::span<const DLTensor> tensors) const {
  const Tensor& spec = plan_[i];
  const TensorArg& arg = schema_.tensors[i];
  const DLTensor& t = tensors[i];
  const bool alternative =
      std::find(spec.alt_codes.begin(), spec.alt_codes.begin() + spec.num_alts, pack_dtype(t.dtype)) !=
      spec.alt_codes.begin() + spec.num_alts;
  const std::string alternatives =
      arg.dtype_alternatives.empty() ? std::string() : fmt::format(" or {}", fmt::join(arg.dtype_alternatives, ", "));
  if (spec.var != kZeroVar) {
    const DLTensor& var_owner = tensors[var_owner_[spec.var]];
    if (pack_dtype(t.dtype) != pack_dtype(var_owner.dtype) && !alternative) {
      return fmt::format("expected dtype {} = {} (as '{}'){}, got {}", var_names_[spec.var],
                         dtype_str(var_owner.dtype), schema_.tensors[var_owner_[spec.var]].name, alternatives,
                         dtype_str(t.dtype));
    }
  } else if (pack_dtype(t.dtype) != static_cast<uint32_t>(spec.header >> 32) && !alternative) {
    return fmt::format("expected dtype {}{}, got {}", arg.dtype, alternatives, dtype_str(t.dtype));
  }
  if ((t.shape == nullptr && t.ndim != 0) || t.ndim < 0) {
    return fmt::format("has {}", t.ndim < 0 ? "a negative ndim" : "a null shape");
  }
  const bool leading = spec.flags & kLeading;
  return fmt::format("expected shape {} ({}{} dims), got {}", pattern_str(arg), leading ? "at least " : "",
                     spec.num_dims, shape_str(t));
}

// Dim k after the leading ones differs from the constant or the bound
// symbol it must equal.
std::string CompiledSchema::dim_problem(size_t i, const DLTensor& t, size_t k, int64_t lead, int64_t expected) const {
  const Dim& d = dims_[plan_[i].first_dim + k];
  const int64_t at = lead + static_cast<int64_t>(k);
  const int64_t size = t.shape[at];
  if (d.match == kZeroSymbol) {
    return fmt::format("dim {} must be {}, got {} (shape {})", at, d.constant, size, shape_str(t));
  }
  const std::string& symbol = symbols_[d.match];
  const std::string token = d.factor == 1 ? symbol : fmt::format("{}*{}", d.factor, symbol);
  return fmt::format("dim {} is {} = {} (from '{}'), got {} (shape {})", at, token, expected,
                     schema_.tensors[symbol_owner_[d.match]].name, size, shape_str(t));
}

std::span<DLTensor> CompiledSchema::unflatten(std::span<DLTensor> tensors, std::span<const kd_attr> attrs,
                                              UnflattenedCall* storage) const {
  // A call with the wrong number of tensors or attributes is check()'s and
  // pack_attrs()'s to refuse.
  if (flattened_.empty() || tensors.size() != num_tensors_ || attrs.size() != schema_.attrs.size()) return tensors;
  bool copied = false;
  for (size_t k = 0; k < flattened_.size(); ++k) {
    const Flattened& f = flattened_[k];
    const kd_attr& attr = attrs[f.attr];
    if (attr.type != KD_ATTR_TYPE_INT || attr.value.i == 0) continue;
    const int64_t n = attr.value.i;
    const TensorArg& arg = schema_.tensors[f.tensor];
    if (n < 0) {
      throw CallError(ErrorCode::bad_arguments,
                      fmt::format("op '{}', attribute '{}': must be >= 0 (0: '{}' has the shape {}; N > 0: it may "
                                  "also be given with its last two dims as one, split into heads of N), got {}",
                                  schema_.op, arg.flattened, arg.name, pattern_str(arg), n));
    }
    const DLTensor& t = tensors[f.tensor];
    if ((plan_[f.tensor].flags & kOptional) && is_absent(t)) continue;
    if (t.ndim <= 0 || t.shape == nullptr) continue;  // the walk words it
    // The rank of the plain form, with "*" as the tensor that binds it has it.
    int64_t rank = f.num_dims;
    int64_t lead = -1;  // the leading dims "*" stands for, when the tensor has them
    if (f.leading) {
      const DLTensor& owner = tensors[leading_owner_];
      lead = int64_t{owner.ndim} - plan_[leading_owner_].num_dims;
      if (lead < 0 || (owner.shape == nullptr && owner.ndim != 0)) continue;  // the walk refuses the owner first
      rank += lead;
    }
    // Words for a refusal only: the accepted calls format nothing.
    const auto leading_words = [&]() -> std::string {
      if (lead < 0) return {};
      return fmt::format(", * being the {} leading dims of '{}' {}", lead, schema_.tensors[leading_owner_].name,
                         shape_str(tensors[leading_owner_]));
    };
    const int64_t last = t.shape[t.ndim - 1];
    if (t.ndim == rank) {
      if (last == n) continue;  // the plain form, its last dim the attribute's size
      fail(f.tensor, fmt::format("has the shape {} of its pattern {}, so its last dim must be {} = {}, got {} (or "
                                 "pass it flattened, with one dim less{})",
                                 shape_str(t), pattern_str(arg), arg.flattened, n, last, leading_words()));
    }
    if (t.ndim != rank - 1) {
      const ShapeToken& heads = arg.shape[arg.shape.size() - 2];
      const ShapeToken& values = arg.shape.back();
      std::vector<std::string> flat;
      for (size_t d = 0; d + 2 < arg.shape.size(); ++d) flat.push_back(arg.shape[d].str());
      flat.push_back(fmt::format("{}*{}", heads.str(), values.str()));
      fail(f.tensor, fmt::format("with {} = {}, expected [{}] (flattened) or {}{}, got shape {}", arg.flattened, n,
                                 fmt::join(flat, ", "), pattern_str(arg), leading_words(), shape_str(t)));
    }
    if (last < 0) continue;  // the walk words a negative dim
    if (last % n != 0) {
      fail(f.tensor, fmt::format("is given flattened, shape {}: its last dim {} must be a multiple of {} = {}",
                                 shape_str(t), last, arg.flattened, n));
    }
    if (t.ndim + 1 > static_cast<int64_t>(kMaxFlattenedDims)) {
      fail(f.tensor, fmt::format("is given flattened with {} dims, at most {} are supported", t.ndim,
                                 kMaxFlattenedDims - 1));
    }
    int64_t head_stride = 0;
    if (t.strides != nullptr && __builtin_mul_overflow(t.strides[t.ndim - 1], n, &head_stride)) {
      fail(f.tensor, fmt::format("is given flattened with strides whose split overflows 64 bits"));
    }
    if (!copied) {
      std::copy(tensors.begin(), tensors.end(), storage->tensors.begin());
      copied = true;
    }
    int64_t* shape = storage->shapes[k].data();
    std::copy(t.shape, t.shape + t.ndim - 1, shape);
    shape[t.ndim - 1] = last / n;
    shape[t.ndim] = n;
    DLTensor& seen = storage->tensors[f.tensor];
    seen.ndim = t.ndim + 1;
    seen.shape = shape;
    if (t.strides != nullptr) {
      int64_t* strides = storage->strides[k].data();
      std::copy(t.strides, t.strides + t.ndim - 1, strides);
      strides[t.ndim - 1] = head_stride;
      strides[t.ndim] = t.strides[t.ndim - 1];
      seen.strides = strides;
    }
  }
  return copied ? std::span<DLTensor>(storage->tensors.data(), tensors.size()) : tensors;
}

std::string CompiledSchema::unflattened_note(std::span<const DLTensor> seen, std::span<const DLTensor> given,
                                             std::span<const kd_attr> attrs) const {
  if (seen.size() != num_tensors_ || given.size() != num_tensors_ || attrs.size() != schema_.attrs.size()) return {};
  std::vector<std::string> split;
  std::vector<std::string> notes;
  for (const Flattened& f : flattened_) {
    const TensorArg& arg = schema_.tensors[f.tensor];
    const DLTensor& s = seen[f.tensor];
    const DLTensor& g = given[f.tensor];
    if (s.shape != g.shape && s.ndim > 0) {
      split.push_back(fmt::format("'{}' {} split by {} = {} into {}", arg.name, shape_str(g), arg.flattened,
                                  s.shape[s.ndim - 1], shape_str(s)));
      continue;
    }
    // Passed flattened without the attribute: one dim less than the pattern.
    if (attrs[f.attr].type != KD_ATTR_TYPE_INT || attrs[f.attr].value.i != 0 || g.ndim <= 0 || g.shape == nullptr) {
      continue;
    }
    int64_t rank = f.num_dims;
    if (f.leading) {
      const DLTensor& owner = given[leading_owner_];
      rank += int64_t{owner.ndim} - plan_[leading_owner_].num_dims;
    }
    if (g.ndim == rank - 1) {
      notes.push_back(fmt::format("'{}' {} has one dim less than its pattern {}: given flattened, it needs {}",
                                  arg.name, shape_str(g), pattern_str(arg), arg.flattened));
    }
  }
  if (!split.empty()) notes.insert(notes.begin(), fmt::format("given flattened: {}", fmt::join(split, "; ")));
  return notes.empty() ? std::string() : fmt::format(" ({})", fmt::join(notes, "; "));
}

CompiledSchema::CallInfo CompiledSchema::check_plan(std::span<const DLTensor> seen, std::span<const DLTensor> given,
                                                    std::span<const kd_attr> attrs) const {
  try {
    return check_plan(seen);
  } catch (const CallError& e) {
    throw CallError(e.code(), e.message() + unflattened_note(seen, given, attrs));
  }
}

void CompiledSchema::check_layout(std::span<const DLTensor> seen, std::span<const DLTensor> given,
                                  std::span<const kd_attr> attrs) const {
  try {
    check_layout(seen);
  } catch (const CallError& e) {
    throw CallError(e.code(), e.message() + unflattened_note(seen, given, attrs));
  }
}

CompiledSchema::CallInfo CompiledSchema::check_plan(std::span<const DLTensor> tensors) const {
  CallInfo info;
  const auto quiet = [](size_t, const auto&) noexcept { return false; };
  std::array<uint64_t, kMaxSchemaTensors> extents;
  if (!walk<Scope::call>(tensors, &info, quiet, extents.data())) [[unlikely]] diagnose<Scope::call>(tensors);
  remember(tensors, info.dtype, extents.data());
  return info;
}

CompiledSchema::CallInfo CompiledSchema::check_layout(std::span<const DLTensor> tensors) const {
  CallInfo info;
  const auto quiet = [](size_t, const auto&) noexcept { return false; };
  if (!walk<Scope::layout>(tensors, &info, quiet)) diagnose<Scope::layout>(tensors);
  return info;
}

template <CompiledSchema::Scope scope>
void CompiledSchema::diagnose(std::span<const DLTensor> tensors) const {
  CallInfo info;
  walk<scope>(tensors, &info, [this](size_t i, const auto& words) -> bool {
    fail(i, words());
    return false;  // not reached: fail() throws
  });
  // The walk refused the call once and accepted it now: its rules read
  // something that changed in between (another thread writing the shape).
  throw CallError(ErrorCode::bad_arguments,
                  fmt::format("op '{}': arguments refused, then accepted when checked again (were they changed "
                              "while the call was checked?)",
                              schema_.op));
}

void CompiledSchema::fail(size_t tensor, const std::string& what) const {
  if (tensor == kWholeCall) throw CallError(ErrorCode::bad_arguments, what);
  throw CallError(ErrorCode::bad_arguments,
                  fmt::format("op '{}', argument {} '{}': {}", schema_.op, tensor, schema_.tensors[tensor].name, what));
}

}  // namespace kdispatch
