"""What the compat modules share: the torch op of an op id, and the error for
an argument kdispatch cannot serve, and a kdispatch op's refusal reworded to
name the compat function and the caller's argument."""
import re as _re

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


# A kdispatch call error: "op 'x.y', argument 1 'x': why" for one tensor,
# "op 'x.y': why" for a requirement between tensors, naming each "(from 'x')".
_ARGUMENT = _re.compile(r"op '([^']+)', argument \d+ '([^']+)': (.*)", _re.S)
_CALL = _re.compile(r"op '([^']+)': (.*)", _re.S)
_NAMED = _re.compile(r"\(from '([^']+)'\)")


def renamed(function, names, error):
    """A kdispatch op's KD-E030 error as one of `function`, naming the
    caller's argument (`names` maps the op's tensor names to the caller's):
    the tensor the error is about, or the first one a requirement names.
    Any other error is returned as it is."""
    if error.code != "KD-E030":
        return error
    match = _ARGUMENT.match(error.message)
    if match is not None:
        op, tensor, why = match.groups()
    else:
        match = _CALL.match(error.message)
        if match is None:
            return error
        op, why = match.groups()
        tensor = next((t for t in _NAMED.findall(why) if t in names), None)
        if tensor is None:
            return error
    error_of_function = unsupported(function, names.get(tensor, tensor),
                                    f"{why} (kdispatch op '{op}', its tensor '{tensor}')")
    error_of_function.hints = list(error.hints)
    return error_of_function


def forward(function, names, opfn, *args):
    """opfn(*args), a kdispatch op's refusal raised as `function`'s (see renamed)."""
    try:
        opfn(*args)
    except CallError as e:
        error = renamed(function, names, e)
        if error is e:
            raise
        raise error from e
