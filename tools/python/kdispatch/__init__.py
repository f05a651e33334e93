"""kdispatch: a kernel dispatcher with plugin backends.

    import numpy as np, kdispatch
    x = np.random.rand(4, 4096).astype(np.float32)
    w = np.ones(4096, np.float32)
    out = np.empty_like(x)
    kdispatch.call("layernorm.rmsnorm", out, x, w, eps=1e-6)   # writes out

    rmsnorm = kdispatch.op("layernorm.rmsnorm")                 # resolved once
    rmsnorm(out, x, w, eps=1e-6)

Tensors are any objects with ``__dlpack__`` / ``__dlpack_device__`` (NumPy
arrays, torch tensors, CuPy arrays) or DLPack capsules, passed in schema
order; outputs are written in place, nothing is copied. ``import
kdispatch.torch`` registers every op as ``torch.ops.kdispatch.<group>_<name>``.
"""
import sys as _sys

from . import _kdispatch
from ._errors import (CallError, Error, KernelError, ManifestError, PluginError, RegistrationError,
                      SelectionError, Unsupported)
from ._runtime_kernels import register_kernel, unregister_kernel

version = _kdispatch.version
__version__ = version

Op = _kdispatch.Op
ops = _kdispatch.ops
backends = _kdispatch.backends
select = _kdispatch.select
set_preference = _kdispatch.set_preference
set_fallback = _kdispatch.set_fallback
fallback = _kdispatch.fallback
preference = _kdispatch.preference
tuning_key = _kdispatch.tuning_key
write_tuning = _kdispatch.write_tuning
set_tuning_file = _kdispatch.set_tuning_file
schema = _kdispatch.schema
schemas = _kdispatch.schemas
doctor = _kdispatch.doctor
explain = _kdispatch.explain
error_codes = _kdispatch.error_codes
configure = _kdispatch.configure
op = _kdispatch.op
call = _kdispatch.call

__all__ = [
    "CallError", "Error", "KernelError", "ManifestError", "Op", "PluginError", "RegistrationError",
    "SelectionError", "Unsupported", "backends", "call", "configure", "doctor", "error_codes", "explain",
    "fallback", "op", "ops", "preference", "register_kernel", "schema", "schemas", "select", "set_fallback",
    "set_preference", "set_tuning_file", "tuning_key", "unregister_kernel", "version", "write_tuning",
]

# torch tensors are read from their own attributes rather than through a
# DLPack capsule when torch is loaded (kdispatch.torch does this too).
if "torch" in _sys.modules:
    from . import _torch_tensors as _tt
    _tt.enable()
