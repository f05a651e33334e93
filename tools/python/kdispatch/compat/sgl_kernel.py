"""SGLang's ``sgl_kernel`` functions on kdispatch's torch ops.

``import kdispatch.compat.sgl_kernel as sgl_kernel`` gives the names,
signatures and in-place/out conventions of ``sgl_kernel``'s norms,
activations, rotary embedding, MoE top-k softmax and block alignment, and
fp8 quantisers (per tensor, per token, per token group); each call forwards its
tensors as they are (strides included: a column slice, q and k sliced from
a fused QKV output) to ``torch.ops.kdispatch.*``, which runs the kernel the
selection rules choose for the device. Nothing is copied or cast: an
argument the op cannot take as given raises ``kdispatch.CallError``
(KD-E030) naming the function and the argument.

``enable_pdl`` (programmatic dependent launch, a CUDA scheduling hint) is
accepted and has no effect: kdispatch launches its kernels on torch's
current stream without PDL, and the results do not depend on it.
"""
import torch as _torch

from . import _forward
from ._common import unsupported
from ._forward import call, check_enable_pdl, check_float

__all__ = [
    "apply_rope_with_cos_sin_cache_inplace",
    "fused_add_rmsnorm",
    "gelu_and_mul",
    "gelu_tanh_and_mul",
    "gemma_fused_add_rmsnorm",
    "gemma_rmsnorm",
    "moe_align_block_size",
    "rmsnorm",
    "sgl_per_tensor_quant_fp8",
    "sgl_per_token_group_quant_8bit",
    "sgl_per_token_group_quant_fp8",
    "sgl_per_token_quant_fp8",
    "silu_and_mul",
    "topk_softmax",
]

_MODULE = "sgl_kernel"

# The norms and gated activations, shared with the other peer's module.
(rmsnorm, fused_add_rmsnorm, gemma_rmsnorm, gemma_fused_add_rmsnorm, silu_and_mul, gelu_and_mul,
 gelu_tanh_and_mul) = _forward.norms_and_activations(__name__, _MODULE)


def apply_rope_with_cos_sin_cache_inplace(positions, query, key, head_size, cos_sin_cache, is_neox=True,
                                          fused_set_kv_buffer_arg=None, enable_pdl=None):
    """Rotates query [*, HQ * head_size] and key [*, HK * head_size] in place
    (returns None), * the shape of positions (int32 or int64, used as given);
    forwards them as they are, with head_size, to embeddings.rotary_embedding,
    which splits them into [*, H, head_size] views (no copy: slices of a
    fused QKV output stay strided). The rotary dim is
    cos_sin_cache.shape[-1]; the cache is float32 (or query's dtype). key
    may be None (only query is rotated). fused_set_kv_buffer_arg is refused:
    kdispatch has no fused KV-cache write."""
    function = f"{_MODULE}.apply_rope_with_cos_sin_cache_inplace"
    check_enable_pdl(function, enable_pdl)
    if fused_set_kv_buffer_arg is not None:
        raise unsupported(function, "fused_set_kv_buffer_arg",
                          "kdispatch's rotary embedding has no fused KV-cache write; pass None and write the "
                          "rotated key and the value into the cache after the call")
    _forward.rope_inplace(function, positions, query, key, head_size, cos_sin_cache, is_neox)


def topk_softmax(topk_weights, topk_ids, gating_output, renormalize=False, moe_softcapping=0.0,
                 correction_bias=None, *, token_expert_indices=None):
    """Writes the top-K experts of each row of gating_output [*, E] into
    topk_weights [*, K] (float32) and topk_ids [*, K] (int32 or int64),
    returns None; forwards to moe.topk_softmax, which follows SGLang's order:
    softcap (tanh(x / c) * c when moe_softcapping c != 0; tanh is odd, so -c
    is c), then + correction_bias (float32 [E]), then the softmax, the top K
    and, with renormalize, their division by their sum.

    Also takes sgl_kernel's earlier form topk_softmax(topk_weights, topk_ids,
    token_expert_indices, gating_output), whose third tensor (int32 [*, K])
    receives i * T + t for the i-th choice of row t of T; token_expert_indices=
    gives it in the current form."""
    function = f"{_MODULE}.topk_softmax"
    if isinstance(renormalize, _torch.Tensor):
        # The earlier form: (topk_weights, topk_ids, token_expert_indices, gating_output).
        if token_expert_indices is not None:
            raise unsupported(function, "token_expert_indices", "given twice: as the third tensor and by name")
        token_expert_indices, gating_output, renormalize = gating_output, renormalize, False
    op = "moe.topk_softmax"
    check_float(function, "gating_output", gating_output, op)
    if not isinstance(renormalize, bool):
        raise unsupported(function, "renormalize", f"expected a bool, got {renormalize!r}")
    if topk_weights.dim() > 0 and gating_output.dim() > 0 and topk_weights.shape[-1] > gating_output.shape[-1]:
        raise unsupported(function, "topk_weights", f"K = {topk_weights.shape[-1]} top experts of "
                          f"E = {gating_output.shape[-1]}: moe.topk_softmax requires K <= E")
    call(function, op,
         {"topk_weights": "topk_weights", "topk_ids": "topk_ids", "gating_output": "gating_output",
          "correction_bias": "correction_bias", "token_expert_indices": "token_expert_indices"},
         topk_weights, topk_ids, gating_output, correction_bias, token_expert_indices, renormalize,
         abs(float(moe_softcapping)))


