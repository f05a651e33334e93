#!/usr/bin/env python3
"""kdispatch.compat.vllm, on the CPU:

- every function, in bfloat16, float16 and float32 with odd sizes and random
  inputs, against the same kdispatch op run by the reference backend (the
  schema's tolerances) and against vLLM's formula written in plain torch
  with vLLM's roundings (within the documented difference: kdispatch rounds
  once where vLLM's kernels round intermediate values);
- row-strided views (column slices, q and k sliced from a fused QKV output)
  written in place: same storage, the values of a contiguous call, the
  rest of the buffer untouched;
- moe_align_block_size and reshape_and_cache_flash (the cache halves of
  one fused buffer, key and value views into a QKV output; an fp8 cache in
  vLLM's uint8 storage where torch has float8 dtypes) exactly as the
  reference backend and vLLM's formula;
- vLLM's signatures (names, order, defaults) and in-place/out conventions
  (what is written, what is only read, None returned);
- scaled_fp8_quant, where torch has float8 dtypes: static, dynamic per
  tensor and per token, against the reference backend (bit for bit) and
  vLLM's formulas (within one fp8 step), padded rows, a given output (with
  more rows, row-strided, poisoned), strided input; everywhere, what reaches
  the kdispatch op and what is returned, with the op replaced by a recorder;
- every refusal: kdispatch.CallError KD-E030 naming the function and vLLM's
  name of the argument (a strided or mis-sized top-k output among them;
  scaled_fp8_quant's before any fp8 tensor is made, so they run on a torch
  without float8 too);
- the parametrisations of vLLM's own kernel tests (tests/kernels/core/
  test_layernorm.py, test_activation.py, test_pos_encoding.py,
  test_rotary_embedding.py, tests/kernels/moe/test_fused_topk.py,
  tests/kernels/quantization/test_fp8_quant.py) run through this module,
  with a line per file: how many cases pass at vLLM's own tolerance, and
  which do not and why. Cases of the seq_len 8192 rotary
  test run with 512 tokens, layernorm's and fp8_quant's 4096-token cases
  with 256 and test_fp8_quant_large's 1024000 tokens with 2048, unless
  --full is given.

Exits 77 without torch."""
import argparse
import itertools
import sys
import time

try:
    import torch
except ImportError as e:
    print(f"SKIPPED: {e} (Debian: python3-torch)")
    sys.exit(77)

import kdispatch
import kdispatch.testing as kt
import kdispatch.compat.vllm as ops
from fp8_codes import codes, fp8_apart

KD = torch.ops.kdispatch
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# How far vLLM's roundings of intermediate values put its result from
# kdispatch's (rounded once), in steps of the output dtype: one step, and a
# half for a result near a power of two, whose step below is half the one
# above; in float32 also the differences of exp, erf and tanh.
VLLM_STEPS = {torch.bfloat16: 1.5, torch.float16: 1.5, torch.float32: 4}
# The absolute difference the op schemas allow beside their ulps.
ATOL = {torch.bfloat16: 1e-5, torch.float16: 1e-5, torch.float32: 1e-6}

passed = 0
failures = []


def check(ok, what):
    global passed
    if ok:
        passed += 1
    else:
        failures.append(what)
        print("FAIL", what)


def randn(shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float32) * scale).to(dtype)


def steps(got, want, dtype):
    """The largest |got - want| in steps of `dtype` at want, an absolute
    difference up to the op schemas' atol counting as none (near zero the
    steps of the dtype shrink far below what either side resolves)."""
    if got.numel() == 0:
        return 0.0
    g, w = got.double(), want.double()
    fi = torch.finfo(dtype)
    step = torch.exp2(torch.floor(torch.log2(w.abs().clamp(min=fi.tiny)))) * fi.eps
    diff = ((g - w).abs() - ATOL[dtype]).clamp(min=0)
    return float((diff / step).max())


def matches_reference(op, got, want):
    verdict = kt.compare(op, got, want)
    return verdict.ok, getattr(verdict, "first_mismatch", "")


def refused(fn, function, argument):
    """fn() raises KD-E030 naming `function` and `argument`."""
    try:
        fn()
    except kdispatch.CallError as e:
        ok = e.code == "KD-E030" and f"vllm.{function}" in e.message and f"argument '{argument}'" in e.message
        check(ok, f"{function}: refusal of {argument}: {e}")
        return
    check(False, f"{function}: {argument} was accepted")


# ---- vLLM's formulas, with the roundings of its CUDA kernels ----

def vllm_rms_norm(x, weight, eps):
    xf = x.float()
    s = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * s).to(x.dtype) * weight


def vllm_fused_add_rms_norm(x, residual, weight, eps):
    r = x + residual  # rounded to the dtype
    return vllm_rms_norm(r, weight, eps), r


ACTS = {
    "silu_and_mul": (ops.silu_and_mul, "activation.silu_and_mul", torch.nn.functional.silu),
    "gelu_and_mul": (ops.gelu_and_mul, "activation.gelu_and_mul", lambda a: torch.nn.functional.gelu(a)),
    "gelu_tanh_and_mul": (ops.gelu_tanh_and_mul, "activation.gelu_tanh_and_mul",
                          lambda a: torch.nn.functional.gelu(a, approximate="tanh")),
}


def vllm_act_and_mul(act, x):
    """act(x1) rounded to x's dtype, times x2. The activation is evaluated in
    float64: torch's float32 CPU activations are not correctly rounded (on
    torch 2.11 gelu's is up to 1e-5 off), and that is torch's error, not the
    formula's."""
    d = x.shape[-1] // 2
    return act(x[..., :d].double()).to(x.dtype) * x[..., d:]


