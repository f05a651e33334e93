#include "harness.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <numbers>
#include <random>
#include <stdexcept>
#include <unordered_map>

#include <signal.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <atomic>
#include <mutex>


namespace kdispatch::harness {

// --- element conversion -------------------------------------------------------

double load(const void* data, Dtype dtype, size_t i) {
  switch (dtype) {
    case Dtype::float32: return static_cast<const float*>(data)[i];
    case Dtype::float16: return reference::decode(reference::Dtype::kFloat16, static_cast<const uint16_t*>(data)[i]);
    case Dtype::bfloat16: return reference::decode(reference::Dtype::kBFloat16, static_cast<const uint16_t*>(data)[i]);
    case Dtype::float64: return static_cast<const double*>(data)[i];
    case Dtype::int32: return static_cast<const int32_t*>(data)[i];
    case Dtype::int64: return static_cast<double>(static_cast<const int64_t*>(data)[i]);
    case Dtype::uint8: case Dtype::bool_: return static_cast<const uint8_t*>(data)[i];
    case Dtype::float8_e4m3fn:
      return reference::decode(reference::Dtype::kFloat8E4M3FN, static_cast<const uint8_t*>(data)[i]);
    case Dtype::float8_e5m2:
      return reference::decode(reference::Dtype::kFloat8E5M2, static_cast<const uint8_t*>(data)[i]);
  }
  return 0;
}

void store(void* data, Dtype dtype, size_t i, double v) {
  switch (dtype) {
    case Dtype::float32: static_cast<float*>(data)[i] = static_cast<float>(v); break;
    case Dtype::float16:
      static_cast<uint16_t*>(data)[i] = static_cast<uint16_t>(reference::encode(reference::Dtype::kFloat16, v));
      break;
    case Dtype::bfloat16:
      static_cast<uint16_t*>(data)[i] = static_cast<uint16_t>(reference::encode(reference::Dtype::kBFloat16, v));
      break;
    case Dtype::float64: static_cast<double*>(data)[i] = v; break;
    case Dtype::int32: static_cast<int32_t*>(data)[i] = static_cast<int32_t>(v); break;
    case Dtype::int64: static_cast<int64_t*>(data)[i] = static_cast<int64_t>(v); break;
    case Dtype::uint8: case Dtype::bool_: static_cast<uint8_t*>(data)[i] = static_cast<uint8_t>(v); break;
    case Dtype::float8_e4m3fn:
      static_cast<uint8_t*>(data)[i] = static_cast<uint8_t>(reference::encode(reference::Dtype::kFloat8E4M3FN, v));
      break;
    case Dtype::float8_e5m2:
      static_cast<uint8_t*>(data)[i] = static_cast<uint8_t>(reference::encode(reference::Dtype::kFloat8E5M2, v));
      break;
  }
}


// --- shapes ---------------------------------------------------------------------

namespace {
constexpr int64_t kDefaultSymbolSize = 256;
constexpr int64_t kDefaultRows = 16;

int64_t parse_size(const std::string& text, const std::string& what) {
  size_t used = 0;
  long long v = -1;
  try {
    v = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != text.size() || v < 0) throw std::invalid_argument(fmt::format("{}: '{}' is not a size", what, text));
  return v;
}
}  // namespace

Shapes example_shapes(const OpSchema& schema) {
  Shapes s;
  s.leading = schema.example_leading;
  bool has_leading = false;
  for (const auto& t : schema.tensors) {
    for (const auto& tok : t.shape) {
      if (tok.kind == ShapeToken::Kind::leading) has_leading = true;
      if (tok.kind == ShapeToken::Kind::symbol || tok.kind == ShapeToken::Kind::multiple) {
        auto it = schema.example_sizes.find(tok.symbol);
        s.symbols.emplace(tok.symbol, it != schema.example_sizes.end() ? it->second : kDefaultSymbolSize);
      }
    }
    if (t.range_max && t.range_max->kind == ShapeToken::Kind::symbol) {
      auto it = schema.example_sizes.find(t.range_max->symbol);
      s.symbols.emplace(t.range_max->symbol, it != schema.example_sizes.end() ? it->second : kDefaultSymbolSize);
    }
  }
  if (has_leading && s.leading.empty() && schema.example_leading.empty()) s.leading = {kDefaultRows};
  return s;
}

void apply_overrides(Shapes& shapes, const std::vector<std::string>& overrides, const OpSchema& schema) {
  for (const auto& o : overrides) {
    const auto eq = o.find('=');
    if (eq == std::string::npos) throw std::invalid_argument(fmt::format("--shape '{}': expected NAME=N", o));
    const std::string name = o.substr(0, eq);
    const std::string value = o.substr(eq + 1);
    if (name == "*") {
      shapes.leading.clear();
      size_t start = 0;
      while (start <= value.size()) {
        size_t comma = value.find(',', start);
        if (comma == std::string::npos) comma = value.size();
        if (comma > start) shapes.leading.push_back(parse_size(value.substr(start, comma - start), "--shape *"));
        start = comma + 1;
      }
      continue;
    }
    if (!shapes.symbols.count(name)) {
      std::vector<std::string> known{"*"};
      for (const auto& [k, v] : shapes.symbols) known.push_back(k);
      throw std::invalid_argument(fmt::format("--shape {}: op '{}' has no shape symbol '{}' (symbols: {})", o,
                                              schema.op, name, fmt::join(known, ", ")));
    }
    shapes.symbols[name] = parse_size(value, "--shape " + name);
  }
}

void apply_attr_overrides(std::vector<NamedAttr>& attrs, const std::vector<std::string>& overrides,
                          const OpSchema& schema, bool skip_unknown) {
  for (const std::string& o : overrides) {
    const auto eq = o.find('=');
    if (eq == std::string::npos) throw std::invalid_argument(fmt::format("--attr '{}': expected NAME=VALUE", o));
    const std::string name = o.substr(0, eq);
    const std::string text = o.substr(eq + 1);
    const auto arg = std::find_if(schema.attrs.begin(), schema.attrs.end(), [&](const AttrArg& a) { return a.name == name; });
    if (arg == schema.attrs.end()) {
      if (skip_unknown) continue;
      std::vector<std::string_view> known;
      for (const AttrArg& a : schema.attrs) known.push_back(a.name);
      throw std::invalid_argument(fmt::format("--attr {}: op '{}' has no attribute '{}' (attributes: {})", o, schema.op,
                                              name, known.empty() ? "none" : fmt::format("{}", fmt::join(known, ", "))));
    }
    // The text is typed as the C++ and Python callers' values are: a float
    // takes an integer too, a bool is true or false only.
    const auto bad = [&] {
      return std::invalid_argument(fmt::format("--attr {}: attribute '{}' of op '{}' is a {}; '{}' is not one{}", o,
                                               name, schema.op, attr_type_name(arg->type), text,
                                               arg->type == AttrType::bool_ ? " (true or false)" : ""));
    };
    AttrValue value;
    size_t used = 0;
    try {
      switch (arg->type) {
        case AttrType::float_: value = std::stod(text, &used); break;
        case AttrType::int_: value = static_cast<int64_t>(std::stoll(text, &used)); break;
        case AttrType::bool_:
          if (text != "true" && text != "false") throw bad();
          value = text == "true";
          used = text.size();
          break;
        case AttrType::string: value = text; used = text.size(); break;
      }
    } catch (const std::logic_error&) {  // std::stod's invalid_argument and out_of_range
      throw bad();
    }
    if (used != text.size() || text.empty()) throw bad();
    const auto existing = std::find_if(attrs.begin(), attrs.end(), [&](const NamedAttr& a) { return a.name == name; });
    if (existing != attrs.end()) {
      existing->value = std::move(value);
    } else {
      attrs.push_back({arg->name, std::move(value)});
    }
  }
}

std::vector<int64_t> tensor_shape(const TensorArg& arg, const Shapes& shapes) {
  std::vector<int64_t> out;
  for (const auto& tok : arg.shape) {
    switch (tok.kind) {
      case ShapeToken::Kind::leading: out.insert(out.end(), shapes.leading.begin(), shapes.leading.end()); break;
      case ShapeToken::Kind::symbol: out.push_back(shapes.symbols.at(tok.symbol)); break;
      case ShapeToken::Kind::constant: out.push_back(tok.value); break;
      case ShapeToken::Kind::multiple: {
        int64_t n = 0;
        if (__builtin_mul_overflow(tok.value, shapes.symbols.at(tok.symbol), &n)) {
          throw std::invalid_argument(fmt::format("tensor '{}': {} * {}={} does not fit in 64 bits", arg.name,
                                                  tok.value, tok.symbol, shapes.symbols.at(tok.symbol)));
        }
        out.push_back(n);
        break;
      }
    }
  }
  return out;
}

size_t tensor_bytes(Dtype dtype, const std::vector<int64_t>& shape) {
  size_t bytes = dtype_size(dtype);
  for (int64_t d : shape) {
    if (d < 0 || __builtin_mul_overflow(bytes, static_cast<size_t>(d), &bytes)) {
      throw std::invalid_argument(
          fmt::format("a {} tensor of shape [{}] is too large to address", dtype_name(dtype), fmt::join(shape, ", ")));
    }
  }
  return bytes;
}

namespace {
// The primary dtype of `arg` in a call whose dtype variable is bound to `dtype`.
Dtype arg_dtype(const OpSchema& schema, const TensorArg& arg, Dtype dtype) {
  const std::vector<Dtype> dtypes = schema.tensor_dtypes(arg, dtype);
  return dtypes.empty() ? dtype : dtypes.front();
}
}  // namespace

size_t call_bytes(const OpSchema& schema, Dtype dtype, const Shapes& shapes) {
  size_t total = 0;
  for (const TensorArg& arg : schema.tensors) {
    const std::vector<int64_t> shape = tensor_shape(arg, shapes);  // names the tensor where it throws
    size_t bytes = 0;
    try {
      bytes = tensor_bytes(arg_dtype(schema, arg, dtype), shape);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(fmt::format("tensor '{}': {}", arg.name, e.what()));
    }
    if (__builtin_add_overflow(total, bytes, &total)) {
      throw std::invalid_argument(fmt::format("the tensors of {} at {} are too large to address", schema.op,
                                              shapes_str(shapes)));
    }
  }
  return total;
}

std::string shapes_str(const Shapes& shapes) {
  std::string s;
  if (!shapes.leading.empty()) s = fmt::format("*=[{}]", fmt::join(shapes.leading, ","));
  for (const auto& [k, v] : shapes.symbols) s += fmt::format("{}{}={}", s.empty() ? "" : " ", k, v);
  return s;
}

// --- buffers --------------------------------------------------------------------

namespace {
size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

void check(kd_status status, const char* what, const char* error) {
  if (status != KD_STATUS_OK) {
    throw KernelError(ErrorCode::device_error, fmt::format("{} failed: {}", what, error[0] ? error : "no message"));
  }
}
}  // namespace

namespace {
// Elements after the last one of a padded tensor: the pad of its last row.
constexpr int64_t kTailPad = 3;

// The storage a tensor of `shape` with `strides` spans, in elements, its
// padding included; throws std::invalid_argument where it does not fit.
size_t strided_elements(const std::vector<int64_t>& shape, const std::vector<int64_t>& strides) {
  int64_t last = 0;
  for (size_t k = 0; k < shape.size(); ++k) {
    if (shape[k] == 0) return 0;
    int64_t reach = 0;
    if (strides[k] < 0 || __builtin_mul_overflow(shape[k] - 1, strides[k], &reach) ||
        __builtin_add_overflow(last, reach, &last)) {
      throw std::invalid_argument(fmt::format("a tensor of shape [{}] and strides [{}] is too large to address",
                                              fmt::join(shape, ", "), fmt::join(strides, ", ")));
    }
  }
  return static_cast<size_t>(last + 1 + kTailPad);
}
}  // namespace

std::vector<int64_t> padded_strides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> strides(shape.size(), 1);
  if (shape.empty()) return strides;
  int64_t span = shape.back();  // elements the dims after k span
  for (size_t k = shape.size() - 1; k-- > 0;) {
    if (shape[k] == 1) {
      strides[k] = (int64_t{1} << 31) + 3;  // never stepped over: only its width is tested
      continue;
    }
    const int64_t pad = (shape.size() - 1 - k) % 2 == 1 ? 3 : 7;
    strides[k] = span + pad;
    span = strides[k] * shape[k];
  }
  return strides;
}

