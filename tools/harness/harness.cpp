#include "harness.hpp"

#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <numbers>
#include <random>
#include <stdexcept>

namespace kdispatch::harness {

// --- element conversion -------------------------------------------------------

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400u) == 0);
      bits = sign | static_cast<uint32_t>(127 - 15 - e) << 23 | (mant & 0x3ffu) << 13;
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | mant << 13;
  } else {
    bits = sign | (exp + 127 - 15) << 23 | mant << 13;
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

uint16_t float_to_half(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs >= 0x7f800000u) return static_cast<uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u));
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (abs < 0x38800000u) {
    // Below half's smallest normal: a subnormal, in units of 2^-24. Scaling
    // by a power of two is exact; nearbyint rounds to nearest even.
    float magnitude;
    std::memcpy(&magnitude, &abs, sizeof magnitude);
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(std::nearbyint(magnitude * 16777216.0f)));
  }
  uint32_t result = ((abs >> 13) - ((127 - 15) << 10)) & 0xffffu;
  const uint32_t rem = abs & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (result & 1u))) ++result;
  return static_cast<uint16_t>(sign | result);
}

float bf16_to_float(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);  // quiet NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

double load(const void* data, Dtype dtype, size_t i) {
  switch (dtype) {
    case Dtype::float32: return static_cast<const float*>(data)[i];
    case Dtype::float16: return half_to_float(static_cast<const uint16_t*>(data)[i]);
    case Dtype::bfloat16: return bf16_to_float(static_cast<const uint16_t*>(data)[i]);
    case Dtype::float64: return static_cast<const double*>(data)[i];
    case Dtype::int32: return static_cast<const int32_t*>(data)[i];
    case Dtype::int64: return static_cast<double>(static_cast<const int64_t*>(data)[i]);
    case Dtype::uint8: case Dtype::bool_: return static_cast<const uint8_t*>(data)[i];
  }
  return 0;
}

