#include "kdispatch/schema_check.hpp"

#include <fmt/format.h>

#include <algorithm>

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
  return fmt::format("<dlpack code {} bits {} lanes {}>", t.code, t.bits, t.lanes);
}

std::string device_str(DLDevice d) {
  if (auto type = from_dlpack_device_type(d.device_type)) {
    return fmt::format("{}:{}", device_type_name(*type), d.device_id);
  }
  return fmt::format("<dlpack device type {}>:{}", static_cast<int>(d.device_type), d.device_id);
}

}  // namespace

int64_t numel(const DLTensor& t) {
  int64_t n = 1;
  for (int i = 0; i < t.ndim; ++i) n *= t.shape[i];
  return n;
}

bool is_contiguous(const DLTensor& t) {
  if (t.strides == nullptr) return true;
  int64_t expected = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    if (t.shape[i] != 1 && t.strides[i] != expected) return false;
    expected *= t.shape[i];
  }
  return true;
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
  for (const auto& [name, allowed] : schema.dtype_vars) {
    DtypeVar var{name, allowed, {}};
    for (Dtype d : allowed) var.codes.push_back(pack_dtype(to_dlpack(d)));
    vars_.push_back(std::move(var));
  }
  bool seen_leading = false;
  uint32_t bound_vars = 0;
  for (const TensorArg& arg : schema.tensors) {
    Tensor t;
    t.strided = arg.strided;
    auto var = std::find_if(vars_.begin(), vars_.end(), [&](const DtypeVar& v) { return v.name == arg.dtype; });
    if (var != vars_.end()) {
      t.dtype_var = static_cast<int>(var - vars_.begin());
      if (selecting_var_ < 0) selecting_var_ = t.dtype_var;
    } else if (auto d = parse_dtype(arg.dtype)) {
      t.dtype = *d;
      t.dtype_code = pack_dtype(to_dlpack(*d));
    }
    const auto push = [&](Dim d) {
      limit(t.num_dims + 1, kMaxSchemaDims, "dims in one shape pattern");
      t.dims[t.num_dims++] = d;
    };
    const auto symbol_dim = [&](Dim::Kind kind, const std::string& name, int64_t factor) {
      const size_t before = symbols_.size();
      const uint8_t slot = symbol_slot(name);
      push({kind, symbols_.size() > before, slot, factor});
    };
    for (const ShapeToken& tok : arg.shape) {
      switch (tok.kind) {
        case ShapeToken::Kind::leading:
          t.leading = true;
          t.binds_leading = !seen_leading;
          seen_leading = true;
          break;
        case ShapeToken::Kind::symbol: symbol_dim(Dim::Kind::symbol, tok.symbol, 1); break;
        case ShapeToken::Kind::constant: push({Dim::Kind::constant, false, 0, tok.value}); break;
        case ShapeToken::Kind::multiple: symbol_dim(Dim::Kind::multiple, tok.symbol, tok.value); break;
      }
    }
    if (t.dtype_var >= 0) {
      t.binds_var = !(bound_vars & (1u << t.dtype_var));
      bound_vars |= 1u << t.dtype_var;
    }
    tensors_.push_back(t);
  }
}

void CompiledSchema::fail(size_t tensor, const std::string& what) const {
  throw CallError(ErrorCode::bad_arguments,
                  fmt::format("op '{}', argument {} '{}': {}", schema_.op, tensor, schema_.tensors[tensor].name, what));
}