size_t Buffer::offset(size_t i) const {
  if (strides_.empty()) return i;
  size_t at = 0;
  for (size_t k = runs_.size(); k-- > 1;) {
    at += (i % runs_[k]) * run_strides_[k];
    i /= runs_[k];
  }
  return runs_.empty() ? at : at + i * run_strides_[0];  // i < runs_[0]
}

Buffer Buffer::absent(Dtype dtype, DLDevice device, std::string name) {
  Buffer b(dtype, {}, device, nullptr, std::move(name));
  munmap(b.mapping_, b.mapping_bytes_);
  b.mapping_ = nullptr;
  b.mapping_bytes_ = 0;
  b.data_ = nullptr;
  b.bytes_ = 0;
  b.numel_ = 0;
  b.present_ = false;
  b.tensor_ = DLTensor{};
  b.tensor_.device = device;
  return b;
}

Buffer::Buffer(Dtype dtype, std::vector<int64_t> shape, DLDevice device, const kd_memory_api* memory,
               std::string name, std::vector<int64_t> strides)
    : dtype_(dtype), shape_(std::move(shape)), strides_(std::move(strides)), name_(std::move(name)), memory_(memory) {
  bytes_ = tensor_bytes(dtype, shape_);
  numel_ = bytes_ / dtype_size(dtype);
  if (!strides_.empty()) {
    if (strides_.size() != shape_.size()) throw std::invalid_argument("Buffer: one stride per dim");
    if (__builtin_mul_overflow(strided_elements(shape_, strides_), dtype_size(dtype), &bytes_)) {
      throw std::invalid_argument(fmt::format("tensor '{}' with padded rows is too large to address", name_));
    }
    for (size_t k = 0; k < shape_.size(); ++k) {
      const auto dim = static_cast<size_t>(shape_[k]);
      const auto stride = static_cast<size_t>(strides_[k]);
      if (dim == 1) continue;  // any stride: it is never stepped over
      if (!runs_.empty() && run_strides_.back() == stride * dim) {
        runs_.back() *= dim;
        run_strides_.back() = stride;
      } else {
        runs_.push_back(dim);
        run_strides_.push_back(stride);
      }
    }
  }
  // [PROT_NONE page][front guard][data][back guard][PROT_NONE page]; the
  // data starts on a page, and each guard holds at least kGuardBytes.
  page_ = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t front = round_up(kGuardBytes, page_);
  if (bytes_ > SIZE_MAX - kGuardBytes - front - 3 * page_) throw std::bad_alloc();
  const size_t data_and_back = round_up(bytes_ + kGuardBytes, page_);
  mapping_bytes_ = page_ + front + data_and_back + page_;
  void* mapping = mmap(nullptr, mapping_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mapping == MAP_FAILED) throw std::bad_alloc();
  mapping_ = static_cast<unsigned char*>(mapping);
  mprotect(mapping_, page_, PROT_NONE);
  mprotect(mapping_ + mapping_bytes_ - page_, page_, PROT_NONE);
  data_ = mapping_ + page_ + front;
  std::memset(mapping_ + page_, kGuardByte, front);
  std::memset(data_ + bytes_, kGuardByte, data_and_back - bytes_);
  if (!strides_.empty()) std::memset(data_, kPadByte, bytes_);  // the padding; elements are written over it
  tensor_.data = data_;
  if (memory_ != nullptr) {
    char error[256] = "";
    try {
      check(memory_->alloc(device.device_id, bytes_ + 2 * kGuardBytes, &device_ptr_, error, sizeof error),
            "device allocation", error);
    } catch (...) {
      munmap(mapping_, mapping_bytes_);
      throw;
    }
    tensor_.data = static_cast<unsigned char*>(device_ptr_) + kGuardBytes;
  }
  tensor_.device = device;
  tensor_.ndim = static_cast<int32_t>(shape_.size());
  tensor_.dtype = to_dlpack(dtype);
  tensor_.shape = shape_.data();
  tensor_.strides = strides_.empty() ? nullptr : strides_.data();
  tensor_.byte_offset = 0;
}