def vllm_cos_sin_cache(rotary_dim, max_position, base=10000.0):
    """vLLM's RotaryEmbedding cache, float32: cos then sin."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
    freqs = torch.arange(max_position, dtype=torch.float)[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def vllm_rotary(positions, x, head_size, cache, is_neox, exact=False):
    """x [*, H * head_size] or [*, H, head_size] rotated in x's dtype, each
    product rounded (exact: in float64, from the same cache values); also
    returns the bound of vLLM's rounding error (one step of the dtype at
    each product and at the result)."""
    shape, dtype = x.shape, x.dtype
    x = x.reshape(*positions.shape, -1, head_size)
    rot = cache.shape[-1]
    cs = cache[positions].to(x.dtype)
    if exact:
        x, cs = x.double(), cs.double()
    cos, sin = cs[..., None, : rot // 2], cs[..., None, rot // 2:]
    xr = x[..., :rot]
    if is_neox:
        a, b = xr[..., : rot // 2], xr[..., rot // 2:]
    else:
        a, b = xr[..., 0::2], xr[..., 1::2]
    o1, o2 = a * cos - b * sin, b * cos + a * sin
    bound1 = a.double().abs() * cos.double().abs() + b.double().abs() * sin.double().abs()
    bound2 = b.double().abs() * cos.double().abs() + a.double().abs() * sin.double().abs()
    if is_neox:
        out_rot, bound = torch.cat((o1, o2), -1), torch.cat((bound1, bound2), -1)
    else:
        out_rot = torch.stack((o1, o2), -1).flatten(-2)
        bound = torch.stack((bound1, bound2), -1).flatten(-2)
    out = torch.cat((out_rot, x[..., rot:]), -1)
    eps = torch.finfo(dtype).eps
    bound = torch.cat((bound * eps, torch.zeros_like(x[..., rot:], dtype=torch.double)), -1)
    bound = bound + out.double().abs() * eps
    return out.reshape(shape), bound.reshape(shape)


def within(got, want, bound):
    return bool(((got.double() - want.double()).abs() <= bound).all())


def vllm_topk_softmax(gating, k, renormalize):
    p = torch.softmax(gating.float(), dim=-1)
    w, ids = torch.topk(p, k, dim=-1)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w, ids


# ---- the functions, one by one ----

NORM_SIZES = [(1, 1), (7, 7), (33, 67), (3, 4097), (5, 130)]


def test_rms_norm():
    for dtype, (t, h), wdtype in itertools.product(DTYPES, NORM_SIZES, ["same", torch.float32]):
        wd = dtype if wdtype == "same" else wdtype
        x = randn([t, h], dtype, 1)
        w = (1 + randn([h], torch.float32, 2, 0.1)).to(wd)
        x0 = x.clone()
        out = torch.full_like(x, float("nan"))
        check(ops.rms_norm(out, x, w, 1e-6) is None, "rms_norm returns None")
        check(torch.equal(x, x0), f"rms_norm leaves input as it was ({dtype}, {t}x{h})")
        ref = torch.full_like(x, float("nan"))
        KD.layernorm_rmsnorm(ref, x, w, 1e-6, backend="reference")
        ok, why = matches_reference("layernorm.rmsnorm", [out, x, w], [ref, x, w])
        check(ok, f"rms_norm {dtype} {t}x{h} weight {wd} against the reference: {why}")
        if wd == dtype:
            s = steps(out, vllm_rms_norm(x, w, 1e-6), dtype)
            check(s <= VLLM_STEPS[dtype], f"rms_norm {dtype} {t}x{h}: {s} steps from vLLM's formula")
    # Row-strided input and output: column slices, written in place.
    for dtype in DTYPES:
        t, h = 9, 67
        x_base = randn([t, h + 5], dtype, 3)
        x = x_base[:, :h]
        w = (1 + randn([h], torch.float32, 4, 0.1)).to(dtype)
        out_base = torch.full([t, h + 3], 7.0, dtype=dtype)
        out = out_base[:, 2:2 + h]
        ptr = out.data_ptr()
        ops.rms_norm(out, x, w, 1e-5)
        want = torch.empty(t, h, dtype=dtype)
        ops.rms_norm(want, x.contiguous(), w, 1e-5)
        check(out.data_ptr() == ptr and torch.equal(out, want), f"rms_norm {dtype}: strided out and input")
        check(bool((out_base[:, :2] == 7).all() and (out_base[:, 2 + h:] == 7).all()),
              f"rms_norm {dtype}: columns beside the strided out untouched")


def test_fused_add_rms_norm():
    for dtype, (t, h), wdtype in itertools.product(DTYPES, NORM_SIZES, ["same", torch.float32]):
        wd = dtype if wdtype == "same" else wdtype
        x = randn([t, h], dtype, 5)
        r = randn([t, h], dtype, 6)
        w = (1 + randn([h], torch.float32, 7, 0.1)).to(wd)
        want_x, want_r = vllm_fused_add_rms_norm(x, r, w, 1e-6)
        # The reference: the fused op for the residual, then the norm of the rounded residual.
        rx, rr = x.clone(), r.clone()
        KD.layernorm_fused_add_rmsnorm(rx, rr, w, 1e-6, backend="reference")
        ref_x = torch.full_like(x, float("nan"))
        KD.layernorm_rmsnorm(ref_x, rr, w, 1e-6, backend="reference")
        check(ops.fused_add_rms_norm(x, r, w, 1e-6) is None, "fused_add_rms_norm returns None")
        check(torch.equal(r, want_r), f"fused_add_rms_norm {dtype} {t}x{h}: residual = input + residual, rounded")
        check(torch.equal(r, rr), f"fused_add_rms_norm {dtype} {t}x{h}: residual as the reference's")
        ok, why = matches_reference("layernorm.rmsnorm", [x, r, w], [ref_x, r, w])
        check(ok, f"fused_add_rms_norm {dtype} {t}x{h} weight {wd}: input against the reference norm of the "
              f"rounded residual: {why}")
        if wd == dtype:
            s = steps(x, want_x, dtype)
            check(s <= VLLM_STEPS[dtype], f"fused_add_rms_norm {dtype} {t}x{h}: {s} steps from vLLM's formula")
    # Strided input and residual, updated in place.
    for dtype in DTYPES:
        t, h = 6, 130
        xb, rb = randn([t, h + 6], dtype, 8), randn([t, h + 2], dtype, 9)
        x, r = xb[:, 3:3 + h], rb[:, :h]
        xc, rc = x.clone(), r.clone()
        w = (1 + randn([h], torch.float32, 10, 0.1)).to(dtype)
        edges = (xb[:, :3].clone(), xb[:, 3 + h:].clone(), rb[:, h:].clone())
        ptrs = (x.data_ptr(), r.data_ptr())
        ops.fused_add_rms_norm(x, r, w, 1e-6)
        ops.fused_add_rms_norm(xc, rc, w, 1e-6)
        check((x.data_ptr(), r.data_ptr()) == ptrs and torch.equal(x, xc) and torch.equal(r, rc),
              f"fused_add_rms_norm {dtype}: strided input and residual updated in place")
        check(torch.equal(xb[:, :3], edges[0]) and torch.equal(xb[:, 3 + h:], edges[1])
              and torch.equal(rb[:, h:], edges[2]), f"fused_add_rms_norm {dtype}: columns beside untouched")


def test_activations():
    for (name, (fn, op, act)), dtype, (t, d) in itertools.product(ACTS.items(), DTYPES,
                                                                  [(1, 1), (3, 7), (33, 64), (2, 4097)]):
        x = randn([t, 2 * d], dtype, 11, 3.0)
        x0 = x.clone()
        out = torch.full([t, d], float("nan"), dtype=dtype)
        check(fn(out, x) is None and torch.equal(x, x0), f"{name}: returns None, input only read")
        ref = torch.full_like(out, float("nan"))
        getattr(KD, op.replace(".", "_"))(ref, x, backend="reference")
        ok, why = matches_reference(op, [out, x], [ref, x])
        check(ok, f"{name} {dtype} {t}x{d} against the reference: {why}")
        s = steps(out, vllm_act_and_mul(act, x), dtype)
        check(s <= VLLM_STEPS[dtype], f"{name} {dtype} {t}x{d}: {s} steps from vLLM's formula")
    # A column slice of a wider input into a column slice of a wider output.
    for name, (fn, op, act) in ACTS.items():
        t, d = 5, 33
        xb = randn([t, 2 * d + 4], torch.bfloat16, 12)
        ob = torch.full([t, d + 1], 5.0, dtype=torch.bfloat16)
        x, out = xb[:, 4:], ob[:, 1:]
        ptr = out.data_ptr()
        fn(out, x)
        want = torch.empty(t, d, dtype=torch.bfloat16)
        fn(want, x.contiguous())
        check(out.data_ptr() == ptr and torch.equal(out, want) and bool((ob[:, 0] == 5).all()),
              f"{name}: strided input and out")


ROTARY_SIZES = [  # tokens, HQ, HK, head_size, rotary_dim, max_position
    (1, 1, 1, 2, 2, 5), (7, 3, 1, 19, 14, 97), (33, 4, 2, 128, 64, 300), (5, 5, 3, 80, 24, 17)]


def test_rotary_embedding():
    for dtype, (t, hq, hk, d, rot, p), is_neox, cache_dtype, flat in itertools.product(
            DTYPES, ROTARY_SIZES, [True, False], ["same", torch.float32], [True, False]):
        cd = dtype if cache_dtype == "same" else cache_dtype
        cache = vllm_cos_sin_cache(rot, p).to(cd)
        g = torch.Generator().manual_seed(t + d)
        pos = torch.randint(0, p, (t,), generator=g)
        q3, k3 = randn([t, hq, d], dtype, 13), randn([t, hk, d], dtype, 14)
        q = q3.reshape(t, hq * d).clone() if flat else q3.clone()
        k = k3.reshape(t, hk * d).clone() if flat else k3.clone()
        want_q, bound_q = vllm_rotary(pos, q3.to(cd), d, cache, is_neox) if cd == dtype else (None, None)
        rq, rk = q3.clone(), k3.clone()
        KD.embeddings_rotary_embedding(pos, rq, rk, cache, is_neox, backend="reference")
        check(ops.rotary_embedding(pos, q, k, d, cache, is_neox) is None, "rotary_embedding returns None")
        qv, kv = q.view(t, hq, d), k.view(t, hk, d)
        ok, why = matches_reference("embeddings.rotary_embedding", [pos, qv, kv, cache], [pos, rq, rk, cache])
        what = f"rotary {dtype} {t},{hq},{hk},{d},{rot} neox={is_neox} cache {cd} flat={flat}"
        check(ok, f"{what} against the reference: {why}")
        if want_q is not None:
            check(within(qv, want_q, bound_q), f"{what}: query beyond vLLM's rounding of its formula")
        # key None: query only.
        q2 = q3.clone()
        ops.rotary_embedding(pos, q2, None, d, cache, is_neox)
        check(torch.equal(q2, qv), f"{what}: key=None rotates query alike")
    # q and k sliced from a fused QKV output ([T, (HQ + 2 HK) * D]), flattened, and positions [B, S].
    for dtype in DTYPES:
        b, s, hq, hk, d, rot, p = 2, 5, 4, 2, 64, 32, 50
        qkv = randn([b, s, (hq + 2 * hk) * d], dtype, 15)
        before = qkv.clone()
        q, k = qkv[..., : hq * d], qkv[..., hq * d:(hq + hk) * d]
        pos = torch.randint(0, p, (b, s), generator=torch.Generator().manual_seed(16))
        cache = vllm_cos_sin_cache(rot, p)
        ptr = qkv.data_ptr()
        ops.rotary_embedding(pos, q, k, d, cache, True)
        qc, kc = before[..., : hq * d].clone(), before[..., hq * d:(hq + hk) * d].clone()
        ops.rotary_embedding(pos, qc, kc, d, cache, True)
        check(qkv.data_ptr() == ptr and torch.equal(q, qc) and torch.equal(k, kc),
              f"rotary {dtype}: q and k of a fused QKV rotated in place")
        check(torch.equal(qkv[..., (hq + hk) * d:], before[..., (hq + hk) * d:]), f"rotary {dtype}: v untouched")


def test_topk_softmax():
    for dtype, (t, e, k), renormalize, ids_dtype in itertools.product(
            DTYPES, [(1, 1, 1), (7, 7, 3), (33, 64, 6), (5, 256, 8), (3, 1000, 4)], [False, True],
            [torch.int32, torch.int64]):
        # Logits a multiple of 1/64 apart: distinct up to 256 experts, ties beyond in bfloat16.
        g = torch.Generator().manual_seed(t * e)
        gating = torch.stack([(torch.randperm(e, generator=g) - e // 2).float() / 64 for _ in range(t)])
        gating = gating.to(dtype)
        w = torch.full([t, k], float("nan"))
        ids = torch.full([t, k], -1, dtype=ids_dtype)
        tei = torch.full([t, k], -1, dtype=torch.int32)
        check(ops.topk_softmax(w, ids, tei, gating, renormalize) is None, "topk_softmax returns None")
        rw, rids, rtei = torch.empty_like(w), torch.empty_like(ids), torch.empty_like(tei)
        KD.moe_topk_softmax(rw, rids, gating, None, rtei, renormalize, 0.0, backend="reference")
        ok, why = matches_reference("moe.topk_softmax", [w, ids, gating, None, tei], [rw, rids, gating, None, rtei])
        what = f"topk_softmax {dtype} {t}x{e} k={k} renormalize={renormalize} ids {ids_dtype}"
        check(ok, f"{what} against the reference: {why}")
        want_w, want_ids = vllm_topk_softmax(gating, k, renormalize)
        p = torch.softmax(gating.float(), -1)
        same = torch.equal(ids.long(), want_ids) or torch.equal(p.gather(1, ids.long()), p.gather(1, want_ids))
        check(same, f"{what}: ids as vLLM's formula (or tied with them)")
        check(torch.allclose(w, want_w, rtol=1e-5, atol=1e-7), f"{what}: weights as vLLM's formula")
        want_tei = torch.arange(k)[None, :] * t + torch.arange(t)[:, None]
        check(torch.equal(tei.long(), want_tei), f"{what}: token_expert_indices = i * T + t")
    # A column slice of wider logits.
    wide = randn([9, 40], torch.bfloat16, 17)
    gating = wide[:, 3:35]
    w, ids, tei = torch.empty(9, 4), torch.empty(9, 4, dtype=torch.int32), torch.empty(9, 4, dtype=torch.int32)
    ops.topk_softmax(w, ids, tei, gating, True)
    w2, ids2, tei2 = torch.empty(9, 4), torch.empty(9, 4, dtype=torch.int32), torch.empty(9, 4, dtype=torch.int32)
    ops.topk_softmax(w2, ids2, tei2, gating.contiguous(), True)
    check(torch.equal(w, w2) and torch.equal(ids, ids2), "topk_softmax: strided gating_output")


def test_moe_align_block_size():
    for (t, k, e, b), ids_dtype in itertools.product([(1, 1, 1, 1), (7, 3, 5, 4), (33, 8, 64, 16), (64, 8, 256, 64)],
                                                    [torch.int32, torch.int64]):
        g = torch.Generator().manual_seed(t * e + b)
        ids = torch.randint(0, e, (t, k), generator=g).to(ids_dtype)
        padded = ids.numel() + e * (b - 1)
        blocks = -(-padded // b)
        outs = [torch.full([padded], -7, dtype=torch.int32), torch.full([blocks], -7, dtype=torch.int32),
                torch.full([1], -7, dtype=torch.int32)]
        check(ops.moe_align_block_size(ids, e, b, *outs) is None, "moe_align_block_size returns None")
        want = [torch.empty_like(o) for o in outs]
        KD.moe_align_block_size(ids, *want, e, b, backend="reference")
        what = f"moe_align_block_size {t}x{k} of {e} experts, block {b}, ids {ids_dtype}"
        check(all(torch.equal(a, w) for a, w in zip(outs, want)), f"{what}: as the reference backend")
        # vLLM's test: each expert's indices form the set of its (token, slot) pairs.
        total = int(outs[2][0])
        flat = ids.flatten().long()
        for block in range(total // b):
            expert = int(outs[1][block])
            got = outs[0][block * b:(block + 1) * b]
            check(all(int(i) == ids.numel() or int(flat[int(i)]) == expert for i in got),
                  f"{what}: block {block} holds only expert {expert}'s pairs")
    ids = torch.randint(0, 4, (3, 2), dtype=torch.int32)
    refused(lambda: ops.moe_align_block_size(ids, 4, 2, torch.empty(14, dtype=torch.int32),
                                             torch.empty(7, dtype=torch.int32), torch.empty(1, dtype=torch.int32),
                                             expert_map=torch.arange(4)), "moe_align_block_size", "expert_map")
    refused(lambda: ops.moe_align_block_size(ids, 4, 2, torch.empty(14, dtype=torch.int64),
                                             torch.empty(7, dtype=torch.int32), torch.empty(1, dtype=torch.int32)),
            "moe_align_block_size", "sorted_token_ids")


def test_reshape_and_cache_flash():
    for dtype, (n, h, d, nb, bs) in itertools.product(DTYPES, [(1, 1, 1, 1, 1), (7, 3, 7, 5, 3), (33, 2, 64, 9, 16)]):
        g = torch.Generator().manual_seed(n * d)
        slots = torch.randperm(nb * bs, generator=g)[:n]
        slots[::3] = -1
        # key and value as views into a fused QKV output, the caches two
        # halves of one [nb, 2, bs, h, d] buffer.
        qkv = randn([n, 3, h, d], dtype, n + d)
        key, value = qkv[:, 1], qkv[:, 2]
        kv = randn([nb, 2, bs, h, d], dtype, nb)
        before = kv.clone()
        scale = torch.tensor([1.0])
        check(ops.reshape_and_cache_flash(key, value, kv[:, 0], kv[:, 1], slots, "auto", scale, scale) is None,
              "reshape_and_cache_flash returns None")
        flat_k, flat_v = before[:, 0].reshape(-1, h, d).clone(), before[:, 1].reshape(-1, h, d).clone()
        keep = slots >= 0
        flat_k[slots[keep]] = key[keep]
        flat_v[slots[keep]] = value[keep]
        want = torch.stack((flat_k.view(nb, bs, h, d), flat_v.view(nb, bs, h, d)), dim=1)
        check(torch.equal(kv, want), f"reshape_and_cache_flash {dtype} {n}x{h}x{d} into {nb}x{bs}: tokens in "
                                     "their slots, slot -1 skipped, the rest untouched")
    key = randn([2, 1, 4], torch.float32, 30)
    cache = torch.zeros(2, 2, 1, 4)
    slots = torch.tensor([0, 3])
    scale = torch.tensor([1.0])
    refused(lambda: ops.reshape_and_cache_flash(key, key, cache, cache.clone(), slots, "int8", scale, scale),
            "reshape_and_cache_flash", "kv_cache_dtype")
    refused(lambda: ops.reshape_and_cache_flash(key, key.double(), cache, cache.clone(), slots, "auto", scale,
                                                scale), "reshape_and_cache_flash", "value")
    if hasattr(torch, "float8_e4m3fn"):  # vLLM's uint8 fp8 cache, viewed as float8_e4m3fn
        cache8 = torch.zeros(2, 2, 1, 4, dtype=torch.uint8)
        k_scale = torch.tensor([0.5])
        ops.reshape_and_cache_flash(key, key, cache8, cache8.clone(), slots, "fp8", k_scale, k_scale)
        want = (key / 0.5).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
        check(torch.equal(cache8.view(-1, 1, 4)[slots], want), "reshape_and_cache_flash fp8 into a uint8 cache")
    else:
        print(f"SKIPPED reshape_and_cache_flash into an fp8 cache: torch {torch.__version__} has no float8 dtypes")


def test_refusals():
    x = randn([4, 16], torch.bfloat16, 20)
    w = randn([16], torch.bfloat16, 21)
    out = torch.empty_like(x)
    refused(lambda: ops.rms_norm(out, x, None, 1e-6), "rms_norm", "weight")
    refused(lambda: ops.rms_norm(out, x.double(), w, 1e-6), "rms_norm", "input")
    refused(lambda: ops.rms_norm(out.double(), x, w, 1e-6), "rms_norm", "out")
    refused(lambda: ops.rms_norm(out, x.t().contiguous().t(), w, 1e-6), "rms_norm", "input")
    refused(lambda: ops.rms_norm(out, x, w.half(), 1e-6), "rms_norm", "weight")
    refused(lambda: ops.fused_add_rms_norm(x.clone(), x.clone(), None, 1e-6), "fused_add_rms_norm", "weight")
    refused(lambda: ops.fused_add_rms_norm(x.clone(), x.half(), w, 1e-6), "fused_add_rms_norm", "residual")
    refused(lambda: ops.fused_add_rms_norm(x.double(), x.double(), w.double(), 1e-6), "fused_add_rms_norm",
            "input")
    for name, (fn, _, _) in ACTS.items():
        refused(lambda: fn(torch.empty(4, 8, dtype=torch.float64), x.double()), name, "out")
        refused(lambda: fn(torch.empty(4, 8, dtype=torch.bfloat16), x.t().contiguous().t()), name, "input")
    pos = torch.arange(4)
    q, k = randn([4, 2 * 8], torch.float32, 22), randn([4, 8], torch.float32, 23)
    cache = vllm_cos_sin_cache(8, 10)
    refused(lambda: ops.rotary_embedding(pos, q, k, 8, cache, True, rope_dim_offset=2), "rotary_embedding",
            "rope_dim_offset")
    refused(lambda: ops.rotary_embedding(pos, q, k, 8, cache, True, 0, True), "rotary_embedding", "inverse")
    refused(lambda: ops.rotary_embedding(pos, q, k, 5, cache, True), "rotary_embedding", "query")
    refused(lambda: ops.rotary_embedding(pos, q, k.t().contiguous().t(), 8, cache, True), "rotary_embedding",
            "key")
    refused(lambda: ops.rotary_embedding(pos, q.view(4, 2, 8), k.view(4, 1, 8), 4, cache, True),
            "rotary_embedding", "query")
    refused(lambda: ops.rotary_embedding(pos.float(), q, k, 8, cache, True), "rotary_embedding", "positions")
    refused(lambda: ops.rotary_embedding(pos, q, k, 8, cache.double(), True), "rotary_embedding", "cos_sin_cache")
    refused(lambda: ops.rotary_embedding(pos, q, k, 8, vllm_cos_sin_cache(10, 10), True), "rotary_embedding",
            "cos_sin_cache")
    refused(lambda: ops.rotary_embedding(pos, q, k, 0, cache, True), "rotary_embedding", "head_size")
    gating = randn([4, 8], torch.float32, 24)
    tw, ti, te = torch.empty(4, 2), torch.empty(4, 2, dtype=torch.int32), torch.empty(4, 2, dtype=torch.int32)
    refused(lambda: ops.topk_softmax(tw, ti, te, gating, False, torch.zeros(8)), "topk_softmax",
            "e_score_correction_bias")
    refused(lambda: ops.topk_softmax(tw, ti, te, gating, False, None, torch.zeros(4, dtype=torch.bool)),
            "topk_softmax", "is_padding")
    refused(lambda: ops.topk_softmax(tw, ti.float(), te, gating, False), "topk_softmax", "topk_ids")
    refused(lambda: ops.topk_softmax(tw, ti, te.long(), gating, False), "topk_softmax", "token_expert_indices")
    refused(lambda: ops.topk_softmax(tw, ti, te, gating.double(), False), "topk_softmax", "gating_output")
    refused(lambda: ops.topk_softmax(tw.half(), ti, te, gating, False), "topk_softmax", "topk_weights")
    refused(lambda: ops.topk_softmax(torch.empty(4, 5)[:, :2], ti, te, gating, False), "topk_softmax", "topk_weights")
    refused(lambda: ops.topk_softmax(tw, torch.empty(4, 3, dtype=torch.int32), te, gating, False), "topk_softmax",
            "topk_ids")
    try:
        ops.mul_and_silu
        check(False, "a vLLM op kdispatch lacks is not an attribute")
    except AttributeError as e:
        check("mul_and_silu" in str(e), f"unknown name: {e}")


def test_signatures():
    """vLLM's parameter names, order and defaults, for callers passing them by keyword."""
    import inspect

    want = {
        "rms_norm": ["out", "input", "weight", "epsilon"],
        "fused_add_rms_norm": ["input", "residual", "weight", "epsilon"],
        "silu_and_mul": ["out", "input"],
        "gelu_and_mul": ["out", "input"],
        "gelu_tanh_and_mul": ["out", "input"],
        "rotary_embedding": ["positions", "query", "key", "head_size", "cos_sin_cache", "is_neox",
                             "rope_dim_offset=0", "inverse=False"],
        "topk_softmax": ["topk_weights", "topk_ids", "token_expert_indices", "gating_output", "renormalize=False",
                         "e_score_correction_bias=None", "is_padding=None"],
        "moe_align_block_size": ["topk_ids", "num_experts", "block_size", "sorted_token_ids", "experts_ids",
                                 "num_tokens_post_pad", "expert_map=None"],
        "reshape_and_cache_flash": ["key", "value", "key_cache", "value_cache", "slot_mapping", "kv_cache_dtype",
                                    "k_scale", "v_scale"],
        "scaled_fp8_quant": ["input", "scale=None", "num_token_padding=None", "scale_ub=None",
                             "use_per_token_if_dynamic=False", "output=None", "group_shape=None"],
    }
    check(sorted(ops.__all__) == sorted(want), f"functions {ops.__all__}")
    for name, params in want.items():
        got = [p.name if p.default is p.empty else f"{p.name}={p.default!r}"
               for p in inspect.signature(getattr(ops, name)).parameters.values()]
        check(got == params, f"{name}{tuple(got)} is not vLLM's {tuple(params)}")


