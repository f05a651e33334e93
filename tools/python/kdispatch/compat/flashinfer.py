"""FlashInfer's norm, activation and rope functions on kdispatch's torch ops.

``import kdispatch.compat.flashinfer as flashinfer`` gives the names,
signatures and in-place/out conventions of FlashInfer's ``rmsnorm``,
``fused_add_rmsnorm``, ``gemma_rmsnorm``, ``gemma_fused_add_rmsnorm``,
``layernorm``, ``rmsnorm_quant``, ``fused_add_rmsnorm_quant``,
``silu_and_mul``, ``gelu_and_mul``, ``gelu_tanh_and_mul``,
``apply_rope_with_cos_sin_cache`` and ``apply_rope_with_cos_sin_cache_inplace``,
at the top level (``flashinfer.rmsnorm``) and in the submodules FlashInfer
has them in (``flashinfer.norm``, ``flashinfer.activation``,
``flashinfer.rope``; ``import kdispatch.compat.flashinfer.norm`` works too).
Each call forwards its tensors as they are (strides included) to
``torch.ops.kdispatch.*``; nothing is copied or cast: an argument the op
cannot take as given raises ``kdispatch.CallError`` (KD-E030) naming the
function and the argument.

``enable_pdl`` (programmatic dependent launch, a CUDA scheduling hint) is
accepted and has no effect: kdispatch launches its kernels on torch's
current stream without PDL, and the results do not depend on it.
"""
import sys as _sys
import types as _types

import torch as _torch

from . import _forward
from ._common import unsupported
from ._forward import call, check_enable_pdl, check_float

__all__ = [
    "activation",
    "apply_rope_with_cos_sin_cache",
    "apply_rope_with_cos_sin_cache_inplace",
    "fused_add_rmsnorm",
    "fused_add_rmsnorm_quant",
    "gelu_and_mul",
    "gelu_tanh_and_mul",
    "gemma_fused_add_rmsnorm",
    "gemma_rmsnorm",
    "layernorm",
    "norm",
    "rmsnorm",
    "rmsnorm_quant",
    "rope",
    "silu_and_mul",
]

_MODULE = "flashinfer"

# The norms and gated activations, shared with the other peer's module.
(rmsnorm, fused_add_rmsnorm, gemma_rmsnorm, gemma_fused_add_rmsnorm, silu_and_mul, gelu_and_mul,
 gelu_tanh_and_mul) = _forward.norms_and_activations(__name__, _MODULE)


def layernorm(input, gemma, beta, eps=1e-6):
    """Returns a new tensor (input - mean) * rsqrt(var + eps) * gemma + beta,
    mean and biased variance over the last dim, in float32; forwards to
    layernorm.layernorm. FlashInfer takes bfloat16 input with float32 gemma
    and beta; kdispatch also takes float32 and float16 input, and gemma and
    beta of input's dtype."""
    function = f"{_MODULE}.layernorm"
    op = "layernorm.layernorm"
    check_float(function, "input", input, op)
    out = _torch.empty(input.shape, dtype=input.dtype, device=input.device)
    call(function, op, {"x": "input", "weight": "gemma", "bias": "beta", "out": "out"},
         out, input, gemma, beta, float(eps))
    return out


def _scale_tensor(scale, input):
    """FlashInfer's scale, a float or a float32 tensor of one element, as the
    tensor [1] the op reads on the device: a float becomes one on input's
    device, a 0-dim tensor a view of it; any other tensor is passed as it is
    (the op refuses it unless float32 of one element)."""
    if isinstance(scale, _torch.Tensor):
        return scale.view(1) if scale.dim() == 0 else scale
    return _torch.tensor([float(scale)], dtype=_torch.float32, device=input.device)


def rmsnorm_quant(out, input, weight, scale, eps=1e-6, enable_pdl=None):
    """Fills out (float8_e4m3fn or float8_e5m2, input's shape) with
    input * rsqrt(mean(input^2) + eps) * weight * (1 / scale), accumulated in
    float32 and rounded once, saturating at the format's largest finite
    value; returns None. scale is a float or a float32 tensor of one element
    (read on the device, so a captured CUDA graph follows a changed scale).
    Forwards to layernorm.rmsnorm_quant_fp8."""
    function = f"{_MODULE}.rmsnorm_quant"
    op = "layernorm.rmsnorm_quant_fp8"
    check_enable_pdl(function, enable_pdl)
    check_float(function, "input", input, op)
    call(function, op, {"x": "input", "out": "out", "weight": "weight", "scale": "scale"},
         out, input, weight, _scale_tensor(scale, input), float(eps))