Buffer::Buffer(Buffer&& o) noexcept
    : dtype_(o.dtype_),
      shape_(std::move(o.shape_)),
      strides_(std::move(o.strides_)),
      runs_(std::move(o.runs_)),
      run_strides_(std::move(o.run_strides_)),
      name_(std::move(o.name_)),
      present_(o.present_),
      numel_(o.numel_),
      bytes_(o.bytes_),
      mapping_(o.mapping_),
      mapping_bytes_(o.mapping_bytes_),
      page_(o.page_),
      data_(o.data_),
      device_ptr_(o.device_ptr_),
      memory_(o.memory_),
      tensor_(o.tensor_) {
  o.mapping_ = nullptr;
  o.data_ = nullptr;
  o.device_ptr_ = nullptr;
  if (present_) {
    tensor_.shape = shape_.data();
    tensor_.strides = strides_.empty() ? nullptr : strides_.data();
  }
}

Buffer::~Buffer() {
  if (memory_ != nullptr && device_ptr_ != nullptr) {
    char error[256] = "";
    memory_->free(tensor_.device.device_id, device_ptr_, error, sizeof error);
  }
  if (mapping_ != nullptr) munmap(mapping_, mapping_bytes_);
}

void Buffer::upload() {
  if (memory_ == nullptr || !present_) return;
  char error[256] = "";
  check(memory_->copy(tensor_.device.device_id, device_ptr_, data_ - kGuardBytes, bytes_ + 2 * kGuardBytes,
                      KD_COPY_HOST_TO_DEVICE, error, sizeof error),
        "copy to device", error);
}

void Buffer::download() {
  if (memory_ == nullptr || !present_) return;
  char error[256] = "";
  check(memory_->copy(tensor_.device.device_id, data_ - kGuardBytes, device_ptr_, bytes_ + 2 * kGuardBytes,
                      KD_COPY_DEVICE_TO_HOST, error, sizeof error),
        "copy from device", error);
}

std::optional<Buffer::Damage> Buffer::guard_damage() const {
  std::optional<Damage> damage;
  if (!present_) return damage;
  const auto note = [&](int64_t offset) {
    if (!damage) damage = Damage{offset, offset};
    damage->last = offset;
  };
  const unsigned char* front = mapping_ + page_;
  for (const unsigned char* p = front; p < data_; ++p) {
    if (*p != kGuardByte) note(p - data_);
  }
  const unsigned char* end = mapping_ + mapping_bytes_ - page_;
  for (const unsigned char* p = data_ + bytes_; p < end; ++p) {
    if (*p != kGuardByte) note(p - data_);
  }
  return damage;
}

std::optional<Buffer::Damage> Buffer::pad_damage() const {
  std::optional<Damage> damage;
  if (!present_ || strides_.empty()) return damage;
  const size_t size = dtype_size(dtype_);
  std::vector<bool> element(bytes_ / size, false);
  for (size_t i = 0; i < numel_; ++i) element[offset(i)] = true;
  for (size_t e = 0; e < element.size(); ++e) {
    if (element[e]) continue;
    for (size_t b = e * size; b < (e + 1) * size; ++b) {
      if (data_[b] == kPadByte) continue;
      if (!damage) damage = Damage{static_cast<int64_t>(b), static_cast<int64_t>(b)};
      damage->last = static_cast<int64_t>(b);
    }
  }
  return damage;
}