# ---- vLLM's own test parametrisations ----

class Tally:
    """The cases of one vLLM test file: passed, and the others by reason."""

    def __init__(self, path):
        self.path = path
        self.total = 0
        self.passed = 0
        self.others = {}

    def add(self, ok, why=None):
        self.total += 1
        if ok:
            self.passed += 1
        else:
            self.others[why] = self.others.get(why, 0) + 1

    def skip(self, count, why):
        self.total += count
        self.others[why] = self.others.get(why, 0) + count

    def report(self):
        rest = "; ".join(f"{n} {why}" for why, n in self.others.items())
        print(f"vLLM {self.path}: {self.passed} of {self.total} cases pass" + (f"; not passing: {rest}" if rest
                                                                               else ""))


def close(got, want, atol, rtol):
    return bool(torch.isclose(got.double(), want.double(), atol=atol, rtol=rtol).all())


def vllm_layernorm_cases(full):
    tally = Tally("tests/kernels/core/test_layernorm.py")
    hidden_sizes = [8, 768, 769, 5120, 5125, 8192]
    # vLLM's 4096-token cases run with 256 tokens unless --full is given.
    tokens = [7, 83, 4096 if full else 256]
    grid = list(itertools.product(tokens, hidden_sizes, [False, True],
                                  [torch.half, torch.bfloat16, torch.float], [False, True]))
    for seed, (num_tokens, hidden, add_residual, dtype, strided) in enumerate(grid):
        # test_rms_norm: RMSNorm(hidden) with weight ~ N(1, 0.1), inputs scaled by 1 / (2 hidden).
        w = (1 + randn([hidden], torch.float32, seed, 0.1)).to(dtype)
        scale = 1 / (2 * hidden)
        x = randn([num_tokens, 2 * hidden if strided else hidden], dtype, seed + 1)[..., :hidden]
        x *= scale
        residual = (randn([num_tokens, x.stride(0)], dtype, seed + 2, scale)[..., :hidden] if add_residual
                    else None)
        # vLLM's forward_native: the sum and the norm in float32, rounded, then the weight.
        xf = x.float() + (residual.float() if add_residual else 0)
        want_r = xf.to(dtype)
        want = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype) * w
        if add_residual:
            ops.fused_add_rms_norm(x, residual, w, 1e-6)
            ok = close(x, want, 1e-2, 1e-2) and close(residual, want_r, 1e-2, 1e-2)
        else:
            out = torch.empty_like(x)
            ops.rms_norm(out, x, w, 1e-6)
            ok = close(out, want, 1e-2, 1e-2)
        tally.add(ok, "beyond atol=rtol=1e-2")
        check(ok, f"vLLM test_rms_norm {num_tokens}x{hidden} residual={add_residual} {dtype} strided={strided}")
    # test_rms_norm_weightless: RMSNorm(has_weight=False) passes weight=None.
    for num_tokens, hidden, add_residual, dtype in itertools.product(tokens, hidden_sizes, [False, True],
                                                                      [torch.half, torch.bfloat16, torch.float]):
        x = randn([num_tokens, hidden], dtype, 30)
        try:
            if add_residual:
                ops.fused_add_rms_norm(x, x.clone(), None, 1e-6)
            else:
                ops.rms_norm(torch.empty_like(x), x, None, 1e-6)
            check(False, "weight=None accepted")
        except kdispatch.CallError as e:
            check("'weight'" in e.message, f"weightless refusal: {e}")
        tally.add(False, "refused (test_rms_norm_weightless: weight=None)")
    tally.skip(6 * 3 * 2 * 3 * 2 * 3, "test_fused_rms_norm_quant (fp8 quantising norms: no kdispatch op)")
    tally.skip(6 * 3 * 2 * 3 * 2 + 1, "test_gemma_rms_norm* (GemmaRMSNorm is not a vllm._custom_ops function)")
    tally.report()
    if not full:
        print("  (test_layernorm.py: the 4096-token cases ran with 256 tokens; --full runs them at full size)")


