"""How the sgl_kernel and flashinfer compat functions call a kdispatch op:
the tensors as given, and a refusal reworded to name the compat function
and the caller's argument."""
import re as _re

import torch as _torch

from .._errors import CallError
from ._common import torch_op, unsupported

# The dtypes of the activations of every op these modules forward to.
FLOAT_DTYPES = (_torch.float32, _torch.float16, _torch.bfloat16)
_ARGUMENT = _re.compile(r"argument \d+ '(\w+)'")


def check_float(function, argument, t, op):
    """Refuses a tensor whose dtype `op` has not (e.g. float64): kdispatch casts nothing."""
    if t.dtype not in FLOAT_DTYPES:
        raise unsupported(function, argument,
                          f"{t.dtype} is not a dtype of {op} (float32, float16, bfloat16); "
                          "kdispatch does not cast it")


def check_enable_pdl(function, enable_pdl):
    """enable_pdl is None or a bool: a scheduling hint kdispatch takes and does not act on."""
    if enable_pdl is not None and not isinstance(enable_pdl, bool):
        raise unsupported(function, "enable_pdl", f"expected None or a bool, got {enable_pdl!r}")


def check_out(function, out, like, shape):
    """out has the dtype of `like` and `shape`: kdispatch writes no other."""
    if out.dtype != like.dtype or tuple(out.shape) != tuple(shape):
        raise unsupported(function, "out", f"expected {like.dtype} of shape {list(shape)} (from input), got "
                          f"{out.dtype} of shape {list(out.shape)}")


def call(function, op, names, *args):
    """torch.ops.kdispatch.<op>(*args). A KD-E030 refusal of the op (a
    layout it cannot address, a dtype or shape that does not fit) is raised
    again as the KD-E030 error of `function`, naming the argument by the
    caller's name: `names` maps the op's tensor names to them
    ({"x": "input"})."""
    try:
        torch_op(op)(*args)
    except CallError as e:
        if e.code != "KD-E030":
            raise
        match = _ARGUMENT.search(e.message)
        if match is None:
            raise
        raise unsupported(function, names.get(match.group(1), match.group(1)), e.message) from None


def heads_view(function, argument, t, lead, head_size):
    """t [*, H * head_size] viewed as [*, H, head_size] (view, never
    reshape: a copy would leave the caller's tensor unrotated); t
    [*, H, head_size] as it is. `lead` is the number of dims of *."""
    if t.dim() == lead + 2:
        return t
    if t.dim() != lead + 1 or head_size <= 0 or t.shape[-1] % head_size != 0:
        raise unsupported(function, argument,
                          f"expected [*, H * head_size] or [*, H, head_size] with * the {lead} dims of "
                          f"positions and head_size {head_size}, got shape {list(t.shape)}")
    try:
        return t.view(*t.shape[:-1], t.shape[-1] // head_size, head_size)
    except RuntimeError as e:
        raise unsupported(function, argument, f"cannot be viewed as [*, H, {head_size}] without a copy: {e}")


_NORM_NAMES = {"x": "input", "out": "out", "weight": "weight", "residual": "residual"}


def norm(function, op, input, weight, eps, out, enable_pdl):
    """out = op(input, weight, eps) into `out`, or into a new tensor shaped like input; returns it."""
    check_enable_pdl(function, enable_pdl)
    check_float(function, "input", input, op)
    if out is None:
        out = _torch.empty(input.shape, dtype=input.dtype, device=input.device)
    else:
        check_out(function, out, input, input.shape)
    call(function, op, _NORM_NAMES, out, input, weight, float(eps))
    return out


def fused_add_norm(function, op, input, residual, weight, eps, enable_pdl):
    """op(input, residual, weight, eps), updating input and residual in place."""
    check_enable_pdl(function, enable_pdl)
    check_float(function, "input", input, op)
    call(function, op, _NORM_NAMES, input, residual, weight, float(eps))


def act_and_mul(function, op, input, out, enable_pdl):
    """out [..., D] = op(input [..., 2D]) into `out`, or into a new tensor; returns it."""
    check_enable_pdl(function, enable_pdl)
    check_float(function, "input", input, op)
    shape = (*input.shape[:-1], input.shape[-1] // 2)
    if out is None:
        out = _torch.empty(shape, dtype=input.dtype, device=input.device)
    else:
        check_out(function, out, input, shape)
    call(function, op, {"x": "input", "out": "out"}, out, input)
    return out


_ROPE_NAMES = {"positions": "positions", "query": "query", "key": "key", "cos_sin_cache": "cos_sin_cache"}


def rope_inplace(function, positions, query, key, head_size, cos_sin_cache, is_neox):
    """Rotates query and key (or None) in place through [*, H, head_size] views of them."""
    op = "embeddings.rotary_embedding"
    check_float(function, "query", query, op)
    lead = positions.dim()
    q = heads_view(function, "query", query, lead, int(head_size))
    k = None if key is None else heads_view(function, "key", key, lead, int(head_size))
    call(function, op, _ROPE_NAMES, positions, q, k, cos_sin_cache, bool(is_neox))