std::vector<Buffer::Span> Buffer::guard_pages() const {
  if (memory_ != nullptr || mapping_ == nullptr) return {};
  const auto base = reinterpret_cast<uintptr_t>(mapping_);
  return {Span{base, base + page_}, Span{base + mapping_bytes_ - page_, base + mapping_bytes_}};
}

std::vector<DLTensor> CallData::dl() const {
  std::vector<DLTensor> out;
  for (const auto& b : tensors) out.push_back(b.dl());
  return out;
}

size_t CallData::bytes_moved(const OpSchema& schema) const {
  size_t total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorArg& a = schema.tensors[i];
    total += tensors[i].numel() * dtype_size(tensors[i].dtype()) * (a.inplace ? 2 : 1);
  }
  return total;
}

namespace {

// "values": "distinct": element i the i-th value of a random ordering of
// [lo, hi), drawn by a partial Fisher-Yates shuffle that keeps only the
// positions it moved, so a wide range costs nothing.
void fill_distinct(Buffer& b, int64_t lo, int64_t hi, std::mt19937_64& rng) {
  const auto n = static_cast<int64_t>(b.numel());
  if (hi - lo < n) {
    throw std::invalid_argument(fmt::format("tensor '{}': {} distinct values do not fit its range [{}, {})", b.name(),
                                            n, lo, hi));
  }
  std::unordered_map<int64_t, int64_t> moved;  // position -> value, where not lo + position
  const auto at = [&](int64_t k) {
    const auto it = moved.find(k);
    return it != moved.end() ? it->second : lo + k;
  };
  for (int64_t i = 0; i < n; ++i) {
    const int64_t j = std::uniform_int_distribution<int64_t>(i, hi - lo - 1)(rng);
    const int64_t vj = at(j);
    moved[j] = at(i);
    b.set(static_cast<size_t>(i), static_cast<double>(vj));
  }
}

// "values": "cos_sin": each row of the last dim holds cos(phi) in its first
// half and sin(phi) of the same random angles in its second. Random values
// there would scale, not rotate, and repeated in-place calls (a benchmark)
// would soon run on Inf, NaN or subnormal numbers.
void fill_cos_sin(Buffer& b, std::mt19937_64& rng) {
  const int64_t width = b.shape().empty() ? 0 : b.shape().back();
  if (width < 2) return;
  const int64_t half = width / 2;
  const auto rows = static_cast<int64_t>(b.numel()) / width;
  std::uniform_real_distribution<double> angle(0.0, 2.0 * std::numbers::pi);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < half; ++i) {
      const double phi = angle(rng);
      const auto at = static_cast<size_t>(r * width + i);
      b.set(at, std::cos(phi));
      b.set(at + static_cast<size_t>(half), std::sin(phi));
    }
  }
}

}  // namespace

bool has_rows(const OpSchema& schema) {
  return std::any_of(schema.tensors.begin(), schema.tensors.end(),
                     [](const TensorArg& t) { return t.layout != Layout::contiguous; });
}

bool has_flattened(const OpSchema& schema) {
  return std::any_of(schema.tensors.begin(), schema.tensors.end(),
                     [](const TensorArg& t) { return !t.flattened.empty(); });
}

bool flattens(const OpSchema& schema, std::span<const NamedAttr> attrs) {
  for (const NamedAttr& a : attrs) {
    const int64_t* value = std::get_if<int64_t>(&a.value);
    if (value == nullptr || *value == 0) continue;
    for (const TensorArg& t : schema.tensors) {
      if (t.flattened == a.name) return true;
    }
  }
  return false;
}

std::vector<Variant> variants(const OpSchema& schema, Dtype dtype) {
  const size_t n = schema.tensors.size();
  // Every combination of dtype alternatives, then of optional tensors left out.
  std::vector<std::vector<Dtype>> dtype_sets{{}};
  for (const TensorArg& arg : schema.tensors) {
    const std::vector<Dtype> choices = schema.tensor_dtypes(arg, dtype);
    std::vector<std::vector<Dtype>> next;
    for (const auto& set : dtype_sets) {
      for (Dtype d : choices) {
        next.push_back(set);
        next.back().push_back(d);
      }
    }
    dtype_sets = std::move(next);
  }
  std::vector<std::vector<bool>> absent_sets{std::vector<bool>(n, false)};
  for (size_t i = 0; i < n; ++i) {
    if (!schema.tensors[i].optional) continue;
    const size_t count = absent_sets.size();
    for (size_t k = 0; k < count; ++k) {
      absent_sets.push_back(absent_sets[k]);
      absent_sets.back()[i] = true;
    }
  }
  std::vector<bool> layouts{false};
  if (has_rows(schema)) layouts.push_back(true);
  std::vector<bool> forms{false};
  if (has_flattened(schema)) forms.push_back(true);
  std::vector<Variant> out;
  for (bool flattened : forms) {
    for (bool padded : layouts) {
      for (const auto& absent : absent_sets) {
        for (const auto& dtypes : dtype_sets) out.push_back(Variant{padded, dtypes, absent, flattened});
      }
    }
  }
  return out;
}

std::string describe(const OpSchema& schema, const Variant& v) {
  std::vector<std::string> parts{v.padded ? "padded rows" : "dense"};
  if (v.flattened) {
    for (const TensorArg& arg : schema.tensors) {
      if (!arg.flattened.empty()) parts.push_back(fmt::format("{} flattened", arg.name));
    }
  }
  for (size_t i = 0; i < schema.tensors.size(); ++i) {
    const TensorArg& arg = schema.tensors[i];
    if (i < v.absent.size() && v.absent[i]) {
      parts.push_back(fmt::format("{} absent", arg.name));
      continue;
    }
    if (i < v.dtypes.size() && !arg.dtype_alternatives.empty()) {
      parts.push_back(fmt::format("{} {}", arg.name, dtype_name(v.dtypes[i])));
    }
  }
  return fmt::format("{}", fmt::join(parts, ", "));
}