def vllm_activation_cases():
    tally = Tally("tests/kernels/core/test_activation.py")
    worst = {}
    acts = {"silu_and_mul": "silu_and_mul", "gelu": "gelu_and_mul", "gelu_tanh": "gelu_tanh_and_mul"}
    for activation, num_tokens, d, dtype in itertools.product(
            ["silu_and_mul", "mul_and_silu", "gelu", "gelu_tanh", "fatrelu", "swigluoai_and_mul"], [7, 83, 2048],
            [512, 13824], [torch.half, torch.bfloat16, torch.float]):
        if activation not in acts:
            tally.add(False, f"{activation} (no kdispatch op)")
            continue
        fn, _, act = ACTS[acts[activation]]
        x = randn([num_tokens, 2 * d], dtype, num_tokens + d)
        out = torch.empty(num_tokens, d, dtype=dtype)
        fn(out, x)
        # vLLM's forward_native: act(x1) * x2 in the dtype, compared exactly.
        want = vllm_act_and_mul(act, x)  # act in float64, rounded to the dtype
        if torch.equal(out, want):
            tally.add(True)
            continue
        s = steps(out, want, dtype)
        worst[dtype] = max(worst.get(dtype, 0), s)
        check(s <= VLLM_STEPS[dtype], f"vLLM test_act_and_mul {activation} {num_tokens}x{d} {dtype}: {s} steps")
        tally.add(False, "not bit-equal to forward_native (vLLM asserts atol=rtol=0; kdispatch rounds "
                  "act(x1) * x2 once, forward_native rounds act(x1) first)")
    tally.skip(3 * 3 * 2 * 3, "test_activation (gelu_fast, gelu_new, gelu_quick: no kdispatch op)")
    tally.report()
    print("  (test_activation.py: largest distance from forward_native, in steps of the dtype beyond atol: "
          + ", ".join(f"{str(d)[6:]} {s:.2g}" for d, s in worst.items()) + ")")


