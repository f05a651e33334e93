#!/usr/bin/env python3
"""kdispatch.rotary: the float32 cos_sin_cache it builds matches a float64
formula written out here (from (rotary_dim, max_position, base) and from a
model's inv_freq with an attention scaling factor), in SGLang's layout (cos
then sin); apply_rope_with_cos_sin_cache_inplace rotates q and k taken as
flattened views of a fused QKV output in place (partial rotary, key
present or absent, int32 and int64 positions) and leaves everything else
of the QKV buffer as it was; the torch op's head_size attribute takes them
flattened [*, H*D] (padded rows, odd sizes, leading dims), with results
equal to those of [*, H, D] views and of the reference backend, also on
meta tensors, and refuses bad head sizes with KD-E030."""
import math
import sys

try:
    import torch
except ImportError as e:
    print(f"SKIPPED: {e} (Debian: python3-torch)")
    sys.exit(77)

import kdispatch.rotary as rotary

failures = []


def check(ok, what):
    if not ok:
        failures.append(what)
        print("FAIL", what)


def formula(freqs, max_position, scale=1.0):
    """[max_position][2 * len(freqs)] in float64: cos then sin."""
    return [[math.cos(p * f) * scale for f in freqs] + [math.sin(p * f) * scale for f in freqs]
            for p in range(max_position)]


def max_error_in_float32_steps(cache, want):
    """The largest |cache - want| over the float32 spacing at want (1.0 = one step)."""
    worst = 0.0
    got = cache.tolist()
    for row_got, row_want in zip(got, want):
        for g, w in zip(row_got, row_want):
            step = math.ulp(max(abs(w), 2.0 ** -126)) * 2.0 ** 29  # float64 ulp -> float32 ulp
            worst = max(worst, abs(g - w) / step)
    return worst


