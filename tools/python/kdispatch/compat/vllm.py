"""vLLM's ``vllm._custom_ops`` norm, rotary and MoE routing functions, and
the activation ops vLLM's activation layers call as
``torch.ops._C.<name>(out, input)``, on kdispatch's torch ops:

    import kdispatch.compat.vllm as ops     # was: from vllm import _custom_ops as ops
    ops.rms_norm(out, x, weight, 1e-6)
    ops.silu_and_mul(out, x)                # was: torch.ops._C.silu_and_mul(out, x)

Every function takes vLLM's arguments in vLLM's order, writes the tensors
vLLM writes (``out``; ``input`` and ``residual``; ``query`` and ``key``;
the three top-k outputs) and returns None. Tensors reach the kernel as
they are, row-strided views included: nothing is copied or cast. An
argument kdispatch cannot serve as given, or one for which it would give
another result than vLLM, raises ``kdispatch.CallError`` (KD-E030) naming
the function and vLLM's name of the argument:

- ``rms_norm`` and ``fused_add_rms_norm`` with ``weight=None``;
- ``rotary_embedding`` with ``rope_dim_offset != 0`` or ``inverse=True``;
- ``topk_softmax`` with an ``e_score_correction_bias`` (vLLM adds it to
  the probabilities after the softmax, for the choice of experts only;
  kdispatch's op adds it to the logits before the softmax, as SGLang does)
  or an ``is_padding`` mask;
- a dtype, shape or layout the kdispatch op does not take (float64, a
  transposed tensor, a head size that does not divide the flattened dim).

Where kdispatch rounds once and vLLM's CUDA kernels round intermediate
values to the activation dtype (the normalised value before the weight,
the activation before the product, each rotary product), results differ
by up to one step of the dtype, kdispatch being the closer to the exact
value. ``fused_add_rms_norm`` normalises the sum rounded to the dtype, as
vLLM does: for float16 and bfloat16 that is two kdispatch calls (the
fused add, then ``layernorm.rmsnorm`` of the rounded residual into
``input``). A ``topk_softmax`` row whose logits hold NaN or +inf gets NaN
weights, where vLLM's kernel gives finite ones.
"""
import torch as _torch

from .. import rotary as _rotary
from ._common import forward as _forward, torch_op, unsupported

__all__ = ["fused_add_rms_norm", "gelu_and_mul", "gelu_tanh_and_mul", "rms_norm", "rotary_embedding",
           "silu_and_mul", "topk_softmax"]

_rmsnorm = torch_op("layernorm.rmsnorm")
_fused_add_rmsnorm = torch_op("layernorm.fused_add_rmsnorm")
_silu_and_mul = torch_op("activation.silu_and_mul")
_gelu_and_mul = torch_op("activation.gelu_and_mul")
_gelu_tanh_and_mul = torch_op("activation.gelu_tanh_and_mul")
_rotary_embedding = torch_op("embeddings.rotary_embedding")
_topk_softmax = torch_op("moe.topk_softmax")

def _need_weight(function, weight):
    if weight is None:
        raise unsupported(function, "weight", "None (a norm without a weight) is not supported: kdispatch's "
                          "norms multiply by a weight; pass torch.ones(hidden_size) of the input's dtype")


_RMS_NORM_NAMES = {"out": "out", "x": "input", "weight": "weight"}


def rms_norm(out, input, weight, epsilon):
    """out = input * rsqrt(mean(input^2) + epsilon) * weight, over the last dim.

    layernorm.rmsnorm: input and out may be row-strided; weight is of the
    input's dtype or float32."""
    _need_weight("vllm.rms_norm", weight)
    _forward("vllm.rms_norm", _RMS_NORM_NAMES, _rmsnorm, out, input, weight, epsilon)


_FUSED_ADD_NAMES = {"x": "input", "residual": "residual", "weight": "weight"}
_NORM_OF_RESIDUAL_NAMES = {"out": "input", "x": "residual", "weight": "weight"}


def fused_add_rms_norm(input, residual, weight, epsilon):
    """residual = input + residual (rounded to the dtype); input = rms_norm of
    that rounded residual times weight. Both updated in place.

    layernorm.fused_add_rmsnorm; for float16 and bfloat16 inputs, then
    layernorm.rmsnorm(out=input, x=residual), since the fused op normalises
    the unrounded float32 sum (SGLang's order) and vLLM the rounded one.
    For float32 the two are the same number and one call serves."""
    _need_weight("vllm.fused_add_rms_norm", weight)
    _forward("vllm.fused_add_rms_norm", _FUSED_ADD_NAMES, _fused_add_rmsnorm, input, residual, weight, epsilon)
    if input.dtype != _torch.float32:
        _forward("vllm.fused_add_rms_norm", _NORM_OF_RESIDUAL_NAMES, _rmsnorm, input, residual, weight, epsilon)


