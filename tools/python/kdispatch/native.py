"""The ``torch`` backend: each op's formula in plain torch.

    import kdispatch, kdispatch.native
    kdispatch.native.register()          # backend "torch" for the ops below
    kdispatch.call("layernorm.rmsnorm", out, x, w, eps=1e-6, backend="torch")

An ordinary backend, registered at run time (``kdispatch.register_kernel``):
its kernels go through the dispatcher's checks, run wherever torch runs (the
devices of ``targets``), on torch's current stream, and are compared with the
reference backend with the op schema's tolerances like any plugin's
(``kdispatch.testing``). They compute in float32 from the stored inputs and
round once to the output's dtype, as the GPU kernels do.

By default the kernels are opt-in: installing them changes no selection. The
backend takes part when a call names it, when an op's preference or a tuned
choice names it (``kdispatch.set_preference``, ``kdispatch.tune``), or when
``KDISPATCH_BACKEND_ORDER`` lists it. ``register(opt_in=False,
priority=...)`` makes it rank by priority instead.

Ops without a formula here: the fp8 quantisers and the fp8 KV cache (a call
with an fp8 cache passes to the next backend as unsupported). While a CUDA
graph is being captured, the KV-cache write and align_block_size pass the
call on too: their torch formulas size their work by the data.
"""
import torch as _torch
import torch.nn.functional as _F

from ._errors import Unsupported
from ._runtime_kernels import register_backend as _register_backend, unregister_backend as _unregister_backend

BACKEND = "torch"


def _capturing():
    """Whether torch's current CUDA stream is capturing a graph: the checks
    that read a tensor on the host are skipped then, and the formulas whose
    output sizes depend on the data pass the call on."""
    return _torch.cuda.is_available() and _torch.cuda.is_current_stream_capturing()


def _rms(x, eps):
    """x (float32) times the reciprocal of its rows' root mean square."""
    return x * _torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)


def _rmsnorm(out, x, weight, eps):
    out.copy_(_rms(x.float(), eps) * weight.float())


def _gemma_rmsnorm(out, x, weight, eps):
    out.copy_(_rms(x.float(), eps) * (1.0 + weight.float()))


def _fused(x, residual, weight, eps, gemma, out, residual_out):
    total = x.float() + residual.float()
    w = weight.float()
    if gemma:
        w = 1.0 + w
    residual_out.copy_(total)
    out.copy_(_rms(total, eps) * w)


def _fused_add_rmsnorm(x, residual, weight, eps):
    _fused(x, residual, weight, eps, False, x, residual)


def _gemma_fused_add_rmsnorm(x, residual, weight, eps):
    _fused(x, residual, weight, eps, True, x, residual)


def _fused_add_rmsnorm_out(out, residual_out, x, residual, weight, eps):
    _fused(x, residual, weight, eps, False, out, residual_out)


def _gemma_fused_add_rmsnorm_out(out, residual_out, x, residual, weight, eps):
    _fused(x, residual, weight, eps, True, out, residual_out)


def _layernorm(out, x, weight, bias, eps):
    xf = x.float()
    centred = xf - xf.mean(dim=-1, keepdim=True)
    variance = centred.pow(2).mean(dim=-1, keepdim=True)
    out.copy_(centred * _torch.rsqrt(variance + eps) * weight.float() + bias.float())


def _gated(activation):
    def kernel(out, x):
        d = out.shape[-1]
        a = x[..., :d].float()
        out.copy_(activation(a) * x[..., d:].float())
    return kernel


def _rotate(x, cos, sin, is_neox):
    """Rotates the first 2 R values of each head of x [*, H, D] in place;
    cos and sin are [*, 1, R] float32."""
    r = cos.shape[-1]
    rot = x[..., :2 * r]
    if is_neox:
        a, b = rot[..., :r], rot[..., r:]
    else:
        a, b = rot[..., 0::2], rot[..., 1::2]
    af, bf = a.float(), b.float()
    new_a = af * cos - bf * sin
    new_b = bf * cos + af * sin
    a.copy_(new_a)
    b.copy_(new_b)


def _rotary_embedding(positions, query, key, cos_sin_cache, is_neox, head_size):
    del head_size  # the dispatcher passes query and key as [*, H, D] already
    flat = positions.reshape(-1).long()
    if flat.numel() and not _capturing() and (int(flat.min()) < 0 or int(flat.max()) >= cos_sin_cache.shape[0]):
        raise ValueError(f"a position is outside the cache [0, {cos_sin_cache.shape[0]})")
    r = cos_sin_cache.shape[-1] // 2
    rows = cos_sin_cache.index_select(0, flat).float()
    cos = rows[:, :r].reshape(*positions.shape, 1, r)
    sin = rows[:, r:].reshape(*positions.shape, 1, r)
    for x in (query, key):
        if x is not None:
            _rotate(x, cos, sin, is_neox)


def _topk_softmax(topk_weights, topk_ids, gating_output, correction_bias, token_expert_indices, renormalize,
                  moe_softcapping):
    k = topk_weights.shape[-1]
    e = gating_output.shape[-1]
    if k > e:
        raise ValueError(f"K={k} is larger than E={e}")
    x = gating_output.reshape(-1, e).float()
    if moe_softcapping > 0:
        x = _torch.tanh(x / moe_softcapping) * moe_softcapping
    if correction_bias is not None:
        x = x + correction_bias.float()
    # float64, as the reference: far logits keep distinct probabilities
    # rather than ties at 0 that would order by index.
    p = _torch.softmax(x.double(), dim=-1)
    values, order = _torch.sort(p, dim=-1, descending=True, stable=True)
    values, order = values[:, :k], order[:, :k]
    if renormalize:
        total = values.sum(dim=-1, keepdim=True)
        values = _torch.where(total > 0, values / total, values)
    topk_weights.copy_(values.reshape(topk_weights.shape))
    topk_ids.copy_(order.reshape(topk_ids.shape))
    if token_expert_indices is not None:
        rows = x.shape[0]
        index = (_torch.arange(k, device=x.device).unsqueeze(0) * rows
                 + _torch.arange(rows, device=x.device).unsqueeze(1))
        token_expert_indices.copy_(index.reshape(token_expert_indices.shape))


