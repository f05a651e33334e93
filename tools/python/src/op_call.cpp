#include "op_call.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <array>
#include <cxxabi.h>
#include <string_view>

#include "errors.hpp"
#include "runtime.hpp"
#include "tensor_args.hpp"

namespace py = pybind11;

namespace kdispatch::python {

namespace {

inline constexpr size_t kMaxAttrs = 32;

std::string_view utf8(PyObject* str) {
  Py_ssize_t size = 0;
  const char* data = PyUnicode_AsUTF8AndSize(str, &size);
  if (data == nullptr) {
    PyErr_Clear();
    throw_call_error("attribute names must be strings");
  }
  return {data, static_cast<size_t>(size)};
}

// A Python scalar as an attribute value; the schema's type is checked (and
// ints widened to floats) by the dispatcher.
AttrValue attr_value(std::string_view op, std::string_view name, PyObject* value) {
  if (PyBool_Check(value)) return value == Py_True;
  if (PyLong_Check(value)) {
    const long long v = PyLong_AsLongLong(value);
    if (v == -1 && PyErr_Occurred()) {
      PyErr_Clear();
      throw_call_error(fmt::format("op '{}', attribute '{}': the int does not fit 64 bits", op, name));
    }
    return int64_t{v};
  }
  if (PyFloat_Check(value)) return PyFloat_AS_DOUBLE(value);
  if (PyUnicode_Check(value)) return std::string(utf8(value));
  // NumPy's bool scalar is a bool (it also has __index__, which would make
  // it an int).
  const std::string_view type_name = Py_TYPE(value)->tp_name;
  if (type_name == "numpy.bool_" || type_name == "numpy.bool") {
    const int truth = PyObject_IsTrue(value);
    if (truth >= 0) return truth == 1;
    PyErr_Clear();
  }
  // NumPy and torch scalars: integers through __index__, the rest through __float__.
  if (PyIndex_Check(value)) {
    const long long v = PyLong_AsLongLong(value);
    if (!(v == -1 && PyErr_Occurred())) return int64_t{v};
    PyErr_Clear();
  }
  if (Py_TYPE(value)->tp_as_number != nullptr && Py_TYPE(value)->tp_as_number->nb_float != nullptr) {
    const double d = PyFloat_AsDouble(value);
    if (!(d == -1.0 && PyErr_Occurred())) return d;
    PyErr_Clear();
  }
  throw_call_error(fmt::format("op '{}', attribute '{}': expected a float, int, bool or str, got {}", op, name,
                               Py_TYPE(value)->tp_name));
}

bool interpreter_exiting() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

[[noreturn]] void wait_for_exit() {
  for (;;) ::pause();
}

void take_back_gil(PyThreadState* thread) {
  if (interpreter_exiting()) wait_for_exit();
  try {
    PyEval_RestoreThread(thread);
  } catch (abi::__forced_unwind&) {
    // The exit began between the check and the call: CPython ends the
    // thread with pthread_exit(), whose unwinding would run the call's
    // destructors without the GIL. The thread waits here instead; the
    // exception is never left unrethrown, since this block never returns.
    wait_for_exit();
  }
}

// The kernel call itself: the GIL is released while a host kernel runs (a GPU
// kernel is only launched, which takes less time than releasing it).
// A daemon thread whose call ends while the interpreter exits cannot have
// the GIL back: PyEval_RestoreThread() would end the thread by unwinding its
// stack, through destructors that need the GIL themselves (the DLPack
// deleters) and are noexcept, which aborts the process. Such a thread waits
// instead, for the exit that is under way to end it. For the same reason
// the GIL is never taken back in a destructor (py::gil_scoped_release).
void launch(const OpHandle& handle, TensorArgs& tensors, std::span<const NamedAttr> attrs) {
  if (!tensors.on_cpu()) {
    handle(tensors.tensors(), attrs, tensors.stream());
    return;
  }
  PyThreadState* const thread = PyEval_SaveThread();
  try {
    handle(tensors.tensors(), attrs, tensors.stream());
  } catch (...) {
    take_back_gil(thread);
    throw;
  }
  take_back_gil(thread);
}

// The call, then the record of its writes in the torch tensors' version
// counters: after a kernel that ran, whether it succeeded or failed (it may
// have written part of its outputs), and never after a call refused before
// any kernel ran. A failed kernel's error is the one raised.
void run(const OpHandle& handle, TensorArgs& tensors, std::span<const NamedAttr> attrs) {
  try {
    launch(handle, tensors, attrs);
  } catch (const KernelError&) {
    try {
      tensors.record_writes();
    } catch (const Error&) {
    }
    throw;
  }
  tensors.record_writes();
}

// Tensors args[first:], attributes and `stream` from kwargs (`skip` names a
// keyword that is not an attribute, besides `stream`).
void call_with_kwargs(const OpHandle& handle, const py::args& args, size_t first, const py::kwargs& kwargs,
                      std::string_view skip) {
  const OpSchema& schema = handle.schema();
  const size_t count = args.size() - first;
  PyObject* stream = nullptr;
  std::array<NamedAttr, kMaxAttrs> attrs;
  size_t num_attrs = 0;
  if (kwargs) {
    PyObject* key = nullptr;
    PyObject* value = nullptr;
    Py_ssize_t pos = 0;
    while (PyDict_Next(kwargs.ptr(), &pos, &key, &value)) {
      const std::string_view name = utf8(key);
      if (name == "stream") {
        stream = value;
        continue;
      }
      if (name == skip) continue;
      if (num_attrs == attrs.size()) throw_call_error(fmt::format("op '{}': too many attributes", schema.op));
      attrs[num_attrs++] = {name, attr_value(schema.op, name, value)};
    }
  }
  TensorArgs tensors(schema, StreamRequest::from(stream));
  for (size_t i = 0; i < count; ++i) tensors.add(args[first + i].ptr());
  // Optional tensors at the end may be left off, as None.
  for (size_t i = count; i < schema.tensors.size() && schema.tensors[i].optional; ++i) tensors.add(Py_None);
  run(handle, tensors, std::span<const NamedAttr>(attrs.data(), num_attrs));
}

// The attributes among the first `given` positional arguments of a torch
// op (those after the schema's tensors, in the schema's order) into
// `attrs`; returns how many.
size_t positional_attrs(const OpSchema& schema, const py::args& args, size_t given,
                        std::array<NamedAttr, kMaxAttrs>& attrs) {
  const size_t num_tensors = schema.tensors.size();
  const size_t num_attrs = given > num_tensors ? given - num_tensors : 0;
  for (size_t i = 0; i < num_attrs; ++i) {
    const std::string& name = schema.attrs[i].name;
    attrs[i] = {name, attr_value(schema.op, name, args[num_tensors + i].ptr())};
  }
  return num_attrs;
}

}  // namespace

void Op::call(const py::args& args, const py::kwargs& kwargs) const { call_with_kwargs(handle_, args, 0, kwargs, {}); }

void Op::call_positional(const py::args& args) const {
  const OpSchema& schema = handle_.schema();
  const size_t num_tensors = schema.tensors.size();
  size_t given = args.size();
  // torch.ops.kdispatch.* pass a last argument, the backend (None: the
  // selection rules decide), after every attribute.
  OpHandle handle = handle_;
  std::shared_ptr<Runtime> named;  // the runtime of a handle by backend name, held until the call is done
  if (given == num_tensors + schema.attrs.size() + 1) {
    PyObject* backend = args[given - 1].ptr();
    --given;
    if (backend != Py_None) {
      if (!PyUnicode_Check(backend)) throw py::type_error("backend must be a str or None");
      named = runtime();
      handle = named->dispatcher.op(handle_.op(), utf8(backend));
    }
  }
  // torch leaves off trailing arguments equal to their defaults: optional
  // tensors at the end (None) as well as attributes.
  size_t required = num_tensors;
  while (required > 0 && schema.tensors[required - 1].optional) --required;
  if (given < required || given > num_tensors + schema.attrs.size()) {
    throw_call_error(fmt::format("op '{}' takes {} tensors and up to {} attributes, got {} arguments", schema.op,
                                 num_tensors, schema.attrs.size(), given));
  }
  std::array<NamedAttr, kMaxAttrs> attrs;
  const size_t num_attrs = positional_attrs(schema, args, given, attrs);
  TensorArgs tensors(schema, StreamRequest{});
  for (size_t i = 0; i < num_tensors; ++i) tensors.add(i < given ? args[i].ptr() : Py_None);
  run(handle, tensors, std::span<const NamedAttr>(attrs.data(), num_attrs));
}

void Op::check_layout(const py::args& args) const {
  const OpSchema& schema = handle_.schema();
  const size_t num_tensors = schema.tensors.size();
  // The arguments of the torch op: tensors, attributes (they can say how
  // tensors are laid out: "flattened"), then the backend, which the check
  // does not depend on.
  size_t given = args.size();
  if (given == num_tensors + schema.attrs.size() + 1) --given;
  if (given > num_tensors + schema.attrs.size()) {
    throw_call_error(fmt::format("op '{}' takes {} tensors and up to {} attributes, got {} arguments", schema.op,
                                 num_tensors, schema.attrs.size(), given));
  }
  std::array<NamedAttr, kMaxAttrs> attrs;
  const size_t num_attrs = positional_attrs(schema, args, given, attrs);
  TensorArgs tensors(schema, StreamRequest{}, TensorArgs::Purpose::layout);
  const size_t count = std::min(given, num_tensors);
  for (size_t i = 0; i < count; ++i) tensors.add(args[i].ptr());
  // Optional tensors at the end that torch left off (None by default).
  for (size_t i = count; i < num_tensors && schema.tensors[i].optional; ++i) tensors.add(Py_None);
  handle_.check(tensors.tensors(), std::span<const NamedAttr>(attrs.data(), num_attrs), OpHandle::CheckScope::layout);
}

void call(const py::args& args, const py::kwargs& kwargs) {
  if (args.size() == 0 || !PyUnicode_Check(args[0].ptr())) {
    throw py::type_error("kdispatch.call(op, *tensors, backend=None, stream=None, **attrs): op must be a str");
  }
  const std::string_view op = utf8(args[0].ptr());
  std::string_view backend;
  if (kwargs) {
    if (PyObject* b = PyDict_GetItemString(kwargs.ptr(), "backend"); b != nullptr && b != Py_None) {
      if (!PyUnicode_Check(b)) throw py::type_error("kdispatch.call: backend must be a str or None");
      backend = utf8(b);
    }
  }
  const std::shared_ptr<Runtime> held = runtime();  // held until the call is done
  const OpHandle handle = held->dispatcher.op(op, backend);
  call_with_kwargs(handle, args, 1, kwargs, "backend");
}

}  // namespace kdispatch::python
