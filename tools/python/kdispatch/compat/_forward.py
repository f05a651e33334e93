"""How the sgl_kernel and flashinfer compat functions call a kdispatch op:
the tensors as given, and a refusal reworded to name the compat function
and the caller's argument."""
import torch as _torch

from ._common import forward, torch_op, unsupported

# The dtypes of the activations of every op these modules forward to.
FLOAT_DTYPES = (_torch.float32, _torch.float16, _torch.bfloat16)


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
    as the KD-E030 error of `function`, naming the argument by the caller's
    name: `names` maps the op's tensor names to them ({"x": "input"})."""
    forward(function, names, torch_op(op), *args)


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
    """Rotates query and key (or None) in place, each [*, H * head_size] or
    [*, H, head_size]: passed as they are with head_size, which the op's
    schema splits them by."""
    op = "embeddings.rotary_embedding"
    check_float(function, "query", query, op)
    head_size = int(head_size)
    if head_size <= 0:
        raise unsupported(function, "head_size", f"must be > 0, got {head_size}")
    call(function, op, _ROPE_NAMES, positions, query, key, cos_sin_cache, bool(is_neox), head_size)


def norms_and_activations(module, peer):
    """The norm and gated-activation functions that sgl_kernel and FlashInfer
    both have, with the same names, signatures and conventions, as functions
    of `module` (their __module__) that name `peer` in their errors:
    rmsnorm, fused_add_rmsnorm, gemma_rmsnorm, gemma_fused_add_rmsnorm,
    silu_and_mul, gelu_and_mul, gelu_tanh_and_mul."""

    def rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):
        """out = input * rsqrt(mean(input^2 over the last dim) + eps) * weight, into
        ``out`` when given (then returned), else into a new tensor; forwards to
        layernorm.rmsnorm. input [*, H] with rows of any stride, weight [H] of
        input's dtype or float32. enable_pdl: accepted, no effect (see the module)."""
        return norm(f"{peer}.rmsnorm", "layernorm.rmsnorm", input, weight, eps, out, enable_pdl)

    def fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None):
        """residual += input; input = rmsnorm(residual) * weight, both in place,
        returns None; forwards to layernorm.fused_add_rmsnorm, which normalises
        the float32 sum before it is rounded into residual, as {peer} does."""
        fused_add_norm(f"{peer}.fused_add_rmsnorm", "layernorm.fused_add_rmsnorm", input, residual, weight, eps,
                       enable_pdl)

    def gemma_rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):
        """Gemma's norm: out = input * rsqrt(mean(input^2) + eps) * (1 + weight),
        into ``out`` when given (then returned), else into a new tensor; forwards
        to layernorm.gemma_rmsnorm."""
        return norm(f"{peer}.gemma_rmsnorm", "layernorm.gemma_rmsnorm", input, weight, eps, out, enable_pdl)

    def gemma_fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None):
        """residual += input; input = gemma_rmsnorm(residual), both in place,
        returns None; forwards to layernorm.gemma_fused_add_rmsnorm (the float32
        sum is normalised)."""
        fused_add_norm(f"{peer}.gemma_fused_add_rmsnorm", "layernorm.gemma_fused_add_rmsnorm", input, residual,
                       weight, eps, enable_pdl)

    def silu_and_mul(input, out=None, enable_pdl=None):
        """out = silu(input[..., :D]) * input[..., D:], into ``out`` when given
        (then returned), else into a new [..., D] tensor; forwards to
        activation.silu_and_mul. Any D: {peer}'s 16-byte row requirement
        is not kdispatch's."""
        return act_and_mul(f"{peer}.silu_and_mul", "activation.silu_and_mul", input, out, enable_pdl)

    def gelu_and_mul(input, out=None, enable_pdl=None):
        """out = gelu(input[..., :D]) * input[..., D:] (erf form); forwards to
        activation.gelu_and_mul."""
        return act_and_mul(f"{peer}.gelu_and_mul", "activation.gelu_and_mul", input, out, enable_pdl)

    def gelu_tanh_and_mul(input, out=None, enable_pdl=None):
        """out = gelu_tanh(input[..., :D]) * input[..., D:]; forwards to
        activation.gelu_tanh_and_mul."""
        return act_and_mul(f"{peer}.gelu_tanh_and_mul", "activation.gelu_tanh_and_mul", input, out, enable_pdl)

    functions = (rmsnorm, fused_add_rmsnorm, gemma_rmsnorm, gemma_fused_add_rmsnorm, silu_and_mul, gelu_and_mul,
                 gelu_tanh_and_mul)
    for f in functions:
        f.__module__ = module
        f.__qualname__ = f.__name__
        f.__doc__ = f.__doc__.replace("{peer}", peer)
    return functions
