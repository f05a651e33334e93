"""What the compat modules share: the torch op of an op id, and the error for
an argument kdispatch cannot serve."""
import torch as _torch

from .. import torch as _kdt
from .._errors import CallError


def torch_op(op):
    """torch.ops.kdispatch.<name> of an op id, e.g. "layernorm.rmsnorm"."""
    return getattr(_torch.ops.kdispatch, _kdt.registered[op])


def unsupported(function, argument, why):
    """The KD-E030 error of a compat function given an argument it cannot
    forward without a copy or a cast, e.g.
    unsupported("sgl_kernel.rmsnorm", "input", "float64 is not a dtype of layernorm.rmsnorm")."""
    return CallError("KD-E030", f"{function}: argument '{argument}': {why}")
