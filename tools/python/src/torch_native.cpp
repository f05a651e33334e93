// kdispatch._torch_native: the reads of torch_native.hpp, against the torch
// headers of the build. It links torch's C++ libraries, which the process
// has loaded already when this module is imported (kdispatch._torch_tensors
// imports it only after torch).

#include "torch_native.hpp"

#include <ATen/PythonTorchFunctionTLS.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/version.h>

#include <exception>

namespace {

using kdispatch::python::TorchNativeApi;

int flags(PyObject* tensor) noexcept {
  const at::Tensor& t = THPVariable_Unpack(tensor);
  return (t.is_neg() ? kdispatch::python::kNegative : 0) | (t.requires_grad() ? kdispatch::python::kRequiresGrad : 0);
}

int bump_version(PyObject* tensor) noexcept {
  try {
    const at::Tensor& t = THPVariable_Unpack(tensor);
    if (!t.is_inference()) torch::autograd::impl::bump_version(t);
    return 0;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return -1;
  }
}

int scalar_type(PyObject* dtype) noexcept { return static_cast<int>(reinterpret_cast<THPDtype*>(dtype)->scalar_type); }

int read(PyObject* tensor, kdispatch::python::TorchNativeTensor* out, int64_t* shape, int64_t* strides,
         int max_dims) noexcept {
  try {
    const at::Tensor& t = THPVariable_Unpack(tensor);
    if (t.layout() != c10::kStrided || !t.has_storage() || t.dim() > max_dims) return 1;
    const c10::Device device = t.device();
    if (!device.is_cpu() && !device.is_cuda()) return 1;
    out->data = t.data_ptr();
    out->scalar_type = static_cast<int>(t.scalar_type());
    out->cuda = device.is_cuda();
    out->device_index = device.is_cuda() ? device.index() : 0;
    out->ndim = static_cast<int>(t.dim());
    const auto sizes = t.sizes();
    const auto steps = t.strides();
    for (size_t d = 0; d < sizes.size(); ++d) {
      shape[d] = sizes[d];
      strides[d] = steps[d];
    }
    return 0;
  } catch (const std::exception&) {
    return 1;  // read through the bindings, whose error the caller reports
  }
}

bool function_mode_enabled() noexcept {
#if TORCH_VERSION_MAJOR >= 2
  return at::impl::torch_function_mode_enabled();
#else
  return at::impl::function_mode_enabled();
#endif
}

const TorchNativeApi api{sizeof(TorchNativeApi), &flags, &bump_version, &function_mode_enabled, &scalar_type, &read};

PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_torch_native",
    "Reads of torch tensors' C++ state for the kdispatch extension module (built for one torch version).", -1,
    nullptr, nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__torch_native() {
  PyObject* module = PyModule_Create(&module_def);
  if (module == nullptr) return nullptr;
  PyObject* capsule =
      PyCapsule_New(const_cast<TorchNativeApi*>(&api), kdispatch::python::kTorchNativeCapsule, nullptr);
  if (capsule == nullptr || PyModule_AddObject(module, "API", capsule) != 0) {  // steals it on success
    Py_XDECREF(capsule);
    Py_DECREF(module);
    return nullptr;
  }
  if (PyModule_AddStringConstant(module, "TORCH_VERSION", KDISPATCH_TORCH_VERSION) != 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