CallData make_call(const OpSchema& schema, Dtype dtype, const Shapes& shapes, uint64_t seed,
                   const Variant& variant) {
  CallData data{{}, {}, dtype, shapes};
  std::vector<std::pair<std::string, int64_t>> flattened_by;  // attribute, the size it splits by
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> uniform(-2.0, 2.0);
  for (size_t t = 0; t < schema.tensors.size(); ++t) {
    const TensorArg& arg = schema.tensors[t];
    const Dtype d = t < variant.dtypes.size() ? variant.dtypes[t] : arg_dtype(schema, arg, dtype);
    if (t < variant.absent.size() && variant.absent[t]) {
      data.tensors.push_back(Buffer::absent(d, DLDevice{kDLCPU, 0}, arg.name));
      continue;
    }
    std::vector<int64_t> shape = tensor_shape(arg, shapes);
    if (variant.flattened && !arg.flattened.empty() && shape.size() >= 2) {
      // [*, H, D] given as [*, H*D], its attribute D.
      const int64_t values = shape.back();
      shape.pop_back();
      if (__builtin_mul_overflow(shape.back(), values, &shape.back())) {
        throw std::invalid_argument(fmt::format("tensor '{}': flattened, its size does not fit in 64 bits", arg.name));
      }
      flattened_by.emplace_back(arg.flattened, values);
    }
    std::vector<int64_t> strides;
    if (variant.padded && arg.layout != Layout::contiguous) strides = padded_strides(shape);
    Buffer b(d, std::move(shape), DLDevice{kDLCPU, 0}, nullptr, arg.name, std::move(strides));
    const size_t n = b.numel();
    const bool is_float = is_floating(d);
    if (arg.written && !arg.inplace) {
      for (size_t i = 0; i < n; ++i) b.set(i, is_float ? std::nan("") : -7.0);
    } else if (is_float) {
      bool nonzero = false;
      for (size_t i = 0; i < n; ++i) {
        const double v = uniform(rng);
        b.set(i, v);
        nonzero = nonzero || b.at(i) != 0.0;
      }
      if (!nonzero && n > 0) b.set(0, 1.0);
      if (arg.values == TensorValues::cos_sin) fill_cos_sin(b, rng);
    } else {
      int64_t lo = arg.range_min.value_or(0);
      int64_t hi = 100;
      if (arg.range_max) {
        hi = arg.range_max->kind == ShapeToken::Kind::constant ? arg.range_max->value
                                                               : shapes.symbols.at(arg.range_max->symbol);
      }
      if (hi <= lo) throw std::invalid_argument(fmt::format("tensor '{}': empty range [{}, {})", arg.name, lo, hi));
      if (arg.values == TensorValues::distinct) {
        fill_distinct(b, lo, hi, rng);
      } else {
        std::uniform_int_distribution<int64_t> pick(lo, hi - 1);
        for (size_t i = 0; i < n; ++i) b.set(i, static_cast<double>(pick(rng)));
      }
    }
    data.tensors.push_back(std::move(b));
  }
  for (const AttrArg& attr : schema.attrs) {
    if (!attr.default_value) continue;
    data.attrs.push_back({attr.name, *attr.default_value});
    for (const auto& [name, size] : flattened_by) {
      if (name == attr.name) data.attrs.back().value = size;
    }
  }
  return data;
}

CallData clone_to(const CallData& src, DLDevice device, const kd_memory_api* memory, bool dense) {
  CallData out{{}, src.attrs, src.dtype, src.shapes};
  for (const Buffer& b : src.tensors) {
    if (!b.present()) {
      out.tensors.push_back(Buffer::absent(b.dtype(), device, b.name()));
      continue;
    }
    Buffer copy(b.dtype(), b.shape(), device, memory, b.name(), dense ? std::vector<int64_t>{} : b.strides());
    if (copy.bytes() == b.bytes()) {
      std::memcpy(copy.host(), b.host(), b.bytes());  // the padding too
    } else {
      const size_t size = dtype_size(b.dtype());
      for (size_t i = 0; i < b.numel(); ++i) {
        std::memcpy(static_cast<char*>(copy.host()) + copy.offset(i) * size,
                    static_cast<const char*>(b.host()) + b.offset(i) * size, size);
      }
    }
    copy.upload();
    out.tensors.push_back(std::move(copy));
  }
  return out;
}

CallData plain_copy(const OpSchema& schema, const CallData& src) {
  CallData out{{}, src.attrs, src.dtype, src.shapes};
  const DLDevice host{kDLCPU, 0};
  for (size_t t = 0; t < src.tensors.size(); ++t) {
    const Buffer& b = src.tensors[t];
    if (!b.present()) {
      out.tensors.push_back(Buffer::absent(b.dtype(), host, b.name()));
      continue;
    }
    std::vector<int64_t> shape = b.shape();
    if (t < schema.tensors.size() && !schema.tensors[t].flattened.empty()) {
      std::vector<int64_t> plain = tensor_shape(schema.tensors[t], src.shapes);
      if (plain.size() == shape.size() + 1) shape = std::move(plain);  // given flattened: split
    }
    Buffer copy(b.dtype(), std::move(shape), host, nullptr, b.name());
    if (copy.numel() != b.numel()) {
      throw std::invalid_argument(fmt::format("plain_copy: tensor '{}' has {} elements, its pattern {}", b.name(),
                                              b.numel(), copy.numel()));
    }
    const size_t size = dtype_size(b.dtype());
    for (size_t i = 0; i < b.numel(); ++i) {
      std::memcpy(static_cast<char*>(copy.host()) + i * size, static_cast<const char*>(b.host()) + b.offset(i) * size,
                  size);
    }
    out.tensors.push_back(std::move(copy));
  }
  for (NamedAttr& a : out.attrs) {
    for (const TensorArg& arg : schema.tensors) {
      if (arg.flattened == a.name) a.value = int64_t{0};
    }
  }
  return out;
}

void download_all(CallData& data) {
  for (auto& b : data.tensors) b.download();
}

// --- guards ---------------------------------------------------------------------

void check_guards(const CallData& data, const std::string& kernel) {
  for (const Buffer& b : data.tensors) {
    if (const std::optional<Buffer::Damage> pad = b.pad_damage()) {
      throw GuardViolation(fmt::format(
          "{} wrote into the padding between the rows of tensor '{}' (shape [{}], strides [{}]): the pad bytes "
          "at offsets {} to {} from its start changed",
          kernel, b.name(), fmt::join(b.shape(), ", "), fmt::join(b.strides(), ", "), pad->first, pad->last));
    }
    const std::optional<Buffer::Damage> damage = b.guard_damage();
    if (!damage) continue;
    const auto bytes = static_cast<int64_t>(b.bytes());
    const char* where = damage->first >= bytes ? "past its end"
                        : damage->last < 0     ? "before its start"
                                               : "before its start and past its end";
    throw GuardViolation(fmt::format(
        "{} wrote outside tensor '{}' ({} bytes): the guard bytes at offsets {} to {} from its start, {}, changed",
        kernel, b.name(), bytes, damage->first, damage->last, where));
  }
}

