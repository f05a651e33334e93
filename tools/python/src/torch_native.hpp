#pragma once
// The functions kdispatch._torch_native, a helper module built against
// torch's C++ headers, hands the extension module: reads of a torch tensor's
// C++ state that torch's Python API offers only as calls through its
// bindings (each about 0.04-0.09 us, is_neg() releasing and retaking the
// GIL), done here as function calls of a few nanoseconds.
//
// Only the extension module and the helper include this header; the helper
// passes a pointer to its TorchNativeApi in a capsule named
// kTorchNativeCapsule. Its functions read torch's C++ tensor layout, which
// changes between torch versions: kdispatch._torch_tensors uses the helper
// only under the torch version it was built for.

#include <Python.h>

#include <cstdint>

namespace kdispatch::python {

inline constexpr const char* kTorchNativeCapsule = "kdispatch._torch_native.api";

// What TorchNativeApi::read gives of a tensor beside its sizes and strides.
struct TorchNativeTensor {
  void* data;
  int scalar_type;   // as TorchNativeApi::scalar_type gives it
  bool cuda;         // a CUDA (or ROCm) tensor, else a CPU one
  int device_index;  // of a CUDA tensor
  int ndim;
};

struct TorchNativeApi {
  uint32_t size;  // sizeof(TorchNativeApi) in the helper's build
  // Of a torch tensor (torch.Tensor or a subclass; its C++ tensor is read,
  // no Python code runs): kNegative when its negative bit is set,
  // kRequiresGrad when it requires grad.
  int (*flags)(PyObject* tensor) noexcept;
  // Bumps the tensor's version counter, as torch's in-place ops do (a
  // view's counter is its base's). An inference tensor, which has no
  // counter, is left as it is. 0, or -1 with a Python error set.
  int (*bump_version)(PyObject* tensor) noexcept;
  // Whether a torch-function mode is active on this thread
  // (torch._C._is_torch_function_mode_enabled()).
  bool (*function_mode_enabled)() noexcept;
  // The scalar type of a torch.dtype (its index in torch's ScalarType); the
  // object must be a torch.dtype.
  int (*scalar_type)(PyObject* dtype) noexcept;
  // The layout of a tensor a call passes to a kernel, when it is a strided
  // CPU or CUDA tensor of at most max_dims dims with storage: its sizes and
  // strides written to shape and strides, 0 returned. 1 for any other
  // tensor, which the caller reads through torch's bindings instead (and
  // reports as they find it).
  int (*read)(PyObject* tensor, TorchNativeTensor* out, int64_t* shape, int64_t* strides, int max_dims) noexcept;
};
inline constexpr int kNegative = 1;
inline constexpr int kRequiresGrad = 2;

}  // namespace kdispatch::python