def vllm_pos_encoding_cases(full):
    tally = Tally("tests/kernels/core/test_pos_encoding.py")
    atol = {torch.bfloat16: 1e-3, torch.float: 1e-5}
    rtol = {torch.bfloat16: 1.6e-2, torch.float: 1.3e-6}
    caches = {}
    grid = itertools.product([True, False], ["batch", "flat", "padded"], [5], [11, 8192], [17], [64, 80, 120, 256],
                             [None, 32], [torch.bfloat16, torch.float], [True, False])
    for n, (is_neox, shape_fn, batch, seq_len, heads, head_size, rotary_dim, dtype, use_key) in enumerate(grid):
        rotary_dim = rotary_dim or head_size
        if seq_len == 8192 and not full:
            batch, seq_len = 1, 512
        max_position = 8192
        if rotary_dim not in caches:
            caches[rotary_dim] = vllm_cos_sin_cache(rotary_dim, max_position)
        cache = caches[rotary_dim].to(dtype)  # vLLM's rope.to(dtype)
        positions = torch.randint(0, max_position, (batch, seq_len), generator=torch.Generator().manual_seed(n))
        shape = {"batch": [batch, seq_len, heads, head_size], "flat": [batch, seq_len, heads * head_size],
                 "padded": [batch, seq_len, heads, head_size + 64]}[shape_fn]
        query = randn(shape, dtype, n)[..., :head_size]
        key = randn(shape, dtype, n + 1)[..., :head_size] if use_key else None
        want_q, _ = vllm_rotary(positions, query, head_size, cache, is_neox)
        want_k = vllm_rotary(positions, key, head_size, cache, is_neox)[0] if use_key else None
        exact_q, bound_q = vllm_rotary(positions, query, head_size, cache, is_neox, exact=True)
        ops.rotary_embedding(positions, query, key, head_size, cache, is_neox)
        ok = close(query, want_q, atol[dtype], rtol[dtype]) and (not use_key
                                                                   or close(key, want_k, atol[dtype], rtol[dtype]))
        if not ok:
            # forward_native rounds each product to the dtype: kdispatch is as close to the exact rotation
            # of the same cache values as one rounding (plus float32's error at the products).
            eps = torch.finfo(dtype).eps
            closest = within(query, exact_q, exact_q.abs() * eps + bound_q / eps * 2.0 ** -22)
            check(closest, f"vLLM test_rotary_embedding case {n}: query not within one rounding of the exact rotation")
            check(within(query, want_q, bound_q), f"vLLM test_rotary_embedding case {n}: beyond vLLM's roundings")
        tally.add(ok, f"{str(dtype)[6:]}: beyond vLLM's default atol/rtol for the dtype, by forward_native's "
                  "rounding of each product (kdispatch rounds once, within one step of the exact rotation)")
    if not full:
        print("  (test_pos_encoding.py: the seq_len 8192 cases ran with batch 1, 512 tokens; --full runs 5 x 8192)")
    tally.skip(1, "test_rope_module_cache (a module cache, no kernel)")
    tally.report()


def vllm_rotary_embedding_cases():
    tally = Tally("tests/kernels/core/test_rotary_embedding.py")
    grid = itertools.product([11, 4096, 32768], [True, False], [32], [32, 108], [11, 1024], [True, False],
                             [True, False])
    for n, (max_position, is_neox, rotary_dim, head_size, seq_len, use_key, head_stride_is_contiguous) in \
            enumerate(grid):
        cache = vllm_cos_sin_cache(rotary_dim, max_position)
        positions = torch.randint(0, max_position, (1, seq_len), generator=torch.Generator().manual_seed(n))
        head_stride = head_size + (64 if head_stride_is_contiguous else 0)
        query = randn([1, seq_len, 7, head_stride], torch.float32, n)[..., :head_size]
        key = randn([1, seq_len, 7, head_stride], torch.float32, n + 1)[..., :head_size] if use_key else None
        calls = [(query, key)]
        if head_stride_is_contiguous:
            calls.append((query.flatten(start_dim=-2), key.flatten(start_dim=-2) if use_key else None))
        ok = True
        for q, k in calls:
            want_q, bound_q = vllm_rotary(positions, q, head_size, cache, is_neox)
            want_k, bound_k = vllm_rotary(positions, k, head_size, cache, is_neox) if use_key else (None, None)
            ops.rotary_embedding(positions, q, k, head_size, cache, is_neox)
            ok = ok and within(q, want_q, bound_q) and (not use_key or within(k, want_k, bound_k))
        tally.add(ok, "beyond vLLM's rounding of its formula")
        check(ok, f"vLLM test_rotary_embedding_opcheck case {n}")
    print("  (test_rotary_embedding.py: each case's batched_rotary_embedding call, an op vllm._custom_ops no "
          "longer has, is not run)")
    tally.report()