void store(void* data, Dtype dtype, size_t i, double v) {
  switch (dtype) {
    case Dtype::float32: static_cast<float*>(data)[i] = static_cast<float>(v); break;
    case Dtype::float16: static_cast<uint16_t*>(data)[i] = float_to_half(static_cast<float>(v)); break;
    case Dtype::bfloat16: static_cast<uint16_t*>(data)[i] = float_to_bf16(static_cast<float>(v)); break;
    case Dtype::float64: static_cast<double*>(data)[i] = v; break;
    case Dtype::int32: static_cast<int32_t*>(data)[i] = static_cast<int32_t>(v); break;
    case Dtype::int64: static_cast<int64_t*>(data)[i] = static_cast<int64_t>(v); break;
    case Dtype::uint8: case Dtype::bool_: static_cast<uint8_t*>(data)[i] = static_cast<uint8_t>(v); break;
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
// The dtype of `arg` in a call whose dtype variable is bound to `dtype`.
Dtype arg_dtype(const OpSchema& schema, const TensorArg& arg, Dtype dtype) {
  if (schema.dtype_vars.count(arg.dtype)) return dtype;
  return parse_dtype(arg.dtype).value_or(dtype);
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
void check(kd_status status, const char* what, const char* error) {
  if (status != KD_STATUS_OK) {
    throw KernelError(ErrorCode::device_error, fmt::format("{} failed: {}", what, error[0] ? error : "no message"));
  }
}
}  // namespace

Buffer::Buffer(Dtype dtype, std::vector<int64_t> shape, DLDevice device, const kd_memory_api* memory)
    : dtype_(dtype), shape_(std::move(shape)), memory_(memory) {
  host_.resize(tensor_bytes(dtype, shape_));
  tensor_.data = host_.data();
  if (memory_ != nullptr) {
    char error[256] = "";
    check(memory_->alloc(device.device_id, std::max<size_t>(host_.size(), 1), &device_ptr_, error, sizeof error),
          "device allocation", error);
    tensor_.data = device_ptr_;
  }
  tensor_.device = device;
  tensor_.ndim = static_cast<int32_t>(shape_.size());
  tensor_.dtype = to_dlpack(dtype);
  tensor_.shape = shape_.data();
  tensor_.strides = nullptr;
  tensor_.byte_offset = 0;
}

Buffer::Buffer(Buffer&& o) noexcept
    : dtype_(o.dtype_),
      shape_(std::move(o.shape_)),
      host_(std::move(o.host_)),
      device_ptr_(o.device_ptr_),
      memory_(o.memory_),
      tensor_(o.tensor_) {
  o.device_ptr_ = nullptr;
  tensor_.shape = shape_.data();
  if (memory_ == nullptr) tensor_.data = host_.data();
}

Buffer::~Buffer() {
  if (memory_ != nullptr && device_ptr_ != nullptr) {
    char error[256] = "";
    memory_->free(tensor_.device.device_id, device_ptr_, error, sizeof error);
  }
}

void Buffer::upload() {
  if (memory_ == nullptr || host_.empty()) return;
  char error[256] = "";
  check(memory_->copy(tensor_.device.device_id, device_ptr_, host_.data(), host_.size(), KD_COPY_HOST_TO_DEVICE, error,
                      sizeof error),
        "copy to device", error);
}

void Buffer::download() {
  if (memory_ == nullptr || host_.empty()) return;
  char error[256] = "";
  check(memory_->copy(tensor_.device.device_id, host_.data(), device_ptr_, host_.size(), KD_COPY_DEVICE_TO_HOST, error,
                      sizeof error),
        "copy from device", error);
}

std::vector<DLTensor> CallData::dl() {
  std::vector<DLTensor> out;
  for (auto& b : tensors) out.push_back(b.dl());
  return out;
}

size_t CallData::bytes_moved(const OpSchema& schema) const {
  size_t total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorArg& a = schema.tensors[i];
    total += tensors[i].bytes() * (a.inplace ? 2 : 1);
  }
  return total;
}

namespace {

// Inputs that an op's meaning constrains. A rotary cos_sin_cache row holds
// cos(phi) then sin(phi) of the same angles: random values there would scale
// query and key at every call, and a benchmark repeating the in-place call
// on the same data would soon run on Inf, NaN or subnormal numbers (which
// some CPUs process a hundred times slower). The angles are random.
void constrain_inputs(const OpSchema& schema, CallData& data, std::mt19937_64& rng) {
  if (schema.op != "embeddings.rotary_embedding") return;
  for (size_t t = 0; t < schema.tensors.size(); ++t) {
    if (schema.tensors[t].name != "cos_sin_cache") continue;
    Buffer& cache = data.tensors[t];
    if (cache.shape().size() != 2 || cache.shape()[1] % 2 != 0) return;
    const int64_t rows = cache.shape()[0];
    const int64_t half = cache.shape()[1] / 2;
    std::uniform_real_distribution<double> angle(0.0, 2.0 * std::numbers::pi);
    for (int64_t p = 0; p < rows; ++p) {
      for (int64_t i = 0; i < half; ++i) {
        const double phi = angle(rng);
        const auto at = static_cast<size_t>(p * 2 * half + i);
        store(cache.host(), cache.dtype(), at, std::cos(phi));
        store(cache.host(), cache.dtype(), at + static_cast<size_t>(half), std::sin(phi));
      }
    }
  }
}

}  // namespace

CallData make_call(const OpSchema& schema, Dtype dtype, const Shapes& shapes, uint64_t seed) {
  CallData data{{}, {}, dtype, shapes};
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> uniform(-2.0, 2.0);
  for (const TensorArg& arg : schema.tensors) {
    const Dtype d = arg_dtype(schema, arg, dtype);
    Buffer b(d, tensor_shape(arg, shapes), DLDevice{kDLCPU, 0}, nullptr);
    const size_t n = b.numel();
    const bool is_float = d == Dtype::float32 || d == Dtype::float16 || d == Dtype::bfloat16 || d == Dtype::float64;
    if (arg.written && !arg.inplace) {
      for (size_t i = 0; i < n; ++i) store(b.host(), d, i, is_float ? std::nan("") : -7.0);
    } else if (is_float) {
      bool nonzero = false;
      for (size_t i = 0; i < n; ++i) {
        const double v = uniform(rng);
        store(b.host(), d, i, v);
        nonzero = nonzero || b.at(i) != 0.0;
      }
      if (!nonzero && n > 0) store(b.host(), d, 0, 1.0);
    } else {
      int64_t lo = arg.range_min.value_or(0);
      int64_t hi = 100;
      if (arg.range_max) {
        hi = arg.range_max->kind == ShapeToken::Kind::constant ? arg.range_max->value
                                                               : shapes.symbols.at(arg.range_max->symbol);
      }
      if (hi <= lo) throw std::invalid_argument(fmt::format("tensor '{}': empty range [{}, {})", arg.name, lo, hi));
      std::uniform_int_distribution<int64_t> pick(lo, hi - 1);
      for (size_t i = 0; i < n; ++i) store(b.host(), d, i, static_cast<double>(pick(rng)));
    }
    data.tensors.push_back(std::move(b));
  }
  constrain_inputs(schema, data, rng);
  for (const AttrArg& attr : schema.attrs) {
    if (attr.default_value) data.attrs.push_back({attr.name, *attr.default_value});
  }
  return data;
}

CallData clone_to(const CallData& src, DLDevice device, const kd_memory_api* memory) {
  CallData out{{}, src.attrs, src.dtype, src.shapes};
  for (const Buffer& b : src.tensors) {
    Buffer copy(b.dtype(), b.shape(), device, memory);
    std::memcpy(copy.host(), b.host(), b.bytes());
    copy.upload();
    out.tensors.push_back(std::move(copy));
  }
  return out;
}

void download_all(CallData& data) {
  for (auto& b : data.tensors) b.download();
}

// --- checking -------------------------------------------------------------------

reference::Dtype to_reference(Dtype dtype) {
  switch (dtype) {
    case Dtype::float16: return reference::Dtype::kFloat16;
    case Dtype::bfloat16: return reference::Dtype::kBFloat16;
    default: return reference::Dtype::kFloat32;
  }
}

Dtype from_reference(reference::Dtype dtype) {
  switch (dtype) {
    case reference::Dtype::kFloat16: return Dtype::float16;
    case reference::Dtype::kBFloat16: return Dtype::bfloat16;
    case reference::Dtype::kFloat32: break;
  }
  return Dtype::float32;
}

Tolerance tolerance(Dtype dtype) {
  switch (dtype) {
    case Dtype::float32: return {.rtol = 1e-4, .atol = 1e-5};
    case Dtype::float16: return {.rtol = 4e-3, .atol = 2e-3};
    case Dtype::bfloat16: return {.rtol = 3.2e-2, .atol = 1.6e-2};
    default: return {0, 0};
  }
}

std::vector<std::vector<double>> written_values(const OpSchema& schema, const CallData& data) {
  std::vector<std::vector<double>> out;
  for (size_t i = 0; i < schema.tensors.size(); ++i) {
    if (!schema.tensors[i].written && !schema.tensors[i].inplace) continue;
    const Buffer& b = data.tensors[i];
    std::vector<double> v(b.numel());
    for (size_t k = 0; k < v.size(); ++k) v[k] = b.at(k);
    out.push_back(std::move(v));
  }
  return out;
}

Comparison compare(const OpSchema& schema, const CallData& got, const std::vector<std::vector<double>>& expected) {
  Comparison c;
  size_t out_index = 0;
  for (size_t i = 0; i < schema.tensors.size(); ++i) {
    if (!schema.tensors[i].written && !schema.tensors[i].inplace) continue;
    const Buffer& b = got.tensors[i];
    const std::vector<double>& want = expected.at(out_index++);
    const Tolerance tol = tolerance(b.dtype());
    for (size_t k = 0; k < b.numel(); ++k) {
      const double g = b.at(k);
      const double e = want[k];
      const double abs_err = std::fabs(g - e);
      const double rel_err = abs_err / std::max(std::fabs(e), 1e-30);
      const bool bad = std::isnan(g) != std::isnan(e) || abs_err > tol.atol + tol.rtol * std::fabs(e);
      if (!std::isnan(abs_err)) {
        c.max_abs_err = std::max(c.max_abs_err, abs_err);
        if (std::fabs(e) > tol.atol) c.max_rel_err = std::max(c.max_rel_err, rel_err);
      }
      if (bad && c.ok) {
        c.ok = false;
        c.first_mismatch = fmt::format("{}[flat {}]: got {}, expected {} (atol {}, rtol {})", schema.tensors[i].name,
                                       k, g, e, tol.atol, tol.rtol);
      }
    }
  }
  return c;
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
  if (widen_bf16) {
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
