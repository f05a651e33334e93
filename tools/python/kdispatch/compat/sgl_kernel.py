"""SGLang's ``sgl_kernel`` functions on kdispatch's torch ops.

``import kdispatch.compat.sgl_kernel as sgl_kernel`` gives the names,
signatures and in-place/out conventions of ``sgl_kernel``'s norms,
activations, rotary embedding, MoE top-k softmax and block alignment; each call forwards its
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