def vllm_fused_topk_cases():
    tally = Tally("tests/kernels/moe/test_fused_topk.py")
    for num_tokens, hidden_size, num_experts, topk, renormalize, scoring_func, dtype in itertools.product(
            [1, 33, 56], [1024, 2048], [6, 16], [3, 4], [True, False], ["softmax", "sigmoid"],
            [torch.bfloat16, torch.half, torch.float32]):
        if scoring_func == "sigmoid":
            tally.add(False, "test_fused_topk sigmoid (topk_sigmoid: no kdispatch op)")
            continue
        torch.manual_seed(0)
        gating = torch.randn((num_tokens, num_experts), dtype=torch.float32).to(dtype)
        w = torch.empty(num_tokens, topk)
        ids = torch.empty(num_tokens, topk, dtype=torch.int32)
        tei = torch.empty(num_tokens, topk, dtype=torch.int32)
        ops.topk_softmax(w, ids, tei, gating, renormalize)
        want_w, want_ids = vllm_topk_softmax(gating, topk, renormalize)
        ok = close(w, want_w, 1e-2, 1e-2) and torch.equal(ids.long(), want_ids)
        if not ok:
            # Tied logits: torch.topk's order among equal values is not the lower index first.
            p = torch.softmax(gating.float(), -1)
            tied = bool((p.gather(1, ids.long()) == p.gather(1, want_ids)).all())
            tally.add(False, "tied logits ordered by index (torch.topk orders ties otherwise)" if tied
                      else "different experts or weights")
            check(tied, f"vLLM test_fused_topk {num_tokens}x{num_experts} k={topk} {dtype}")
        else:
            tally.add(True)
    for scoring_func in ["softmax", "sigmoid"]:
        count = 3 * 2 * 2 * 2 * 2 * 3
        if scoring_func == "softmax":
            w, ids, tei = torch.empty(2, 3), torch.empty(2, 3, dtype=torch.int32), torch.empty(2, 3, dtype=torch.int32)
            refused(lambda: ops.topk_softmax(w, ids, tei, torch.randn(2, 6), False, torch.randn(6)), "topk_softmax",
                    "e_score_correction_bias")
            tally.skip(count, "test_fused_topk_bias softmax (refused: e_score_correction_bias, added after the "
                       "softmax in vLLM)")
        else:
            tally.skip(count, "test_fused_topk_bias sigmoid (no kdispatch op)")
    for num_experts, topk, scoring_func, bad_value, dtype in itertools.product(
            [6, 8, 16], [3, 4], ["softmax", "sigmoid"], [float("nan"), float("inf")],
            [torch.bfloat16, torch.half, torch.float32]):
        if scoring_func == "sigmoid":
            tally.add(False, "test_fused_topk_nan_inf_clamp sigmoid (no kdispatch op)")
            continue
        torch.manual_seed(0)
        gating = torch.randn((4, num_experts), dtype=torch.float32).to(dtype)
        gating[1:, :] = bad_value
        w, ids = torch.empty(4, topk), torch.empty(4, topk, dtype=torch.int32)
        ops.topk_softmax(w, ids, torch.empty(4, topk, dtype=torch.int32), gating, False)
        want_w, want_ids = vllm_topk_softmax(gating[:1], topk, False)
        normal_row = close(w[:1], want_w, 1e-2, 1e-2) and torch.equal(ids[:1].long(), want_ids)
        check(normal_row, f"vLLM nan_inf_clamp {num_experts} k={topk} {dtype}: the normal row")
        poisoned_ok = all(ids[r].unique().numel() == topk and bool(torch.isfinite(w[r]).all()) for r in range(1, 4))
        tally.add(normal_row and poisoned_ok, "test_fused_topk_nan_inf_clamp softmax: rows of NaN/+inf logits get "
                  "NaN weights (vLLM's kernel clamps them to finite ones)")
    tally.skip(3 * 2 * 2 * 2 * 3, "test_fused_topk_bias_nan_inf_clamp (refused: e_score_correction_bias; sigmoid: "
               "no kdispatch op)")
    tally.report()


# ---- fp8 quantisation ----

FP8 = getattr(torch, "float8_e4m3fn", None)
NO_FP8 = f"torch {torch.__version__} has no float8 dtypes"
FP8_MAX = 448.0
QUANT_SIZES = [(1, 1), (7, 7), (33, 67), (3, 4097), (5, 130)]
PER_TENSOR, PER_TOKEN = "quantization.per_tensor_quant_fp8", "quantization.per_token_quant_fp8"


def poisoned(shape, dtype):
    """An fp8 tensor of code 0x7f, NaN in float8_e4m3fn and in float8_e5m2."""
    return torch.full(shape, 0x7F, dtype=torch.uint8).view(dtype)


def vllm_quant(x, inv):
    """vLLM's fp8 conversion: the float32 product x * inv, clamped and rounded to float8_e4m3fn."""
    return (x.float() * inv).clamp(-FP8_MAX, FP8_MAX).to(FP8)


class QuantOpsRecorded:
    """kdispatch.compat.vllm with the kdispatch ops its fp8 quantiser
    forwards to replaced by recorders, and, where torch has no float8, the
    dtype it allocates its output in by float32: what reaches the op and
    what is returned, without a kernel."""

    def __enter__(self):
        self.calls = []
        self.saved = (ops._per_tensor_quant_fp8, ops._per_token_quant_fp8, ops._FP8_OUTPUT)

        def recorder(op):
            return lambda *args: self.calls.append((op, args))
        ops._per_tensor_quant_fp8, ops._per_token_quant_fp8 = recorder(PER_TENSOR), recorder(PER_TOKEN)
        ops._FP8_OUTPUT = ops._FP8_OUTPUT or torch.float32
        return self

    def __exit__(self, *exc):
        ops._per_tensor_quant_fp8, ops._per_token_quant_fp8, ops._FP8_OUTPUT = self.saved

    def last(self):
        return self.calls[-1]


def same_memory(view, t):
    return view.data_ptr() == t.data_ptr()


def test_scaled_fp8_quant_plumbing():
    x = randn([5, 24], torch.bfloat16, 40)
    with QuantOpsRecorded() as rec:
        out, s = ops.scaled_fp8_quant(x)
        op, args = rec.last()
        check(op == PER_TENSOR and args[0] is x and args[1] is out and args[2] is s and args[3] is False
              and out.shape == (5, 24) and out.dtype == ops._FP8_OUTPUT and s.shape == (1,)
              and s.dtype == torch.float32, f"scaled_fp8_quant dynamic per tensor: {op} {args[1:]}")
        out, s = ops.scaled_fp8_quant(x, num_token_padding=8, use_per_token_if_dynamic=True)
        op, (xi, q, sv) = rec.last()
        check(op == PER_TOKEN and xi is x and out.shape == (8, 24) and s.shape == (8, 1)
              and q.shape == (5, 24) and same_memory(q, out) and sv.shape == (5,) and same_memory(sv, s)
              and sv.stride() == (1,), "scaled_fp8_quant per token, padded: output and scale of 8 rows, their "
              "first 5 passed as views")
        out, s = ops.scaled_fp8_quant(x, num_token_padding=3)
        check(out.shape == (5, 24) and rec.last()[1][1] is out, "scaled_fp8_quant: padding below M pads nothing")
        # A static 0-dim scale: passed as a [1] view, returned as given; group_shape, scale_ub and
        # use_per_token_if_dynamic are not read (as in vLLM).
        scale = torch.tensor(0.5)
        out, s = ops.scaled_fp8_quant(x, scale, scale_ub=torch.tensor(1.0), use_per_token_if_dynamic=True,
                                      group_shape=(1, -1))
        op, args = rec.last()
        check(op == PER_TENSOR and s is scale and args[2].shape == (1,) and same_memory(args[2], scale)
              and args[3] is True, "scaled_fp8_quant static: the one-element scale as a [1] view, is_static")
        scale2 = torch.full([1, 1], 0.25)
        ops.scaled_fp8_quant(x, scale2, group_shape=(-1, -1))
        check(rec.last()[1][2].shape == (1,) and same_memory(rec.last()[1][2], scale2), "static [1, 1] scale")
        # A given output with more rows: its first M rows are written.
        buf = torch.empty(9, 24, dtype=ops._FP8_OUTPUT)
        out, s = ops.scaled_fp8_quant(x, output=buf)
        q = rec.last()[1][1]
        check(out is buf and q.shape == (5, 24) and same_memory(q, buf), "scaled_fp8_quant: output's first M rows")
        # Strided input, strided output: passed as they are.
        xs = randn([5, 31], torch.bfloat16, 42)[:, 3:27]
        os_ = torch.empty(5, 30, dtype=ops._FP8_OUTPUT)[:, 2:26]
        out, s = ops.scaled_fp8_quant(xs, output=os_, use_per_token_if_dynamic=True)
        op, args = rec.last()
        check(args[0] is xs and args[1] is os_ and out is os_ and s.shape == (5, 1),
              "scaled_fp8_quant: strided input and output passed as they are")
        # group_shape agreeing with the dynamic quantisation is accepted.
        for per_token, shape in ((False, (-1, -1)), (False, (5, 24)), (True, (1, -1)), (True, (1, 24))):
            ops.scaled_fp8_quant(x, use_per_token_if_dynamic=per_token, group_shape=shape)
            check(rec.last()[0] == (PER_TOKEN if per_token else PER_TENSOR), f"group_shape {shape}")