void CompiledSchema::diagnose(std::span<const DLTensor> tensors) const {
  if (tensors.size() != tensors_.size() || tensors.empty()) {
    std::vector<std::string_view> names;
    for (const auto& a : schema_.tensors) names.push_back(a.name);
    throw CallError(ErrorCode::bad_arguments,
                    fmt::format("op '{}' takes {} tensors ({}), got {}", schema_.op, tensors_.size(),
                                fmt::join(names, ", "), tensors.size()));
  }
  std::array<int64_t, kMaxSchemaSymbols> bound;
  bound.fill(-1);
  std::array<int, kMaxSchemaSymbols> bound_by{};
  std::array<DLDataType, kMaxSchemaSymbols> var_type{};
  std::array<int, kMaxSchemaSymbols> var_by;
  var_by.fill(-1);
  const DLTensor* leading_owner = nullptr;
  int leading_index = -1;
  int64_t leading_count = 0;

  for (size_t i = 0; i < tensors_.size(); ++i) {
    const Tensor& spec = tensors_[i];
    const DLTensor& t = tensors[i];
    // Device: one for the whole call.
    if (t.device.device_type != tensors[0].device.device_type || t.device.device_id != tensors[0].device.device_id) {
      fail(i, fmt::format("is on {}, but '{}' is on {}: all tensors of a call must be on one device",
                          device_str(t.device), schema_.tensors[0].name, device_str(tensors[0].device)));
    }
    // Dtype.
    if (spec.dtype_var >= 0) {
      const auto v = static_cast<size_t>(spec.dtype_var);
      if (var_by[v] < 0) {
        const auto d = from_dlpack(t.dtype);
        const auto& allowed = vars_[v].allowed;
        if (!d || std::find(allowed.begin(), allowed.end(), *d) == allowed.end()) {
          std::vector<std::string_view> names;
          for (Dtype a : allowed) names.push_back(dtype_name(a));
          fail(i, fmt::format("expected dtype {} in [{}], got {}", vars_[v].name, fmt::join(names, ", "),
                              dtype_str(t.dtype)));
        }
        var_by[v] = static_cast<int>(i);
        var_type[v] = t.dtype;
      } else if (t.dtype.code != var_type[v].code || t.dtype.bits != var_type[v].bits ||
                 t.dtype.lanes != var_type[v].lanes) {
        fail(i, fmt::format("expected dtype {} = {} (as '{}'), got {}", vars_[v].name, dtype_str(var_type[v]),
                            schema_.tensors[static_cast<size_t>(var_by[v])].name, dtype_str(t.dtype)));
      }
    } else {
      const DLDataType want = to_dlpack(spec.dtype);
      if (t.dtype.code != want.code || t.dtype.bits != want.bits || t.dtype.lanes != want.lanes) {
        fail(i, fmt::format("expected dtype {}, got {}", dtype_name(spec.dtype), dtype_str(t.dtype)));
      }
    }
    // Rank.
    const int64_t fixed = static_cast<int64_t>(spec.num_dims);
    if (t.ndim < 0 || (t.ndim > 0 && t.shape == nullptr)) fail(i, "has a null shape");
    if (spec.leading ? t.ndim < fixed : t.ndim != fixed) {
      fail(i, fmt::format("expected shape {} ({}{} dims), got {}", pattern_str(schema_.tensors[i]),
                          spec.leading ? "at least " : "", fixed, shape_str(t)));
    }
    // Leading dims: the same for every tensor that has them.
    const int64_t lead = t.ndim - fixed;
    if (spec.leading) {
      if (leading_owner == nullptr) {
        leading_owner = &t;
        leading_index = static_cast<int>(i);
        leading_count = lead;
      } else if (lead != leading_count || !std::equal(t.shape, t.shape + lead, leading_owner->shape)) {
        fail(i, fmt::format("leading dims of {} differ from those of '{}' {}", shape_str(t),
                            schema_.tensors[static_cast<size_t>(leading_index)].name, shape_str(*leading_owner)));
      }
    }
    // Named and constant dims.
    for (size_t k = 0; k < spec.num_dims; ++k) {
      const Dim& d = spec.dims[k];
      const int64_t size = t.shape[lead + static_cast<int64_t>(k)];
      if (size < 0) fail(i, fmt::format("has a negative dim in {}", shape_str(t)));
      switch (d.kind) {
        case Dim::Kind::constant:
          if (size != d.value) {
            fail(i, fmt::format("dim {} must be {}, got {} (shape {})", lead + static_cast<int64_t>(k), d.value, size,
                                shape_str(t)));
          }
          break;
        case Dim::Kind::symbol:
        case Dim::Kind::multiple: {
          const int64_t factor = d.kind == Dim::Kind::multiple ? d.value : 1;
          int64_t& value = bound[d.symbol];
          if (value < 0) {
            if (size % factor != 0) {
              fail(i, fmt::format("dim {} must be a multiple of {} ({}*{}), got {}", lead + static_cast<int64_t>(k),
                                  factor, factor, symbols_[d.symbol], size));
            }
            value = size / factor;
            bound_by[d.symbol] = static_cast<int>(i);
          } else if (size != factor * value) {
            const std::string token =
                factor == 1 ? symbols_[d.symbol] : fmt::format("{}*{}", factor, symbols_[d.symbol]);
            fail(i, fmt::format("dim {} is {} = {} (from '{}'), got {} (shape {})", lead + static_cast<int64_t>(k),
                                token, factor * value, schema_.tensors[static_cast<size_t>(bound_by[d.symbol])].name,
                                size, shape_str(t)));
          }
          break;
        }
      }
    }
    // Memory.
    if (t.data == nullptr && numel(t) > 0) fail(i, "has null data");
    if (!spec.strided && !is_contiguous(t)) {
      std::vector<int64_t> strides(t.strides, t.strides + t.ndim);
      fail(i, fmt::format("must be contiguous, got strides [{}] for shape {}", fmt::join(strides, ", "), shape_str(t)));
    }
  }

  // check_fast() refused what this pass accepts: the two disagree.
  throw CallError(ErrorCode::bad_arguments, fmt::format("op '{}': arguments refused (no detail found)", schema_.op));
}

}  // namespace kdispatch