namespace {

// The guard pages being watched, read by the SIGSEGV handler: fixed slots
// of plain data, published by `state` (0 free, 1 taken, 2 watched), so the
// handler reads no lock and allocates nothing.
struct GuardSlot {
  std::atomic<int> state{0};
  uintptr_t pages[2][2] = {};  // two [begin, end) spans
  uintptr_t data = 0;
  size_t bytes = 0;
  char kernel[192] = {};
  char tensor[64] = {};
};
constexpr size_t kGuardSlots = 1024;
GuardSlot g_guard_slots[kGuardSlots];
struct sigaction g_previous_segv{};

// write(2) of a NUL-terminated string, in a signal handler.
void write_text(const char* text) {
  size_t n = std::strlen(text);
  while (n > 0) {
    const ssize_t w = write(2, text, n);
    if (w <= 0) return;
    text += w;
    n -= static_cast<size_t>(w);
  }
}

void write_number(int64_t v) {
  char digits[24];
  char* p = digits + sizeof digits;
  *--p = '\0';
  const bool negative = v < 0;
  uint64_t u = negative ? 0 - static_cast<uint64_t>(v) : static_cast<uint64_t>(v);
  do {
    *--p = static_cast<char>('0' + u % 10);
    u /= 10;
  } while (u != 0);
  if (negative) *--p = '-';
  write_text(p);
}

void on_guard_fault(int signal, siginfo_t* info, void* context) {
  const auto address = reinterpret_cast<uintptr_t>(info->si_addr);
  for (const GuardSlot& slot : g_guard_slots) {
    if (slot.state.load(std::memory_order_acquire) != 2) continue;
    bool hit = false;
    for (const auto& span : slot.pages) hit = hit || (address >= span[0] && address < span[1]);
    if (!hit) continue;
    const char* access = "touched";
#if defined(__x86_64__)
    // Bit 1 of the page-fault error code: a write.
    access = (static_cast<ucontext_t*>(context)->uc_mcontext.gregs[REG_ERR] & 2) != 0 ? "wrote" : "read";
#else
    (void)context;
#endif
    write_text("kdispatch: ");
    write_text(slot.kernel);
    write_text(" ");
    write_text(access);
    write_text(" outside tensor '");
    write_text(slot.tensor);
    write_text("' (");
    write_number(static_cast<int64_t>(slot.bytes));
    write_text(" bytes), beyond its guard bytes: at byte offset ");
    write_number(static_cast<int64_t>(address - slot.data));
    write_text(" from its start, a guard page; stopping (exit ");
    write_number(kGuardFaultExit);
    write_text(")\n");
    _exit(kGuardFaultExit);
  }
  // Not a guard page: the fault the process would have had.
  sigaction(signal, &g_previous_segv, nullptr);
}

void install_guard_handler() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction action {};
    action.sa_sigaction = on_guard_fault;
    action.sa_flags = SA_SIGINFO;
    sigemptyset(&action.sa_mask);
    sigaction(SIGSEGV, &action, &g_previous_segv);
  });
}

void copy_text(char* to, size_t capacity, const std::string& text) {
  const size_t n = std::min(text.size(), capacity - 1);
  std::memcpy(to, text.data(), n);
  to[n] = '\0';
}

}  // namespace

GuardWatch& GuardWatch::watch(const Buffer& buffer) {
  const std::vector<Buffer::Span> pages = buffer.guard_pages();
  if (pages.size() != 2) return *this;
  install_guard_handler();
  for (size_t i = 0; i < kGuardSlots; ++i) {
    GuardSlot& slot = g_guard_slots[i];
    int free = 0;
    if (!slot.state.compare_exchange_strong(free, 1, std::memory_order_acq_rel)) continue;
    for (size_t p = 0; p < 2; ++p) {
      slot.pages[p][0] = pages[p].begin;
      slot.pages[p][1] = pages[p].end;
    }
    slot.data = reinterpret_cast<uintptr_t>(buffer.host());
    slot.bytes = buffer.bytes();
    copy_text(slot.kernel, sizeof slot.kernel, kernel_);
    copy_text(slot.tensor, sizeof slot.tensor, buffer.name());
    slot.state.store(2, std::memory_order_release);
    slots_.push_back(i);
    return *this;
  }
  return *this;  // every slot taken: the guard bytes still catch a near overrun
}

GuardWatch& GuardWatch::watch(const CallData& data) {
  for (const Buffer& b : data.tensors) watch(b);
  return *this;
}

GuardWatch::~GuardWatch() {
  for (size_t i : slots_) g_guard_slots[i].state.store(0, std::memory_order_release);
}

// --- cases ----------------------------------------------------------------------

std::vector<Dtype> call_dtypes(const OpSchema& schema) { return schema.call_dtypes(); }

std::vector<Dtype> kernel_dtypes(const OpSchema& schema, const KernelSpec& spec) {
  std::vector<Dtype> out;
  for (Dtype d : call_dtypes(schema)) {
    if (spec.supports(d)) out.push_back(d);
  }
  return out;
}

std::vector<TestCase> test_cases(const OpSchema& schema) {
  std::vector<std::vector<NamedAttr>> combos{{}};
  for (const auto& [name, values] : schema.test_attrs) {
    std::vector<std::vector<NamedAttr>> next;
    for (const auto& combo : combos) {
      for (const AttrValue& v : values) {
        next.push_back(combo);
        next.back().push_back({name, v});
      }
    }
    combos = std::move(next);
  }
  std::vector<Shapes> sizes = schema.test_sizes;
  if (sizes.empty()) sizes.push_back(example_shapes(schema));
  std::vector<TestCase> cases;
  const auto add = [&](const std::vector<Shapes>& at, const SpecialValues* special) {
    for (const Shapes& s : at) {
      for (const auto& combo : combos) cases.push_back({s, combo, special});
    }
  };
  add(sizes, nullptr);
  for (const SpecialValues& special : schema.test_special) add(special.sizes.empty() ? sizes : special.sizes, &special);
  return cases;
}

std::string describe(const TestCase& c) {
  std::string s = shapes_str(c.shapes);
  for (const auto& a : c.attrs) {
    s += fmt::format(" {}={}", a.name, std::visit([](const auto& v) { return fmt::format("{}", v); }, a.value));
  }
  if (c.special != nullptr) s += fmt::format(" (special: {})", c.special->what);
  return s;
}

CallData make_case(const OpSchema& schema, Dtype dtype, const TestCase& c, uint64_t seed,
                   const Variant& variant) {
  CallData data = make_call(schema, dtype, c.shapes, seed, variant);
  for (const NamedAttr& a : c.attrs) {
    for (NamedAttr& have : data.attrs) {
      if (have.name == a.name) have.value = a.value;
    }
  }
  if (c.special != nullptr) plant_special(data, schema, *c.special, seed ^ 0x5bd1e995u);
  return data;
}

