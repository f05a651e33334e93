// Calling an op from Python: tensors (tensor_args.hpp), attributes from
// Python scalars, the stream, and the checked C++ call. The GIL is released
// while a kernel runs on the host.
#pragma once

#include <pybind11/pybind11.h>

#include <kdispatch/dispatcher.hpp>

#include <memory>
#include <string>

#include "runtime.hpp"

namespace kdispatch::python {

// kdispatch.op(...): an op resolved by name once, with the runtime its
// handle points into.
class Op {
 public:
  Op(OpHandle handle, std::shared_ptr<Runtime> runtime) : handle_(handle), runtime_(std::move(runtime)) {}
  // op(*tensors, stream=None, **attrs)
  void call(const pybind11::args& args, const pybind11::kwargs& kwargs) const;
  // The torch kernel: tensors then every attribute in schema order
  // (trailing ones may be left out; their defaults apply), then optionally
  // the backend (a str names one, None lets the selection rules decide).
  void call_positional(const pybind11::args& args) const;
  // The check of a call on tensors without data (torch's meta and fake
  // tensors): the dispatcher's own rules and words, data not read. Takes
  // the arguments of the torch kernel (call_positional), whose attributes
  // may say how tensors are laid out; the backend is not looked at.
  void check_layout(const pybind11::args& args) const;
  const OpHandle& handle() const { return handle_; }

 private:
  OpHandle handle_;
  std::shared_ptr<Runtime> runtime_;
};

// kdispatch.call(op, *tensors, backend=None, stream=None, **attrs)
void call(const pybind11::args& args, const pybind11::kwargs& kwargs);

}  // namespace kdispatch::python
