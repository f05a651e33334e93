// kdispatch::Error and its subclasses as the Python exceptions of
// kdispatch._errors (kdispatch.Error, kdispatch.CallError, ...), with the
// code ("KD-E030"), the message and the hints.
#pragma once

#include <pybind11/pybind11.h>

#include <kdispatch/error.hpp>

#include <string>
#include <string_view>

namespace kdispatch::python {

// Sets `error` as the current Python exception, as an instance of the
// matching class of kdispatch._errors.
void set_python_error(const Error& error);

// Lets every bound function throw kdispatch::Error.
void register_error_translator();

// Text from the core as a Python str: UTF-8, with any other byte (a file or
// folder name that is not UTF-8) kept as a lone surrogate, as os.fsdecode
// does ("surrogateescape"), so that no name makes a UnicodeDecodeError.
pybind11::str text(std::string_view s);

// A KD-E030 error: the arguments of a call do not fit the op.
[[noreturn]] void throw_call_error(std::string message);

}  // namespace kdispatch::python
