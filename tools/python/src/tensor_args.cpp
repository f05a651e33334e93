#include "tensor_args.hpp"

#include <fmt/format.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <kdispatch/dtype.hpp>

#include <cstring>
#include <string>

#include "dlpack_versioned.hpp"
#include "errors.hpp"
#include "torch_native.hpp"

namespace py = pybind11;

namespace kdispatch::python {

namespace {

// Interned attribute names, made once (never freed).
struct Names {
  PyObject* dlpack = PyUnicode_InternFromString("__dlpack__");
  PyObject* dlpack_device = PyUnicode_InternFromString("__dlpack_device__");
  PyObject* stream = PyUnicode_InternFromString("stream");
  PyObject* max_version = PyUnicode_InternFromString("max_version");
  PyObject* cuda_stream = PyUnicode_InternFromString("cuda_stream");
  PyObject* ptr = PyUnicode_InternFromString("ptr");
  PyObject* torch_function = PyUnicode_InternFromString("__torch_function__");
};
const Names& names() {
  static const Names* n = new Names();
  return *n;
}

struct TorchDtype {
  PyObject* dtype;  // a torch.dtype, referenced for the process's lifetime
  DLDataType dl;
  int scalar_type;  // its ScalarType, where kdispatch._torch_native is used
};
struct TorchSupport {
  PyObject* tensor_type = nullptr;
  std::array<TorchDtype, 16> dtypes{};
  size_t dtype_count = 0;
  PyObject* raw_stream = nullptr;  // torch._C._cuda_getCurrentRawStream, or nullptr
  // The C-level methods and getters of torch's tensor base type, called
  // directly: no lookup per call, and a subclass cannot override them. They
  // do honour __torch_function__ (see has_torch_function).
  struct {
    PyObject* is_neg = nullptr;  // methods
    PyObject* is_inference = nullptr;
    PyObject* copy_ = nullptr;
    PyObject* resolve_neg = nullptr;
    PyObject* data_ptr = nullptr;
    PyObject* get_device = nullptr;
    PyObject* stride = nullptr;
    PyObject* requires_grad = nullptr;  // getters
    PyObject* dtype = nullptr;
    PyObject* is_cuda = nullptr;
    PyObject* is_cpu = nullptr;
    PyObject* is_meta = nullptr;
    PyObject* device = nullptr;
    PyObject* shape = nullptr;
  } base;
  PyObject* disabled_torch_function = nullptr;  // torch._C._disabled_torch_function_impl
  PyObject* function_mode_enabled = nullptr;    // torch._C._is_torch_function_mode_enabled
  PyObject* to_dlpack = nullptr;                // torch._C._to_dlpack
  PyObject* grad_enabled = nullptr;             // torch.is_grad_enabled
  PyObject* version_bump = nullptr;             // torch._C._increment_version or the like, or nullptr
  bool bump_takes_sequence = false;             // version_bump takes a tuple of tensors
  // kdispatch._torch_native's functions, or nullptr: they read the negative
  // bit, requires_grad, the layout and the torch-function mode and bump
  // version counters in place of the calls above, for tensors whose reads
  // run no Python code.
  const TorchNativeApi* native = nullptr;
  bool rocm = false;
};
TorchSupport g_torch;
// Whether the torch tensor read last was a GPU one (read_torch asks about
// that kind first); guarded by the GIL.
bool g_last_read_cuda = false;

// Types whose __dlpack__ refused max_version (a TypeError): they are asked
// for unversioned capsules right away. References kept.
std::array<PyTypeObject*, 8> g_unversioned_types{};
size_t g_unversioned_count = 0;

bool known_unversioned(PyTypeObject* type) {
  for (size_t i = 0; i < g_unversioned_count; ++i) {
    if (g_unversioned_types[i] == type) return true;
  }
  return false;
}

py::object steal(PyObject* o) { return py::reinterpret_steal<py::object>(o); }

// The pending Python exception as "TypeName: message", cleared.
std::string take_python_error() {
  PyObject* type = nullptr;
  PyObject* value = nullptr;
  PyObject* trace = nullptr;
  PyErr_Fetch(&type, &value, &trace);
  PyErr_NormalizeException(&type, &value, &trace);
  std::string text = "unknown error";
  if (type != nullptr) {
    text = reinterpret_cast<PyTypeObject*>(type)->tp_name;
    if (value != nullptr) {
      if (PyObject* s = PyObject_Str(value)) {
        if (const char* c = PyUnicode_AsUTF8(s)) text += std::string(": ") + c;
        Py_DECREF(s);
      }
    }
  }
  PyErr_Clear();
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(trace);
  return text;
}

std::string repr_of(PyObject* o) {
  std::string text = "?";
  if (PyObject* s = PyObject_Str(o)) {
    if (const char* c = PyUnicode_AsUTF8(s)) text = c;
    Py_DECREF(s);
  }
  PyErr_Clear();
  return text;
}

// A sequence of ints (a tuple, torch.Size) into `out`; its length, or -1.
Py_ssize_t read_ints(PyObject* seq, std::array<int64_t, kMaxDims>& out) {
  if (!PyTuple_Check(seq)) return -1;
  const Py_ssize_t n = PyTuple_GET_SIZE(seq);
  if (n > static_cast<Py_ssize_t>(kMaxDims)) return -1;
  for (Py_ssize_t i = 0; i < n; ++i) {
    const long long v = PyLong_AsLongLong(PyTuple_GET_ITEM(seq, i));
    if (v == -1 && PyErr_Occurred()) return -1;
    out[static_cast<size_t>(i)] = v;
  }
  return n;
}

// torch.Tensor and its subclasses, told by the name of torch's C base type:
// for torch tensors met before kdispatch was told about torch (kdispatch
// imported before torch), whose DLPack export would drop their negative bit.
bool torch_tensor_type(PyTypeObject* type) {
  for (PyTypeObject* t = type; t != nullptr; t = t->tp_base) {
    if (std::strcmp(t->tp_name, "torch._C._TensorBase") == 0 || std::strcmp(t->tp_name, "torch._C.TensorBase") == 0) {
      return true;
    }
  }
  return false;
}

// A getter of torch's tensor base type, read on `object`: a new reference,
// or nullptr with a Python error set.
PyObject* get(PyObject* getter, PyObject* object) {
  return Py_TYPE(getter)->tp_descr_get(getter, object, reinterpret_cast<PyObject*>(Py_TYPE(object)));
}

// Whether torch's C methods and getters hand `object` to Python code, the
// __torch_function__ it has, which may answer anything: for every type but
// torch.Tensor itself and subclasses that keep __torch_function__ disabled
// (torch.nn.Parameter), as torch decides it (check_has_torch_function: the
// attribute of the object, not only of its type). Found without running
// Python code, or taken to be so; an active torch-function mode is checked
// apart.
bool has_torch_function(PyObject* object) {
  PyTypeObject* type = Py_TYPE(object);
  if (reinterpret_cast<PyObject*>(type) == g_torch.tensor_type) return false;
  if (_PyType_Lookup(type, names().torch_function) != g_torch.disabled_torch_function) return true;
  // The type's is a plain function, no descriptor: the generic lookup only
  // adds the object's own __dict__.
  if (type->tp_getattro != PyObject_GenericGetAttr) return true;
  PyObject* own = PyObject_GenericGetAttr(object, names().torch_function);
  if (own == nullptr) {
    PyErr_Clear();
    return true;
  }
  const bool disabled = own == g_torch.disabled_torch_function;
  Py_DECREF(own);
  return !disabled;
}

bool is_gpu(int32_t dl_type) { return dl_type == kDLCUDA || dl_type == kDLROCM || dl_type == kDLCUDAManaged; }

}  // namespace

void set_torch_support(PyObject* tensor_type, PyObject* dtype_table, PyObject* raw_stream_fn, PyObject* grad_enabled_fn,
                       PyObject* version_bump_fn, bool bump_takes_sequence, bool rocm, PyObject* native_api) {
  if (!PyType_Check(tensor_type)) throw py::type_error("torch support: tensor_type must be a type");
  if (version_bump_fn != Py_None && !PyCallable_Check(version_bump_fn)) {
    throw py::type_error("torch support: version_bump must be callable or None");
  }
  TorchSupport support;
  if (native_api != Py_None) {
    auto* api = static_cast<const TorchNativeApi*>(PyCapsule_GetPointer(native_api, kTorchNativeCapsule));
    if (api == nullptr) {
      PyErr_Clear();
      throw py::type_error(fmt::format("torch support: native must be None or a capsule named '{}'", kTorchNativeCapsule));
    }
    if (api->size != sizeof(TorchNativeApi)) {
      throw py::value_error(fmt::format("torch support: kdispatch._torch_native was built with another version of "
                                        "the extension module ({} bytes of API, {} expected); rebuild both",
                                        api->size, sizeof(TorchNativeApi)));
    }
    Py_INCREF(native_api);  // the helper module stays loaded while its capsule lives
    support.native = api;
  }
  Py_INCREF(tensor_type);
  support.tensor_type = tensor_type;
  PyTypeObject* base = nullptr;
  for (PyTypeObject* t = reinterpret_cast<PyTypeObject*>(tensor_type); t != nullptr; t = t->tp_base) {
    if (std::strcmp(t->tp_name, "torch._C._TensorBase") == 0 || std::strcmp(t->tp_name, "torch._C.TensorBase") == 0) {
      base = t;
      break;
    }
  }
  if (base == nullptr) throw py::type_error("torch support: tensor_type does not derive from torch's tensor base type");
  // Each entry of the base type's own dictionary: a method or a getter of
  // its C code (referenced for the process's lifetime).
  auto own = [&](const char* name, bool getter) {
    PyObject* entry = PyDict_GetItemString(base->tp_dict, name);  // borrowed
    if (entry == nullptr || Py_TYPE(entry)->tp_descr_get == nullptr ||
        (getter ? !PyObject_TypeCheck(entry, &PyGetSetDescr_Type)
                : !PyObject_TypeCheck(entry, &PyMethodDescr_Type))) {
      throw py::type_error(fmt::format("torch support: torch's tensor base type has no C {} '{}'",
                                       getter ? "getter" : "method", name));
    }
    Py_INCREF(entry);
    return entry;
  };
  support.base.is_neg = own("is_neg", false);
  support.base.is_inference = own("is_inference", false);
  support.base.copy_ = own("copy_", false);
  support.base.resolve_neg = own("resolve_neg", false);
  support.base.data_ptr = own("data_ptr", false);
  support.base.get_device = own("get_device", false);
  support.base.stride = own("stride", false);
  support.base.requires_grad = own("requires_grad", true);
  support.base.dtype = own("dtype", true);
  support.base.is_cuda = own("is_cuda", true);
  support.base.is_cpu = own("is_cpu", true);
  support.base.is_meta = own("is_meta", true);
  support.base.device = own("device", true);
  support.base.shape = own("shape", true);
  {
    py::module_ c = py::module_::import("torch._C");
    support.disabled_torch_function = py::object(c.attr("_disabled_torch_function_impl")).release().ptr();
    support.function_mode_enabled = py::object(c.attr("_is_torch_function_mode_enabled")).release().ptr();
    support.to_dlpack = py::object(c.attr("_to_dlpack")).release().ptr();
  }
  py::list table = py::reinterpret_borrow<py::list>(dtype_table);
  for (py::handle entry : table) {
    auto pair = entry.cast<py::tuple>();
    const std::string name = pair[1].cast<std::string>();
    const auto dtype = parse_dtype(name);
    if (!dtype) throw py::value_error("torch support: unknown kdispatch dtype '" + name + "'");
    if (support.dtype_count == support.dtypes.size()) throw py::value_error("torch support: too many dtypes");
    PyObject* torch_dtype = pair[0].ptr();
    Py_INCREF(torch_dtype);
    const int scalar_type = support.native != nullptr ? support.native->scalar_type(torch_dtype) : -1;
    support.dtypes[support.dtype_count++] = {torch_dtype, to_dlpack(*dtype), scalar_type};
  }
  if (raw_stream_fn != nullptr && raw_stream_fn != Py_None) {
    Py_INCREF(raw_stream_fn);
    support.raw_stream = raw_stream_fn;
  }
  Py_INCREF(grad_enabled_fn);
  support.grad_enabled = grad_enabled_fn;
  if (version_bump_fn != Py_None) {
    Py_INCREF(version_bump_fn);
    support.version_bump = version_bump_fn;
    support.bump_takes_sequence = bump_takes_sequence;
  }
  support.rocm = rocm;
  g_torch = support;  // the previous references are kept: handles made before may still use them
}

StreamRequest StreamRequest::from(PyObject* stream) {
  StreamRequest r;
  if (stream == nullptr || stream == Py_None) return r;
  r.given = true;
  py::object value = py::reinterpret_borrow<py::object>(stream);
  if (!PyLong_Check(stream)) {
    if (PyObject_HasAttr(stream, names().cuda_stream)) {
      value = steal(PyObject_GetAttr(stream, names().cuda_stream));
    } else if (PyObject_HasAttr(stream, names().ptr)) {
      value = steal(PyObject_GetAttr(stream, names().ptr));
    }
  }
  if (!value || !PyLong_Check(value.ptr())) {
    PyErr_Clear();
    throw_call_error(
        fmt::format("stream: expected None, an int (a cudaStream_t) or a stream object with "
                    "`cuda_stream` or `ptr`, got {}",
                    Py_TYPE(stream)->tp_name));
  }
  r.handle = reinterpret_cast<uintptr_t>(PyLong_AsVoidPtr(value.ptr()));
  if (PyErr_Occurred()) throw_call_error("stream: " + take_python_error());
  return r;
}

TensorArgs::~TensorArgs() {
  for (size_t i = 0; i < torch_count_; ++i) Py_DECREF(torch_[i].object);
  for (size_t i = 0; i < taken_count_; ++i) {
    if (taken_[i].versioned) {
      auto* m = static_cast<ManagedTensorVersioned*>(taken_[i].managed);
      if (m->deleter != nullptr) m->deleter(m);
    } else {
      auto* m = static_cast<DLManagedTensor*>(taken_[i].managed);
      if (m->deleter != nullptr) m->deleter(m);
    }
  }
}

std::span<DLTensor> TensorArgs::tensors() {
  finish();
  if (absent_ != 0) {
    if (const DLTensor* given = first_present()) {
      for (size_t i = 0; i < count_; ++i) {
        if ((absent_ >> i) & 1u) tensors_[i].device = given->device;
      }
    }
  }
  return {tensors_.data(), count_};
}

const DLTensor* TensorArgs::first_present() const {
  for (size_t i = 0; i < count_; ++i) {
    if (((absent_ >> i) & 1u) == 0) return &tensors_[i];
  }
  return nullptr;
}

std::string TensorArgs::where() const { return where(count_); }

bool TensorArgs::writes(size_t i) const {
  return i < schema_.tensors.size() && (schema_.tensors[i].written || schema_.tensors[i].inplace);
}

std::string TensorArgs::where(size_t i) const {
  const std::string name = i < schema_.tensors.size() ? schema_.tensors[i].name : "?";
  return fmt::format("op '{}', argument {} '{}'", schema_.op, i, name);
}

void TensorArgs::add(PyObject* object) {
  if (count_ == kMaxTensors) {
    throw_call_error(fmt::format("op '{}': more than {} tensors given; no op takes that many", schema_.op,
                                 kMaxTensors));
  }
  DLTensor& out = tensors_[count_];
  if (object == Py_None) {
    if (count_ >= schema_.tensors.size() || !schema_.tensors[count_].optional) {
      throw_call_error(fmt::format("{}: is None, but the op's schema does not mark it optional; pass a tensor",
                                   where()));
    }
    // An optional tensor left out: data == NULL, ndim == 0, on the call's
    // device, which tensors() fills in from the tensors given.
    out = DLTensor{};
    absent_ |= uint32_t{1} << count_;
    ++count_;
    return;
  }
  if (g_torch.tensor_type == nullptr && torch_tensor_type(Py_TYPE(object))) {
    // kdispatch._torch_tensors tells this module about torch.
    py::object module = steal(PyImport_ImportModule("kdispatch._torch_tensors"));
    py::object done = module ? steal(PyObject_CallMethod(module.ptr(), "enable", nullptr)) : py::object();
    if (!done) throw_call_error(fmt::format("{}: cannot read torch tensors: {}", where(), take_python_error()));
  }
  if (g_torch.tensor_type != nullptr &&
      PyObject_TypeCheck(object, reinterpret_cast<PyTypeObject*>(g_torch.tensor_type))) {
    add_torch(object);
  } else {
    add_dlpack(object, out);
  }
  ++count_;
}

// Phase one of a torch tensor, which may run Python code (a subclass's
// __torch_function__, resolve_neg): the checks that refuse it or replace it
// by a resolved copy. Its pointer and layout are read by finish(), once
// every argument was added.
void TensorArgs::add_torch(PyObject* object) {
  const auto& base = g_torch.base;
  const bool python = has_torch_function(object);
  if (python) python_ran_ = true;  // its is_neg, requires_grad go through it
  py::object resolved;
  if (purpose_ == Purpose::call) {
    // A lazily negated view (torch's negative bit: torch._neg_view, the
    // imaginary part of a conjugated tensor) holds in memory the negation of
    // its values. An input is read from a resolved copy, kept until the call
    // is done; a written tensor is refused, since the kernel would write
    // values that read back negated. (The conjugate bit only exists on
    // complex dtypes, which no op takes.)
    // Read by kdispatch._torch_native, or through torch's bindings (which
    // run a __torch_function__ the tensor has).
    auto python_flags = [&] {
      py::object neg = steal(PyObject_CallOneArg(base.is_neg, object));
      if (!neg) {
        throw_call_error(fmt::format("{}: cannot read the torch tensor's negative bit: {}", where(),
                                     take_python_error()));
      }
      py::object grad = steal(get(base.requires_grad, object));
      if (!grad) PyErr_Clear();
      return (neg.ptr() == Py_True ? kNegative : 0) | (grad.ptr() == Py_True ? kRequiresGrad : 0);
    };
    const int flags = python || g_torch.native == nullptr ? python_flags() : g_torch.native->flags(object);
    if (flags & kNegative) {
      if (writes(count_)) {
        throw_call_error(
            fmt::format("{}: is a torch tensor with its negative bit set (a lazily negated view, "
                        "t.is_neg()), which the op would write as if it were not; pass a tensor "
                        "without it (t.resolve_neg() is a copy: copy the result back)",
                        where()));
      }
      resolved = steal(PyObject_CallOneArg(base.resolve_neg, object));
      if (!resolved) throw_call_error(fmt::format("{}: t.resolve_neg() failed: {}", where(), take_python_error()));
      object = resolved.ptr();
    }
    // No op has a backward: a call that autograd would have to follow is
    // refused rather than leaving results without a grad_fn. (A resolved
    // copy requires grad as the tensor it was made of does.)
    if (flags & kRequiresGrad) {
      py::object enabled = steal(PyObject_CallNoArgs(g_torch.grad_enabled));
      if (!enabled) throw_call_error(fmt::format("{}: torch.is_grad_enabled() failed: {}", where(), take_python_error()));
      if (enabled.ptr() == Py_True) {
        throw_call_error(
            fmt::format("{}: requires grad, and kdispatch ops have no backward (their results would have no "
                        "grad_fn); call under torch.no_grad() or torch.inference_mode(), or pass t.detach()",
                        where()));
      }
    }
    // The first torch tensor, when no stream was asked for and no GPU
    // tensor before it chose one, gives torch's current stream of its
    // device (finish() asks torch for it if the device is a GPU).
    if (!launch_stream_set_) {
      launch_stream_set_ = true;
      stream_from_ = static_cast<int>(count_);
    }
  }
  // Referenced until the call is done (a later argument's __dlpack__ may
  // drop the caller's references), as is a resolved copy.
  Py_INCREF(object);
  torch_[torch_count_++] = {object, count_, python};
}

namespace {

// Bumps the version counter of one torch tensor: a new reference, or
// nullptr with a Python error set. torch 2.1 and later have a function for
// it (torch._C._increment_version, of a tensor or, later, of a tuple of
// them); before, a copy of the tensor into itself, an in-place op that torch
// counts as one write and that returns before touching any memory, since
// source and destination are the same tensor: no device work, whatever the
// size. Allowed on every tensor a call may write: detached ones, views
// (whose counter is their base's), expanded ones, and under
// torch.no_grad() ones that require grad.
PyObject* bump_version(PyObject* tensor) {
  if (g_torch.version_bump != nullptr) {
    if (!g_torch.bump_takes_sequence) return PyObject_CallOneArg(g_torch.version_bump, tensor);
    PyObject* tensors = PyTuple_Pack(1, tensor);
    if (tensors == nullptr) return nullptr;
    PyObject* done = PyObject_CallOneArg(g_torch.version_bump, tensors);
    Py_DECREF(tensors);
    return done;
  }
  PyObject* args[] = {tensor, tensor};
  return PyObject_Vectorcall(g_torch.base.copy_, args, 2, nullptr);
}

}  // namespace

void TensorArgs::record_writes() {
  for (size_t k = 0; k < torch_count_; ++k) {
    if (!writes(torch_[k].index)) continue;
    PyObject* tensor = torch_[k].object;
    if (g_torch.native != nullptr && !torch_[k].python) {
      if (g_torch.native->bump_version(tensor) == 0) continue;
      throw_call_error(fmt::format("op '{}': the kernel ran, but bumping the version counter of a tensor it wrote "
                                   "failed: {}",
                                   schema_.op, take_python_error()));
    }
    py::object done = steal(bump_version(tensor));
    if (done) continue;
    // An inference tensor has no counter, and torch refuses to count a
    // write to one outside inference mode: it is left as it is. Asked only
    // here, since the question costs as much as the bump.
    std::string error = take_python_error();
    py::object inference = steal(PyObject_CallOneArg(g_torch.base.is_inference, tensor));
    if (inference.ptr() == Py_True) continue;
    if (!inference) error += "; t.is_inference() failed too: " + take_python_error();
    throw_call_error(fmt::format(
        "op '{}': the kernel ran, but bumping the version counter of a tensor it wrote failed: {}", schema_.op, error));
  }
}

void TensorArgs::finish() {
  if (finished_) return;
  finished_ = true;
  if (torch_count_ == 0) return;
  if (stream_from_ >= 0 && g_torch.raw_stream != nullptr) {
    // Asked first: the function may be Python code.
    const auto& base = g_torch.base;
    const size_t i = static_cast<size_t>(stream_from_);
    PyObject* object = nullptr;
    for (size_t k = 0; k < torch_count_; ++k) {
      if (torch_[k].index == i) object = torch_[k].object;
    }
    py::object is_cuda = steal(get(base.is_cuda, object));
    if (!is_cuda) PyErr_Clear();
    if (is_cuda.ptr() == Py_True) {
      py::object index = steal(PyObject_CallOneArg(base.get_device, object));
      py::object raw = index ? steal(PyObject_CallOneArg(g_torch.raw_stream, index.ptr())) : py::object();
      if (!raw) {
        throw_call_error(
            fmt::format("{}: cannot get torch's current CUDA stream: {}", where(i), take_python_error()));
      }
      launch_stream_ = reinterpret_cast<uintptr_t>(PyLong_AsVoidPtr(raw.ptr()));
    }
  }
  // Nothing below runs Python code for a call (torch's C functions read the
  // C++ tensor; a tensor that would call its __torch_function__ is
  // exported by torch's C++), so no argument can be released, resized or
  // moved between the reads of its pointer and the kernel.
  bool mode = false;
  if (purpose_ == Purpose::call && g_torch.native != nullptr) {
    mode = g_torch.native->function_mode_enabled();
  } else if (purpose_ == Purpose::call) {
    py::object enabled = steal(PyObject_CallNoArgs(g_torch.function_mode_enabled));
    if (!enabled) throw_call_error(fmt::format("op '{}': {}", schema_.op, take_python_error()));
    mode = enabled.ptr() == Py_True;
  }
  for (size_t k = 0; k < torch_count_; ++k) {
    const auto [object, i, python] = torch_[k];
    if (purpose_ == Purpose::call && (mode || python)) {
      read_torch_capsule(object, i);
    } else {
      if (purpose_ != Purpose::call || g_torch.native == nullptr || !read_torch_native(object, i)) {
        read_torch(object, i);
      }
      // Python code ran after the tensor was added (another argument's
      // __dlpack__, a __torch_function__) and may have shrunk its storage
      // under its shape (x.storage().resize_(n)).
      if (purpose_ == Purpose::call && (python_ran_ || mode)) check_storage(object, i);
    }
  }
}

void TensorArgs::check_storage(PyObject* object, size_t i) {
  const DLTensor& t = tensors_[i];
  uint64_t last = 0;  // the offset of the last element, in elements
  for (int32_t d = 0; d < t.ndim; ++d) {
    if (t.shape[d] == 0) return;  // no element is read or written
    last += static_cast<uint64_t>(t.shape[d] - 1) * static_cast<uint64_t>(t.strides[d]);
  }
  const uint64_t bytes = (last + 1) * ((t.dtype.bits * t.dtype.lanes + 7) / 8);
  py::object bounds;
  try {
    bounds = py::module_::import("kdispatch._torch_tensors").attr("storage_bounds")(py::handle(object));
  } catch (py::error_already_set& e) {
    throw_call_error(fmt::format("{}: cannot read the torch tensor's storage: {}", where(i), e.what()));
  }
  const auto [start, size] = bounds.cast<std::pair<uintptr_t, uint64_t>>();
  const auto data = reinterpret_cast<uintptr_t>(t.data);
  if (data < start || data - start > size || size - (data - start) < bytes) {
    throw_call_error(fmt::format("{}: the torch tensor's shape and strides reach {} bytes from its data, past "
                                 "the end of its storage ({} bytes from {:#x}, the data at {:#x}): the storage "
                                 "was changed during the call",
                                 where(i), bytes, size, start, data));
  }
}

// A torch tensor whose reads would go through Python (__torch_function__):
// the DLPack capsule torch's C++ makes of the tensor itself, which holds
// its storage until the capsule's deleter runs, when the call is done.
void TensorArgs::read_torch_capsule(PyObject* object, size_t i) {
  py::object capsule = steal(PyObject_CallOneArg(g_torch.to_dlpack, object));
  if (!capsule) {
    throw_call_error(fmt::format("{}: cannot export the torch tensor (a {} with its own __torch_function__): {}",
                                 where(i), Py_TYPE(object)->tp_name, take_python_error()));
  }
  take_capsule(capsule.ptr(), tensors_[i], i);
  const DLTensor& t = tensors_[i];
  int64_t elements = 1;
  for (int32_t d = 0; d < t.ndim; ++d) elements *= t.shape[d];
  if (t.data == nullptr && elements != 0) {
    throw_call_error(fmt::format("{}: the torch tensor (a {}) has no data for a kernel", where(i),
                                 Py_TYPE(object)->tp_name));
  }
}

bool TensorArgs::read_torch_native(PyObject* object, size_t i) {
  TorchNativeTensor t{};
  if (g_torch.native->read(object, &t, shapes_[i].data(), strides_[i].data(), static_cast<int>(kMaxDims)) != 0) {
    return false;
  }
  const TorchDtype* found = nullptr;
  for (size_t k = 0; k < g_torch.dtype_count; ++k) {
    if (g_torch.dtypes[k].scalar_type == t.scalar_type) {
      found = &g_torch.dtypes[k];
      break;
    }
  }
  int64_t elements = 1;
  for (int d = 0; d < t.ndim; ++d) elements *= shapes_[i][static_cast<size_t>(d)];
  // Another dtype, or no data: read_torch reports it in its words.
  if (found == nullptr || (t.data == nullptr && elements != 0)) return false;
  DLTensor& out = tensors_[i];
  out.data = t.data;
  out.device = t.cuda ? DLDevice{g_torch.rocm ? kDLROCM : kDLCUDA, t.device_index} : DLDevice{kDLCPU, 0};
  out.ndim = t.ndim;
  out.dtype = found->dl;
  out.shape = shapes_[i].data();
  out.strides = strides_[i].data();
  out.byte_offset = 0;
  return true;
}

// A torch tensor through the C methods and getters of torch's tensor base
// type.
void TensorArgs::read_torch(PyObject* object, size_t i) {
  const auto& base = g_torch.base;
  DLTensor& out = tensors_[i];
  void* data = nullptr;  // a layout check reads no data (fake tensors have none to give)
  if (purpose_ == Purpose::call) {
    py::object ptr = steal(PyObject_CallOneArg(base.data_ptr, object));
    if (!ptr) {
      throw_call_error(
          fmt::format("{}: cannot read the torch tensor's data pointer: {}", where(i), take_python_error()));
    }
    data = PyLong_AsVoidPtr(ptr.ptr());
    if (PyErr_Occurred()) throw_call_error(fmt::format("{}: data pointer: {}", where(i), take_python_error()));
  }

  py::object dtype = steal(get(base.dtype, object));
  if (!dtype) throw_call_error(fmt::format("{}: {}", where(i), take_python_error()));
  const TorchDtype* found = nullptr;
  for (size_t k = 0; k < g_torch.dtype_count; ++k) {
    if (g_torch.dtypes[k].dtype == dtype.ptr()) {
      found = &g_torch.dtypes[k];
      break;
    }
  }
  if (found == nullptr) {
    throw_call_error(
        fmt::format("{}: torch dtype {} is not one kdispatch handles (float32, float16, bfloat16, "
                    "float64, int32, int64, uint8, bool, float8_e4m3fn, float8_e5m2)",
                    where(i), repr_of(dtype.ptr())));
  }

  const auto flag = [&](PyObject* getter) {
    py::object value = steal(get(getter, object));
    if (!value) PyErr_Clear();
    return value.ptr() == Py_True;
  };
  // A call's tensors mostly share a device: the kind of the tensor read
  // last is asked about first (one getter instead of two).
  DLDevice device{kDLCPU, 0};
  bool cpu = !g_last_read_cuda && flag(base.is_cpu);
  if (!cpu && flag(base.is_cuda)) {
    py::object index = steal(PyObject_CallOneArg(base.get_device, object));
    if (!index) throw_call_error(fmt::format("{}: {}", where(i), take_python_error()));
    device = {g_torch.rocm ? kDLROCM : kDLCUDA, static_cast<int32_t>(PyLong_AsLong(index.ptr()))};
    g_last_read_cuda = true;
  } else if (!cpu) {
    cpu = g_last_read_cuda && flag(base.is_cpu);
    g_last_read_cuda = false;
  }
  if (!cpu && device.device_type == kDLCPU) {
    if (flag(base.is_meta) && purpose_ == Purpose::layout) {
      // No DLPack device is torch's "meta"; the check only asks that a
      // call's tensors share one device.
      device = {kDLExtDev, 0};
    } else if (flag(base.is_meta)) {
      throw_call_error(
          fmt::format("{}: is a meta tensor, which has no data for a kernel "
                      "(torch.ops.kdispatch.* take meta tensors through their fake implementation)",
                      where(i)));
    } else {
      py::object dev = steal(get(base.device, object));
      PyErr_Clear();
      throw_call_error(
          fmt::format("{}: is on torch device '{}', for which kdispatch has no backend kind "
                      "(cpu, cuda, hip)",
                      where(i), dev ? repr_of(dev.ptr()) : "?"));
    }
  }

  py::object shape = steal(get(base.shape, object));
  const Py_ssize_t ndim = shape ? read_ints(shape.ptr(), shapes_[i]) : -1;
  py::object stride = steal(PyObject_CallOneArg(base.stride, object));
  const Py_ssize_t nstride = stride ? read_ints(stride.ptr(), strides_[i]) : -1;
  if (ndim < 0 || nstride != ndim) {
    PyErr_Clear();
    throw_call_error(
        fmt::format("{}: cannot read the torch tensor's shape and strides (at most {} dims)", where(i), kMaxDims));
  }
  if (purpose_ == Purpose::call && data == nullptr) {
    int64_t elements = 1;
    for (Py_ssize_t d = 0; d < ndim; ++d) elements *= shapes_[i][static_cast<size_t>(d)];
    if (elements != 0) {
      throw_call_error(fmt::format("{}: the torch tensor (a {}) has no data for a kernel", where(i),
                                   Py_TYPE(object)->tp_name));
    }
  }
  out.data = data;
  out.device = device;
  out.ndim = static_cast<int32_t>(ndim);
  out.dtype = found->dl;
  out.shape = shapes_[i].data();
  out.strides = strides_[i].data();
  out.byte_offset = 0;
}

void TensorArgs::add_dlpack(PyObject* object, DLTensor& out) {
  if (PyCapsule_CheckExact(object)) {
    take_capsule(object, out, count_);
    return;
  }
  python_ran_ = true;  // __dlpack_device__ and __dlpack__ are the object's own code
  const Names& n = names();
  py::object dev = steal(PyObject_CallMethodNoArgs(object, n.dlpack_device));
  if (!dev) {
    if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
      PyErr_Clear();
      throw_call_error(
          fmt::format("{}: a {} is not a tensor; pass an object with __dlpack__ and __dlpack_device__ "
                      "(a NumPy array, a torch tensor, a CuPy array) or a DLPack capsule",
                      where(), Py_TYPE(object)->tp_name));
    }
    throw_call_error(fmt::format("{}: __dlpack_device__() failed: {}", where(), take_python_error()));
  }
  long dl_type = -1;
  if (PyTuple_Check(dev.ptr()) && PyTuple_GET_SIZE(dev.ptr()) == 2) {
    dl_type = PyLong_AsLong(PyTuple_GET_ITEM(dev.ptr(), 0));
    PyErr_Clear();
  }
  if (dl_type < 0) {
    throw_call_error(
        fmt::format("{}: __dlpack_device__() returned {}, not (device_type, device_id)", where(), repr_of(dev.ptr())));
  }

