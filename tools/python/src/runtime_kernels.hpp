// kdispatch._kdispatch._register_kernel / _unregister_kernel: Python
// callables as kernels registered at run time (docs/python.md).
#pragma once

#include <pybind11/pybind11.h>

namespace kdispatch::python {

void bind_runtime_kernels(pybind11::module_& m);

}  // namespace kdispatch::python
