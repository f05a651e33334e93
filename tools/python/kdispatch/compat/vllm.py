"""vLLM's ``vllm._custom_ops`` norm, rotary, MoE routing and alignment,
KV-cache write and fp8 quantisation functions, and
the activation ops vLLM's activation layers call as
``torch.ops._C.<name>(out, input)``, on kdispatch's torch ops:

    import kdispatch.compat.vllm as ops     # was: from vllm import _custom_ops as ops
    ops.rms_norm(out, x, weight, 1e-6)
    ops.silu_and_mul(out, x)                # was: torch.ops._C.silu_and_mul(out, x)

Every function takes vLLM's arguments in vLLM's order, writes the tensors
vLLM writes (``out``; ``input`` and ``residual``; ``query`` and ``key``;
the three top-k outputs) and returns None, except ``scaled_fp8_quant``,
which returns ``(output, scale)`` as vLLM's does. Tensors reach the kernel as
they are, row-strided views included: nothing is copied or cast. An
argument kdispatch cannot serve as given, or one for which it would give
another result than vLLM, raises ``kdispatch.CallError`` (KD-E030) naming
the function and vLLM's name of the argument:

- ``rms_norm`` and ``fused_add_rms_norm`` with ``weight=None``;
- ``rotary_embedding`` with ``rope_dim_offset != 0`` or ``inverse=True``;
- ``reshape_and_cache_flash`` with a ``kv_cache_dtype`` other than
  ``"auto"``, ``"fp8"``, ``"fp8_e4m3"`` and ``"fp8_e5m2"``, or caches whose
  dtype disagrees with it (vLLM's uint8 fp8 caches are taken as views of
  the named float8 dtype: a view, not a copy);
- ``moe_align_block_size`` with an ``expert_map`` (expert parallelism);
- ``topk_softmax`` with an ``e_score_correction_bias`` (vLLM adds it to
  the probabilities after the softmax, for the choice of experts only;
  kdispatch's op adds it to the logits before the softmax, as SGLang does)
  or an ``is_padding`` mask;
- ``scaled_fp8_quant`` with a static ``scale`` of more than one element
  (per-channel, per-token or group scales: kdispatch's static quantiser is
  per tensor), a ``scale_ub`` in dynamic per-token quantisation, a
  ``group_shape`` that disagrees with the dynamic quantisation done, or
  ``num_token_padding`` beside ``output``;
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
weights, where vLLM's kernel gives finite ones. ``scaled_fp8_quant`` rounds
the exact product x * (1 / scale) once, where vLLM rounds the float32
product (or, per token, quotient) again: the two can differ by one fp8 step
on a tie. Per token, a row whose largest magnitude is below 1/512 gets the
scale absmax / fp8_max (0 for an all-zero row, whose output is 0) where
vLLM floors the scale at 1 / (fp8_max * 512).
"""
import torch as _torch

from ._common import forward as _forward, torch_op, unsupported

__all__ = ["fused_add_rms_norm", "gelu_and_mul", "gelu_tanh_and_mul", "moe_align_block_size",
           "reshape_and_cache_flash", "rms_norm", "rotary_embedding", "scaled_fp8_quant", "silu_and_mul",
           "topk_softmax"]

_rmsnorm = torch_op("layernorm.rmsnorm")
_fused_add_rmsnorm = torch_op("layernorm.fused_add_rmsnorm")
_silu_and_mul = torch_op("activation.silu_and_mul")
_gelu_and_mul = torch_op("activation.gelu_and_mul")
_gelu_tanh_and_mul = torch_op("activation.gelu_tanh_and_mul")
_rotary_embedding = torch_op("embeddings.rotary_embedding")
_topk_softmax = torch_op("moe.topk_softmax")
_moe_align_block_size = torch_op("moe.align_block_size")
_reshape_and_cache_flash = torch_op("kvcache.reshape_and_cache_flash")
_per_tensor_quant_fp8 = torch_op("quantization.per_tensor_quant_fp8")
_per_token_quant_fp8 = torch_op("quantization.per_token_quant_fp8")

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


