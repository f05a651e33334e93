#include "kdispatch/dispatcher.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <chrono>
#include <cstring>
#include <functional>
#include <utility>
#include <nlohmann/json.hpp>

#include "constraint.hpp"
#include "tuning_set.hpp"
#include "file_check.hpp"
#include "kdispatch/environment.hpp"
#include "kdispatch/log.hpp"
#include "kdispatch/platform.hpp"
#include "schema_check.hpp"

namespace kdispatch {

// An attribute name with two words that hold its first and last characters
// (overlapping loads, zero-padded below 8), so that names of up to 16
// characters compare without a library call.
struct AttrName {
  std::string_view text;
  uint64_t head = 0;
  uint64_t tail = 0;

  explicit AttrName(std::string_view s) : text(s) {
    const char* p = s.data();
    const size_t n = s.size();
    if (n >= 8) {
      std::memcpy(&head, p, 8);
      std::memcpy(&tail, p + n - 8, 8);
    } else if (n >= 4) {
      uint32_t first;
      uint32_t last;
      std::memcpy(&first, p, 4);
      std::memcpy(&last, p + n - 4, 4);
      head = first | uint64_t{last} << 32;
    } else if (n > 0) {
      head = static_cast<unsigned char>(p[0]) | static_cast<unsigned char>(p[n / 2]) << 8 |
             static_cast<unsigned char>(p[n - 1]) << 16;
    }
  }
  bool operator==(const AttrName& o) const {
    return head == o.head && tail == o.tail && text.size() == o.text.size() && (text.size() <= 16 || text == o.text);
  }
};

// A kernel chosen for one (device, dtype[, constraint verdicts]), with how
// it was chosen (for the trace).
struct ResolvedKernel {
  uint64_t device;  // DLDevice as one word (device_type, device_id)
  Dtype dtype;
  uint64_t generation;
  kd_kernel_fn fn;
  kd_kernel_fn supports;  // the spec's supports function, or nullptr
  void* data;  // the spec's function_data: kd_call_args::kernel_data
  const KernelSpec* spec;
  uint64_t rejected;  // `constrained_cache` only: bit i, kernel i of Constrained refused the call
  SelectionRule rule;
  std::vector<const KernelSpec*> ranked;  // Selection::ranked
  // Whether the choice follows from what a call's signature fixes (device,
  // dtypes, shapes): false when a constraint or tuned choice of the op read
  // an attribute. Then only the resolution's caches keep it, never a
  // remembered call (CompiledSchema::attach).
  bool by_signature;

  KernelHandle handle() const;
};

// What a call's fallback did, for its trace line: the kernels that passed
// the call on, in order, and the one that ran it.
struct FallbackTrail {
  struct Step {
    const KernelSpec* spec;
    std::string outcome;  // "unsupported", "device_error", "internal", "not_loaded"
    std::string error;
    bool demoted;
  };
  std::vector<Step> passed;
  const KernelSpec* ran = nullptr;
};

// One (op, backend request): its compiled schema and the kernels resolved
// for it, per (device type, device id, dtype). Owned by the Dispatcher and
// never freed before it, so handles and readers of the cache stay valid.
struct OpState {
  using Resolved = ResolvedKernel;
  // The op's kernels that have constraints, compiled against its schema, at
  // one registry generation. Immutable once published; owned by the state.
  // With them, the "when" of the op's tuned choices (docs/tuning.md): their
  // verdicts are bits of the cache key after the kernels' ones.
  struct Constrained {
    uint64_t generation;
    std::vector<std::pair<const KernelSpec*, ConstraintSet>> kernels;  // with `tuned`, at most 64
    std::shared_ptr<const TuningSet> tuning;  // keeps `tuned` alive
    std::vector<const Constraint*> tuned;
    // Each value the constraints above read other than the dtype, once: a
    // constraint symbol (CompiledSchema::constraint_symbols() slot), an int
    // or a bool attribute (schema index). With the device and dtype they
    // decide every verdict, so they key `memo`; an op whose constraints
    // read more than Memo::kValues of them is not memoised.
    // A symbol is read as its dim where CompiledSchema::dim_source() gives
    // one (`dim`: tensors[tensor].shape[dim], from the end when
    // `from_end`), which takes fewer dependent loads than its value.
    struct Read {
      enum class Kind : uint8_t { dim, symbol, attr_int, attr_bool } kind;
      uint8_t slot;
      uint8_t tensor = 0;
      int8_t dim = 0;
      bool from_end = false;
    };
    std::vector<Read> reads;
    bool memoised = false;
    bool reads_attrs = false;  // an int or bool attribute among `reads`
  };
  // A recent constrained call's kernel, by everything its verdicts depend on:
  // the Constrained it was chosen with (one per registry generation), the
  // device, the dtype and the values of `Constrained::reads`. A decode loop
  // calls an op with the same shapes again and again; such a call takes its
  // kernel here, without evaluating the constraints. Lock-free readers: a
  // seqlock as CompiledSchema's remembered calls have (each word stored with
  // release, loaded with acquire, the sequence read again at the end).
  struct Memo {
    static constexpr size_t kValues = 8;
    std::atomic<uint32_t> seq{0};  // odd: being written; 0: nothing recorded
    std::atomic<const Constrained*> constrained{nullptr};
    std::atomic<uint64_t> device{0};
    std::atomic<Dtype> dtype{Dtype::float32};
    std::array<std::atomic<int64_t>, kValues> values{};
    std::atomic<const ResolvedKernel*> resolved{nullptr};
  };
  // Two, so that calls alternating between two shapes (q and k of one
  // layer) both find theirs.
  static constexpr size_t kMemos = 2;
  static constexpr size_t kSlots = 8;

  Dispatcher* dispatcher = nullptr;
  const KernelRegistry* registry = nullptr;  // its generation invalidates the cache
  std::FILE* trace_file = nullptr;           // the dispatcher's, copied for the call path
  std::string op;
  std::string backend;
  uint64_t hash = 0;
  std::optional<CompiledSchema> compiled;  // absent: no schema, not callable
  // Every attribute with its default, in schema order; complete when every
  // attribute has a default (then a call without attributes copies nothing).
  // A required attribute's entry has its name and type, and a zero value.
  std::vector<kd_attr> defaults;
  bool defaults_complete = true;
  std::vector<AttrName> attr_names;          // the schema's, in schema order
  uint64_t all_attrs = 0;                    // bit per attribute
  uint64_t required_attrs = 0;               // bit per attribute without a default
  bool plain_calls = false;  // defaults_complete and no trace file: a call without attributes packs nothing
  // OpHandle::operator() without attributes and with: the versions for the
  // op's tensor count (OpHandle::call_plain, call_with_attrs).
  void (*plain)(const OpHandle&, std::span<DLTensor>, void*) = nullptr;
  void (*with_attrs)(const OpHandle&, std::span<DLTensor>, std::span<const NamedAttr>, void*) = nullptr;
  std::span<const kd_attr> plain_attrs;  // `defaults`, for plain calls
  std::array<std::atomic<const Resolved*>, kSlots> cache{};
  std::vector<std::unique_ptr<Resolved>> owned;  // guarded by the dispatcher's mutex
  size_t next_victim = 0;
  // An op with constrained kernels chooses per call: the kernels' verdicts
  // on the call's values join device and dtype in the key of
  // `constrained_cache`, and `cache` stays empty, so that the calls above
  // never take a cached kernel without evaluating the constraints.
  std::atomic<const Constrained*> constrained{nullptr};  // null: no kernel of the op has constraints
  std::atomic<uint64_t> constrained_generation{~uint64_t{0}};  // the generation `constrained` was made at
  std::array<std::atomic<const Resolved*>, kSlots> constrained_cache{};
  std::vector<std::unique_ptr<Constrained>> owned_constrained;  // guarded by the dispatcher's mutex
  size_t next_constrained_victim = 0;
  std::array<Memo, kMemos> memo{};
  std::atomic<uint32_t> next_memo{0};  // the entry the next new key replaces

