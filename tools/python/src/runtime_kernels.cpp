// Python callables as kernels registered at run time (kdispatch.register_kernel).
// One kd_kernel_fn, `trampoline`, serves them all: it takes the GIL, finds
// its callable through kd_call_args::kernel_data, hands it the call's
// tensors as torch tensors (DLPack, no copy) and its attributes by name, and
// turns what the callable raised into a status and a message.
#include "runtime_kernels.hpp"

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <kdispatch/manifest.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "errors.hpp"
#include "runtime.hpp"

namespace py = pybind11;

namespace kdispatch::python {

namespace {

// What kernel_data points at. Never freed: specs are never freed either,
// and a selection made before an unregister may still call it.
struct PyKernel {
  py::object fn;           // the callable
  py::object from_dlpack;  // torch.utils.dlpack.from_dlpack
  py::object unsupported;  // kdispatch.Unsupported
};

// A DLManagedTensor over a call's DLTensor: its own copies of shape and
// strides, freed by the deleter; the data is the call's.
struct Borrowed {
  DLManagedTensor managed{};
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
};

void delete_borrowed(DLManagedTensor* self) { delete static_cast<Borrowed*>(self->manager_ctx); }

// A capsule torch has not consumed still owns its DLManagedTensor.
void delete_capsule(PyObject* capsule) {
  if (PyCapsule_IsValid(capsule, "dltensor") == 0) return;  // "used_dltensor": torch owns it
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
  if (managed != nullptr && managed->deleter != nullptr) managed->deleter(managed);
}

py::object torch_tensor(const PyKernel& kernel, const DLTensor& t) {
  auto* b = new Borrowed();
  b->managed.manager_ctx = b;
  b->managed.deleter = delete_borrowed;
  b->managed.dl_tensor = t;
  // The byte offset is folded into the data pointer: torch's importers
  // differ in whether they read it.
  b->managed.dl_tensor.data = static_cast<char*>(t.data) + t.byte_offset;
  b->managed.dl_tensor.byte_offset = 0;
  b->shape.assign(t.shape, t.shape + t.ndim);
  b->managed.dl_tensor.shape = b->shape.data();
  if (t.strides != nullptr) {
    b->strides.assign(t.strides, t.strides + t.ndim);
    b->managed.dl_tensor.strides = b->strides.data();
  }
  PyObject* capsule = PyCapsule_New(&b->managed, "dltensor", delete_capsule);
  if (capsule == nullptr) {
    delete b;
    throw py::error_already_set();
  }
  return kernel.from_dlpack(py::reinterpret_steal<py::object>(capsule));
}

py::object attr_value(const kd_attr& a) {
  switch (a.type) {
    case KD_ATTR_TYPE_FLOAT: return py::float_(a.value.f);
    case KD_ATTR_TYPE_INT: return py::int_(a.value.i);
    case KD_ATTR_TYPE_BOOL: return py::bool_(a.value.b != 0);
    case KD_ATTR_TYPE_STRING: return text(a.value.s != nullptr ? a.value.s : "");
    default: return py::none();
  }
}

void write_error(const kd_call_args* args, std::string_view message) {
  if (args->error == nullptr || args->error_capacity == 0) return;
  const size_t n = std::min(message.size(), args->error_capacity - 1);
  std::memcpy(args->error, message.data(), n);
  args->error[n] = '\0';
}

kd_status run(const kd_call_args* args) {
  const auto& kernel = *static_cast<const PyKernel*>(args->kernel_data);
  try {
    py::tuple tensors(args->num_tensors);
    for (int32_t i = 0; i < args->num_tensors; ++i) {
      const DLTensor& t = args->tensors[i];
      tensors[static_cast<size_t>(i)] = KD_TENSOR_IS_ABSENT(t) ? py::none() : torch_tensor(kernel, t);
    }
    py::dict attrs;
    for (int32_t i = 0; i < args->num_attrs; ++i) attrs[text(args->attrs[i].name)] = attr_value(args->attrs[i]);
    kernel.fn(*tensors, **attrs);
    return KD_STATUS_OK;
  } catch (py::error_already_set& e) {
    if (e.matches(kernel.unsupported)) {
      write_error(args, py::str(e.value()).cast<std::string>());
      return KD_STATUS_UNSUPPORTED;
    }
    std::string type = "Exception";
    try {
      type = py::str(e.type().attr("__name__")).cast<std::string>();
    } catch (const py::error_already_set&) {
    }
    std::string what;
    try {
      what = py::str(e.value()).cast<std::string>();
    } catch (const py::error_already_set&) {
      what = "(its message could not be read)";
    }
    write_error(args, fmt::format("{}: {}", type, what));
    return KD_STATUS_INTERNAL;
  } catch (const std::exception& e) {
    write_error(args, fmt::format("{}", e.what()));
    return KD_STATUS_INTERNAL;
  }
}

kd_status trampoline(const kd_call_args* args) {
  const PyGILState_STATE gil = PyGILState_Ensure();
  kd_status status;
  try {
    status = run(args);
  } catch (...) {
    write_error(args, "a Python kernel failed in a way that could not be reported");
    status = KD_STATUS_INTERNAL;
  }
  PyGILState_Release(gil);
  return status;
}

}  // namespace

void bind_runtime_kernels(py::module_& m) {
  m.def(
      "_register_kernel",
      [](const std::string& op, const std::string& backend, py::object fn, py::object from_dlpack,
         py::object unsupported, const std::string& targets_json, const std::vector<std::string>& dtypes,
         std::vector<std::string> constraints, int64_t priority, bool opt_in, std::string description) {
        KernelSpec spec;
        spec.op = op;
        spec.backend = backend;
        const std::string what = fmt::format("kernel registered at run time for op '{}', backend '{}': targets", op,
                                             backend);
        spec.targets = parse_targets(targets_json, what);
        for (const std::string& name : dtypes) {
          const auto dtype = parse_dtype(name);
          if (!dtype) {
            throw ManifestError(ErrorCode::manifest_bad_field,
                                fmt::format("kernel registered at run time for op '{}', backend '{}': unknown dtype "
                                            "'{}'",
                                            op, backend, name));
          }
          spec.dtypes.push_back(*dtype);
        }
        spec.constraints = std::move(constraints);
        if (priority < -1000 || priority > 1000) {
          throw ManifestError(ErrorCode::manifest_bad_field,
                              fmt::format("kernel registered at run time for op '{}', backend '{}': priority {} is "
                                          "outside [-1000, 1000]",
                                          op, backend, priority));
        }
        spec.priority = static_cast<int32_t>(priority);
        spec.opt_in = opt_in;
        spec.description = std::move(description);
        spec.function = trampoline;
        // The same callable again for the pair reuses its PyKernel, so that
        // registering it twice is the no-op it is for any kernel.
        const KernelSpec* now = runtime()->context.registry().get_backend(op, backend);
        if (now != nullptr && now->function == trampoline &&
            static_cast<const PyKernel*>(now->function_data)->fn.is(fn)) {
          spec.function_data = now->function_data;
          register_kernel(std::move(spec));
          return;
        }
        auto kernel = std::make_unique<PyKernel>(PyKernel{std::move(fn), std::move(from_dlpack), std::move(unsupported)});
        spec.function_data = kernel.get();
        register_kernel(std::move(spec));
        // Kept for the process once registered: see PyKernel.
        static_cast<void>(kernel.release());
      },
      py::arg("op"), py::arg("backend"), py::arg("fn"), py::arg("from_dlpack"), py::arg("unsupported"),
      py::arg("targets_json"), py::arg("dtypes"), py::arg("constraints"), py::arg("priority"), py::arg("opt_in"),
      py::arg("description"));
  m.def("_unregister_kernel", &unregister_kernel, py::arg("op"), py::arg("backend"));
}

}  // namespace kdispatch::python