  // The producer orders its pending work before the consumer's stream: the
  // stream of the call on GPUs (None: the legacy default stream).
  py::dict kwargs;
  if (is_gpu(static_cast<int32_t>(dl_type))) {
    if (stream_.given) {
      kwargs[n.stream] = py::int_(stream_.handle == 0 ? uintptr_t{1} : stream_.handle);
    } else {
      kwargs[n.stream] = py::none();
    }
  }
  py::object dlpack = steal(PyObject_GetAttr(object, n.dlpack));
  if (!dlpack) throw_call_error(fmt::format("{}: {}", where(), take_python_error()));
  py::object capsule;
  PyTypeObject* type = Py_TYPE(object);
  if (!known_unversioned(type)) {
    py::dict versioned;
    for (auto item : kwargs) versioned[item.first] = item.second;
    versioned[n.max_version] = py::make_tuple(kDlpackMajor, 0);
    capsule = steal(PyObject_Call(dlpack.ptr(), py::tuple().ptr(), versioned.ptr()));
    if (!capsule && PyErr_ExceptionMatches(PyExc_TypeError)) {
      // An older producer, without max_version: ask for an unversioned
      // capsule, and do so at once for this type from now on.
      PyErr_Clear();
      capsule = steal(PyObject_Call(dlpack.ptr(), py::tuple().ptr(), kwargs.ptr()));
      if (capsule && g_unversioned_count < g_unversioned_types.size()) {
        Py_INCREF(type);
        g_unversioned_types[g_unversioned_count++] = type;
      }
    }
  } else {
    capsule = steal(PyObject_Call(dlpack.ptr(), py::tuple().ptr(), kwargs.ptr()));
  }
  if (!capsule) throw_call_error(fmt::format("{}: __dlpack__() failed: {}", where(), take_python_error()));
  if (!PyCapsule_CheckExact(capsule.ptr())) {
    throw_call_error(
        fmt::format("{}: __dlpack__() returned a {}, not a capsule", where(), Py_TYPE(capsule.ptr())->tp_name));
  }
  take_capsule(capsule.ptr(), out, count_);
  // The first GPU tensor fixes the launch stream: the requested one, or the
  // default stream the producer was told about.
  if (is_gpu(out.device.device_type)) launch_stream_set_ = true;
}

