// Eligibility constraints of a kernel's manifest entry ("constraints",
// docs/manifest.md): small integer expressions over the op schema's shape
// symbols, the call's dtype and the op's int and bool attributes. Compiled
// once per (op, kernel) into a postfix program of fixed size; evaluated per
// call with no allocation.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kdispatch/dtype.hpp"
#include "kdispatch/kernel_spec.hpp"
#include "kdispatch/plugin_api.h"
#include "kdispatch/schema.hpp"

namespace kdispatch {

// What a constraint's names mean: the schema's shape symbols by slot (the
// slots of CompiledSchema), the dtype variable that selects the kernel (its
// name and "dtype" both read the call's dtype), the attributes in schema
// order (values as packed kd_attr).
struct ConstraintNames {
  std::span<const std::string> symbols;
  std::string_view dtype_var;  // empty: only "dtype"
  std::span<const AttrArg> attrs;
  // Shape symbols and integers only (an op schema's "requires").
  bool symbols_only = false;
};

// One call's values, as the names above index them.
struct ConstraintInput {
  const int64_t* symbols = nullptr;  // by symbol slot
  Dtype dtype = Dtype::float32;
  const kd_attr* attrs = nullptr;  // schema order, every attribute present
};

class Constraint {
 public:
  enum class Result : uint8_t { holds, fails, overflow, division_by_zero };

  // Compiles `text` against `names`; throws std::invalid_argument whose
  // what() says what is wrong (a syntax error with its column, an unknown
  // name, a type mismatch). With `names` absent only the syntax is checked
  // (a manifest is read before the op's schema is known).
  static Constraint compile(std::string_view text, const ConstraintNames* names);

  Result evaluate(const ConstraintInput& in) const noexcept;
  // "constraint 'H % 8 == 0' is false (H = 12)", or "... cannot be
  // evaluated: division by zero (K = 0)".
  std::string explain(Result result, const ConstraintInput& in) const;
  const std::string& text() const { return text_; }

  // Limits of one expression, which keep evaluation on a fixed stack.
  static constexpr size_t kMaxText = 512;
  static constexpr size_t kMaxNodes = 128;
  static constexpr size_t kMaxDepth = 32;

  enum class Op : uint8_t {
    constant, symbol, attr_int, attr_bool, dtype,
    neg, add, sub, mul, div, mod,
    eq, ne, lt, le, gt, ge, in, not_,
    and_jump, or_jump,  // short circuit: leave the deciding value and jump to `value`
  };
  struct Node {
    Op op;
    int64_t value;  // constant, slot, list length or jump target
  };
  struct Name {
    std::string name;
    Op op;  // symbol, attr_int, attr_bool or dtype
    int64_t slot;
  };
  // Each name the expression reads, once, in order of appearance.
  const std::vector<Name>& names() const { return names_; }

 private:
  std::string text_;
  std::vector<Node> program_;
  std::vector<Name> names_;  // each name read, once, in order of appearance
};

// The constraints of one kernel, all of which must hold.
struct ConstraintSet {
  std::vector<Constraint> constraints;
  // The first that does not hold, or nullopt; `result` gets its result.
  const Constraint* first_failing(const ConstraintInput& in, Constraint::Result* result) const noexcept {
    for (const Constraint& c : constraints) {
      const Constraint::Result r = c.evaluate(in);
      if (r != Constraint::Result::holds) {
        *result = r;
        return &c;
      }
    }
    return nullptr;
  }
};

// The constraints of `spec` compiled against an op's names. Throws
// ManifestError KD-E011 naming the manifest, the kernel entry and the
// constraint when one does not fit the op.
ConstraintSet compile_constraints(const KernelSpec& spec, const ConstraintNames& names);

// A call's values for the selector: the compiled constraints are made from
// `names`, the values read from `input`.
struct ConstraintCall {
  ConstraintNames names;
  ConstraintInput input;
};

}  // namespace kdispatch
