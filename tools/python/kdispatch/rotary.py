"""Rotary position embedding helpers for embeddings.rotary_embedding.

``cos_sin_cache`` builds the float32 ``cos_sin_cache [max_position,
rotary_dim]`` the op takes, in the layout of SGLang's
``RotaryEmbedding._compute_cos_sin_cache``: row p holds cos(p * f_j) for
j < rotary_dim / 2, then sin(p * f_j), with f_j = base^(-2j / rotary_dim).
``cos_sin_cache_from_inv_freq`` builds it from a model's own frequencies
(transformers' ``rotary_emb.inv_freq``, which already carries any rope
scaling) and its ``attention_scaling``, which multiplies cos and sin as
transformers does.

The angles and their cos and sin are computed in float64 and rounded once
to float32 (SGLang and transformers compute them in float32, which is off
by up to about p * 2^-24 radians at position p).

``apply_rope_with_cos_sin_cache_inplace`` takes query and key flattened to
``[*, H * head_size]`` (SGLang's and FlashInfer's form) and passes them,
with ``head_size``, to ``torch.ops.kdispatch.embeddings_rotary_embedding``,
whose schema lets them come so: the core splits them into ``[*, H,
head_size]`` views (no copy; a slice of a fused QKV output stays strided).

torch is imported when a function is called, not with this module.
"""

__all__ = ["apply_rope_with_cos_sin_cache_inplace", "cos_sin_cache", "cos_sin_cache_from_inv_freq", "inv_freq"]


def inv_freq(rotary_dim, base=10000.0, device=None):
    """float64 frequencies base^(-2j / rotary_dim), j < rotary_dim / 2."""
    import torch

    _check_rotary_dim(rotary_dim)
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=device) / rotary_dim
    return 1.0 / (float(base) ** exponents)


def cos_sin_cache(rotary_dim, max_position, base=10000.0, *, attention_scaling=1.0, device=None):
    """float32 [max_position, rotary_dim]: cos then sin of p * base^(-2j / rotary_dim)."""
    return cos_sin_cache_from_inv_freq(inv_freq(rotary_dim, base, device=device), max_position,
                                       attention_scaling=attention_scaling, device=device)


def cos_sin_cache_from_inv_freq(inv_freq, max_position, *, attention_scaling=1.0, device=None):
    """float32 [max_position, 2 * len(inv_freq)]: cos(p * inv_freq[j]) * attention_scaling for
    every j, then the sines alike. ``inv_freq`` is a tensor (any float dtype, e.g. a model's
    float32 ``rotary_emb.inv_freq``) or a sequence of numbers; the cache is on ``device``, or on
    inv_freq's device when that is None."""
    import torch

    freq = torch.as_tensor(inv_freq)
    if device is None:
        device = freq.device
    freq = freq.to(device=device, dtype=torch.float64).reshape(-1)
    if int(max_position) < 0:
        raise ValueError(f"max_position must be >= 0, got {max_position}")
    positions = torch.arange(int(max_position), dtype=torch.float64, device=device)
    angles = positions[:, None] * freq[None, :]
    scale = float(attention_scaling)
    cache = torch.cat((angles.cos() * scale, angles.sin() * scale), dim=-1)
    return cache.to(torch.float32).contiguous()


def apply_rope_with_cos_sin_cache_inplace(positions, query, key, head_size, cos_sin_cache, is_neox=True,
                                          backend=None):
    """Rotates query [*, HQ * head_size] and key [*, HK * head_size] (or None) in place, the
    argument order of SGLang's sgl_kernel function of this name; * is the shape of positions.
    Query and key may also be [*, H, head_size] already. The rotary dim is
    cos_sin_cache.shape[-1] (<= head_size)."""
    import torch

    from . import torch as kdt

    head_size = int(head_size)
    if head_size <= 0:
        raise ValueError(f"head_size must be > 0, got {head_size}")
    opfn = getattr(torch.ops.kdispatch, kdt.registered["embeddings.rotary_embedding"])
    opfn(positions, query, key, cos_sin_cache, is_neox, head_size, backend)


def _check_rotary_dim(rotary_dim):
    if int(rotary_dim) <= 0 or int(rotary_dim) % 2 != 0:
        raise ValueError(f"rotary_dim must be even and > 0, got {rotary_dim}")