  // The values `c->reads` names, of a call that the schema check accepted.
  [[gnu::always_inline]] void read_key(const Constrained& c, std::span<const DLTensor> tensors, const kd_attr* attrs,
                                       int64_t* key) const noexcept {
    const size_t n = c.reads.size();
    for (size_t i = 0; i < n; ++i) {
      const Constrained::Read& read = c.reads[i];
      switch (read.kind) {
        case Constrained::Read::Kind::dim: {
          const DLTensor& t = tensors[read.tensor];
          key[i] = t.shape[(read.from_end ? t.ndim : 0) + read.dim];
          break;
        }
        case Constrained::Read::Kind::symbol: key[i] = compiled->constraint_value(tensors, read.slot); break;
        case Constrained::Read::Kind::attr_int: key[i] = attrs[read.slot].value.i; break;
        case Constrained::Read::Kind::attr_bool: key[i] = attrs[read.slot].value.b != 0 ? 1 : 0; break;
      }
    }
  }

  // The memoised kernel for (constrained, device, dtype, values), or null.
  [[gnu::always_inline]] const Resolved* find_memo(const Constrained* c, uint64_t device, Dtype dtype,
                                                   const int64_t* values) const noexcept {
    const size_t n = c->reads.size();
    for (const Memo& m : memo) {
      const uint32_t seq = m.seq.load(std::memory_order_acquire);
      if ((seq & 1) != 0 || seq == 0) continue;
      if (m.constrained.load(std::memory_order_acquire) != c || m.device.load(std::memory_order_acquire) != device ||
          m.dtype.load(std::memory_order_acquire) != dtype) {
        continue;
      }
      uint64_t diff = 0;
      for (size_t i = 0; i < n; ++i) {
        diff |= static_cast<uint64_t>(values[i] ^ m.values[i].load(std::memory_order_acquire));
      }
      if (diff != 0) continue;
      const Resolved* r = m.resolved.load(std::memory_order_acquire);
      // A word from a write in progress makes its odd sequence visible here.
      if (m.seq.load(std::memory_order_relaxed) == seq) return r;
    }
    return nullptr;
  }

  // Records `r` for the key, over the older entry. A writer that finds
  // another one at work on that entry leaves it be: either call is fine.
  void store_memo(const Constrained* c, uint64_t device, Dtype dtype, const int64_t* values,
                  const Resolved* r) noexcept {
    const uint32_t entry = next_memo.load(std::memory_order_relaxed);
    next_memo.store((entry + 1) % kMemos, std::memory_order_relaxed);
    Memo& m = memo[entry % kMemos];
    uint32_t seq = m.seq.load(std::memory_order_relaxed);
    if ((seq & 1) != 0 || !m.seq.compare_exchange_strong(seq, seq + 1, std::memory_order_relaxed)) return;
    // Release stores: each one publishes the odd sequence before itself.
    m.constrained.store(c, std::memory_order_release);
    m.device.store(device, std::memory_order_release);
    m.dtype.store(dtype, std::memory_order_release);
    for (size_t i = 0; i < c->reads.size(); ++i) m.values[i].store(values[i], std::memory_order_release);
    m.resolved.store(r, std::memory_order_release);
    // seq + 2 wraps to 0 ("nothing recorded") once in 2^31 writes: harmless.
    m.seq.store(seq + 2, std::memory_order_release);
  }

  const Resolved* find_constrained(uint64_t device, Dtype dtype, uint64_t rejected, uint64_t generation) const {
    for (const auto& slot : constrained_cache) {
      const Resolved* r = slot.load(std::memory_order_acquire);
      if (r == nullptr) break;
      if (r->device == device && r->dtype == dtype && r->rejected == rejected && r->generation == generation) return r;
    }
    return nullptr;
  }

  // The kernel attached to a remembered call (OpHandle::call_remembered),
  // when chosen at the registry's current generation.
  [[gnu::always_inline]] const Resolved* attached(const RememberedCall& found) const {
    const auto* r = static_cast<const Resolved*>(found.tag);
    return r != nullptr && r->generation == registry->generation() ? r : nullptr;
  }

  // The kernel for a checked call's device and dtype when cached and current.
  const Resolved* find_cached(uint64_t device, Dtype dtype) const {
    const uint64_t generation = registry->generation();
    for (const auto& slot : cache) {
      const Resolved* r = slot.load(std::memory_order_acquire);
      if (r == nullptr) break;  // slots fill in order and are never emptied
      if (r->device == device && r->dtype == dtype && r->generation == generation) return r;
    }
    return nullptr;
  }