def _reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, kv_cache_dtype):
    del k_scale, v_scale
    if kv_cache_dtype != "auto":
        raise Unsupported(f"kv_cache_dtype '{kv_cache_dtype}': the torch backend writes caches in the "
                                     "activation dtype only")
    for cache in (key_cache, value_cache):
        if cache.dtype != key.dtype:
            raise Unsupported(f"a {cache.dtype} cache: the torch backend writes caches in the activation dtype only")
    if _capturing():
        raise Unsupported("the torch formula of the KV-cache write sizes its work by the slots' values, which a "
                          "CUDA graph cannot capture")
    slots = slot_mapping.long()
    per_slot = key_cache.shape[2:]
    cache_slots = key_cache.shape[0] * key_cache.shape[1]
    if slots.numel() and int(slots.max()) >= cache_slots:
        raise ValueError(f"a slot is beyond the caches' {cache_slots} slots")
    # Tokens in order: of several tokens with one slot, the last wins.
    index = _torch.nonzero(slots >= 0).flatten()
    if index.numel() == 0:
        return
    chosen, order = _torch.sort(slots[index], stable=True)
    index = index[order]
    last = _torch.ones_like(chosen, dtype=_torch.bool)
    last[:-1] = chosen[1:] != chosen[:-1]
    winners, targets = index[last], chosen[last]
    for src, cache in ((key, key_cache), (value, value_cache)):
        cache.view(cache_slots, *per_slot)[targets] = src[winners]


def _align_block_size(topk_ids, sorted_token_ids, expert_ids, num_tokens_post_pad, num_experts, block_size):
    if _capturing():
        raise Unsupported("the torch formula of moe.align_block_size sizes its work by the ids' values, which a "
                          "CUDA graph cannot capture")
    n = topk_ids.numel()
    e, b = num_experts, block_size
    if e < 1 or b < 1:
        raise ValueError(f"num_experts={e} and block_size={b} must be at least 1")
    worst = n + e * (b - 1)
    if sorted_token_ids.numel() < worst or expert_ids.numel() < worst // b:
        raise ValueError(f"sorted_token_ids has {sorted_token_ids.numel()} elements and expert_ids "
                         f"{expert_ids.numel()}; N + num_experts * (block_size - 1) = {worst} needs at least that "
                         f"many and {worst // b}")
    flat = topk_ids.reshape(-1).long()
    device = flat.device
    pair = _torch.arange(n, device=device)
    valid = (flat >= 0) & (flat < e)
    ids, pair = flat[valid], pair[valid]
    ids, order = _torch.sort(ids, stable=True)
    pair = pair[order]
    count = _torch.bincount(ids, minlength=e)
    padded = (count + b - 1) // b * b
    start = _torch.cumsum(padded, 0) - padded
    first = _torch.cumsum(count, 0) - count
    place = start[ids] + _torch.arange(ids.numel(), device=device) - first[ids]
    sorted_token_ids.fill_(n)
    sorted_token_ids[place] = pair.to(sorted_token_ids.dtype)
    blocks = _torch.repeat_interleave(_torch.arange(e, device=device), padded // b)
    expert_ids.fill_(-1)
    expert_ids[:blocks.numel()] = blocks.to(expert_ids.dtype)
    num_tokens_post_pad.fill_(int(padded.sum()))


KERNELS = {
    "layernorm.rmsnorm": _rmsnorm,
    "layernorm.gemma_rmsnorm": _gemma_rmsnorm,
    "layernorm.fused_add_rmsnorm": _fused_add_rmsnorm,
    "layernorm.gemma_fused_add_rmsnorm": _gemma_fused_add_rmsnorm,
    "layernorm.fused_add_rmsnorm_out": _fused_add_rmsnorm_out,
    "layernorm.gemma_fused_add_rmsnorm_out": _gemma_fused_add_rmsnorm_out,
    "layernorm.layernorm": _layernorm,
    "activation.silu_and_mul": _gated(_F.silu),
    "activation.gelu_and_mul": _gated(lambda a: _F.gelu(a)),
    "activation.gelu_tanh_and_mul": _gated(lambda a: _F.gelu(a, approximate="tanh")),
    "embeddings.rotary_embedding": _rotary_embedding,
    "moe.topk_softmax": _topk_softmax,
    "kvcache.reshape_and_cache_flash": _reshape_and_cache_flash,
    "moe.align_block_size": _align_block_size,
}


def _targets():
    targets = ["cpu"]
    if _torch.cuda.is_available():
        targets.append("rocm" if getattr(_torch.version, "hip", None) else "cuda")
    return targets


def register(ops=None, *, opt_in=True, priority=0, targets=None):
    """Registers backend "torch" for `ops` (default: every op of KERNELS
    with a schema in the current registry). Returns the ops registered."""
    return _register_backend(BACKEND, KERNELS, ops, "kdispatch.native", "plain torch", targets=targets or _targets(),
                             opt_in=opt_in, priority=priority)


def unregister(ops=None):
    """Withdraws what register() registered."""
    _unregister_backend(BACKEND, KERNELS, ops)