def test_scaled_fp8_quant_refusals():
    """Refused before any fp8 tensor is made (or, for output, by the op's dtype check)."""
    f = "scaled_fp8_quant"
    x = randn([4, 16], torch.bfloat16, 41)
    refused(lambda: ops.scaled_fp8_quant(x.view(2, 2, 16)), f, "input")
    refused(lambda: ops.scaled_fp8_quant(x[0]), f, "input")
    refused(lambda: ops.scaled_fp8_quant(x, torch.ones(4, 1)), f, "scale")                       # static per token
    refused(lambda: ops.scaled_fp8_quant(x, torch.ones(4), group_shape=(1, -1)), f, "scale")
    refused(lambda: ops.scaled_fp8_quant(x, torch.ones(16), group_shape=(-1, 1)), f, "scale")    # per channel
    refused(lambda: ops.scaled_fp8_quant(x, torch.ones(4, 2), group_shape=(1, 8)), f, "scale")   # groups
    refused(lambda: ops.scaled_fp8_quant(x, 0.5), f, "scale")
    refused(lambda: ops.scaled_fp8_quant(x, scale_ub=torch.tensor(1.0), use_per_token_if_dynamic=True), f,
            "scale_ub")
    refused(lambda: ops.scaled_fp8_quant(x, group_shape=(1, 8)), f, "group_shape")
    refused(lambda: ops.scaled_fp8_quant(x, group_shape=(1, -1)), f, "group_shape")   # per token's, per tensor
    refused(lambda: ops.scaled_fp8_quant(x, use_per_token_if_dynamic=True, group_shape=(-1, -1)), f, "group_shape")
    refused(lambda: ops.scaled_fp8_quant(x, group_shape="rows"), f, "group_shape")
    refused(lambda: ops.scaled_fp8_quant(x, num_token_padding=8, output=torch.empty(8, 16)), f, "num_token_padding")
    refused(lambda: ops.scaled_fp8_quant(x, output=torch.empty(4, 16)), f, "output")    # float32: the op's refusal
    if FP8 is None:
        refused(lambda: ops.scaled_fp8_quant(x), f, "output")
    else:
        refused(lambda: ops.scaled_fp8_quant(x, torch.ones(1, dtype=torch.float64)), f, "scale")
        refused(lambda: ops.scaled_fp8_quant(x, output=torch.empty(4, 17, dtype=FP8)), f, "output")
        refused(lambda: ops.scaled_fp8_quant(x.t().contiguous().t()), f, "input")


def test_scaled_fp8_quant():
    if FP8 is None:
        print(f"SKIPPED scaled_fp8_quant against the reference and vLLM's formulas: {NO_FP8}")
        return
    for dtype, (m, n) in itertools.product(DTYPES, QUANT_SIZES):
        x = randn([m, n], dtype, m * n, 3.0)
        x0 = x.clone()
        what = f"scaled_fp8_quant {dtype} {m}x{n}"
        # Dynamic per tensor.
        out, s = ops.scaled_fp8_quant(x)
        ref_q, ref_s = poisoned([m, n], FP8), torch.full([1], -1.0)
        KD.quantization_per_tensor_quant_fp8(x, ref_q, ref_s, False, backend="reference")
        ok, why = matches_reference(PER_TENSOR, [x, out, s], [x, ref_q, ref_s])
        check(ok and out.dtype == FP8 and out.shape == (m, n) and s.shape == (1,) and torch.equal(x, x0),
              f"{what} dynamic per tensor against the reference: {why}")
        check(torch.equal(s, (x.float().abs().max() / FP8_MAX).reshape(1)), f"{what}: scale = absmax / 448")
        apart = fp8_apart(out, vllm_quant(x, 1.0 / s))
        check(apart <= 1, f"{what} dynamic per tensor: {apart} fp8 steps from vLLM's formula")
        # Static, the scale 0-dim, [1] or [1, 1]; 0.75 of the dynamic one saturates the largest values.
        for shape in ([], [1], [1, 1]):
            scale = (s * 0.75).reshape(shape)
            q, s2 = ops.scaled_fp8_quant(x, scale)
            ref_q = poisoned([m, n], FP8)
            KD.quantization_per_tensor_quant_fp8(x, ref_q, scale.reshape(1).clone(), True, backend="reference")
            ok, why = matches_reference(PER_TENSOR, [x, q, scale.reshape(1)], [x, ref_q, scale.reshape(1)])
            check(ok and s2 is scale and torch.equal(scale.reshape(1), s * 0.75),
                  f"{what} static scale {shape}: against the reference, the scale returned unchanged: {why}")
            apart = fp8_apart(q, vllm_quant(x, 1.0 / scale.reshape(1)))
            check(apart <= 1, f"{what} static: {apart} fp8 steps from vLLM's formula")
        # Dynamic per token.
        qt, st = ops.scaled_fp8_quant(x, use_per_token_if_dynamic=True)
        ref_q, ref_s = poisoned([m, n], FP8), torch.full([m], -1.0)
        KD.quantization_per_token_quant_fp8(x, ref_q, ref_s, backend="reference")
        ok, why = matches_reference(PER_TOKEN, [x, qt, st[:, 0]], [x, ref_q, ref_s])
        check(ok and st.shape == (m, 1) and qt.shape == (m, n), f"{what} per token against the reference: {why}")
        absmax = x.float().abs().amax(-1, keepdim=True)
        vllm_s = (absmax / FP8_MAX).clamp(min=1 / (FP8_MAX * 512))
        rows = (absmax >= 1 / 512)[:, 0]  # where vLLM's floor of the scale does not apply
        check(torch.equal(st[rows], vllm_s[rows]), f"{what} per token: scales = absmax / 448")
        apart = fp8_apart(qt[rows], (x.float()[rows] / vllm_s[rows]).clamp(-FP8_MAX, FP8_MAX).to(FP8))
        check(apart <= 1, f"{what} per token: {apart} fp8 steps from vLLM's formula")
        # Padded rows: allocated, the first M written as without padding.
        qp, sp = ops.scaled_fp8_quant(x, num_token_padding=m + 3, use_per_token_if_dynamic=True)
        check(qp.shape == (m + 3, n) and sp.shape == (m + 3, 1) and torch.equal(codes(qp[:m]), codes(qt))
              and torch.equal(sp[:m], st), f"{what} per token padded to {m + 3} rows")
        qp, sp = ops.scaled_fp8_quant(x, num_token_padding=m + 3)
        check(qp.shape == (m + 3, n) and torch.equal(codes(qp[:m]), codes(out)) and torch.equal(sp, s),
              f"{what} per tensor padded to {m + 3} rows")
        # A given, poisoned output with two more rows: the first M written, the rest as it was.
        buf = poisoned([m + 2, n], FP8)
        q, _ = ops.scaled_fp8_quant(x, output=buf)
        check(q is buf and torch.equal(codes(buf[:m]), codes(out)) and bool((codes(buf[m:]) == 0x7F).all()),
              f"{what}: a given output's first M rows written, the others untouched")
        # Strided input and output (column slices), written where they are.
        xb = randn([m, n + 5], dtype, m + n, 3.0)
        xs = xb[:, 2:n + 2]
        ob = poisoned([m, n + 4], FP8)
        os_ = ob[:, 1:n + 1]
        q, ss = ops.scaled_fp8_quant(xs, output=os_, use_per_token_if_dynamic=True)
        qc, sc = ops.scaled_fp8_quant(xs.contiguous(), use_per_token_if_dynamic=True)
        check(q is os_ and torch.equal(codes(os_), codes(qc)) and torch.equal(ss, sc)
              and bool((codes(ob[:, :1]) == 0x7F).all() and (codes(ob[:, n + 1:]) == 0x7F).all()),
              f"{what}: strided input and output")
        # A float8_e5m2 output (vLLM allocates float8_e4m3fn; kdispatch also writes e5m2).
        q5 = poisoned([m, n], torch.float8_e5m2)
        q, s5 = ops.scaled_fp8_quant(x, output=q5)
        ref_q, ref_s = poisoned([m, n], torch.float8_e5m2), torch.full([1], -1.0)
        KD.quantization_per_tensor_quant_fp8(x, ref_q, ref_s, False, backend="reference")
        ok, why = matches_reference(PER_TENSOR, [x, q5, s5], [x, ref_q, ref_s])
        check(ok and q is q5 and torch.equal(s5, (x.float().abs().max() / 57344.0).reshape(1)),
              f"{what}: float8_e5m2 output: {why}")
    # All-zero input: scale 0 and output 0 (vLLM's per-tensor kernel gives NaN; per token it floors the scale).
    z = torch.zeros(3, 8, dtype=torch.bfloat16)
    q, s = ops.scaled_fp8_quant(z)
    check(float(s) == 0 and bool((q.float() == 0).all()), "scaled_fp8_quant of zeros: scale 0, output 0")
    q, s = ops.scaled_fp8_quant(z, use_per_token_if_dynamic=True)
    check(bool((s == 0).all()) and bool((q.float() == 0).all()), "per token, zero rows: scale 0, output 0")