void plant_special(CallData& data, const OpSchema& schema, const SpecialValues& special, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (const std::string& name : special.tensors) {
    const auto arg = std::find_if(schema.tensors.begin(), schema.tensors.end(),
                                  [&](const TensorArg& t) { return t.name == name; });
    if (arg == schema.tensors.end()) {
      throw std::invalid_argument(
          fmt::format("{}: special values for '{}', which the op does not have", schema.op, name));
    }
    Buffer& b = data.tensors[static_cast<size_t>(arg - schema.tensors.begin())];
    if (!b.present()) continue;  // an optional input left out of this call
    const Dtype d = b.dtype();
    const size_t n = b.numel();
    // The last-dim window the values go into, in the pattern's shape (a
    // flattened tensor's elements lie in the same order).
    const std::vector<int64_t> pattern = tensor_shape(*arg, data.shapes);
    const auto width = static_cast<size_t>(pattern.empty() ? 1 : std::max<int64_t>(pattern.back(), 1));
    size_t from = 0;
    size_t to = width;
    if (special.columns) {
      const auto at = [&](const ShapeToken& t) {
        return static_cast<size_t>(t.kind == ShapeToken::Kind::symbol ? data.shapes.symbols.at(t.symbol) : t.value);
      };
      from = std::min(at(special.columns->first), width);
      to = std::min(at(special.columns->second), width);
    }
    std::uniform_real_distribution<double> chance(0.0, 1.0);
    std::uniform_int_distribution<size_t> pick(0, special.values.empty() ? 0 : special.values.size() - 1);
    std::uniform_int_distribution<int64_t> steps(-special.ulps, special.ulps);
    size_t planted = 0;
    for (size_t i = 0; i < n; ++i) {
      const size_t column = i % width;
      if (column < from || column >= to) continue;
      if (special.every_value) {
        // Bit pattern k of a 16-bit dtype (of an 8-bit one, k mod 256); in
        // wider floats, bfloat16 pattern k.
        const auto bits = static_cast<uint16_t>(planted++);
        if (d == Dtype::float16 || d == Dtype::bfloat16) {
          static_cast<uint16_t*>(b.host())[b.offset(i)] = bits;
        } else if (d == Dtype::float8_e4m3fn || d == Dtype::float8_e5m2) {
          static_cast<uint8_t*>(b.host())[b.offset(i)] = static_cast<uint8_t>(bits);
        } else {
          b.set(i, reference::decode(reference::Dtype::kBFloat16, bits));
        }
        continue;
      }
      if (special.fraction < 1.0 && chance(rng) >= special.fraction) continue;
      double v = special.values[pick(rng)];
      if (special.ulps > 0 && std::isfinite(v) && is_floating(d)) {
        b.set(i, v);  // rounded to the dtype first, then moved
        v = b.at(i);
        v += static_cast<double>(steps(rng)) * ulp(d, v);
      }
      b.set(i, v);
    }
  }
}

// --- checking -------------------------------------------------------------------

double ulp(Dtype dtype, double value) {
  int precision = 0;     // significand bits, the implicit one included
  int min_exponent = 0;  // exponent of the smallest normal number
  switch (dtype) {
    case Dtype::float64: precision = 53; min_exponent = -1022; break;
    case Dtype::float32: precision = 24; min_exponent = -126; break;
    case Dtype::float16: precision = 11; min_exponent = -14; break;
    case Dtype::bfloat16: precision = 8; min_exponent = -126; break;
    case Dtype::float8_e4m3fn: precision = 4; min_exponent = -6; break;
    case Dtype::float8_e5m2: precision = 3; min_exponent = -14; break;
    default: return 1.0;  // integers
  }
  const int exponent = value == 0 || !std::isfinite(value) ? min_exponent : std::max(std::ilogb(value), min_exponent);
  return std::ldexp(1.0, exponent - precision + 1);
}

namespace {

// Element k (in row-major order) of a host tensor, any strides.
class Elements {
 public:
  explicit Elements(const DLTensor& t)
      : t_(t), base_(static_cast<const char*>(t.data) + t.byte_offset), dtype_(from_dlpack(t.dtype)) {
    if (!dtype_) throw std::invalid_argument("compare: a tensor of a dtype kdispatch does not know");
    int64_t n = 1;
    for (int i = 0; i < t.ndim; ++i) n *= t.shape[i];
    count_ = static_cast<size_t>(n);
    dense_ = t.strides == nullptr;
    if (!dense_) {
      int64_t expected = 1;
      dense_ = true;
      for (int i = t.ndim - 1; i >= 0; --i) {
        if (t.shape[i] != 1 && t.strides[i] != expected) dense_ = false;
        expected *= t.shape[i];
      }
    }
  }
  size_t size() const { return count_; }
  Dtype dtype() const { return *dtype_; }
  double operator[](size_t k) const {
    if (dense_) return load(base_, *dtype_, k);
    int64_t offset = 0;
    for (int i = t_.ndim - 1; i >= 0; --i) {
      const auto dim = static_cast<size_t>(t_.shape[i]);
      offset += static_cast<int64_t>(k % dim) * t_.strides[i];
      k /= dim;
    }
    return load(base_, *dtype_, static_cast<size_t>(offset));
  }
  // The bits of element k, for comparisons bit for bit.
  uint64_t bits(size_t k) const {
    const double v = (*this)[k];
    if (is_floating(*dtype_)) {
      uint64_t b;
      std::memcpy(&b, &v, sizeof b);
      return std::isnan(v) ? 0x7ff8000000000000ull : b;  // any NaN equals any NaN
    }
    return static_cast<uint64_t>(static_cast<int64_t>(v));
  }

 private:
  const DLTensor& t_;
  const char* base_;
  std::optional<Dtype> dtype_;
  size_t count_ = 0;
  bool dense_ = true;
};

}  // namespace