void TensorArgs::take_capsule(PyObject* capsule, DLTensor& out, size_t i) {
  const bool written = writes(i);
  if (PyCapsule_IsValid(capsule, "dltensor_versioned")) {
    auto* m = static_cast<ManagedTensorVersioned*>(PyCapsule_GetPointer(capsule, "dltensor_versioned"));
    if (PyCapsule_SetName(capsule, "used_dltensor_versioned") != 0) {
      throw_call_error(fmt::format("{}: {}", where(i), take_python_error()));
    }
    taken_[taken_count_++] = {m, true};  // the deleter runs when the call is done, whatever happens
    if (m->version.major != kDlpackMajor) {
      throw_call_error(fmt::format("{}: DLPack version {}.{} is not supported (this consumer reads major {})", where(i),
                                   m->version.major, m->version.minor, kDlpackMajor));
    }
    if (written && (m->flags & kDlpackFlagReadOnly) != 0) {
      throw_call_error(fmt::format("{}: is written by the op, but its producer marked it read-only", where(i)));
    }
    out = m->dl_tensor;
    return;
  }
  if (PyCapsule_IsValid(capsule, "dltensor")) {
    auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
    if (PyCapsule_SetName(capsule, "used_dltensor") != 0) {
      throw_call_error(fmt::format("{}: {}", where(i), take_python_error()));
    }
    taken_[taken_count_++] = {m, false};
    out = m->dl_tensor;
    return;
  }
  PyErr_Clear();
  const char* name = PyCapsule_GetName(capsule);
  PyErr_Clear();
  if (name != nullptr && std::strncmp(name, "used_", 5) == 0) {
    throw_call_error(
        fmt::format("{}: this DLPack capsule was used already (a capsule can be consumed once; "
                    "pass the array itself, or a new capsule)",
                    where(i)));
  }
  throw_call_error(
      fmt::format("{}: a capsule named '{}' is not a DLPack tensor", where(i), name != nullptr ? name : "(none)"));
}

}  // namespace kdispatch::python