def moe_align_block_size(topk_ids, num_experts, block_size, sorted_token_ids, experts_ids, num_tokens_post_pad,
                         cumsum_buffer=None, pad_sorted_token_ids=False):
    """Groups the routed (token, slot) pairs of topk_ids by expert, each
    group padded to a multiple of block_size with topk_ids.numel(), into
    sorted_token_ids, the expert of each block into experts_ids and the
    padded total into num_tokens_post_pad[0] (int32, in place; returns
    None); forwards to moe.align_block_size.

    Within an expert the indices are in ascending order. sorted_token_ids
    is padded to its end and experts_ids gets -1 past the last block
    whatever pad_sorted_token_ids says (sgl_kernel leaves them unwritten
    without it, and its callers read only the first num_tokens_post_pad).
    cumsum_buffer, sgl_kernel's scratch space, is accepted and left as it is."""
    function = f"{_MODULE}.moe_align_block_size"
    if not isinstance(pad_sorted_token_ids, bool):
        raise unsupported(function, "pad_sorted_token_ids", f"expected a bool, got {pad_sorted_token_ids!r}")
    call(function, "moe.align_block_size",
         {"topk_ids": "topk_ids", "sorted_token_ids": "sorted_token_ids", "expert_ids": "experts_ids",
          "num_tokens_post_pad": "num_tokens_post_pad"},
         topk_ids, sorted_token_ids, experts_ids, num_tokens_post_pad, int(num_experts), int(block_size))


_QUANT_NAMES = {"input": "input", "output_q": "output_q", "output_s": "output_s"}
# The largest finite value of each fp8 format kdispatch writes, by dtype name.
_FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}


def _check_bool(function, argument, value):
    if not isinstance(value, bool):
        raise unsupported(function, argument, f"expected a bool, got {value!r}")


def sgl_per_tensor_quant_fp8(input, output_q, output_s, is_static):
    """output_q = fp8(input * (1 / s)) for the float32 scale s in output_s
    (one element); returns None. is_static: s is read from output_s;
    otherwise s = absmax(input) / fp8_max is computed and written into
    output_s (SGLang's callers zero it first; kdispatch writes it whatever
    it held). output_q is float8_e4m3fn or float8_e5m2 of input's shape;
    input and output_q may be row-strided. Forwards to
    quantization.per_tensor_quant_fp8."""
    function = f"{_MODULE}.sgl_per_tensor_quant_fp8"
    _check_bool(function, "is_static", is_static)
    if isinstance(output_s, _torch.Tensor) and output_s.numel() == 1 and output_s.dim() != 1:
        output_s = output_s.reshape(1)  # a view: a 0-dim or [1, 1] scale is the op's [1]
    call(function, "quantization.per_tensor_quant_fp8", _QUANT_NAMES, input, output_q, output_s, is_static)


def sgl_per_token_quant_fp8(input, output_q, output_s):
    """For each row r of input [*, N]: output_s[r] = absmax(row) / fp8_max
    and output_q[r] = fp8(row * (1 / output_s[r])); returns None. output_s
    is float32 [*] or [*, 1] (SGLang's wrappers allocate [T, 1]; its
    [*] view is passed); an all-zero row gets scale 0 and output 0.
    Forwards to quantization.per_token_quant_fp8."""
    function = f"{_MODULE}.sgl_per_token_quant_fp8"
    if (isinstance(output_s, _torch.Tensor) and isinstance(input, _torch.Tensor) and input.dim() >= 1
            and output_s.dim() == input.dim() and output_s.shape[-1] == 1):
        output_s = output_s[..., 0]
    call(function, "quantization.per_token_quant_fp8", _QUANT_NAMES, input, output_q, output_s)


