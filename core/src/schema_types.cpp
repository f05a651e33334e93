#include "kdispatch/schema.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace kdispatch {

std::string ShapeToken::str() const {
  switch (kind) {
    case Kind::leading: return "*";
    case Kind::symbol: return symbol;
    case Kind::constant: return std::to_string(value);
    case Kind::multiple: return fmt::format("{}*{}", value, symbol);
  }
  return "?";
}

bool SpecialValues::operator==(const SpecialValues& other) const {
  const auto same_value = [](double a, double b) { return a == b || (std::isnan(a) && std::isnan(b)); };
  return what == other.what && tensors == other.tensors &&
         std::equal(values.begin(), values.end(), other.values.begin(), other.values.end(), same_value) &&
         ulps == other.ulps && fraction == other.fraction && columns == other.columns &&
         every_value == other.every_value && sizes == other.sizes && unchecked == other.unchecked;
}

std::string_view attr_type_name(AttrType type) {
  switch (type) {
    case AttrType::float_: return "float";
    case AttrType::int_: return "int";
    case AttrType::bool_: return "bool";
    case AttrType::string: return "string";
  }
  return "?";
}

namespace {

void add_once(std::vector<Dtype>& dtypes, Dtype d) {
  if (std::find(dtypes.begin(), dtypes.end(), d) == dtypes.end()) dtypes.push_back(d);
}

}  // namespace

std::vector<Dtype> OpSchema::allowed_dtypes(const TensorArg& tensor) const {
  std::vector<Dtype> dtypes;
  if (const auto var = dtype_vars.find(tensor.dtype); var != dtype_vars.end()) {
    dtypes = var->second;
  } else if (const auto dtype = parse_dtype(tensor.dtype)) {
    dtypes = {*dtype};
  } else {
    // A validated schema names either a variable or a concrete dtype; an
    // unvalidated one with neither allows nothing rather than everything.
    return {};
  }
  for (const std::string& name : tensor.dtype_alternatives) {
    if (const auto d = parse_dtype(name)) add_once(dtypes, *d);
  }
  return dtypes;
}

std::vector<Dtype> OpSchema::tensor_dtypes(const TensorArg& tensor, Dtype call_dtype) const {
  std::vector<Dtype> dtypes;
  const std::string* selecting = nullptr;
  for (const TensorArg& t : tensors) {
    if (dtype_vars.count(t.dtype) != 0) {
      selecting = &t.dtype;
      break;
    }
  }
  if (const auto var = dtype_vars.find(tensor.dtype); var != dtype_vars.end()) {
    if (selecting != nullptr && *selecting == tensor.dtype) {
      dtypes.push_back(call_dtype);
    } else if (!var->second.empty()) {
      dtypes.push_back(var->second.front());
    }
  } else if (const auto dtype = parse_dtype(tensor.dtype)) {
    dtypes.push_back(*dtype);
  }
  for (const std::string& name : tensor.dtype_alternatives) {
    if (const auto d = parse_dtype(name)) add_once(dtypes, *d);
  }
  return dtypes;
}

std::string_view layout_name(Layout layout) {
  switch (layout) {
    case Layout::contiguous: return "contiguous";
    case Layout::rows: return "rows";
    case Layout::any: return "any";
  }
  return "contiguous";
}

std::vector<Dtype> OpSchema::call_dtypes() const {
  for (const TensorArg& t : tensors) {
    if (const auto var = dtype_vars.find(t.dtype); var != dtype_vars.end()) return var->second;
  }
  if (tensors.empty()) return {};
  if (const auto dtype = parse_dtype(tensors.front().dtype)) return {*dtype};
  return {};
}

bool OpSchema::has_output() const {
  return std::any_of(tensors.begin(), tensors.end(), [](const TensorArg& t) { return t.written || t.inplace; });
}

Tolerance default_tolerance(Dtype dtype) {
  switch (dtype) {
    case Dtype::float64: return {.ulps = 1 << 20, .atol = 1e-12, .mean_ulps = 1 << 16};
    case Dtype::float32: return {.ulps = 256, .atol = 1e-6, .mean_ulps = 16};
    case Dtype::float16: return {.ulps = 4, .atol = 1e-5, .mean_ulps = 0.5};
    case Dtype::bfloat16: return {.ulps = 2, .atol = 1e-5, .mean_ulps = 0.5};
    // One ulp of the 8-bit float: a result rounded once to nearest-even is
    // within half an ulp, one from a float32 formula can land on the other
    // side of a tie. Saturated values (448, 57344) are exact either way.
    case Dtype::float8_e4m3fn: case Dtype::float8_e5m2: return {.ulps = 1, .atol = 0, .mean_ulps = 0.25};
    case Dtype::int32: case Dtype::int64: case Dtype::uint8: case Dtype::bool_: break;
  }
  return {};
}

Tolerance OpSchema::tolerance(Dtype dtype) const {
  const auto it = tolerances.find(dtype);
  return it != tolerances.end() ? it->second : default_tolerance(dtype);
}

}  // namespace kdispatch