_ACT_NAMES = {"out": "out", "x": "input"}


def silu_and_mul(out, input):
    """out = silu(input[..., :d]) * input[..., d:] (activation.silu_and_mul)."""
    _forward("vllm.silu_and_mul", _ACT_NAMES, _silu_and_mul, out, input)


def gelu_and_mul(out, input):
    """out = gelu(input[..., :d]) * input[..., d:], gelu with erf (activation.gelu_and_mul)."""
    _forward("vllm.gelu_and_mul", _ACT_NAMES, _gelu_and_mul, out, input)


def gelu_tanh_and_mul(out, input):
    """out = gelu_tanh(input[..., :d]) * input[..., d:] (activation.gelu_tanh_and_mul)."""
    _forward("vllm.gelu_tanh_and_mul", _ACT_NAMES, _gelu_tanh_and_mul, out, input)


_ROTARY_NAMES = {"positions": "positions", "query": "query", "key": "key", "cos_sin_cache": "cos_sin_cache"}


def _heads(function, name, t, lead, head_size):
    """t [*, H, head_size] as it is, or t [*, H * head_size] viewed so (never
    copied), as kdispatch.rotary takes them; * is the `lead` dims of positions."""
    try:
        heads = _rotary._heads_view(t, lead, head_size, name)
    except ValueError as e:
        raise unsupported(function, name, str(e)) from None
    except RuntimeError:  # view() refused: the heads are not evenly strided
        raise unsupported(function, name, f"strides {list(t.stride())} of shape {list(t.shape)} cannot be viewed "
                          f"as [*, H, {head_size}] without a copy") from None
    if heads.shape[-1] != head_size:
        raise unsupported(function, name, f"its last dim {heads.shape[-1]} is not head_size {head_size} "
                          f"(shape {list(t.shape)})")
    return heads


def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox, rope_dim_offset=0, inverse=False):
    """Rotates query and key (None: query only) in place by the angles of
    cos_sin_cache[positions]; rotary_dim = cos_sin_cache.shape[1] <= head_size.

    query and key are [*, H * head_size] or [*, H, head_size], * the shape
    of positions; embeddings.rotary_embedding on [*, H, head_size] views.
    The cache may be float32 or the query's dtype; the rotation is computed
    in float32 and rounded once."""
    function = "vllm.rotary_embedding"
    if rope_dim_offset != 0:
        raise unsupported(function, "rope_dim_offset", f"{rope_dim_offset}: kdispatch's rotary rotates the "
                          "first rotary_dim values of each head; only 0 is supported")
    if inverse:
        raise unsupported(function, "inverse", "True: kdispatch's rotary has no inverse rotation")
    head_size = int(head_size)
    if head_size <= 0:
        raise unsupported(function, "head_size", f"must be > 0, got {head_size}")
    lead = positions.dim()
    q = _heads(function, "query", query, lead, head_size)
    k = None if key is None else _heads(function, "key", key, lead, head_size)
    _forward(function, _ROTARY_NAMES, _rotary_embedding, positions, q, k, cos_sin_cache, bool(is_neox))


_TOPK_NAMES = {"topk_weights": "topk_weights", "topk_ids": "topk_ids", "gating_output": "gating_output",
               "token_expert_indices": "token_expert_indices"}


def topk_softmax(topk_weights, topk_ids, token_expert_indices, gating_output, renormalize=False,
                 e_score_correction_bias=None, is_padding=None):
    """topk_weights, topk_ids = the K = topk_weights.shape[-1] largest of
    softmax(gating_output) per row (float32), divided by their sum when
    renormalize; token_expert_indices[t, i] = i * T + t.

    moe.topk_softmax. topk_ids is int32 or int64, token_expert_indices int32."""
    function = "vllm.topk_softmax"
    if e_score_correction_bias is not None:
        raise unsupported(function, "e_score_correction_bias",
                          "vLLM adds it to the probabilities after the softmax, for the choice of experts "
                          "only; kdispatch's moe.topk_softmax adds it to the logits before the softmax "
                          "(SGLang's order) and would choose and weigh differently")
    if is_padding is not None:
        raise unsupported(function, "is_padding", "a padding mask is not supported; pass None")
    _forward(function, _TOPK_NAMES, _topk_softmax, topk_weights, topk_ids, gating_output, None,
             token_expert_indices, bool(renormalize), 0.0)


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    raise AttributeError(f"kdispatch.compat.vllm has no '{name}': kdispatch has no op serving vLLM's '{name}' "
                         f"(functions: {', '.join(__all__)})")