def _check_fp8_range(function, output_q, fp8_min, fp8_max):
    """fp8_min and fp8_max are the format's own range, -max and max of
    output_q's dtype: kdispatch saturates at the format's largest finite
    value and takes no other range."""
    if isinstance(output_q, _torch.Tensor) and not output_q.dtype.is_floating_point:
        raise unsupported(function, "output_q", f"{output_q.dtype}: kdispatch quantises to float8_e4m3fn or "
                          "float8_e5m2 only (no int8 quantiser)")
    limits = ", ".join(f"{v:g} ({k})" for k, v in _FP8_MAX.items())
    if float(fp8_max) not in _FP8_MAX.values():
        raise unsupported(function, "fp8_max", f"{fp8_max}: kdispatch saturates at the fp8 format's largest "
                          f"finite value, one of {limits}")
    if float(fp8_min) != -float(fp8_max):
        raise unsupported(function, "fp8_min", f"{fp8_min}: expected -fp8_max = {-float(fp8_max):g}")
    name = str(output_q.dtype).replace("torch.", "") if isinstance(output_q, _torch.Tensor) else ""
    if name in _FP8_MAX and float(fp8_max) != _FP8_MAX[name]:
        raise unsupported(function, "fp8_max", f"{fp8_max} with output_q in {name}, whose largest finite value "
                          f"is {_FP8_MAX[name]:g}")


def sgl_per_token_group_quant_8bit(input, output_q, output_s, group_size, eps, fp8_min, fp8_max, scale_ue8m0=False,
                                   fuse_silu_and_mul=False, masked_m=None, enable_v2=None):
    """Cuts each row of input [*, N] into G = N / group_size groups; for
    group g of row r: output_s[r, g] = max(absmax(group), eps) / fp8_max
    (rounded up to a power of two with scale_ue8m0, stored as that
    float32) and output_q = fp8(x * (1 / output_s[r, g])) over the group;
    returns None. output_s is float32 [*, G] of any strides (SGLang's
    column-major and TMA-aligned scales, buffer.t() views, included);
    SGLang's packed UE8M0 scales (int32, four exponents each) are refused.
    fp8_min and fp8_max must be the range of output_q's format (-448, 448
    for float8_e4m3fn; -57344, 57344 for float8_e5m2). enable_v2 (the
    choice of SGLang's kernel) is accepted and changes nothing; a fused
    silu_and_mul and masked_m (the masked MoE layout) are refused.
    Forwards to quantization.per_token_group_quant_fp8."""
    function = f"{_MODULE}.sgl_per_token_group_quant_8bit"
    _check_bool(function, "scale_ue8m0", scale_ue8m0)
    if fuse_silu_and_mul:
        raise unsupported(function, "fuse_silu_and_mul", "kdispatch has no fused silu_and_mul quantiser: run "
                          "silu_and_mul into a buffer of input's dtype, then quantise it")
    if masked_m is not None:
        raise unsupported(function, "masked_m", "the masked MoE layout is not supported; pass None")
    if enable_v2 is not None:
        _check_bool(function, "enable_v2", enable_v2)
    _check_fp8_range(function, output_q, fp8_min, fp8_max)
    if isinstance(output_s, _torch.Tensor) and output_s.dtype == _torch.int32:
        raise unsupported(function, "output_s", "int32: SGLang's packed UE8M0 scales (four exponent bytes in each "
                          "int32) are not supported; pass a float32 output_s [*, G], which receives each scale "
                          "rounded up to a power of two with scale_ue8m0=True")
    group_size = int(group_size)
    if (isinstance(input, _torch.Tensor) and isinstance(output_s, _torch.Tensor) and input.dim() >= 1
            and output_s.dtype == _torch.float32):
        n = input.shape[-1]
        groups = output_s.shape[-1] if output_s.dim() >= 1 else 0
        if group_size <= 0 or group_size * groups != n:
            raise unsupported(function, "group_size", f"{group_size}: expected N / G, with N = {n} (input's last "
                              f"dim) cut into G = {groups} groups (output_s's last dim)")
    call(function, "quantization.per_token_group_quant_fp8", _QUANT_NAMES, input, output_q, output_s, group_size,
         float(eps), scale_ue8m0)


# sgl_kernel's earlier name, an alias there too.
sgl_per_token_group_quant_fp8 = sgl_per_token_group_quant_8bit
