// kdispatch.testing's half in C++: the checks every kdispatch test makes,
// given to Python so that its tests make them the same way. The cases come
// from the op schema's "tests", the inputs from the harness's generator,
// the expected values from the op's reference backend, and the verdict from
// harness::compare with the schema's tolerances.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <optional>
#include <string>

namespace kdispatch::python {

// [{"sizes": {"*": [...], "H": n}, "attrs": {...}, "special": what or None,
//   "unchecked": [...], "elements": n}] for every case harness::test_cases()
// gives; "elements" counts those of all its tensors.
pybind11::list test_cases(const std::string& op);
// The tensors of case `index` in `dtype`, in schema order, as
// [(bytes, dtype name, shape)]: inputs random (special values planted),
// outputs poisoned. `dtypes` ({tensor name: dtype name}) picks a dtype
// alternative of a tensor; the optional tensors named in `absent` are None.
pybind11::list make_inputs(const std::string& op, const std::string& dtype, size_t index, uint64_t seed,
                           const pybind11::dict& dtypes, const pybind11::list& absent);
// The tensors of one call at the schema's example sizes with `sizes`
// ("NAME=N", "*=a,b") applied, as make_inputs gives them (no case: default
// attributes, no special values).
pybind11::list make_sized_inputs(const std::string& op, const std::string& dtype,
                                 const std::vector<std::string>& sizes, uint64_t seed);
// harness::call_dtypes of the op, or harness::kernel_dtypes of `backend`'s
// kernel for it, as names.
pybind11::list call_dtypes(const std::string& op, const std::optional<std::string>& backend);
// The name of the op's reference backend; SelectionError when it has none.
std::string reference_backend(const std::string& op);
// harness::compare of `got` against `want` (sequences of host tensors in
// schema order) as {"ok", "max_abs_err", "max_rel_err", "max_ulps",
// "mean_ulps", "first_mismatch"}.
pybind11::dict compare(const std::string& op, const pybind11::sequence& got, const pybind11::sequence& want,
                       const pybind11::sequence& unchecked);

}  // namespace kdispatch::python