Comparison compare(const OpSchema& schema, std::span<const DLTensor> got, std::span<const DLTensor> want,
                   std::span<const std::string> unchecked) {
  if (got.size() != schema.tensors.size() || want.size() != schema.tensors.size()) {
    throw std::invalid_argument(fmt::format("compare: op '{}' has {} tensors, got {} and {}", schema.op,
                                            schema.tensors.size(), got.size(), want.size()));
  }
  Comparison c;
  for (size_t i = 0; i < schema.tensors.size(); ++i) {
    const TensorArg& arg = schema.tensors[i];
    if (!arg.written && !arg.inplace) continue;
    if (std::find(unchecked.begin(), unchecked.end(), arg.name) != unchecked.end()) continue;
    const bool got_absent = got[i].data == nullptr && got[i].ndim == 0;
    const bool want_absent = want[i].data == nullptr && want[i].ndim == 0;
    if (got_absent && want_absent) continue;  // an optional output left out of both calls
    if (got_absent != want_absent) {
      throw std::invalid_argument(fmt::format("compare: op '{}', '{}': absent from one call only", schema.op,
                                              arg.name));
    }
    const Elements g(got[i]);
    const Elements w(want[i]);
    if (g.size() != w.size() || g.dtype() != w.dtype()) {
      throw std::invalid_argument(fmt::format("compare: op '{}', '{}': {} {} elements against {} {}", schema.op,
                                              arg.name, g.size(), dtype_name(g.dtype()), w.size(),
                                              dtype_name(w.dtype())));
    }
    const Dtype dtype = g.dtype();
    if (!is_floating(dtype) || arg.exact) {
      for (size_t k = 0; k < g.size(); ++k) {
        if (g.bits(k) == w.bits(k)) continue;
        const double abs_err = std::fabs(g[k] - w[k]);
        if (std::isfinite(abs_err)) c.max_abs_err = std::max(c.max_abs_err, abs_err);
        if (c.ok) {
          c.ok = false;
          c.first_mismatch = fmt::format("{}[flat {}]: got {}, expected {} (compared bit for bit)", arg.name, k,
                                         g[k], w[k]);
        }
      }
      continue;
    }
    const Tolerance tol = schema.tolerance(dtype);
    double ulps_sum = 0;
    for (size_t k = 0; k < g.size(); ++k) {
      const double gv = g[k];
      const double wv = w[k];
      const double abs_err = gv == wv ? 0.0 : std::fabs(gv - wv);  // equal infinities: no error
      const double unit = ulp(dtype, wv);
      const bool bad = std::isnan(gv) != std::isnan(wv) || (!std::isnan(wv) && !(abs_err <= tol.ulps * unit + tol.atol));
      if (std::isfinite(abs_err)) {
        c.max_abs_err = std::max(c.max_abs_err, abs_err);
        if (std::fabs(wv) > tol.atol) c.max_rel_err = std::max(c.max_rel_err, abs_err / std::fabs(wv));
        const double beyond_floor = std::max(0.0, abs_err - tol.atol) / unit;
        c.max_ulps = std::max(c.max_ulps, beyond_floor);
        ulps_sum += beyond_floor;
      }
      if (bad && c.ok) {
        c.ok = false;
        c.first_mismatch = fmt::format("{}[flat {}]: got {}, expected {} ({:.3g} ulps; allowed {} ulps + {})", arg.name,
                                       k, gv, wv, abs_err / unit, tol.ulps, tol.atol);
      }
    }
    const double mean = g.size() == 0 ? 0.0 : ulps_sum / static_cast<double>(g.size());
    c.mean_ulps = std::max(c.mean_ulps, mean);
    if (!(mean <= tol.mean_ulps) && c.ok) {
      c.ok = false;
      c.first_mismatch = fmt::format("{}: mean error {:.3g} ulps (beyond {} each), allowed {}", arg.name, mean,
                                     tol.atol, tol.mean_ulps);
    }
  }
  return c;
}

Comparison compare(const OpSchema& schema, const CallData& got, const CallData& want,
                   std::span<const std::string> unchecked) {
  const std::vector<DLTensor> g = got.dl();
  const std::vector<DLTensor> w = want.dl();
  // Host copies: a device buffer's DLTensor points at device memory.
  std::vector<DLTensor> gh = g;
  std::vector<DLTensor> wh = w;
  for (size_t i = 0; i < gh.size(); ++i) {
    gh[i].data = const_cast<void*>(got.tensors[i].host());
    wh[i].data = const_cast<void*>(want.tensors[i].host());
  }
  return compare(schema, gh, wh, unchecked);
}

// --- .npy -----------------------------------------------------------------------

void save_npy(const std::string& path, const Buffer& buffer) {
  std::string descr;
  bool widen_bf16 = false;
  switch (buffer.dtype()) {
    case Dtype::float32: descr = "<f4"; break;
    case Dtype::float16: descr = "<f2"; break;
    case Dtype::bfloat16: descr = "<f4"; widen_bf16 = true; break;
    case Dtype::float64: descr = "<f8"; break;
    case Dtype::int32: descr = "<i4"; break;
    case Dtype::int64: descr = "<i8"; break;
    case Dtype::uint8: descr = "|u1"; break;
    case Dtype::bool_: descr = "|b1"; break;
    // NumPy has no 8-bit float: the raw bytes, the dtype in the file name
    // (<op>.<backend>.<dtype>) or the op's schema.
    case Dtype::float8_e4m3fn: case Dtype::float8_e5m2: descr = "|u1"; break;
  }
  std::string shape;
  for (int64_t d : buffer.shape()) shape += fmt::format("{}, ", d);
  if (buffer.shape().size() == 1) shape.pop_back();       // "(7,)"
  else if (!shape.empty()) shape.resize(shape.size() - 2);  // "(3, 4)"
  std::string header =
      fmt::format("{{'descr': '{}', 'fortran_order': False, 'shape': ({}), }}", descr, shape);
  // Pad so that the data starts on a 64-byte boundary (format 1.0).
  const size_t total = 10 + header.size() + 1;
  header.append((64 - total % 64) % 64, ' ');
  header.push_back('\n');
  std::ofstream out(path, std::ios::binary);
  if (!out) throw std::runtime_error(fmt::format("cannot write {}", path));
  out.write("\x93NUMPY\x01\x00", 8);
  const auto len = static_cast<uint16_t>(header.size());
  const char len_bytes[2] = {static_cast<char>(len & 0xff), static_cast<char>(len >> 8)};
  out.write(len_bytes, 2);
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  if (buffer.padded()) {
    // The elements only, row-major; bfloat16 widened.
    const size_t size = widen_bf16 ? sizeof(float) : dtype_size(buffer.dtype());
    std::vector<char> dense(buffer.numel() * size);
    for (size_t i = 0; i < buffer.numel(); ++i) {
      if (widen_bf16) {
        const auto v = static_cast<float>(buffer.at(i));
        std::memcpy(dense.data() + i * size, &v, size);
      } else {
        std::memcpy(dense.data() + i * size, static_cast<const char*>(buffer.host()) + buffer.offset(i) * size, size);
      }
    }
    out.write(dense.data(), static_cast<std::streamsize>(dense.size()));
  } else if (widen_bf16) {
    std::vector<float> wide(buffer.numel());
    for (size_t i = 0; i < wide.size(); ++i) wide[i] = static_cast<float>(buffer.at(i));
    out.write(reinterpret_cast<const char*>(wide.data()), static_cast<std::streamsize>(wide.size() * sizeof(float)));
  } else {
    out.write(static_cast<const char*>(buffer.host()), static_cast<std::streamsize>(buffer.bytes()));
  }
  // close() writes what is still buffered: a full disk shows up here.
  out.close();
  if (!out) throw std::runtime_error(fmt::format("error writing {}", path));
}

}  // namespace kdispatch::harness
