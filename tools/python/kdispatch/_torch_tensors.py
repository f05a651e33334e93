"""Tells the extension module about torch, so that torch tensors are read
by kdispatch._torch_native where it is used, else through the C methods and
getters of torch's tensor base type (data_ptr, shape, stride, dtype,
device), instead of being exported as DLPack capsules,
CUDA calls run on torch's current stream, and the tensors a call writes
have their version counters bumped as torch's own in-place ops do."""
import os

import torch

from . import _kdispatch

_DTYPES = [
    (torch.float32, "float32"), (torch.float16, "float16"), (torch.bfloat16, "bfloat16"),
    (torch.float64, "float64"), (torch.int32, "int32"), (torch.int64, "int64"),
    (torch.uint8, "uint8"), (torch.bool, "bool"),
] + [
    # The 8-bit floats, where this torch has them (torch >= 2.1).
    (getattr(torch, name), name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)
]

_enabled = False


def _raw_stream_function():
    """A function of a device index returning torch's current raw stream."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw
    if not torch.cuda.is_available():
        return None
    return lambda index: torch.cuda.current_stream(index).cuda_stream


def _version_bump_function():
    """(function, takes_sequence): torch's C function that bumps the version
    counter of a tensor (torch >= 2.1: torch._C._increment_version, whose
    argument became a sequence of tensors in later versions; which one this
    torch has is found by trying both on a tensor of its own), called
    without torch.autograd.graph.increment_version's Python wrapper; else
    that wrapper; else (None, False), and the extension bumps a tensor's
    version counter by copying the tensor into itself. Autograd compares
    the counter with the version it saved to tell that a tensor saved for
    backward was overwritten since."""
    direct = getattr(torch._C, "_increment_version", None)
    if direct is not None:
        with torch.inference_mode(False):  # a probe with a version counter, whatever the caller's mode
            probe = torch.zeros(1)
            for argument, takes_sequence in (((probe,), True), (probe, False)):
                before = probe._version
                try:
                    direct(argument)
                except (TypeError, RuntimeError):
                    continue
                if probe._version == before + 1:
                    return direct, takes_sequence
    return getattr(getattr(torch.autograd, "graph", None), "increment_version", None), False


# The untyped storage of a tensor: Tensor.untyped_storage (torch >= 2.0),
# Tensor._storage before.
_untyped_storage = getattr(torch.Tensor, "untyped_storage", None) or torch.Tensor._storage


def storage_bounds(tensor):
    """(address, bytes) of the memory of a tensor's storage."""
    storage = _untyped_storage(tensor)
    return storage.data_ptr(), storage.nbytes()


def _native():
    """(capsule, reason): the API of kdispatch._torch_native, the helper that
    reads a tensor's negative bit, requires_grad and layout and bumps its
    version counter as function calls into torch's C++ (a few nanoseconds,
    where torch's Python bindings take 0.03-0.09 us a read), and None with the
    reason where it is not used: turned off (KDISPATCH_TORCH_NATIVE=0), not
    built (torch had no C++ headers at build time), or built for another
    torch version (its reads follow the C++ tensor layout of the torch it
    was built for)."""
    if os.environ.get("KDISPATCH_TORCH_NATIVE", "1") == "0":
        return None, "turned off by KDISPATCH_TORCH_NATIVE=0"
    try:
        from . import _torch_native
    except ImportError as e:
        return None, f"kdispatch._torch_native is not available ({e})"
    if _torch_native.TORCH_VERSION != torch.__version__:
        return None, (f"kdispatch._torch_native was built for torch {_torch_native.TORCH_VERSION}, "
                      f"and this is torch {torch.__version__}")
    return _torch_native.API, None


# Why torch tensors are read through torch's bindings rather than by
# kdispatch._torch_native, or None while the helper reads them.
native_reason = None


def enable():
    global _enabled, native_reason
    if _enabled:
        return
    bump, bump_takes_sequence = _version_bump_function()
    native, native_reason = _native()
    _kdispatch._set_torch(torch.Tensor, _DTYPES, _raw_stream_function(), torch.is_grad_enabled,
                          bump, bump_takes_sequence, getattr(torch.version, "hip", None) is not None, native)
    _enabled = True
