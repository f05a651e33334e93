// The tensors of one call, from Python objects, as DLTensors in schema
// order, without copying data:
//   - torch tensors (once the module knows torch's Tensor type: from
//     kdispatch.torch, an import of kdispatch after torch, or the first
//     torch tensor a call meets): read through the C methods and getters
//     of torch's tensor base type (data_ptr, shape, stride, dtype, device),
//     never through attributes a subclass can override, which costs a
//     fraction of exporting a DLPack capsule. A tensor whose reads would go
//     through Python code (a subclass with its own __torch_function__, or
//     an active torch-function mode) is read, for a call, from the DLPack
//     capsule torch's C++ makes of it (torch._C._to_dlpack). An input with
//     torch's negative bit is read through a resolved copy, an output with
//     it is refused, and so is any tensor that requires grad while grad
//     mode is on (no op has a backward). The pointers and layouts of torch
//     tensors are read last (finish()), after every other argument's
//     __dlpack__ ran, so no Python code runs between reading them and the
//     kernel; the tensors are referenced until the call is done. The torch
//     tensors a call writes have their version counters bumped once the
//     kernel ran (record_writes), as torch's own in-place ops do;
//   - any other object with __dlpack__ / __dlpack_device__ (NumPy, CuPy, ...)
//     and bare DLPack capsules: the capsule protocol, versioned capsules
//     ("dltensor_versioned") asked for first, unversioned ("dltensor")
//     accepted. A capsule is renamed to "used_dltensor[_versioned]" when it
//     is taken and its deleter runs exactly once, when the call is done.
#pragma once

#include <Python.h>
#include <dlpack/dlpack.h>

#include <kdispatch/schema.hpp>

#include <array>
#include <cstdint>
#include <span>

namespace kdispatch::python {

inline constexpr size_t kMaxTensors = kMaxSchemaTensors;
static_assert(kMaxTensors <= 32, "TensorArgs keeps the absent tensors in a 32-bit mask");
inline constexpr size_t kMaxDims = 16;

// Tells the module about torch: its Tensor type, each torch dtype with its
// DLPack code and bits, the function returning the raw current CUDA stream
// of a device index (torch._C._cuda_getCurrentRawStream) or None,
// torch.is_grad_enabled, torch's function that bumps the version counter of
// a tensor written by a call (taking the tensor, or with
// `bump_takes_sequence` a tuple of tensors) or None where torch has none,
// whether torch is a ROCm build (its "cuda" tensors are DLPack kDLROCM),
// and the capsule of kdispatch._torch_native (torch_native.hpp) or None.
void set_torch_support(PyObject* tensor_type, PyObject* dtype_table, PyObject* raw_stream_fn, PyObject* grad_enabled_fn,
                       PyObject* version_bump_fn, bool bump_takes_sequence, bool rocm, PyObject* native_api);

// The stream a caller asked for: None, an int (a cudaStream_t), or an object
// with a `cuda_stream` (torch) or `ptr` (CuPy) attribute.
struct StreamRequest {
  bool given = false;
  uintptr_t handle = 0;
  static StreamRequest from(PyObject* stream);  // nullptr or None: not given
};

class TensorArgs {
 public:
  // What the tensors are read for: a call, or only their layout (devices,
  // dtypes, shapes, strides) for a check of tensors that have no data,
  // such as torch's meta and fake tensors.
  enum class Purpose { call, layout };
  TensorArgs(const OpSchema& schema, StreamRequest stream, Purpose purpose = Purpose::call)
      : schema_(schema),
        stream_(stream),
        launch_stream_(stream.handle),
        launch_stream_set_(stream.given),
        purpose_(purpose) {}
  ~TensorArgs();  // runs the deleters of the DLPack tensors taken
  TensorArgs(const TensorArgs&) = delete;
  TensorArgs& operator=(const TensorArgs&) = delete;