def vllm_ref_per_token(x, scale_ub=None):
    """vLLM's ref_dynamic_per_token_quant (tests/kernels/quant_utils.py) for float8_e4m3fn."""
    x_max = x.abs().amax(-1).float()
    if scale_ub is not None:
        x_max = x_max.clamp(max=scale_ub)
    scales = (x_max / FP8_MAX)[:, None].clamp(min=1.0 / (FP8_MAX * 512.0))
    return vllm_quant(x, 1.0 / scales), scales


def vllm_ref_per_tensor(x):
    """vLLM's ref_dynamic_per_tensor_fp8_quant."""
    scale = x.abs().max().float() / FP8_MAX
    return vllm_quant(x, 1.0 / scale), scale


def fp8_close(got, want, atol=1e-5, rtol=1.3e-6):
    """torch.testing.assert_close of the float values (float32's default tolerances)."""
    return close(got.float(), want.float(), atol, rtol)


def vllm_fp8_quant_cases(full):
    tally = Tally("tests/kernels/quantization/test_fp8_quant.py")
    tiny = "within one fp8 step (vLLM rounds the float32 product or quotient again; kdispatch the exact product " \
           "once) beyond assert_close's float32 tolerance"

    def rand(shape, dtype, seed):
        return torch.rand(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32).to(dtype)

    def judge(ok_scale, out, want_out, what):
        """A case passes at vLLM's tolerance, or differs by one fp8 step on a tie (checked)."""
        if ok_scale and fp8_close(out, want_out):
            return True, None
        apart = fp8_apart(out, want_out)
        check(ok_scale and apart <= 1, f"vLLM {what}: scale equal {ok_scale}, {apart} fp8 steps apart")
        return False, tiny

    hidden_sizes = [17, 1024, 1025, 1026, 5137, 8193]
    tokens = [1, 7, 4096 if full else 256]
    dtypes = [torch.bfloat16, torch.float]
    for seed, (num_tokens, hidden, dtype, do_scale_ub) in enumerate(
            itertools.product(tokens, hidden_sizes, dtypes, [True, False])):
        x = rand([num_tokens, hidden], dtype, seed) + 1e-6
        if do_scale_ub:
            refused(lambda: ops.scaled_fp8_quant(x, scale_ub=x.float().mean(), use_per_token_if_dynamic=True),
                    "scaled_fp8_quant", "scale_ub")
            tally.add(False, "test_dynamic_per_token_fp8_quant with scale_ub (refused: no upper bound of the "
                      "per-token scales)")
        elif FP8 is None:
            tally.add(False, f"not run: {NO_FP8}")
        else:
            out, s = ops.scaled_fp8_quant(x, use_per_token_if_dynamic=True)
            want, want_s = vllm_ref_per_token(x)
            tally.add(*judge(close(s, want_s, 1e-5, 1.3e-6), out, want,
                             f"test_dynamic_per_token_fp8_quant {num_tokens}x{hidden} {dtype}"))
    for seed, (num_tokens, hidden, dtype) in enumerate(itertools.product(tokens, hidden_sizes, dtypes)):
        if FP8 is None:
            tally.add(False, f"not run: {NO_FP8}")
            continue
        x = rand([num_tokens, hidden], dtype, 100 + seed)
        out, s = ops.scaled_fp8_quant(x)
        want, want_s = vllm_ref_per_tensor(x)
        tally.add(*judge(close(s, want_s, 1e-5, 1.3e-6), out, want,
                         f"test_dynamic_per_tensor_fp8_quant {num_tokens}x{hidden} {dtype}"))
    for pad, dtype in itertools.product([8, 16], dtypes):
        if FP8 is None:
            tally.add(False, f"not run: {NO_FP8}")
            continue
        full_x = rand([64, 4096 + pad], dtype, pad)
        x = full_x[:, :4096]
        out, s = ops.scaled_fp8_quant(x)
        flat, flat_s = ops.scaled_fp8_quant(x.contiguous())
        want, want_s = vllm_ref_per_tensor(x)
        same = torch.equal(s, flat_s) and torch.equal(codes(out), codes(flat))
        check(same, f"vLLM test_dynamic_per_tensor_fp8_quant_strided_input pad {pad} {dtype}: strided as contiguous")
        ok = same and torch.equal(s.reshape(()), want_s) and torch.equal(codes(out), codes(want))
        tally.add(*((True, None) if ok else judge(torch.equal(s.reshape(()), want_s), out, want,
                                                  f"strided_input pad {pad} {dtype}")))
    if FP8 is None:
        tally.add(False, f"not run: {NO_FP8}")
    else:
        # test_fp8_quant_large: a static (0-dim) scale over many rows.
        x = rand([1024000 if full else 2048, 1152], torch.bfloat16, 7)
        want, scale = vllm_ref_per_tensor(x)
        out, _ = ops.scaled_fp8_quant(x, scale)
        ok = close(out.to(torch.bfloat16), want.to(torch.bfloat16), 1e-5, 1.6e-2)
        tally.add(*((True, None) if ok else judge(True, out, want, "test_fp8_quant_large")))
    group_shapes = [(-1, -1), (-1, 1), (1, -1), (-1, 128), (1, 128), (128, 128), (1, 64), (1, 16), (4, 256)]
    for seed, (num_tokens, hidden, group_shape, dtype) in enumerate(
            itertools.product([128, 512], [256, 1024, 2048], group_shapes, dtypes)):
        gm = num_tokens if group_shape[0] == -1 else group_shape[0]
        gn = hidden if group_shape[1] == -1 else group_shape[1]
        x = rand([num_tokens, hidden], dtype, 200 + seed)
        if (gm, gn) != (num_tokens, hidden):
            refused(lambda: ops.scaled_fp8_quant(x, scale=torch.ones(num_tokens // gm, hidden // gn),
                                                 group_shape=group_shape), "scaled_fp8_quant", "scale")
            tally.add(False, "test_static_fp8_quant_group_2d, not per tensor (refused: static per-channel, "
                      "per-token and group scales)")
            continue
        if FP8 is None:
            tally.add(False, f"not run: {NO_FP8}")
            continue
        # vLLM's scaled_quantize for the whole tensor: x * (448 / amax), scale = its float32 reciprocal, [1, 1].
        amax = x.float().abs().max().clamp(min=1e-12)
        inv = FP8_MAX / amax
        want = vllm_quant(x, inv)
        scale = inv.reciprocal().reshape(1, 1)
        out, s = ops.scaled_fp8_quant(x, scale=scale, group_shape=group_shape)
        tally.add(s is scale and close(out.float(), want.float(), 1e-5, 1.2e-1),
                  "test_static_fp8_quant_group_2d per tensor: beyond rtol 0.12")
    for seed, (num_tokens, hidden, dtype, group_shape) in enumerate(
            itertools.product([128, 512], [256, 1024, 2048], dtypes, [(1, -1), (-1, 1)])):
        x = rand([num_tokens, hidden], dtype, 300 + seed)
        length = num_tokens if group_shape == (1, -1) else hidden
        refused(lambda: ops.scaled_fp8_quant(x, scale=torch.ones(length), group_shape=group_shape),
                "scaled_fp8_quant", "scale")
        tally.add(False, "test_static_fp8_quant_1d_scale (refused: static per-token and per-channel scales)")
    tally.report()
    if not full:
        print("  (test_fp8_quant.py: the 4096-token cases ran with 256 tokens and test_fp8_quant_large with 2048; "
              "--full runs them at full size)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true",
                        help="run vLLM's largest layernorm, rotary and fp8_quant cases at full size")
    parser.add_argument("--verbose", action="store_true", help="print the time of each part")
    parts = {f.__name__: f for f in (
        test_signatures, test_rms_norm, test_fused_add_rms_norm, test_activations, test_rotary_embedding,
        test_topk_softmax, test_moe_align_block_size, test_reshape_and_cache_flash, test_refusals,
        test_scaled_fp8_quant_plumbing, test_scaled_fp8_quant_refusals, test_scaled_fp8_quant)}
    parts.update({"vllm_layernorm_cases": lambda: vllm_layernorm_cases(args.full),
                  "vllm_activation_cases": vllm_activation_cases,
                  "vllm_pos_encoding_cases": lambda: vllm_pos_encoding_cases(args.full),
                  "vllm_rotary_embedding_cases": vllm_rotary_embedding_cases,
                  "vllm_fused_topk_cases": vllm_fused_topk_cases,
                  "vllm_fp8_quant_cases": lambda: vllm_fp8_quant_cases(args.full)})
    parser.add_argument("--part", action="append", choices=list(parts), metavar="PART",
                        help="run only this part (repeatable): " + ", ".join(parts))
    args = parser.parse_args()
    for name in args.part or parts:
        start = time.time()
        parts[name]()
        if args.verbose:
            print(f"  {name}: {time.time() - start:.1f} s")
    print(f"{passed} passed, {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
