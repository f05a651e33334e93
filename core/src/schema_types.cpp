#include "kdispatch/schema.hpp"

#include <fmt/format.h>

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

std::string_view attr_type_name(AttrType type) {
  switch (type) {
    case AttrType::float_: return "float";
    case AttrType::int_: return "int";
    case AttrType::bool_: return "bool";
    case AttrType::string: return "string";
  }
  return "?";
}

std::vector<Dtype> OpSchema::allowed_dtypes(const TensorArg& tensor) const {
  if (const auto var = dtype_vars.find(tensor.dtype); var != dtype_vars.end()) return var->second;
  // A validated schema names either a variable or a concrete dtype; an
  // unvalidated one with neither allows nothing rather than everything.
  if (const auto dtype = parse_dtype(tensor.dtype)) return {*dtype};
  return {};
}

}  // namespace kdispatch