  // Adds the next tensor of the call. None, for a tensor the schema marks
  // optional, is an absent tensor (data == NULL, ndim == 0, shape == NULL,
  // on the device of the call's first tensor given). Throws CallError
  // KD-E030 naming the argument when `object` is not a tensor kdispatch can
  // read (None for a tensor that is not optional), or when the call has
  // more tensors than any op takes (kMaxTensors); how many the op takes is
  // the dispatcher's check.
  void add(PyObject* object);

  // Reads the torch tensors added, once: their data pointers and layouts,
  // through torch's C functions, which run no Python code for a call.
  // Throws CallError KD-E030 naming the argument. tensors(), stream() and
  // on_cpu() call it.
  void finish();

  std::span<DLTensor> tensors();
  size_t count() const { return count_; }
  // The stream to launch on: the requested one, else torch's current
  // stream for torch CUDA tensors, else the default stream (nullptr).
  void* stream() {
    finish();
    return reinterpret_cast<void*>(launch_stream_);
  }
  // Records that the kernel ran: bumps the version counter of every torch
  // tensor the op writes, once each (a view's counter is its base's; an
  // inference tensor has none and is skipped), so that autograd sees the
  // write as it sees torch's own in-place ops. Throws CallError KD-E030
  // when torch refuses.
  void record_writes();
  // True when the first tensor given lives in host memory.
  bool on_cpu() {
    finish();
    const DLTensor* t = first_present();
    return t != nullptr && t->device.device_type == kDLCPU;
  }

 private:
  const DLTensor* first_present() const;
  void add_torch(PyObject* object);
  void read_torch(PyObject* object, size_t i);
  // Through kdispatch._torch_native, for a call: whether it read the tensor
  // (a strided CPU or CUDA tensor of a dtype kdispatch handles, with data).
  bool read_torch_native(PyObject* object, size_t i);
  void read_torch_capsule(PyObject* object, size_t i);
  // Refuses torch tensor i when its shape and strides reach past its storage.
  void check_storage(PyObject* object, size_t i);
  void add_dlpack(PyObject* object, DLTensor& out);
  void take_capsule(PyObject* capsule, DLTensor& out, size_t i);
  std::string where() const;  // of the tensor being added
  std::string where(size_t i) const;  // "op 'X', argument 1 'x'", as the C++ check words it
  bool writes(size_t i) const;        // the op writes tensor i ("written" or "inplace")

  const OpSchema& schema_;
  StreamRequest stream_;
  uintptr_t launch_stream_;
  bool launch_stream_set_;  // the requested stream, or one chosen from a GPU tensor
  int stream_from_ = -1;    // the torch tensor that gives torch's current stream, if on a GPU
  Purpose purpose_;
  bool finished_ = false;
  bool python_ran_ = false;  // an argument's own Python code ran while the tensors were added
  size_t count_ = 0;
  uint32_t absent_ = 0;  // bit i: tensor i is an optional one given as None
  // Left uninitialised (about 10 KiB a call): entries below count_ and
  // taken_count_ are written before they are read.
  std::array<DLTensor, kMaxTensors> tensors_;
  // Shapes and strides of torch tensors (DLPack tensors keep their own).
  std::array<std::array<int64_t, kMaxDims>, kMaxTensors> shapes_;
  std::array<std::array<int64_t, kMaxDims>, kMaxTensors> strides_;
  struct Taken {
    void* managed;
    bool versioned;
  };
  std::array<Taken, kMaxTensors> taken_;
  size_t taken_count_ = 0;
  // The torch tensors, read by finish(), referenced until the call is done
  // (for an input with its negative bit, the resolved copy).
  struct Torch {
    PyObject* object;
    size_t index;
    bool python;  // has_torch_function: torch's C reads would call its Python code
  };
  std::array<Torch, kMaxTensors> torch_;
  size_t torch_count_ = 0;
};

}  // namespace kdispatch::python
