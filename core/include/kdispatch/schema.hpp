// Op schemas: the signature of an op (tensors with shape patterns and dtype
// variables, attributes with defaults). Parsed from JSON by manifest.cpp;
// checked against calls by schema_check.cpp (OpHandle::check).
#pragma once

#include <kdispatch/export.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "kdispatch/dtype.hpp"

namespace kdispatch KDISPATCH_API {

// The most tensors and attributes an op schema may have.
inline constexpr size_t kMaxSchemaTensors = 32;
inline constexpr size_t kMaxSchemaAttrs = 32;

struct ShapeToken {
  enum class Kind : uint8_t {
    leading,   // "*": any number of leading dims, first token only
    symbol,    // "H": binds one dim, consistent across tensors
    constant,  // 64
    multiple,  // "2*D": factor * value of symbol
  };
  Kind kind = Kind::symbol;
  std::string symbol;   // symbol, multiple
  int64_t value = 0;    // constant: the size; multiple: the factor
  std::string str() const;  // "*", "H", "64", "2*D"
  bool operator==(const ShapeToken&) const = default;
};

// How tools fill an input tensor.
enum class TensorValues : uint8_t {
  uniform,  // random, uniform in [-2, 2) (integers: in their "range")
  cos_sin,  // each row of the last dim holds cos(phi) in its first half and
            // sin(phi) of the same random angles in its second
  distinct,  // integers of the "range", no value twice (cache slots)
};

// The strides a tensor may have ("layout" in docs/op-schema.md).
enum class Layout : uint8_t {
  contiguous,  // dense, row-major (dims of size 1 any stride)
  rows,        // the last dim contiguous; every other dim any stride >= 1
  any,         // any strides
};
std::string_view layout_name(Layout layout);  // "contiguous", "rows", "any"

struct TensorArg {
  std::string name;
  std::vector<ShapeToken> shape;
  std::string dtype;          // a key of OpSchema::dtype_vars, or a dtype name
  bool written = false;       // an output: the kernel writes it
  bool inplace = false;       // read and written (implies written)
  Layout layout = Layout::contiguous;
  bool exact = false;         // "exact": written values equal the reference's bit for bit
  bool optional = false;      // may be absent (ABI 1.1: data NULL, ndim 0)
  // The further entries of a "dtype" list: dtype names the tensor may also
  // take (["T", "float32"]: T's dtype or float32).
  std::vector<std::string> dtype_alternatives;
  // Integer inputs that index something: values in [range_min, range_max),
  // range_max a constant or a shape symbol ("P"). Lets tools generate valid
  // inputs for any op.
  std::optional<int64_t> range_min;
  std::optional<ShapeToken> range_max;
  TensorValues values = TensorValues::uniform;  // "values"
  // "flattened": the name of an int attribute (default 0). A call that
  // gives it a value N > 0 may pass the tensor with its pattern's last two
  // dims as one, [*, L] with L a multiple of N (SGLang's query [T, H*D] with
  // head_size D); the core checks it, and the kernel gets it, as the view
  // [*, L/N, N]. Empty: the tensor always has its pattern's shape.
  std::string flattened;
  bool operator==(const TensorArg&) const = default;
};

enum class AttrType : uint8_t { float_, int_, bool_, string };
std::string_view attr_type_name(AttrType type);  // "float", "int", "bool", "string"

using AttrValue = std::variant<double, int64_t, bool, std::string>;

struct AttrArg {
  std::string name;
  AttrType type = AttrType::float_;
  std::optional<AttrValue> default_value;  // absent: the attribute is required
  std::string doc;
  bool operator==(const AttrArg&) const = default;
};

// How far a backend's result in one dtype may be from the op's reference
// (docs/op-schema.md). For every element, in units of the output dtype's spacing
// at the expected value (ulp):
//   |got - want| <= ulps * ulp(want) + atol
// and over all elements of an output
//   mean(max(0, |got - want| - atol) / ulp(want)) <= mean_ulps,
// so rounding noise passes while a small systematic error, which stays
// below the per-element bound where values are small, still fails. Integer
// and bool outputs always compare exactly.
struct Tolerance {
  double ulps = 0;
  double atol = 0;       // absolute floor, for results that cancel to near zero
  double mean_ulps = 0;
  bool operator==(const Tolerance&) const = default;
};

// The tolerance of an op schema that declares none for `dtype`.
Tolerance default_tolerance(Dtype dtype);

// Sizes of one call: the "*" dims and each shape symbol ({"*": [64], "H": 4096}).
struct Sizes {
  std::vector<int64_t> leading;
  std::map<std::string, int64_t> symbols;
  bool operator==(const Sizes&) const = default;
};

// "tests": {"special": [...]}: calls whose inputs `tensors` have special
// values planted among their random ones (NaN, infinities, ties, far tails,
// every value of a 16-bit dtype), which the conformance suite runs beside
// the random calls, on every backend.
struct SpecialValues {
  std::string what;            // what the set exercises, shown with a failure
  std::vector<std::string> tensors;  // the inputs whose elements are replaced
  std::vector<double> values;        // each replacement picks one ("nan", "inf", "-inf" in JSON)
  int64_t ulps = 0;                  // ... then moves it by up to this many steps of the dtype
  double fraction = 1.0;             // share of the elements replaced
  // Only elements whose index in the last dim lies in [columns.first,
  // columns.second), each a constant or a shape symbol ("columns": [0, "D"]:
  // the first half of a [*, 2*D] input); absent: every element.
  std::optional<std::pair<ShapeToken, ShapeToken>> columns;
  // Instead of `values`: the k-th element replaced holds the k-th bit
  // pattern of a 16-bit dtype, cyclically (float32 and float64 tensors:
  // every bfloat16 value).
  bool every_value = false;
  std::vector<Sizes> sizes;            // empty: the schema's test sizes
  std::vector<std::string> unchecked;  // outputs these values leave unspecified
  // Every field equal, a NaN among `values` equal to a NaN.
  bool operator==(const SpecialValues& other) const;
};

struct OpSchema {
  std::string op;   // "layernorm.rmsnorm"
  std::string doc;
  std::vector<TensorArg> tensors;  // call order
  std::vector<AttrArg> attrs;      // call order (passed by name)
  std::map<std::string, std::vector<Dtype>> dtype_vars;  // "T" -> allowed
  // Example sizes for tools ("example": {"*": [64], "H": 4096}); symbols not
  // given here get a tool default.
  std::vector<int64_t> example_leading;
  std::map<std::string, int64_t> example_sizes;
  // "tests": {"sizes": [...], "attrs": {"is_neox": [true, false]}}: the
  // conformance suite runs every size with every combination of these
  // attribute values (an attribute not listed keeps its default), by name.
  std::vector<Sizes> test_sizes;
  std::vector<std::pair<std::string, std::vector<AttrValue>>> test_attrs;
  std::vector<SpecialValues> test_special;  // "tests": {"special": [...]}
  // "requires": relations between shape symbols every call must satisfy,
  // e.g. "2*R <= D", as written.
  std::vector<std::string> requirements;
  // "out_of_place": for an op that updates tensors in place, the op that
  // computes the same results into separate outputs, taking the same inputs
  // and attributes (functional variants call it instead of cloning); empty
  // when none.
  std::string out_of_place;
  // "bench": the sizes benchmarks time.
  std::optional<Sizes> bench_sizes;
  // "tolerance": {"bfloat16": {"ulps": 2, "atol": 1e-5, "mean_ulps": 0.8}},
  // keyed by the dtype of the output compared.
  std::map<Dtype, Tolerance> tolerances;
  std::string source;  // file that defined it ("<builtin>/layernorm.json")