  // The attributes of a call that gives `attrs` by name, in the common case:
  // each given value written into a copy of its attribute's default entry,
  // then the default entries of the attributes not given. False (and `out`
  // partly written) when a given name is unknown or repeated, a value's type
  // is not the attribute's, or a required attribute is missing:
  // OpHandle::pack_attrs then converts the value or words the error.
  [[gnu::always_inline]] bool pack_given(std::span<const NamedAttr> attrs, kd_attr* out) const noexcept {
    static_assert(std::is_same_v<std::variant_alternative_t<0, AttrValue>, double> &&
                  std::is_same_v<std::variant_alternative_t<1, AttrValue>, int64_t> &&
                  std::is_same_v<std::variant_alternative_t<2, AttrValue>, bool> &&
                  std::is_same_v<std::variant_alternative_t<3, AttrValue>, std::string>);
    const size_t n = plain_attrs.size();  // every attribute (a stored size: no division)
    uint64_t given = 0;
    for (const NamedAttr& a : attrs) {
      const AttrName name(a.name);
      size_t i = 0;
      while (i < n && !(attr_names[i] == name)) ++i;
      if (i == n || (given >> i & 1) != 0) return false;
      given |= uint64_t{1} << i;
      // Written field by field, the type read from the default: reading
      // it back from `out` waits on the copy just stored there.
      const kd_attr& d = defaults[i];
      kd_attr& attr = out[i];
      attr.name = d.name;
      attr.type = d.type;
      attr.reserved = 0;
      switch (a.value.index()) {
        case 0:
          if (d.type != KD_ATTR_TYPE_FLOAT) return false;
          attr.value.f = *std::get_if<0>(&a.value);
          break;
        case 1:
          if (d.type != KD_ATTR_TYPE_INT) return false;
          attr.value.i = *std::get_if<1>(&a.value);
          break;
        case 2:
          if (d.type != KD_ATTR_TYPE_BOOL) return false;
          attr.value.i = 0;
          attr.value.b = *std::get_if<2>(&a.value) ? 1 : 0;
          break;
        default:
          if (d.type != KD_ATTR_TYPE_STRING) return false;
          attr.value.s = std::get_if<3>(&a.value)->c_str();
          break;
      }
    }
    if ((given & required_attrs) != required_attrs) return false;
    for (uint64_t rest = all_attrs & ~given; rest != 0; rest &= rest - 1) {
      const int i = std::countr_zero(rest);
      out[i] = defaults[i];
    }
    return true;
  }
};

namespace {

// Hash of an op id and backend request: 8 bytes per step, since looking up
// an op by its string is on the path of callers that do not keep handles.
uint64_t hash_bytes(uint64_t h, std::string_view s) {
  size_t i = 0;
  for (; i + 8 <= s.size(); i += 8) {
    uint64_t chunk;
    std::memcpy(&chunk, s.data() + i, 8);
    h = (h ^ chunk) * 0x9e3779b97f4a7c15ull;
    h ^= h >> 29;
  }
  uint64_t tail = 0;
  for (size_t k = i; k < s.size(); ++k) tail = tail << 8 | static_cast<unsigned char>(s[k]);
  h = (h ^ tail ^ s.size()) * 0x9e3779b97f4a7c15ull;
  return h ^ (h >> 32);
}

uint64_t intern_hash(std::string_view op, std::string_view backend) {
  return backend.empty() ? hash_bytes(0x243f6a8885a308d3ull, op)
                         : hash_bytes(hash_bytes(0x243f6a8885a308d3ull, op), backend);
}

int32_t kd_attr_type_of(AttrType type) {
  switch (type) {
    case AttrType::float_: return KD_ATTR_TYPE_FLOAT;
    case AttrType::int_: return KD_ATTR_TYPE_INT;
    case AttrType::bool_: return KD_ATTR_TYPE_BOOL;
    case AttrType::string: break;
  }
  return KD_ATTR_TYPE_STRING;
}

void fill_attr(kd_attr& out, const AttrArg& arg, const AttrValue& value, std::string_view op) {
  out.name = arg.name.c_str();
  out.type = kd_attr_type_of(arg.type);
  out.reserved = 0;
  const auto mistyped = [&](std::string_view given) {
    return CallError(ErrorCode::bad_arguments, fmt::format("op '{}', attribute '{}': expected {}, got {}", op,
                                                           arg.name, attr_type_name(arg.type), given));
  };
  switch (arg.type) {
    case AttrType::float_:
      if (auto* d = std::get_if<double>(&value)) out.value.f = *d;
      else if (auto* i = std::get_if<int64_t>(&value)) out.value.f = static_cast<double>(*i);
      else throw mistyped(std::holds_alternative<bool>(value) ? "bool" : "string");
      break;
    case AttrType::int_:
      if (auto* i = std::get_if<int64_t>(&value)) out.value.i = *i;
      else throw mistyped(std::holds_alternative<double>(value) ? "float" : std::holds_alternative<bool>(value) ? "bool" : "string");
      break;
    case AttrType::bool_:
      if (auto* b = std::get_if<bool>(&value)) out.value.b = *b ? 1 : 0;
      else throw mistyped(std::holds_alternative<double>(value) ? "float" : std::holds_alternative<int64_t>(value) ? "int" : "string");
      break;
    case AttrType::string:
      if (auto* s = std::get_if<std::string>(&value)) out.value.s = s->c_str();
      else throw mistyped("a number or bool");
      break;
  }
}

}  // namespace

namespace {

ErrorCode failure_code(kd_status status) {
  return status == KD_STATUS_DEVICE_ERROR ? ErrorCode::device_error : ErrorCode::kernel_failed;
}

std::string failure_text(const KernelSpec& spec, kd_status status, const char* error) {
  const std::string kernel =
      spec.is_runtime() ? std::string("kernel registered at run time") : fmt::format("kernel '{}'", spec.symbol);
  return fmt::format("{} of backend '{}' failed for op '{}' (status {}): {}", kernel, spec.backend, spec.op,
                     static_cast<int>(status), error[0] != '\0' ? error : "no message");
}

std::string_view status_name(kd_status status) {
  switch (status) {
    case KD_STATUS_OK: return "ok";
    case KD_STATUS_INVALID_ARGUMENT: return "invalid_argument";
    case KD_STATUS_UNSUPPORTED: return "unsupported";
    case KD_STATUS_DEVICE_ERROR: return "device_error";
    case KD_STATUS_INTERNAL: return "internal";
    default: break;
  }
  return "unknown";
}

// A JSON string, whatever bytes `text` holds.
std::string json_string(std::string_view text) {
  return nlohmann::json(std::string(text)).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace

// --- KernelHandle -------------------------------------------------------------

void KernelHandle::raise(kd_status status, char* error) const {
  error[511] = '\0';
  throw KernelError(failure_code(status), failure_text(*spec_, status, error));
}

// --- OpHandle -----------------------------------------------------------------

const OpSchema& OpHandle::schema() const { return state_->compiled->schema(); }
std::string_view OpHandle::op() const { return state_->op; }
std::string_view OpHandle::backend() const { return state_->backend; }

std::span<const kd_attr> OpHandle::pack_attrs(std::span<const NamedAttr> attrs, std::span<kd_attr> storage) const {
  if (attrs.empty() && state_->defaults_complete) [[likely]] return state_->defaults;
  const OpSchema& s = schema();
  if (storage.size() >= s.attrs.size() && state_->pack_given(attrs, storage.data())) return storage.first(s.attrs.size());
  uint64_t used = 0;  // bit per given attribute
  for (size_t i = 0; i < s.attrs.size(); ++i) {
    const AttrArg& arg = s.attrs[i];
    const AttrValue* value = nullptr;
    for (size_t j = 0; j < attrs.size(); ++j) {
      if (attrs[j].name == arg.name) {
        value = &attrs[j].value;
        used |= uint64_t{1} << j;
        break;
      }
    }
    if (value == nullptr) {
      if (!arg.default_value) {
        throw CallError(ErrorCode::bad_arguments,
                        fmt::format("op '{}': attribute '{}' ({}) is required", s.op, arg.name, attr_type_name(arg.type)));
      }
      value = &*arg.default_value;
    }
    fill_attr(storage[i], arg, *value, s.op);
  }
  if (attrs.size() > 64 || used != (attrs.size() == 64 ? ~uint64_t{0} : (uint64_t{1} << attrs.size()) - 1)) {
    std::vector<std::string_view> known;
    for (const auto& a : s.attrs) known.push_back(a.name);
    for (size_t j = 0; j < attrs.size(); ++j) {
      if (j >= 64 || !(used & (uint64_t{1} << j))) {
        throw CallError(ErrorCode::bad_arguments,
                        fmt::format("op '{}' has no attribute '{}' (attributes: [{}])", s.op, attrs[j].name,
                                    fmt::join(known, ", ")));
      }
    }
  }
  return storage.first(s.attrs.size());
}

void OpHandle::check(std::span<const DLTensor> tensors, CheckScope scope) const {
  if (scope == CheckScope::layout) {
    state_->compiled->check_layout(tensors);
  } else {
    state_->compiled->check(tensors);
  }
}

void OpHandle::check(std::span<const DLTensor> tensors, std::span<const NamedAttr> attrs, CheckScope scope) const {
  std::array<kd_attr, kMaxSchemaAttrs> storage;
  const std::span<const kd_attr> packed = pack_attrs(attrs, storage);
  const CompiledSchema& compiled = *state_->compiled;
  if (!compiled.has_flattened()) {
    check(tensors, scope);
    return;
  }
  // unflatten() only reads the tensors it is given and writes `call`.
  std::span<DLTensor> given(const_cast<DLTensor*>(tensors.data()), tensors.size());
  UnflattenedCall call;
  const std::span<DLTensor> seen = compiled.unflatten(given, packed, &call);
  if (scope == CheckScope::layout) {
    compiled.check_layout(seen, tensors, packed);
  } else {
    compiled.check_plan(seen, tensors, packed);
  }
}

Selection OpHandle::select(const Device& device, int32_t device_id, std::span<const DLTensor> tensors,
                           std::span<const NamedAttr> attrs) const {
  std::array<kd_attr, kMaxSchemaAttrs> storage;
  const std::span<const kd_attr> packed = pack_attrs(attrs, storage);
  const CompiledSchema& compiled = *state_->compiled;
  const Dtype dtype = compiled.check_layout(tensors).dtype;
  std::array<int64_t, kMaxConstraintSymbols> symbols{};
  compiled.bind_constraint_values(tensors, symbols.data());
  const ConstraintCall call{{compiled.constraint_symbols(), compiled.selecting_dtype_var(), compiled.schema().attrs},
                            {symbols.data(), dtype, packed.data()}};
  return state_->dispatcher->context().choose({state_->op, state_->backend, device, dtype, &call, device_id});
}

KernelHandle OpHandle::resolve(std::span<const DLTensor> tensors) const {
  const CompiledSchema::CallInfo info = state_->compiled->check(tensors);
  return state_->dispatcher->resolve(*state_, info.device, info.dtype, tensors, state_->defaults).handle();
}

// The same work as KernelHandle::operator() when the kernel returns OK.
// A kernel's call: its supports function first, when it has one, whose
// refusal is the call's status (KD_STATUS_UNSUPPORTED passes it on).
[[gnu::always_inline]] inline kd_status run_kernel(kd_kernel_fn supports, kd_kernel_fn fn, const kd_call_args* args) {
  if (supports != nullptr) [[unlikely]] {
    const kd_status s = supports(args);
    if (s != KD_STATUS_OK) return s;
  }
  return fn(args);
}

[[gnu::always_inline]] inline void OpHandle::run(const OpState& state, const ResolvedKernel& kernel, DLDevice device,
                                                 std::span<DLTensor> tensors, std::span<const kd_attr> attrs,
                                                 void* stream, FallbackTrail* trail) {
  char error[512];
  error[0] = '\0';
  const kd_call_args args{sizeof(kd_call_args), tensors.data(), static_cast<int32_t>(tensors.size()),
                          static_cast<int32_t>(attrs.size()), attrs.data(), stream, error, sizeof error,
                          kernel.data};
  const kd_status status = run_kernel(kernel.supports, kernel.fn, &args);
  if (status != KD_STATUS_OK) [[unlikely]] {
    error[sizeof error - 1] = '\0';
    state.dispatcher->recover(kernel, device, tensors, attrs, stream, status, error, trail);
  }
}

void OpHandle::operator()(std::span<DLTensor> tensors, std::span<const NamedAttr> attrs, void* stream) const {
  if (attrs.empty()) [[likely]] {
    state_->plain(*this, tensors, stream);
    return;
  }
  state_->with_attrs(*this, tensors, attrs, stream);
}

// The common call, kept small so that it needs few registers: no
// attributes given, a repeat of a recently accepted signature whose kernel
// is attached to it and current, no tracing. Everything else goes through
// call_unremembered() or call_remembered(), each tier of the check run at
// most once.
template <size_t N>
void OpHandle::call_plain(const OpHandle& op, std::span<DLTensor> tensors, void* stream) {
  const OpState& state = *op.state_;
  if (!state.plain_calls) [[unlikely]] {
    state.with_attrs(op, tensors, {}, stream);
    return;
  }
  CompiledSchema::CallInfo info;
  RememberedCall found;
  bool remembered = false;
  if constexpr (N != 0) {
    remembered = tensors.size() == N && state.compiled->matches_remembered<N>(tensors.data(), &info, &found);
  } else {
    remembered = state.compiled->matches_remembered(tensors, &info, &found);
  }
  if (remembered) [[likely]] {
    if (const OpState::Resolved* r = state.attached(found)) [[likely]] {
      run(state, *r, info.device, tensors, state.plain_attrs, stream, nullptr);
      return;
    }
    op.call_remembered(tensors, state.plain_attrs, stream, info.device, info.dtype, found);
    return;
  }
  op.call_unremembered(tensors, stream);
}

[[gnu::noinline]] void OpHandle::call_unremembered(std::span<DLTensor> tensors, void* stream) const {
  const OpState& state = *state_;
  // The defaults never split a "flattened" tensor (0); a refusal says
  // when one looks passed flattened without its attribute.
  const CompiledSchema::CallInfo info = state.compiled->check_plan(tensors, tensors, state.plain_attrs);
  // The attributes are the defaults, as pack_attrs() would give them.
  call_packed(tensors, state.plain_attrs, stream, info.device, info.dtype);
}

// The call with attributes, as call_plain() without them: when
// pack_given() takes the attributes, the tensors repeat a remembered
// signature and no trace is written, the kernel runs at once (or is
// resolved and attached first); anything else goes through call_packed()
// or call_checked(), each tier of the check run at most once. The
// attributes are packed first, while few values are live.
template <size_t N>
void OpHandle::call_with_attrs(const OpHandle& op, std::span<DLTensor> tensors, std::span<const NamedAttr> attrs,
                               void* stream) {
  const OpState& state = *op.state_;
  std::array<kd_attr, kMaxSchemaAttrs> storage;
  const bool packed = state.pack_given(attrs, storage.data());
  const std::span<const kd_attr> packed_attrs(storage.data(), state.plain_attrs.size());
  CompiledSchema::CallInfo info;
  RememberedCall found;
  bool remembered = false;
  if constexpr (N != 0) {
    remembered = tensors.size() == N && state.compiled->matches_remembered<N>(tensors.data(), &info, &found);
  } else {
    remembered = state.compiled->matches_remembered(tensors, &info, &found);
  }
  if (remembered) [[likely]] {
    if (packed && state.trace_file == nullptr) [[likely]] {
      if (const OpState::Resolved* r = state.attached(found)) [[likely]] {
        run(state, *r, info.device, tensors, packed_attrs, stream, nullptr);
        return;
      }
      op.call_remembered(tensors, packed_attrs, stream, info.device, info.dtype, found);
      return;
    }
  } else {
    info = state.compiled->check_plan(tensors);
  }
  if (packed) {
    // What pack_attrs() would pack again.
    op.call_packed(tensors, packed_attrs, stream, info.device, info.dtype);
    return;
  }
  op.call_checked(tensors, attrs, stream, info.device, info.dtype);
}

// The call with attributes of an op whose schema has "flattened" tensors:
// the attributes are packed first, since they say how the tensors are
// split (CompiledSchema::unflatten), then the call goes as in
// call_with_attrs() on the tensors as the schema sees them. The split
// tensors' shapes and strides live on this function's stack.
void OpHandle::call_flattened(const OpHandle& op, std::span<DLTensor> tensors, std::span<const NamedAttr> attrs,
                              void* stream) {
  const OpState& state = *op.state_;
  std::array<kd_attr, kMaxSchemaAttrs> storage;
  const std::span<const kd_attr> packed = op.pack_attrs(attrs, storage);
  UnflattenedCall call;
  const std::span<DLTensor> seen = state.compiled->unflatten(tensors, packed, &call);
  CompiledSchema::CallInfo info;
  RememberedCall found;
  if (state.compiled->matches_remembered(seen, &info, &found)) [[likely]] {
    if (state.trace_file == nullptr) [[likely]] {
      if (const OpState::Resolved* r = state.attached(found)) [[likely]] {
        run(state, *r, info.device, seen, packed, stream, nullptr);
        return;
      }
      op.call_remembered(seen, packed, stream, info.device, info.dtype, found);
      return;
    }
  } else {
    info = state.compiled->check_plan(seen, tensors, packed);
  }
  op.call_packed(seen, packed, stream, info.device, info.dtype);
}

// A call that repeats a remembered one with no current kernel attached: the
// kernel is resolved, attached when the call's signature decides it, and
// run. No trace is written (the callers check).
[[gnu::noinline]] void OpHandle::call_remembered(std::span<DLTensor> tensors, std::span<const kd_attr> packed,
                                                 void* stream, DLDevice device, Dtype dtype,
                                                 const RememberedCall& found) const {
  OpState& state = *state_;
  const uint64_t generation = state.registry->generation();
  const ResolvedKernel& resolved = state.dispatcher->resolve(state, device, dtype, tensors, packed);
  // A choice made at a newer generation than the one read first may rest
  // on an older list of constrained kernels: it is not attached.
  if (resolved.by_signature && resolved.generation == generation) state.compiled->attach(found, &resolved);
  run(state, resolved, device, tensors, packed, stream, nullptr);
}

void OpHandle::call_checked(std::span<DLTensor> tensors, std::span<const NamedAttr> attrs, void* stream,
                            DLDevice device, Dtype dtype) const {
  std::array<kd_attr, kMaxSchemaAttrs> storage;
  call_packed(tensors, pack_attrs(attrs, storage), stream, device, dtype);
}

void OpHandle::call_packed(std::span<DLTensor> tensors, std::span<const kd_attr> packed, void* stream,
                           DLDevice device, Dtype dtype) const {
  OpState& state = *state_;
  const ResolvedKernel& resolved = state.dispatcher->resolve(state, device, dtype, tensors, packed);
  if (state.trace_file == nullptr) {
    run(state, resolved, device, tensors, packed, stream, nullptr);
    return;
  }
  FallbackTrail trail;
  const auto start = std::chrono::steady_clock::now();
  run(state, resolved, device, tensors, packed, stream, &trail);
  const std::chrono::duration<double, std::micro> us = std::chrono::steady_clock::now() - start;
  state.dispatcher->trace(state, resolved, tensors, us.count(), &trail);
}

void OpHandle::operator()(std::initializer_list<DLTensor> tensors, std::initializer_list<NamedAttr> attrs,
                          void* stream) const {
  std::array<DLTensor, kMaxSchemaTensors> copy;
  if (tensors.size() > copy.size()) {
    throw CallError(ErrorCode::bad_arguments, fmt::format("op '{}': too many tensors ({})", op(), tensors.size()));
  }
  std::copy(tensors.begin(), tensors.end(), copy.begin());
  (*this)(std::span<DLTensor>(copy.data(), tensors.size()), std::span<const NamedAttr>(attrs.begin(), attrs.size()),
          stream);
}

// --- Dispatcher ---------------------------------------------------------------

Dispatcher::Dispatcher(Context& context)
    : context_(context), intern_slots_(new std::atomic<OpState*>[kInternSlots]) {
  for (size_t i = 0; i < kInternSlots; ++i) intern_slots_[i].store(nullptr, std::memory_order_relaxed);
  if (auto path = get_env("KDISPATCH_TRACE"); path && !path->empty()) {
    std::string why;
    const int fd = open_regular_file(*path, O_WRONLY | O_APPEND | O_CREAT, why);
    if (fd >= 0) trace_file_ = ::fdopen(fd, "a");
    if (fd >= 0 && trace_file_ == nullptr) {
      why = std::strerror(errno);
      ::close(fd);
    }
    if (trace_file_ == nullptr) {
      log(LogLevel::warn, "{}: KDISPATCH_TRACE={}: cannot open for appending, not tracing: {}",
          code_string(ErrorCode::file_not_writable), *path, why);
    }
  }
}

Dispatcher::~Dispatcher() {
  if (trace_file_ != nullptr) std::fclose(trace_file_);
}

OpState* Dispatcher::intern(std::string_view op, std::string_view backend) {
  const uint64_t hash = intern_hash(op, backend);
  for (size_t i = 0; i < kInternSlots; ++i) {
    OpState* s = intern_slots_[(hash + i) & (kInternSlots - 1)].load(std::memory_order_acquire);
    if (s == nullptr) break;
    if (s->hash == hash && std::string_view(s->op) == op && std::string_view(s->backend) == backend) [[likely]] {
      return s;
    }
  }
  std::lock_guard lock(mutex_);
  // Another thread may have added it meanwhile.
  size_t free_slot = kInternSlots;
  for (size_t i = 0; i < kInternSlots; ++i) {
    const size_t slot = (hash + i) & (kInternSlots - 1);
    OpState* s = intern_slots_[slot].load(std::memory_order_acquire);
    if (s == nullptr) {
      free_slot = slot;
      break;
    }
    if (s->hash == hash && s->op == op && s->backend == backend) return s;
  }
  std::string key = overflow_key(op, backend);
  if (free_slot == kInternSlots) {  // ops that did not fit in the table
    if (const auto it = overflow_.find(key); it != overflow_.end()) return it->second;
  }
  const KernelRegistry& registry = context_.registry();
  if (!registry.has(op)) {
    // The selector words KD-E001 (with did-you-mean and failed plugins).
    context_.selector().select({op, backend, Device::host_cpu(), std::nullopt});
  }
  if (!backend.empty() && !registry.has(op, backend)) {
    // A backend name the op does not have is not interned (each name would
    // stay for the process's life): the selector words KD-E002, with the
    // failures of plugins that declared it. A name that answers otherwise
    // ("reference" for the op's reference kernel) passes; any other
    // selection error is the call's to report, for its device.
    try {
      context_.selector().select({op, backend, Device::host_cpu(), std::nullopt});
    } catch (const SelectionError& e) {
      if (e.code() == ErrorCode::backend_not_registered) throw;
    }
  }
  const OpSchema* schema = registry.schema(op);
  if (schema == nullptr) {
    throw CallError(ErrorCode::bad_arguments,
                    fmt::format("op '{}' has kernels but no schema, so it cannot be called through the checked path; "
                                "define it in an op-schema file or in the \"ops\" of a plugin manifest",
                                op));
  }
  auto state = std::make_unique<OpState>();
  state->dispatcher = this;
  state->registry = &context_.registry();
  state->trace_file = trace_file_;
  state->op = std::string(op);
  state->backend = std::string(backend);
  state->hash = hash;
  state->compiled.emplace(*schema);
  for (const AttrArg& arg : state->compiled->schema().attrs) {
    kd_attr a{};
    if (arg.default_value) {
      fill_attr(a, arg, *arg.default_value, state->op);
    } else {
      a.name = arg.name.c_str();
      a.type = kd_attr_type_of(arg.type);
      state->required_attrs |= uint64_t{1} << state->defaults.size();
      state->defaults_complete = false;
    }
    state->all_attrs |= uint64_t{1} << state->defaults.size();
    state->defaults.push_back(a);
    state->attr_names.emplace_back(arg.name);
  }
  state->plain_calls = state->defaults_complete && state->trace_file == nullptr;
  set_calls(*state);
  state->plain_attrs = state->defaults;
  OpState* raw = state.get();
  states_.push_back(std::move(state));
  // A full table still works, through the mutex-guarded map.
  if (free_slot < kInternSlots) {
    intern_slots_[free_slot].store(raw, std::memory_order_release);
  } else {
    overflow_.emplace(std::move(key), raw);
  }
  return raw;
}

void Dispatcher::set_calls(OpState& state) {
  static_assert(kMaxRememberedTensors == 8);
  // Entry n: the calls compiled for n tensors; entry 0 takes any count.
  static constexpr auto plain = []<size_t... N>(std::index_sequence<N...>) {
    return std::array{&OpHandle::call_plain<N>...};
  }(std::make_index_sequence<kMaxRememberedTensors + 1>{});
  static constexpr auto with_attrs = []<size_t... N>(std::index_sequence<N...>) {
    return std::array{&OpHandle::call_with_attrs<N>...};
  }(std::make_index_sequence<kMaxRememberedTensors + 1>{});
  const size_t n = state.compiled->num_tensors();
  state.plain = plain[n < plain.size() ? n : 0];
  state.with_attrs = with_attrs[n < with_attrs.size() ? n : 0];
  if (state.compiled->has_flattened()) state.with_attrs = &OpHandle::call_flattened;
}

std::string Dispatcher::overflow_key(std::string_view op, std::string_view backend) {
  std::string key;
  key.reserve(op.size() + backend.size() + 1);
  key.append(op).push_back('\0');
  key.append(backend);
  return key;
}

size_t Dispatcher::interned() const {
  std::lock_guard lock(mutex_);
  return states_.size();
}

OpHandle Dispatcher::op(std::string_view op, std::string_view backend) { return OpHandle(intern(op, backend)); }

KernelHandle ResolvedKernel::handle() const { return KernelHandle(fn, data, spec); }

const ResolvedKernel& Dispatcher::resolve(OpState& state, DLDevice device, Dtype dtype,
                                          std::span<const DLTensor> tensors, std::span<const kd_attr> attrs) {
  const uint64_t generation = state.registry->generation();
  if (state.constrained_generation.load(std::memory_order_acquire) != generation) [[unlikely]] {
    refresh_constraints(state, generation);
  }
  const OpState::Constrained* constrained = state.constrained.load(std::memory_order_acquire);
  if (constrained == nullptr) [[likely]] {
    if (const OpState::Resolved* r = state.find_cached(device_word(device), dtype)) return *r;
    return resolve_slow(state, device, dtype, nullptr, 0, generation, true);
  }
  const uint64_t word = device_word(device);
  // The values the constraints read: a call that repeats a recent key takes
  // its kernel without evaluating them.
  std::array<int64_t, OpState::Memo::kValues> key;
  if (constrained->memoised) [[likely]] {
    state.read_key(*constrained, tensors, attrs.data(), key.data());
    if (const OpState::Resolved* r = state.find_memo(constrained, word, dtype, key.data())) [[likely]] return *r;
  }
  std::array<int64_t, kMaxConstraintSymbols> symbols{};
  state.compiled->bind_constraint_values(tensors, symbols.data());
  ConstraintCall call{{state.compiled->constraint_symbols(), state.compiled->selecting_dtype_var(), state.compiled->schema().attrs},
                      {symbols.data(), dtype, attrs.data()}};
  uint64_t rejected = 0;
  for (size_t i = 0; i < constrained->kernels.size(); ++i) {
    Constraint::Result result{};
    if (constrained->kernels[i].second.first_failing(call.input, &result) != nullptr) rejected |= uint64_t{1} << i;
  }
  const size_t base = constrained->kernels.size();
  for (size_t i = 0; i < constrained->tuned.size(); ++i) {
    if (constrained->tuned[i]->evaluate(call.input) != Constraint::Result::holds) rejected |= uint64_t{1} << (base + i);
  }
  const OpState::Resolved* r = state.find_constrained(word, dtype, rejected, constrained->generation);
  if (r == nullptr) {
    r = &resolve_slow(state, device, dtype, &call, rejected, constrained->generation, !constrained->reads_attrs);
  }
  // A choice made at a newer generation than `constrained` is not memoised
  // for it (resolve_slow() does not cache it either).
  if (constrained->memoised && r->generation == constrained->generation) {
    state.store_memo(constrained, word, dtype, key.data(), r);
  }
  return *r;
}

void Dispatcher::refresh_constraints(OpState& state, uint64_t generation) {
  std::vector<std::pair<const KernelSpec*, ConstraintSet>> kernels;
  const ConstraintNames names{state.compiled->constraint_symbols(), state.compiled->selecting_dtype_var(),
                              state.compiled->schema().attrs};
  for (const KernelSpec* spec : state.registry->get(state.op)) {
    if (!spec->constraints.empty()) kernels.emplace_back(spec, compile_constraints(*spec, names));
  }
  if (kernels.size() > 64) {
    throw CallError(ErrorCode::bad_arguments,
                    fmt::format("op '{}' has {} kernels with constraints; at most 64 are supported", state.op,
                                kernels.size()));
  }
  // The tuned choices with a "when": an op with any takes this path, so
  // that Selector::choose sees the call's values (a tuning file has at most
  // kMaxTunedConditions of them per op).
  std::shared_ptr<const TuningSet> tuning = context_.selector().tuning();
  std::vector<const Constraint*> tuned;
  if (tuning) {
    if (const std::vector<TunedChoice>* choices = tuning->choices(state.op)) {
      for (const TunedChoice& c : *choices) {
        if (c.when) tuned.push_back(&*c.when);
      }
    }
  }
  if (kernels.size() + tuned.size() > 64) {
    throw CallError(ErrorCode::bad_arguments,
                    fmt::format("op '{}' has {} kernels with constraints and {} tuned choices with a \"when\"; at "
                                "most 64 together are supported",
                                state.op, kernels.size(), tuned.size()));
  }
  // What they read, each once, for the memo's key.
  std::vector<OpState::Constrained::Read> reads;
  const auto add_reads = [&](const Constraint& c) {
    for (const Constraint::Name& name : c.names()) {
      using Kind = OpState::Constrained::Read::Kind;
      Kind kind;
      switch (name.op) {
        case Constraint::Op::symbol: kind = Kind::symbol; break;
        case Constraint::Op::attr_int: kind = Kind::attr_int; break;
        case Constraint::Op::attr_bool: kind = Kind::attr_bool; break;
        default: continue;  // the dtype: part of every key
      }
      OpState::Constrained::Read read{kind, static_cast<uint8_t>(name.slot)};
      if (kind == Kind::symbol) {
        if (const auto source = state.compiled->dim_source(read.slot)) {
          read.kind = Kind::dim;
          read.tensor = source->tensor;
          read.dim = source->dim;
          read.from_end = source->from_end;
        }
      }
      const bool seen = std::any_of(reads.begin(), reads.end(), [&](const auto& r) {
        return (r.kind == Kind::symbol || r.kind == Kind::dim) == (kind == Kind::symbol) && r.slot == read.slot;
      });
      if (!seen) reads.push_back(read);
    }
  };
  for (const auto& kernel : kernels) {
    for (const Constraint& c : kernel.second.constraints) add_reads(c);
  }
  for (const Constraint* c : tuned) add_reads(*c);
  const bool memoised = reads.size() <= OpState::Memo::kValues;
  const bool reads_attrs = std::any_of(reads.begin(), reads.end(), [](const OpState::Constrained::Read& r) {
    return r.kind == OpState::Constrained::Read::Kind::attr_int ||
           r.kind == OpState::Constrained::Read::Kind::attr_bool;
  });
  std::lock_guard lock(mutex_);
  if (!kernels.empty() || !tuned.empty()) {
    state.owned_constrained.push_back(std::make_unique<OpState::Constrained>(OpState::Constrained{
        generation, std::move(kernels), std::move(tuning), std::move(tuned), std::move(reads), memoised, reads_attrs}));
    state.constrained.store(state.owned_constrained.back().get(), std::memory_order_release);
  } else {
    state.constrained.store(nullptr, std::memory_order_release);
  }
  state.constrained_generation.store(generation, std::memory_order_release);
}

const ResolvedKernel& Dispatcher::resolve_slow(OpState& state, DLDevice device, Dtype dtype, const ConstraintCall* call,
                                               uint64_t rejected, uint64_t seen_generation, bool by_signature) {
  const auto type = from_dlpack_device_type(device.device_type);
  if (!type) {
    throw CallError(ErrorCode::bad_arguments,
                    fmt::format("op '{}': tensors are on DLPack device type {}, which no backend kind supports "
                                "(cpu = {}, cuda = {}, rocm = {})",
                                state.op, static_cast<int>(device.device_type), static_cast<int>(kDLCPU),
                                static_cast<int>(kDLCUDA), static_cast<int>(kDLROCM)));
  }
  const uint64_t generation = context_.registry().generation();
  Selection selection =
      context_.choose({state.op, state.backend, context_.device(*type, device.device_id), dtype, call, device.device_id});
  const kd_kernel_fn fn = context_.kernel(*selection.spec);
  const kd_kernel_fn supports = context_.supports(*selection.spec);
  std::lock_guard lock(mutex_);
  auto resolved = std::make_unique<OpState::Resolved>(
      OpState::Resolved{device_word(device), dtype, generation, fn, supports, selection.spec->function_data,
                        selection.spec, rejected, selection.rule, std::move(selection.ranked), by_signature});
  const OpState::Resolved& out = *resolved;
  state.owned.push_back(std::move(resolved));
  // A choice made against an older list of constrained kernels (or before
  // the op had any) is not cached for this generation.
  if (seen_generation != generation) return out;
  // A choice made with constraints goes to their cache (see OpState).
  auto& cache = call != nullptr ? state.constrained_cache : state.cache;
  size_t& next_victim = call != nullptr ? state.next_constrained_victim : state.next_victim;
  // Prefer an empty or stale slot; else evict round-robin. Old entries stay
  // owned, so a reader holding one is safe.
  size_t slot = OpState::kSlots;
  for (size_t i = 0; i < OpState::kSlots; ++i) {
    const OpState::Resolved* r = cache[i].load(std::memory_order_relaxed);
    if (r == nullptr || r->generation != generation) {
      slot = i;
      break;
    }
  }
  if (slot == OpState::kSlots) slot = next_victim++ % OpState::kSlots;
  cache[slot].store(&out, std::memory_order_release);
  return out;
}

void Dispatcher::call(std::string_view op, std::span<DLTensor> tensors, std::span<const NamedAttr> attrs,
                      std::string_view backend, void* stream) {
  OpHandle(intern(op, backend))(tensors, attrs, stream);
}

void Dispatcher::recover(const ResolvedKernel& first, DLDevice device,
                         std::span<DLTensor> tensors, std::span<const kd_attr> attrs, void* stream, kd_status status,
                         const char* error, FallbackTrail* trail) {
  FallbackTrail local;
  FallbackTrail& t = trail != nullptr ? *trail : local;
  const DeviceType type = from_dlpack_device_type(device.device_type).value_or(DeviceType::cpu);
  const bool fallback = context_.fallback();
  // Whether the failure of `spec` passes the call on; records it either way.
  const auto passes_on = [&](const KernelSpec& spec, kd_status s, const char* message) {
    t.passed.push_back({&spec, std::string(status_name(s)), message, false});
    if (s == KD_STATUS_UNSUPPORTED) {
      const std::string key = fmt::format("{}\n{}", spec.op, spec.backend);
      bool first_time;
      {
        std::lock_guard lock(mutex_);
        first_time = reported_unsupported_.insert(key).second;
      }
      if (first_time) {
        log(LogLevel::warn,
            "op '{}': backend '{}' returned unsupported for a call ({}); such calls go to the next ranked backend "
            "(reported once per op and backend)",
            spec.op, spec.backend, message[0] != '\0' ? message : "no message");
      }
      return true;
    }
    if (fallback && (s == KD_STATUS_DEVICE_ERROR || s == KD_STATUS_INTERNAL)) {
      const std::string text = failure_text(spec, s, message);
      t.passed.back().demoted = true;
      if (context_.demote(spec.op, spec.backend, type, device.device_id, fmt::format("[{}] {}", code_string(failure_code(s)), text))) {
        log(LogLevel::warn,
            "{}: {}; backend '{}' is demoted for op '{}' on {}:{} for the rest of the process (fallback is on)",
            code_string(failure_code(s)), text, spec.backend, spec.op, device_type_name(type), device.device_id);
      }
      return true;
    }
    return false;
  };
  // The steps before the last, for an error's message.
  const auto before = [&]() -> std::string {
    if (t.passed.size() < 2) return {};
    std::vector<std::string> steps;
    for (size_t i = 0; i + 1 < t.passed.size(); ++i) {
      steps.push_back(fmt::format("'{}' {}{}", t.passed[i].spec->backend, t.passed[i].outcome,
                                  t.passed[i].demoted ? " (demoted)" : ""));
    }
    return fmt::format(" (after {} passed the call on)", fmt::join(steps, ", "));
  };
  if (!passes_on(*first.spec, status, error)) {
    throw KernelError(failure_code(status), failure_text(*first.spec, status, error));
  }
  for (const KernelSpec* next : first.ranked) {
    // Never onto a reference kernel; each backend once; never onto one
    // demoted for the op on this device.
    if (next->is_reference()) continue;
    if (std::any_of(t.passed.begin(), t.passed.end(), [&](const FallbackTrail::Step& p) { return p.spec == next; })) {
      continue;
    }
    if (context_.selector().demotion(next->op, next->backend, type, device.device_id)) continue;
    // Never onto a kernel whose latest conformance verdict on this kind of
    // device is a failure (docs/internals.md, Conformance verdicts).
    if (std::optional<Verdict> failed = context_.failed_verdict(*next, context_.device(type, device.device_id))) {
      const std::string why = failed->describe();
      t.passed.push_back({next, "failed_conformance", why, false});
      if (context_.first_verdict_skip(next->op, next->backend)) {
        log(LogLevel::warn, "op '{}': backend '{}' is never a fallback: its kernel {}", next->op, next->backend, why);
      }
      continue;
    }
    kd_kernel_fn fn = nullptr;
    kd_kernel_fn supports = nullptr;
    try {
      fn = context_.kernel(*next);
      supports = context_.supports(*next);
    } catch (const Error& e) {
      t.passed.push_back({next, "not_loaded", fmt::format("[{}] {}", e.code_string(), e.message()), false});
      continue;
    }
    char next_error[512];
    next_error[0] = '\0';
    const kd_call_args args{sizeof(kd_call_args), tensors.data(), static_cast<int32_t>(tensors.size()),
                            static_cast<int32_t>(attrs.size()), attrs.data(), stream, next_error, sizeof next_error,
                            next->function_data};
    const kd_status s = run_kernel(supports, fn, &args);
    if (s == KD_STATUS_OK) {
      t.ran = next;
      return;
    }
    next_error[sizeof next_error - 1] = '\0';
    if (!passes_on(*next, s, next_error)) {
      throw KernelError(failure_code(s), failure_text(*next, s, next_error) + before());
    }
  }
  // No backend left: the first kernel's error, naming every one tried.
  std::vector<std::string> tried;
  for (const auto& p : t.passed) {
    tried.push_back(fmt::format("'{}' {}{}: {}", p.spec->backend, p.outcome, p.demoted ? " (demoted)" : "",
                                p.error.empty() ? "no message" : p.error));
  }
  throw KernelError(failure_code(status),
                    fmt::format("{}; no other backend could run the call (the reference is never a fallback{}); "
                                "tried: {}",
                                failure_text(*first.spec, status, error),
                                fallback ? "" : "; KDISPATCH_FALLBACK=1 passes device and internal errors on",
                                fmt::join(tried, "; ")));
}

void Dispatcher::trace(const OpState& state, const ResolvedKernel& kernel, std::span<const DLTensor> tensors,
                       double us, const FallbackTrail* trail) {
  std::vector<std::string> dtypes;
  std::vector<std::string> shapes;
  for (const DLTensor& t : tensors) {
    const auto d = from_dlpack(t.dtype);
    dtypes.push_back(fmt::format("\"{}\"", d ? dtype_name(*d) : "?"));
    shapes.push_back(fmt::format("[{}]", fmt::join(std::span<const int64_t>(t.shape, static_cast<size_t>(t.ndim)), ",")));
  }
  const auto type = from_dlpack_device_type(tensors.empty() ? kDLCPU : tensors[0].device.device_type);
  const int32_t device_id = tensors.empty() ? 0 : tensors[0].device.device_id;
  std::vector<std::string> ranked;
  for (const KernelSpec* s : kernel.ranked) ranked.push_back(fmt::format("\"{}\"", s->backend));
  const KernelSpec* ran = trail != nullptr && trail->ran != nullptr ? trail->ran : kernel.spec;
  std::string extra;
  if (trail != nullptr && !trail->passed.empty()) {
    std::vector<std::string> steps;
    for (const auto& p : trail->passed) {
      steps.push_back(fmt::format("{{\"backend\":\"{}\",\"status\":\"{}\",\"demoted\":{},\"error\":{}}}",
                                  p.spec->backend, p.outcome, p.demoted, json_string(p.error)));
    }
    extra += fmt::format(",\"fallback\":[{}]", fmt::join(steps, ","));
  }
  if (type) {
    std::vector<std::string> demoted;
    for (const Demotion& d : context_.demotions()) {
      if (d.op == state.op && d.device_type == *type && d.device_id == device_id) {
        demoted.push_back(fmt::format("{{\"backend\":\"{}\",\"error\":{}}}", d.backend, json_string(d.error)));
      }
    }
    if (!demoted.empty()) extra += fmt::format(",\"demoted\":[{}]", fmt::join(demoted, ","));
  }
  const std::string line = fmt::format(
      "{{\"op\":\"{}\",\"backend\":\"{}\",\"rule\":\"{}\",\"ranked\":[{}],\"device\":\"{}:{}\",\"dtypes\":[{}],"
      "\"shapes\":[{}],\"us\":{:.3f}{}}}\n",
      state.op, ran->backend, rule_name(kernel.rule), fmt::join(ranked, ","), type ? device_type_name(*type) : "?",
      device_id, fmt::join(dtypes, ","), fmt::join(shapes, ","), us, extra);
  std::lock_guard lock(mutex_);
  std::fputs(line.c_str(), trace_file_);
  std::fflush(trace_file_);
}

}  // namespace kdispatch