def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox, rope_dim_offset=0, inverse=False):
    """Rotates query and key (None: query only) in place by the angles of
    cos_sin_cache[positions]; rotary_dim = cos_sin_cache.shape[1] <= head_size.

    query and key are [*, H * head_size] or [*, H, head_size], * the shape
    of positions, passed as they are with head_size to
    embeddings.rotary_embedding, which splits the flattened ones.
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
    _forward(function, _ROTARY_NAMES, _rotary_embedding, positions, query, key, cos_sin_cache, bool(is_neox),
             head_size)


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


_ALIGN_NAMES = {"topk_ids": "topk_ids", "sorted_token_ids": "sorted_token_ids", "expert_ids": "experts_ids",
                "num_tokens_post_pad": "num_tokens_post_pad"}


def moe_align_block_size(topk_ids, num_experts, block_size, sorted_token_ids, experts_ids, num_tokens_post_pad,
                         expert_map=None):
    """The routed (token, slot) pairs of topk_ids grouped by expert, each
    expert's group padded to a multiple of block_size with topk_ids.numel():
    sorted_token_ids, the expert of each block (experts_ids, -1 past the
    last block) and num_tokens_post_pad[0], all int32, written in place.

    moe.align_block_size. Within an expert the indices are in ascending
    order (vLLM's kernel leaves their order to its atomics)."""
    function = "vllm.moe_align_block_size"
    if expert_map is not None:
        raise unsupported(function, "expert_map", "expert parallelism's map is not supported; pass None (ids "
                          "outside [0, num_experts) are skipped, as vLLM skips unmapped experts)")
    _forward(function, _ALIGN_NAMES, _moe_align_block_size, topk_ids, sorted_token_ids, experts_ids,
             num_tokens_post_pad, int(num_experts), int(block_size))


_CACHE_NAMES = {n: n for n in ("key", "value", "key_cache", "value_cache", "slot_mapping", "k_scale", "v_scale")}
_FP8_CACHE = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale):
    """key_cache[s // block_size, s % block_size] = key[t] and the same for
    value, for each token t with s = slot_mapping[t] >= 0; caches
    [num_blocks, block_size, num_heads, head_size], written in place.

    kvcache.reshape_and_cache_flash. With kv_cache_dtype "auto" the caches
    hold the activation dtype (a copy); with "fp8"/"fp8_e4m3" or "fp8_e5m2"
    they hold fp8(key / k_scale) and fp8(value / v_scale), saturating,
    and may be uint8 (vLLM's storage) or the float8 dtype."""
    function = "vllm.reshape_and_cache_flash"
    if kv_cache_dtype != "auto":
        if kv_cache_dtype not in _FP8_CACHE:
            raise unsupported(function, "kv_cache_dtype", f"{kv_cache_dtype!r}: expected \"auto\", \"fp8\", "
                              "\"fp8_e4m3\" or \"fp8_e5m2\"")
        fp8 = getattr(_torch, _FP8_CACHE[kv_cache_dtype], None)
        if fp8 is None:
            raise unsupported(function, "kv_cache_dtype", f"{kv_cache_dtype!r}: this torch {_torch.__version__} "
                              "has no float8 dtypes")
        key_cache = key_cache.view(fp8) if key_cache.dtype == _torch.uint8 else key_cache
        value_cache = value_cache.view(fp8) if value_cache.dtype == _torch.uint8 else value_cache
    _forward(function, _CACHE_NAMES, _reshape_and_cache_flash, key, value, key_cache, value_cache, slot_mapping,
             k_scale, v_scale, str(kv_cache_dtype))


# The dtype scaled_fp8_quant allocates its output in: vLLM's
# current_platform.fp8_dtype() on CUDA. None where torch has no float8.
_FP8_OUTPUT = getattr(_torch, "float8_e4m3fn", None)
_QUANT_NAMES = {"input": "input", "output_q": "output", "output_s": "scale"}


def _group_shape(function, group_shape, rows, cols):
    """vLLM's (group_m, group_n), -1 meaning the whole extent, as sizes."""
    try:
        group_m, group_n = (int(g) for g in group_shape)
    except (TypeError, ValueError):
        raise unsupported(function, "group_shape", f"expected a pair of ints (-1: the whole extent), got "
                          f"{group_shape!r}") from None
    return (rows if group_m == -1 else group_m, cols if group_n == -1 else group_n)