  // Same signature (doc and source are not compared).
  bool same_signature(const OpSchema& other) const {
    return op == other.op && tensors == other.tensors && attrs == other.attrs &&
           dtype_vars == other.dtype_vars && requirements == other.requirements;
  }
  // The dtypes a tensor may take (its variable's list, or its one dtype,
  // then its alternatives).
  std::vector<Dtype> allowed_dtypes(const TensorArg& tensor) const;
  // The dtypes a tensor may take in a call whose dtype variables take their
  // first tensor's dtype `call_dtype` (the dtype that selects the kernel):
  // its own first, then its alternatives, each once.
  std::vector<Dtype> tensor_dtypes(const TensorArg& tensor, Dtype call_dtype) const;
  // The dtypes a call may have, the one that selects the kernel (a kernel's
  // "dtypes" in its manifest): those of the first dtype variable a tensor
  // uses, else the first tensor's dtype.
  std::vector<Dtype> call_dtypes() const;
  // Whether a tensor is "written" or "inplace": without one, nothing a
  // kernel does can be compared with the reference.
  bool has_output() const;
  // The declared tolerance for outputs of `dtype`, else default_tolerance.
  Tolerance tolerance(Dtype dtype) const;
  // Every field equal, doc and source included.
  bool operator==(const OpSchema&) const = default;
};

}  // namespace kdispatch
