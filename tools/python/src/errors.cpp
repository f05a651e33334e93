#include "errors.hpp"

#include <pybind11/pybind11.h>

namespace py = pybind11;

namespace kdispatch::python {

namespace {

// The class name in kdispatch._errors for the C++ type of `error`.
const char* class_name(const Error& error) {
  if (dynamic_cast<const SelectionError*>(&error)) return "SelectionError";
  if (dynamic_cast<const RegistrationError*>(&error)) return "RegistrationError";
  if (dynamic_cast<const ManifestError*>(&error)) return "ManifestError";
  if (dynamic_cast<const PluginError*>(&error)) return "PluginError";
  if (dynamic_cast<const CallError*>(&error)) return "CallError";
  if (dynamic_cast<const KernelError*>(&error)) return "KernelError";
  return "Error";
}

// The module of the exception classes: kdispatch._errors, or, for this
// extension loaded on its own from the package's folder (the folder on
// sys.path, no kdispatch package), the same file as the top-level _errors.
py::module_ errors_module() {
  try {
    return py::module_::import("kdispatch._errors");
  } catch (const py::error_already_set&) {
    return py::module_::import("_errors");
  }
}

}  // namespace

py::str text(std::string_view s) {
  PyObject* str = PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), "surrogateescape");
  if (str == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::str>(str);
}

void set_python_error(const Error& error) {
  try {
    py::object cls = errors_module().attr(class_name(error));
    py::list hints;
    for (const auto& h : error.hints()) hints.append(text(h));
    py::object instance = cls(text(error.code_string()), text(error.message()), hints);
    PyErr_SetObject(cls.ptr(), instance.ptr());
  } catch (const py::error_already_set&) {
    // kdispatch._errors could not be used: a RuntimeError still carries the
    // code and the message.
    PyErr_Format(PyExc_RuntimeError, "[%s] %s (kdispatch._errors could not be imported)", error.code_string().c_str(),
                 error.message().c_str());
  }
}

void register_error_translator() {
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      set_python_error(e);
    }
  });
}

void throw_call_error(std::string message) { throw CallError(ErrorCode::bad_arguments, std::move(message)); }

}  // namespace kdispatch::python