def test_cache_from_base():
    for rotary_dim, max_position, base in [(128, 257, 10000.0), (64, 100, 500000.0), (2, 5, 10000.0),
                                           (30, 33, 1000000.0)]:
        cache = rotary.cos_sin_cache(rotary_dim, max_position, base)
        check(cache.dtype == torch.float32, f"cache dtype {cache.dtype}")
        check(list(cache.shape) == [max_position, rotary_dim], f"cache shape {list(cache.shape)}")
        check(cache.is_contiguous(), "cache is contiguous")
        freqs = [base ** (-(2.0 * j) / rotary_dim) for j in range(rotary_dim // 2)]
        err = max_error_in_float32_steps(cache, formula(freqs, max_position))
        # Rounded once from float64: half a step, plus float64's own error.
        check(err <= 0.5001, f"cos_sin_cache({rotary_dim}, {max_position}, {base}): {err} float32 steps off")


def test_cache_from_inv_freq():
    # A model's float32 inv_freq (e.g. with rope scaling applied) and transformers' attention_scaling.
    rotary_dim = 64
    inv = (1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)))
    inv = (inv / torch.linspace(1.0, 8.0, rotary_dim // 2, dtype=torch.float64)).to(torch.float32)
    for scale in (1.0, 1.1386):
        cache = rotary.cos_sin_cache_from_inv_freq(inv, 300, attention_scaling=scale)
        check(cache.dtype == torch.float32 and list(cache.shape) == [300, rotary_dim],
              f"from inv_freq: {cache.dtype} {list(cache.shape)}")
        err = max_error_in_float32_steps(cache, formula([float(f) for f in inv.tolist()], 300, scale))
        check(err <= 0.5001, f"cos_sin_cache_from_inv_freq(scale={scale}): {err} float32 steps off")
    # A plain sequence works too, and matches the tensor form.
    seq = rotary.cos_sin_cache_from_inv_freq([1.0, 0.5, 0.25], 7)
    check(torch.equal(seq, rotary.cos_sin_cache_from_inv_freq(torch.tensor([1.0, 0.5, 0.25]), 7)),
          "inv_freq as a list and as a tensor agree")
    # Layout: the sin half of row p is cos shifted by a quarter turn.
    check(abs(float(seq[3, 3]) - math.sin(3.0)) < 1e-7 and abs(float(seq[3, 0]) - math.cos(3.0)) < 1e-7,
          "cos first, then sin")
    for bad in (0, 3, -2):
        try:
            rotary.cos_sin_cache(bad, 4)
            check(False, f"rotary_dim {bad} refused")
        except ValueError:
            pass


def rope_float64(x, positions, cache, is_neox):
    """x [T, H, D] rotated over its first cache.shape[-1] values, in float64."""
    x = x.to(torch.float64).clone()
    half = cache.shape[-1] // 2
    cs = cache.to(torch.float64)[positions.long()]
    cos = cs[:, None, :half]
    sin = cs[:, None, half:]
    if is_neox:
        a = x[..., :half].clone()
        b = x[..., half:2 * half].clone()
        x[..., :half] = a * cos - b * sin
        x[..., half:2 * half] = b * cos + a * sin
    else:
        a = x[..., 0:2 * half:2].clone()
        b = x[..., 1:2 * half:2].clone()
        x[..., 0:2 * half:2] = a * cos - b * sin
        x[..., 1:2 * half:2] = b * cos + a * sin
    return x


def key_may_be_absent():
    """Whether the torch op takes key=None (its torch schema marks key optional)."""
    import kdispatch
    import kdispatch.torch as kdt

    return "? key" in kdt.torch_schema(kdispatch.schema("embeddings.rotary_embedding"))


def test_flattened_views():
    torch.manual_seed(0)
    key_options = (True, False) if key_may_be_absent() else (True,)
    if key_options == (True,):
        print("SKIPPED key=None: the torch op's schema has no optional key (kdispatch.torch)")
    tokens, hq, hk, head_size, rotary_dim, max_position = 11, 4, 2, 64, 32, 50
    cache = rotary.cos_sin_cache(rotary_dim, max_position)
    for dtype, atol in ((torch.float32, 1e-5), (torch.bfloat16, 0.05)):
        for is_neox in (True, False):
            for pos_dtype in (torch.int64, torch.int32):
                for with_key in key_options:
                    qkv = torch.randn(tokens, (hq + 2 * hk) * head_size).to(dtype)
                    before = qkv.clone()
                    positions = torch.randint(0, max_position, (tokens,), dtype=pos_dtype)
                    q = qkv[:, :hq * head_size]
                    k = qkv[:, hq * head_size:(hq + hk) * head_size]
                    rotary.apply_rope_with_cos_sin_cache_inplace(positions, q, k if with_key else None, head_size,
                                                                 cache, is_neox)
                    what = f"{dtype} neox={is_neox} {pos_dtype} key={with_key}"
                    want_q = rope_float64(before[:, :hq * head_size].view(tokens, hq, head_size), positions, cache,
                                          is_neox)
                    got_q = qkv[:, :hq * head_size].view(tokens, hq, head_size).to(torch.float64)
                    check(torch.allclose(got_q, want_q, rtol=0.02, atol=atol), f"{what}: query")
                    k_view = (slice(None), slice(hq * head_size, (hq + hk) * head_size))
                    if with_key:
                        want_k = rope_float64(before[k_view].view(tokens, hk, head_size), positions, cache, is_neox)
                        got_k = qkv[k_view].view(tokens, hk, head_size).to(torch.float64)
                        check(torch.allclose(got_k, want_k, rtol=0.02, atol=atol), f"{what}: key")
                    else:
                        check(torch.equal(qkv[k_view], before[k_view]), f"{what}: absent key left alone")
                    # The tail of every head past rotary_dim, and v, are untouched.
                    tail_q = qkv[:, :hq * head_size].view(tokens, hq, head_size)[..., rotary_dim:]
                    check(torch.equal(tail_q, before[:, :hq * head_size].view(tokens, hq, head_size)[..., rotary_dim:]),
                          f"{what}: query tail untouched")
                    v = slice((hq + hk) * head_size, None)
                    check(torch.equal(qkv[:, v], before[:, v]), f"{what}: v untouched")


def fused_qkv(lead, hq, hk, head_size, dtype, pad, seed):
    """A fused QKV output [*lead, (hq + 2 * hk) * head_size] of random values,
    its rows `pad` values apart beyond that (a view of a wider buffer)."""
    g = torch.Generator().manual_seed(seed)
    width = (hq + 2 * hk) * head_size
    buffer = (torch.rand(*lead, width + pad, generator=g, dtype=torch.float64) * 4 - 2).to(dtype)
    return buffer[..., :width]


def test_head_size_attribute():
    """The torch op with head_size: query and key flattened [*, H*D] (column
    slices of a fused QKV output, rows padded), rotated in place exactly as
    their [*, H, D] views are with head_size 0, and within tolerance of the
    reference backend on the same flattened call and of a float64 formula;
    also through kdispatch.call, on meta tensors, and in the functional form."""
    import kdispatch
    import kdispatch.testing as kt
    import kdispatch.torch as kdt

    op = "embeddings.rotary_embedding"
    opfn = getattr(torch.ops.kdispatch, kdt.registered[op])
    check("int head_size=0" in kdt.torch_schema(kdispatch.schema(op)), "the torch op takes head_size")
    key_options = (True, False) if key_may_be_absent() else (True,)
    # lead dims, HQ, HK, head_size, rotary_dim, max_position, row pad
    sizes = [([1], 1, 1, 2, 2, 3, 0), ([7], 3, 1, 19, 14, 97, 3), ([33], 4, 2, 64, 32, 300, 5),
             ([2, 5], 2, 2, 128, 128, 17, 1)]
    seed = 0
    for lead, hq, hk, head_size, rotary_dim, max_position, pad in sizes:
        cache = rotary.cos_sin_cache(rotary_dim, max_position)
        for dtype in (torch.float32, torch.bfloat16):
            for is_neox in (True, False):
                for with_key in key_options:
                    seed += 1
                    what = f"lead={lead} HQ={hq} HK={hk} D={head_size} R2={rotary_dim} {dtype} neox={is_neox} " \
                           f"key={with_key}"
                    g = torch.Generator().manual_seed(seed)
                    positions = torch.randint(0, max_position, lead, generator=g)
                    qkv = fused_qkv(lead, hq, hk, head_size, dtype, pad, seed)
                    before = qkv.clone()
                    plain = qkv.clone()
                    q = qkv[..., :hq * head_size]
                    k = qkv[..., hq * head_size:(hq + hk) * head_size] if with_key else None
                    check(q.stride()[-2] == qkv.shape[-1] + pad, f"{what}: query is a strided column slice")
                    inputs = [positions, q.clone(), None if k is None else k.clone(), cache]
                    opfn(positions, q, k, cache, is_neox, head_size)
                    # The same call on [*, H, D] views, head_size 0.
                    pq = plain[..., :hq * head_size].view(*lead, hq, head_size)
                    pk = plain[..., hq * head_size:(hq + hk) * head_size].view(*lead, hk, head_size) \
                        if with_key else None
                    opfn(positions, pq, pk, cache, is_neox)
                    check(torch.equal(qkv, plain), f"{what}: flattened and [*, H, D] give the same bits")
                    # The reference backend on the flattened call.
                    verdict = kt.check(op, [positions, q, k, cache], inputs, {"is_neox": is_neox,
                                                                              "head_size": head_size})
                    check(verdict.ok, f"{what}: against the reference: {verdict.first_mismatch}")
                    # A float64 formula of the rotation.
                    flat_lead = positions.numel()
                    want_q = rope_float64(before[..., :hq * head_size].reshape(flat_lead, hq, head_size),
                                          positions.reshape(-1), cache, is_neox)
                    got_q = qkv[..., :hq * head_size].reshape(flat_lead, hq, head_size).to(torch.float64)
                    atol = 1e-5 if dtype == torch.float32 else 0.05
                    check(torch.allclose(got_q, want_q, rtol=0.02, atol=atol), f"{what}: query formula")
                    v = slice((hq + hk) * head_size, None)
                    check(torch.equal(qkv[..., v], before[..., v]), f"{what}: v untouched")
                    if not with_key:
                        kv = slice(hq * head_size, (hq + hk) * head_size)
                        check(torch.equal(qkv[..., kv], before[..., kv]), f"{what}: absent key untouched")
    # kdispatch.call with torch tensors, and one query flattened beside a [*, H, D] key.
    lead, hq, hk, head_size = [5], 3, 2, 16
    cache = rotary.cos_sin_cache(8, 9)
    positions = torch.arange(5) % 9
    qkv = fused_qkv(lead, hq, hk, head_size, torch.float32, 2, 99)
    a, b = qkv.clone(), qkv.clone()
    kdispatch.call(op, positions, a[:, :hq * head_size], a[:, hq * head_size:(hq + hk) * head_size], cache,
                   head_size=head_size, is_neox=False)
    opfn(positions, b[:, :hq * head_size], b[:, hq * head_size:(hq + hk) * head_size].view(5, hk, head_size), cache,
         False, head_size)
    c = qkv.clone()
    opfn(positions, c[:, :hq * head_size].view(5, hq, head_size),
         c[:, hq * head_size:(hq + hk) * head_size].view(5, hk, head_size), cache, False)
    check(torch.equal(a, c) and torch.equal(b, c), "kdispatch.call and a mixed call agree with [*, H, D]")
    # Meta tensors: the fake implementation checks the split call as a call
    # does, and the functional form returns tensors of the shapes given.
    mq = qkv[:, :hq * head_size].to("meta")
    mk = qkv[:, hq * head_size:(hq + hk) * head_size].to("meta")
    opfn(positions.to("meta"), mq, mk, cache.to("meta"), True, head_size)
    refused(lambda: opfn(positions.to("meta"), mq, mk, cache.to("meta"), True, 5),
            "'query': is given flattened, shape [5, 48]: its last dim 48 must be a multiple of head_size = 5")
    out_q, out_k = kdt.embeddings.rotary_embedding(positions.to("meta"), mq, mk, cache.to("meta"),
                                                    head_size=head_size)
    check(out_q.shape == mq.shape and out_k.shape == mk.shape, "functional form on meta: shapes as given")
    out_q, out_k = kdt.embeddings.rotary_embedding(positions, qkv[:, :hq * head_size],
                                                    qkv[:, hq * head_size:(hq + hk) * head_size], cache,
                                                    head_size=head_size, is_neox=False)
    check(torch.equal(out_q, c[:, :hq * head_size]) and torch.equal(out_k, c[:, hq * head_size:(hq + hk) * head_size]),
          "functional form with head_size")
    if hasattr(torch, "compile"):
        def step(p, q, k):
            opfn(p, q, k, cache, False, head_size)
            return q * 1

        d = qkv.clone()
        compiled = torch.compile(step, fullgraph=True)(positions, d[:, :hq * head_size],
                                                       d[:, hq * head_size:(hq + hk) * head_size])
        check(torch.equal(compiled, c[:, :hq * head_size]), "torch.compile(fullgraph=True) with head_size")
    else:
        print("SKIPPED torch.compile: this torch has none")
    # Bad head_size: KD-E030 naming the argument and the numbers, nothing written.
    q = qkv[:, :hq * head_size]
    k = qkv[:, hq * head_size:(hq + hk) * head_size]
    snapshot = qkv.clone()
    refused(lambda: opfn(positions, q, k, cache, True, 7),
            "'query': is given flattened, shape [5, 48]: its last dim 48 must be a multiple of head_size = 7")
    refused(lambda: opfn(positions, q, k, cache, True, 12),
            "'key': is given flattened, shape [5, 32]: its last dim 32 must be a multiple of head_size = 12")
    refused(lambda: opfn(positions, q, k, cache, True, -16), "attribute 'head_size': must be >= 0")
    refused(lambda: opfn(positions, q.view(5, hq, head_size), k, cache, True, 8),
            "'query': has the shape [5, 3, 16] of its pattern [*, HQ, D], so its last dim must be head_size = 8, "
            "got 16")
    refused(lambda: opfn(positions, q.view(5, 1, hq, head_size), k, cache, True, head_size),
            "with head_size = 16, expected [*, HQ*D] (flattened) or [*, HQ, D]")
    refused(lambda: opfn(positions, q, k, cache, True, 2),
            "given flattened: 'query' [5, 48] split by head_size = 2 into [5, 24, 2]")
    check(torch.equal(qkv, snapshot), "refused calls wrote nothing")


def refused(fn, part):
    from kdispatch import CallError

    try:
        fn()
    except CallError as e:
        check(e.code == "KD-E030" and part in str(e), f"refusal lacks '{part}': [{e.code}] {e}")
        return
    except RuntimeError as e:  # torch's wrapping of the fake implementation's error
        check("KD-E030" in str(e) and part in str(e), f"refusal lacks '{part}': {e}")
        return
    check(False, f"accepted, expected a refusal with '{part}'")


def main():
    test_cache_from_base()
    test_cache_from_inv_freq()
    if "--helpers-only" not in sys.argv:
        test_flattened_views()
        test_head_size_attribute()
    if failures:
        print(f"{len(failures)} failures")
        return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