def fused_add_rmsnorm_quant(out, input, residual, weight, scale, eps=1e-6, enable_pdl=None):
    """residual += input in place (input is only read), and out (float8_e4m3fn
    or float8_e5m2) the rmsnorm of the float32 sum times weight * (1 / scale),
    rounded once, saturating; returns None. scale as rmsnorm_quant's.
    Forwards to layernorm.fused_add_rmsnorm_quant_fp8."""
    function = f"{_MODULE}.fused_add_rmsnorm_quant"
    op = "layernorm.fused_add_rmsnorm_quant_fp8"
    check_enable_pdl(function, enable_pdl)
    check_float(function, "input", input, op)
    call(function, op, {"x": "input", "out": "out", "residual": "residual", "weight": "weight", "scale": "scale"},
         out, input, residual, weight, _scale_tensor(scale, input), float(eps))


def apply_rope_with_cos_sin_cache_inplace(positions, query, key, head_size, cos_sin_cache, is_neox=True):
    """Rotates query [*, HQ * head_size] and key [*, HK * head_size] in place
    (returns None), * the shape of positions (int32 or int64); forwards them
    as they are, with head_size, to embeddings.rotary_embedding, which
    splits them into [*, H, head_size] views (no copy: slices of a fused
    QKV output stay strided). The rotary dim is
    cos_sin_cache.shape[-1]; the cache is float32 (or query's dtype)."""
    _forward.rope_inplace(f"{_MODULE}.apply_rope_with_cos_sin_cache_inplace", positions, query, key, head_size,
                          cos_sin_cache, is_neox)


# FlashInfer's implementations of the functional rotary; kdispatch's
# selection rules choose the kernel whichever is named.
_ROPE_BACKENDS = ("cuda", "cute-dsl")


def apply_rope_with_cos_sin_cache(positions, query, key, head_size, cos_sin_cache, is_neox=True, backend="cuda"):
    """Returns (query_out, key_out): new tensors of query's and key's shapes
    holding them rotated (the values past the rotary dim copied as they
    are); query and key are only read. Rotates the new tensors in place with
    embeddings.rotary_embedding. backend: FlashInfer's "cuda" or "cute-dsl",
    accepted; kdispatch's selection rules choose the kernel."""
    function = f"{_MODULE}.apply_rope_with_cos_sin_cache"
    if backend not in _ROPE_BACKENDS:
        raise unsupported(function, "backend", f"expected one of {list(_ROPE_BACKENDS)}, got {backend!r}")
    check_float(function, "query", query, "embeddings.rotary_embedding")
    query_out = query.clone(memory_format=_torch.contiguous_format)
    key_out = None if key is None else key.clone(memory_format=_torch.contiguous_format)
    _forward.rope_inplace(function, positions, query_out, key_out, head_size, cos_sin_cache, is_neox)
    return query_out, key_out


def _submodule(name, doc, names):
    module = _types.ModuleType(f"{__name__}.{name}", doc)
    for n in names:
        setattr(module, n, globals()[n])
    module.__all__ = list(names)
    # Registered so that `import kdispatch.compat.flashinfer.<name>` finds it.
    _sys.modules[module.__name__] = module
    return module


norm = _submodule("norm", "FlashInfer's flashinfer.norm functions on kdispatch's torch ops.",
                  ["rmsnorm", "fused_add_rmsnorm", "gemma_rmsnorm", "gemma_fused_add_rmsnorm", "layernorm",
                   "rmsnorm_quant", "fused_add_rmsnorm_quant"])
activation = _submodule("activation", "FlashInfer's flashinfer.activation functions on kdispatch's torch ops.",
                        ["silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul"])
rope = _submodule("rope", "FlashInfer's flashinfer.rope functions on kdispatch's torch ops.",
                  ["apply_rope_with_cos_sin_cache", "apply_rope_with_cos_sin_cache_inplace"])