def scaled_fp8_quant(input, scale=None, num_token_padding=None, scale_ub=None, use_per_token_if_dynamic=False,
                     output=None, group_shape=None):
    """Quantises input [M, N] to fp8; returns (output, scale).

    - ``scale`` given (static): output = fp8(input * (1 / scale)) with the
      float32 scale of one element (0-dim, [1] or [1, 1]), read on the
      device and returned as given (quantization.per_tensor_quant_fp8,
      is_static). ``group_shape`` is not read: one scale is per tensor,
      as in vLLM; a scale of more elements is refused.
    - no scale, ``use_per_token_if_dynamic`` False: scale = a new float32
      [1], absmax(input) / fp8_max (quantization.per_tensor_quant_fp8).
    - no scale, ``use_per_token_if_dynamic`` True: scale = a new float32
      [M', 1], absmax of each row / fp8_max
      (quantization.per_token_quant_fp8, given scale[:M, 0]).

    ``output`` is a new float8_e4m3fn [M', N] unless given (float8_e4m3fn
    or float8_e5m2 [M, N], or with more rows, of which the first M are
    written); M' = max(num_token_padding, M): the rows past M of the
    output and of a per-token scale are allocated and not written, as vLLM
    leaves them. input and output may be row-strided. Refused: a
    ``scale_ub`` in per-token quantisation, a ``group_shape`` other than
    the dynamic quantisation's ((-1, -1) per tensor, (1, -1) per token;
    vLLM does not read it there), ``num_token_padding`` beside ``output``."""
    function = "vllm.scaled_fp8_quant"
    if not isinstance(input, _torch.Tensor) or input.dim() != 2:
        shape = list(input.shape) if isinstance(input, _torch.Tensor) else type(input).__name__
        raise unsupported(function, "input", f"expected a 2-dim tensor [M, N] (tokens flattened), got {shape}")
    rows, cols = input.shape
    if output is not None and num_token_padding is not None:
        raise unsupported(function, "num_token_padding", "padding is not supported if output is passed in (as in "
                          "vLLM): allocate output with the padded rows instead")
    padded_rows = max(int(num_token_padding), rows) if num_token_padding else rows
    static = scale is not None
    per_token = not static and bool(use_per_token_if_dynamic)
    if static:
        if not isinstance(scale, _torch.Tensor):
            raise unsupported(function, "scale", f"expected a float32 tensor of one element, got "
                              f"{type(scale).__name__}")
        if scale.numel() != 1:
            raise unsupported(function, "scale", f"{list(scale.shape)}: static per-channel, per-token and group "
                              "scales are not supported; kdispatch's static fp8 quantiser takes one scale for "
                              "the whole tensor")
    else:
        if per_token and scale_ub is not None:
            raise unsupported(function, "scale_ub", "an upper bound of the per-token scales is not supported; "
                              "pass None")
        if group_shape is not None:
            want = (1, cols) if per_token else (rows, cols)
            if _group_shape(function, group_shape, rows, cols) != want:
                raise unsupported(function, "group_shape", f"{tuple(group_shape)} without a scale: vLLM "
                                  "quantises per tensor, or per token with use_per_token_if_dynamic, and does "
                                  "not read group_shape; kdispatch refuses one that says otherwise (groups of "
                                  "a row: kdispatch.compat.sgl_kernel.sgl_per_token_group_quant_fp8)")
    if output is None:
        if _FP8_OUTPUT is None:
            raise unsupported(function, "output", f"None: the output vLLM allocates is float8_e4m3fn, which this "
                              f"torch {_torch.__version__} has not")
        output = _torch.empty((padded_rows, cols), dtype=_FP8_OUTPUT, device=input.device)
    written = output[:rows] if output.dim() == 2 and output.shape[0] > rows else output
    if static:
        _forward(function, _QUANT_NAMES, _per_tensor_quant_fp8, input, written, scale.reshape(1), True)
    elif per_token:
        scale = _torch.empty((padded_rows, 1), dtype=_torch.float32, device=input.device)
        _forward(function, _QUANT_NAMES, _per_token_quant_fp8, input, written, scale[:rows, 0])
    else:
        scale = _torch.empty(1, dtype=_torch.float32, device=input.device)
        _forward(function, _QUANT_NAMES, _per_tensor_quant_fp8, input, written, scale, False)
    return output, scale


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    raise AttributeError(f"kdispatch.compat.vllm has no '{name}': kdispatch has no op serving vLLM's '{name}' "
                         f"(functions: {', '.join(__all__)})")
