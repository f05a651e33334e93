#!/usr/bin/env python3
"""kdispatch.compat.sgl_kernel and kdispatch.compat.flashinfer on CPU.

Every function of both modules, on random inputs of odd sizes in bfloat16,
float16 and float32, against the reference backend of the op it forwards
to (torch.ops.kdispatch.* with backend="reference", the op schema's
tolerances) and against a plain-torch formula of the peer's semantics; the
in-place and out= conventions (what is written, what is returned); strided
inputs (column slices, q and k sliced from a fused QKV output) reaching the
op as the caller's memory, with the results in the caller's tensors and the
memory around them untouched; every refusal a KD-E030 CallError naming the
function and the argument. The fp8 quantisers (sgl_kernel's per-tensor,
per-token and per-token-group ones, FlashInfer's quantising norms) run
where torch has float8 dtypes (2.1 and later) and print a skip line
otherwise; their refusals that come before an fp8 tensor is needed, and
what reaches the op, are checked on any torch.

Then the parametrisations of the peers' own unit tests (SGLang's
sgl-kernel/tests and python/sglang/jit_kernel tests, FlashInfer's tests),
their shapes, dtypes and options, as a loop through these modules on CPU
with the peers' reference formulas and tolerances: one line per peer test
file with how many of its cases pass, and why the others do not run.
Cases whose tensors exceed KD_COMPAT_PEER_ELEMENTS elements (default 2^20;
0: no limit) run on their leading rows only, said in that line.
"""
import itertools
import math
import os
import sys

try:
    import torch
except ImportError as e:
    print(f"SKIPPED: {e} (Debian: python3-torch)")
    sys.exit(77)

import kdispatch
import kdispatch.compat._forward as forward
import kdispatch.compat.flashinfer as flashinfer
import kdispatch.compat.flashinfer.activation  # noqa: F401 - the submodule spelling imports
import kdispatch.compat.flashinfer.norm  # noqa: F401
import kdispatch.compat.flashinfer.rope  # noqa: F401
import kdispatch.compat.sgl_kernel as sgl_kernel
import kdispatch.rotary
import kdispatch.testing as kt
from kdispatch.compat._common import torch_op
from fp8_codes import codes, fp8_apart

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Formula comparisons: twice the spacing of the dtype at 1, relative and absolute.
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
MODULES = (("sgl_kernel", sgl_kernel), ("flashinfer", flashinfer))
NORMS = (("rmsnorm", "layernorm.rmsnorm", False), ("gemma_rmsnorm", "layernorm.gemma_rmsnorm", True))
FUSED = (("fused_add_rmsnorm", "layernorm.fused_add_rmsnorm", False),
         ("gemma_fused_add_rmsnorm", "layernorm.gemma_fused_add_rmsnorm", True))
ACTS = ("silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul")

results = {"passed": 0, "failed": 0}
gen = torch.Generator().manual_seed(20261203)


def check(ok, what):
    if ok:
        results["passed"] += 1
    else:
        results["failed"] += 1
        print("FAIL", what)
    return ok


def randn(*shape, dtype=torch.float32, scale=1.0):
    """Random normal values (never all zeros) rounded to dtype."""
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale + 0.01).to(dtype)


def close(got, want, dtype, factor=1.0):
    """|got - want| <= tol * (1 + |want|), tol of dtype; also False on a NaN mismatch."""
    tol = TOL[dtype] * factor
    g, w = got.double(), want.double()
    if g.shape != w.shape:
        return False
    return bool(((g - w).abs() <= tol * (1 + w.abs())).all())


def matches_reference(op, got, want, what):
    verdict = kt.compare(op, got, want)
    return check(verdict.ok, f"{what}: against the reference backend: {verdict.first_mismatch}")


def reference(op, tensors, *attrs):
    """Runs `op` on the reference backend over clones of `tensors` (schema order); returns the clones."""
    copies = [None if t is None else t.clone() for t in tensors]
    torch_op(op)(*copies, *attrs, backend="reference")
    return copies


class Spy:
    """Records the data_ptr and strides of every tensor that reaches torch.ops.kdispatch."""

    def __init__(self):
        self.calls = []
        self._saved = forward.torch_op

    def __enter__(self):
        def spying(op):
            real = self._saved(op)

            def call(*args):
                self.calls.append([(a.data_ptr(), tuple(a.stride())) if isinstance(a, torch.Tensor) else a
                                   for a in args])
                return real(*args)
            return call
        forward.torch_op = spying
        return self

    def __exit__(self, *exc):
        forward.torch_op = self._saved

    def reached(self, t):
        """Whether a tensor with t's memory and strides reached the op, uncopied."""
        return any((t.data_ptr(), tuple(t.stride())) in call for call in self.calls)


def refused(fn, argument, function, *args, **kwargs):
    """fn(*args, **kwargs) raises KD-E030 naming `function` and `argument`."""
    try:
        fn(*args, **kwargs)
    except kdispatch.CallError as e:
        ok = e.code == "KD-E030" and function in e.message and f"argument '{argument}'" in e.message
        return check(ok, f"{function} refusing {argument}: message {e.message!r}")
    except Exception as e:  # noqa: BLE001 - any other exception is the failure reported
        return check(False, f"{function} refusing {argument}: raised {type(e).__name__}: {e}")
    return check(False, f"{function} refusing {argument}: no error")


# ---------------------------------------------------------------- formulas


def f_norm(x, w, eps, gemma):
    xf = x.float()
    scale = 1.0 + w.float() if gemma else w.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * scale).to(x.dtype)


def f_fused(x, r, w, eps, gemma):
    s = x.float() + r.float()
    scale = 1.0 + w.float() if gemma else w.float()
    return (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * scale).to(x.dtype), s.to(x.dtype)


def f_act(name, x):
    d = x.shape[-1] // 2
    a, b = x[..., :d].float(), x[..., d:].float()
    if name == "silu_and_mul":
        g = torch.nn.functional.silu(a)
    elif name == "gelu_and_mul":
        g = torch.nn.functional.gelu(a)
    else:
        g = torch.nn.functional.gelu(a, approximate="tanh")
    return (g * b).to(x.dtype)


def f_layernorm(x, w, b, eps):
    return torch.nn.functional.layer_norm(x.float(), (x.shape[-1],), w.float(), b.float(), eps).to(x.dtype)


def f_rope(positions, x, head_size, cache, is_neox):
    """x [n, H * head_size] rotated over the first cache.shape[-1] values of each head, in float32."""
    n = x.shape[0]
    rot = cache.shape[-1]
    xf = x.float().reshape(n, -1, head_size).clone()
    cs = cache.float()[positions.long()]
    cos, sin = cs[:, None, : rot // 2], cs[:, None, rot // 2:]
    if is_neox:
        a, b = xf[..., : rot // 2].clone(), xf[..., rot // 2: rot].clone()
        xf[..., : rot // 2], xf[..., rot // 2: rot] = a * cos - b * sin, b * cos + a * sin
    else:
        a, b = xf[..., 0:rot:2].clone(), xf[..., 1:rot:2].clone()
        xf[..., 0:rot:2], xf[..., 1:rot:2] = a * cos - b * sin, b * cos + a * sin
    return xf.reshape(x.shape).to(x.dtype)


def f_topk(gating, k, renormalize, softcap=0.0, bias=None):
    x = gating.float()
    if softcap:
        x = torch.tanh(x / softcap) * softcap
    if bias is not None:
        x = x + bias.float()
    p = torch.softmax(x, dim=-1)
    w, ids = torch.topk(p, k, dim=-1)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return w, ids, p


# ---------------------------------------------------------------- own checks

SIZES = ((1, 1), (7, 7), (3, 111), (33, 4097))


def test_norms():
    for (mname, mod), (name, op, gemma), dtype, (rows, h) in itertools.product(MODULES, NORMS, DTYPES, SIZES):
        fn = getattr(mod, name)
        what = f"{mname}.{name} {dtype} [{rows}, {h}]"
        for wdtype in sorted({dtype, torch.float32}, key=str):
            x, w = randn(rows, h, dtype=dtype), randn(h, dtype=wdtype)
            y = fn(x, w, 1e-5)
            want = reference(op, [torch.empty_like(x), x, w], 1e-5)
            matches_reference(op, [y, x, w], want, f"{what} weight {wdtype}")
            check(close(y, f_norm(x, w, 1e-5, gemma), dtype), f"{what} weight {wdtype}: formula")
        # out= is filled and returned; enable_pdl changes nothing.
        out = torch.full_like(x, 7.0)
        ptr = out.data_ptr()
        ret = fn(x, w, eps=1e-5, out=out, enable_pdl=True)
        check(ret is out and out.data_ptr() == ptr and torch.equal(out, y), f"{what}: out= filled and returned")
        check(torch.equal(fn(x, w, 1e-5, enable_pdl=False), y), f"{what}: enable_pdl=False gives the same")
        # A column slice in, a column slice of a wider buffer out.
        xbuf, obuf = randn(rows, h + 5, dtype=dtype), torch.full((rows, h + 3), 5.0, dtype=dtype)
        xs, outs = xbuf[:, 2:h + 2], obuf[:, 1:h + 1]
        xcopy = xbuf.clone()
        with Spy() as spy:
            ret = fn(xs, w, 1e-5, out=outs)
        check(spy.reached(xs) and spy.reached(outs), f"{what}: strided input and out reach the op uncopied")
        check(ret is outs and torch.equal(outs, fn(xs.contiguous(), w, 1e-5)), f"{what}: strided out written")
        check(bool((obuf[:, 0] == 5).all() and (obuf[:, h + 1:] == 5).all()) and torch.equal(xbuf, xcopy),
              f"{what}: the memory around the strided views is untouched")


def test_flashinfer_3d_norm():
    # FlashInfer's 3D form: per-head norm of q sliced from a fused QKV output.
    n, hq, hk, d = 5, 3, 2, 64
    for dtype in DTYPES:
        qkv = randn(n, (hq + 2 * hk) * d, dtype=dtype)
        q = qkv[:, : hq * d].view(n, hq, d)
        w = randn(d, dtype=torch.float32)
        with Spy() as spy:
            y = flashinfer.norm.rmsnorm(q, w)
        check(spy.reached(q) and close(y, f_norm(q, w, 1e-6, False), dtype),
              f"flashinfer.norm.rmsnorm 3D q view {dtype}")
        # out= the input itself: kdispatch's ops write no tensor that overlaps another argument.
        refused(flashinfer.rmsnorm, "out", "flashinfer.rmsnorm", q, w, out=q)


def test_fused():
    for (mname, mod), (name, op, gemma), dtype, (rows, h) in itertools.product(MODULES, FUSED, DTYPES, SIZES):
        fn = getattr(mod, name)
        what = f"{mname}.{name} {dtype} [{rows}, {h}]"
        for wdtype in sorted({dtype, torch.float32}, key=str):
            x, r, w = randn(rows, h, dtype=dtype), randn(rows, h, dtype=dtype), randn(h, dtype=wdtype)
            want = reference(op, [x, r, w], 1e-6)
            fx, fr = f_fused(x, r, w, 1e-6, gemma)
            ptrs = (x.data_ptr(), r.data_ptr())
            ret = fn(x, r, w, 1e-6, enable_pdl=None)
            check(ret is None and (x.data_ptr(), r.data_ptr()) == ptrs, f"{what}: returns None, in place")
            matches_reference(op, [x, r, w], want, f"{what} weight {wdtype}")
            check(close(x, fx, dtype) and torch.equal(r, fr), f"{what} weight {wdtype}: formula (float32 sum)")
        # Column slices of wider buffers, updated where they are.
        xbuf, rbuf = randn(rows, h + 4, dtype=dtype), randn(rows, h + 2, dtype=dtype)
        xs, rs = xbuf[:, 3:h + 3], rbuf[:, :h]
        fx, fr = f_fused(xs, rs, w, 1e-6, gemma)
        want = reference(op, [xs.contiguous(), rs.contiguous(), w], 1e-6)
        edges = (xbuf[:, :3].clone(), xbuf[:, h + 3:].clone(), rbuf[:, h:].clone())
        with Spy() as spy:
            fn(xs, rs, w, 1e-6)
        check(spy.reached(xs) and spy.reached(rs), f"{what}: strided x and residual reach the op uncopied")
        matches_reference(op, [xs, rs, w], want, f"{what}: strided results where they are")
        check(torch.equal(xbuf[:, :3], edges[0]) and torch.equal(xbuf[:, h + 3:], edges[1])
              and torch.equal(rbuf[:, h:], edges[2]), f"{what}: the memory around the views is untouched")


def test_quant_norms():
    # FlashInfer's rmsnorm_quant and fused_add_rmsnorm_quant: out in fp8, the
    # scale a float, a float32 tensor [1] or a 0-dim one.
    if not hasattr(torch, "float8_e4m3fn"):
        print(f"skip flashinfer.rmsnorm_quant, fused_add_rmsnorm_quant: this torch ({torch.__version__}) "
              "has no float8")
        return
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    for dtype, odtype, (rows, h) in itertools.product(DTYPES, fp8, SIZES):
        what = f"{dtype} -> {odtype} [{rows}, {h}]"
        for scale in (0.05, torch.tensor([0.5]), torch.tensor(2.0)):
            x, w = randn(rows, h, dtype=dtype), randn(h, dtype=torch.float32)
            s = scale if isinstance(scale, torch.Tensor) else torch.tensor([scale])
            op = "layernorm.rmsnorm_quant_fp8"
            out = torch.full((rows, h), 7.0).to(odtype)
            want = reference(op, [out, x, w, s.view(1)], 1e-6)
            ret = flashinfer.norm.rmsnorm_quant(out, x, w, scale, 1e-6, enable_pdl=True)
            check(ret is None, f"flashinfer.rmsnorm_quant {what}: returns None")
            matches_reference(op, [out, x, w, s.view(1)], want, f"flashinfer.rmsnorm_quant {what} scale {scale}")
            xf, top = x.float(), torch.finfo(odtype).max
            formula = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w * (1 / float(s))
            # within one step of the fp8 format (a quarter of the value at most)
            check(close(out.double(), formula.clamp(-top, top).to(odtype).double(), torch.bfloat16, factor=16),
                  f"flashinfer.rmsnorm_quant {what}: formula")
            op = "layernorm.fused_add_rmsnorm_quant_fp8"
            r = randn(rows, h, dtype=dtype)
            want = reference(op, [out, x, r, w, s.view(1)], 1e-6)
            xcopy = x.clone()
            ret = flashinfer.fused_add_rmsnorm_quant(out, x, r, w, scale, eps=1e-6)
            check(ret is None and torch.equal(x, xcopy), f"flashinfer.fused_add_rmsnorm_quant {what}: x only read")
            matches_reference(op, [out, x, r, w, s.view(1)], want,
                              f"flashinfer.fused_add_rmsnorm_quant {what} scale {scale}")
    x, w = randn(3, 8), randn(8)
    refused(flashinfer.rmsnorm_quant, "out", "flashinfer.rmsnorm_quant", torch.empty(3, 8), x, w, 1.0)
    refused(flashinfer.rmsnorm_quant, "scale", "flashinfer.rmsnorm_quant", torch.empty(3, 8).to(fp8[0]), x, w,
            torch.tensor([1.0, 2.0]))


def test_activations():
    for (mname, mod), name, dtype, (rows, d) in itertools.product(MODULES, ACTS, DTYPES, SIZES):
        fn = getattr(mod, name)
        op = f"activation.{name}"
        what = f"{mname}.{name} {dtype} [{rows}, 2*{d}]"
        x = randn(rows, 2 * d, dtype=dtype, scale=2.0)
        y = fn(x)
        check(y.shape == (rows, d) and y.dtype == dtype, f"{what}: new [*, D] output")
        matches_reference(op, [y, x], reference(op, [torch.empty_like(y), x]), what)
        check(close(y, f_act(name, x), dtype), f"{what}: formula")
        out = torch.full_like(y, 3.0)
        check(fn(x, out=out, enable_pdl=True) is out and torch.equal(out, y), f"{what}: out= filled and returned")
        # 3D input; strided input and out.
        x3 = randn(2, rows, 2 * d, dtype=dtype)
        check(torch.equal(fn(x3), fn(x3.reshape(2 * rows, 2 * d)).reshape(2, rows, d)), f"{what}: 3D input")
        xbuf, obuf = randn(rows, 2 * d + 3, dtype=dtype), torch.full((rows, d + 2), 9.0, dtype=dtype)
        xs, outs = xbuf[:, 1:2 * d + 1], obuf[:, 2:]
        with Spy() as spy:
            ret = fn(xs, outs)
        check(spy.reached(xs) and spy.reached(outs), f"{what}: strided input and out reach the op uncopied")
        check(ret is outs and torch.equal(outs, fn(xs.contiguous())) and bool((obuf[:, :2] == 9).all()),
              f"{what}: strided out written, the rest untouched")


def test_layernorm():
    for dtype, (rows, h) in itertools.product(DTYPES, SIZES):
        what = f"flashinfer.layernorm {dtype} [{rows}, {h}]"
        for pdtype in sorted({dtype, torch.float32}, key=str):
            x = randn(rows, h, dtype=dtype, scale=3.0)
            g, b = randn(h, dtype=pdtype), randn(h, dtype=pdtype)
            y = flashinfer.norm.layernorm(x, g, b, 1e-6)
            check(y is not x and y.shape == x.shape, f"{what}: a new tensor")
            matches_reference("layernorm.layernorm", [y, x, g, b],
                              reference("layernorm.layernorm", [torch.empty_like(x), x, g, b], 1e-6), what)
            check(close(y, f_layernorm(x, g, b, 1e-6), dtype, factor=4), f"{what} params {pdtype}: formula")
        xbuf = randn(rows, h + 2, dtype=dtype)
        with Spy() as spy:
            y = flashinfer.layernorm(xbuf[:, 1:h + 1], g, b)
        want = flashinfer.layernorm(xbuf[:, 1:h + 1].contiguous(), g, b)
        check(spy.reached(xbuf[:, 1:h + 1]) and torch.equal(y, want),
              f"{what}: strided input reaches the op uncopied")


ROPE_CASES = ((5, 2, 1, 64, 64), (7, 3, 2, 80, 48), (1, 1, 1, 2, 2), (33, 4, 2, 128, 96))


def test_rope():
    for (n, hq, hk, d, rot), dtype, is_neox, pdtype in itertools.product(ROPE_CASES, DTYPES, (True, False),
                                                                        (torch.int64, torch.int32)):
        what = f"rope {dtype} n={n} hq={hq} hk={hk} d={d} rot={rot} neox={is_neox} {pdtype}"
        cache = kdispatch.rotary.cos_sin_cache(rot, 50)
        positions = torch.randint(0, 50, (n,), generator=gen).to(pdtype)
        qkv = randn(n, (hq + 2 * hk) * d, dtype=dtype)
        q, k = qkv[:, : hq * d], qkv[:, hq * d:(hq + hk) * d]
        v = qkv[:, (hq + hk) * d:].clone()
        want = reference("embeddings.rotary_embedding",
                         [positions, q.reshape(n, hq, d), k.reshape(n, hk, d), cache], is_neox)
        fq, fk = f_rope(positions, q, d, cache, is_neox), f_rope(positions, k, d, cache, is_neox)
        q0, k0 = q.clone(), k.clone()
        # FlashInfer's functional form: new tensors, the inputs only read.
        qo, ko = flashinfer.rope.apply_rope_with_cos_sin_cache(positions, q, k, d, cache, is_neox=is_neox)
        check(torch.equal(q, q0) and torch.equal(k, k0) and qo.shape == q.shape and ko.shape == k.shape,
              f"flashinfer.apply_rope_with_cos_sin_cache {what}: new tensors, inputs unchanged")
        matches_reference("embeddings.rotary_embedding", [positions, qo.view(n, hq, d), ko.view(n, hk, d), cache],
                          want, f"flashinfer.apply_rope_with_cos_sin_cache {what}")
        for mname, mod in MODULES:
            qkv_run = qkv.clone()
            qr, kr = qkv_run[:, : hq * d], qkv_run[:, hq * d:(hq + hk) * d]
            ptrs = (qr.data_ptr(), kr.data_ptr())
            with Spy() as spy:
                ret = mod.apply_rope_with_cos_sin_cache_inplace(positions, qr, kr, d, cache, is_neox)
            w = f"{mname}.apply_rope_with_cos_sin_cache_inplace {what}"
            check(ret is None and (qr.data_ptr(), kr.data_ptr()) == ptrs and spy.reached(positions),
                  f"{w}: in place, returns None, positions as given")
            check(spy.reached(qr) and spy.reached(kr) and any(c[-1] == d for c in spy.calls),
                  f"{w}: q and k reach the op as the flattened slices of the QKV buffer, with head_size")
            matches_reference("embeddings.rotary_embedding",
                              [positions, qr.view(n, hq, d), kr.view(n, hk, d), cache], want, w)
            check(close(qr, fq, dtype) and close(kr, fk, dtype), f"{w}: formula")
            check(torch.equal(qkv_run[:, (hq + hk) * d:], v), f"{w}: v untouched")
        # positions [2, n] with query and key [2, n, H * D].
        pos2 = torch.stack((positions, positions.flip(0)))
        q2, k2 = randn(2, n, hq * d, dtype=dtype), randn(2, n, hk * d, dtype=dtype)
        want2 = reference("embeddings.rotary_embedding",
                          [pos2, q2.view(2, n, hq, d), k2.view(2, n, hk, d), cache], is_neox)
        sgl_kernel.apply_rope_with_cos_sin_cache_inplace(pos2, q2, k2, d, cache, is_neox)
        matches_reference("embeddings.rotary_embedding", [pos2, q2.view(2, n, hq, d), k2.view(2, n, hk, d), cache],
                          want2, f"rope positions [2, n] {what}")
        # key=None: only query rotated.
        q1 = q0.clone()
        sgl_kernel.apply_rope_with_cos_sin_cache_inplace(positions, q1, None, d, cache, is_neox)
        matches_reference("embeddings.rotary_embedding", [positions, q1.view(n, hq, d), want[2], cache], want,
                          f"rope key=None {what}")


def test_topk():
    for dtype, (t, e, k) in itertools.product(DTYPES, ((1, 4, 1), (7, 9, 3), (33, 64, 8), (5, 257, 6))):
        gating = randn(t, e, dtype=dtype, scale=2.0)
        bias = randn(e, dtype=torch.float32, scale=0.5)
        for renorm, softcap, with_bias in itertools.product((False, True), (0.0, 30.0), (False, True)):
            what = f"sgl_kernel.topk_softmax {dtype} [{t}, {e}] K={k} renormalize={renorm} softcap={softcap} " \
                   f"bias={with_bias}"
            b = bias if with_bias else None
            w, ids = torch.full((t, k), -1.0), torch.full((t, k), -1, dtype=torch.int32)
            ret = sgl_kernel.topk_softmax(w, ids, gating, renorm, softcap, b)
            rw, rids = torch.empty(t, k), torch.empty(t, k, dtype=torch.int32)
            torch_op("moe.topk_softmax")(rw, rids, gating, b, None, renorm, softcap, "reference")
            check(ret is None and torch.equal(ids, rids) and close(w, rw, torch.float32), f"{what}: reference")
            fw, _, p = f_topk(gating, k, renorm, softcap, b)
            picked = p.gather(1, ids.long())
            if renorm:
                picked = picked / picked.sum(-1, keepdim=True)
            check(close(w, fw, torch.float32, factor=5) and close(w, picked, torch.float32, factor=5),
                  f"{what}: formula")
        # Keywords, a negative softcap, int64 ids, a strided gating_output.
        w2, ids2 = torch.empty(t, k), torch.empty(t, k, dtype=torch.int64)
        sgl_kernel.topk_softmax(topk_weights=w2, topk_ids=ids2, gating_output=gating, renormalize=True,
                                moe_softcapping=-30.0, correction_bias=bias)
        w3, ids3 = torch.empty(t, k), torch.empty(t, k, dtype=torch.int32)
        sgl_kernel.topk_softmax(w3, ids3, gating, True, 30.0, bias)
        check(torch.equal(ids2.int(), ids3) and torch.equal(w2, w3), f"topk_softmax {dtype}: keywords, -c is c")
        gbuf = randn(t, e + 3, dtype=dtype)
        with Spy() as spy:
            sgl_kernel.topk_softmax(w2, ids2, gbuf[:, 2:])
        sgl_kernel.topk_softmax(w3, ids3, gbuf[:, 2:].contiguous())
        check(spy.reached(gbuf[:, 2:]) and torch.equal(w2, w3), f"topk_softmax {dtype}: strided gating_output")
        # sgl_kernel's earlier form: (topk_weights, topk_ids, token_expert_indices, gating_output).
        tei = torch.full((t, k), -5, dtype=torch.int32)
        sgl_kernel.topk_softmax(w2, ids3, tei, gating)
        want_tei = (torch.arange(k)[None, :] * t + torch.arange(t)[:, None]).int()
        fw, _, _ = f_topk(gating, k, False)
        check(torch.equal(tei, want_tei) and close(w2, fw, torch.float32, factor=5),
              f"topk_softmax {dtype}: the form with token_expert_indices")
        tei2 = torch.full((t, k), -5, dtype=torch.int32)
        sgl_kernel.topk_softmax(w2, ids3, gating, token_expert_indices=tei2)
        check(torch.equal(tei2, want_tei), f"topk_softmax {dtype}: token_expert_indices=")


def test_moe_align():
    for (t, k, e, b), ids_dtype in itertools.product(((1, 1, 1, 1), (7, 3, 5, 4), (33, 8, 64, 16)),
                                                    (torch.int32, torch.int64)):
        ids = torch.randint(0, e, (t, k), dtype=ids_dtype)
        padded = ids.numel() + e * (b - 1)
        outs = [torch.full([padded], -7, dtype=torch.int32), torch.full([-(-padded // b)], -7, dtype=torch.int32),
                torch.full([1], -7, dtype=torch.int32)]
        cumsum = torch.full([e + 1], -3, dtype=torch.int32)
        ret = sgl_kernel.moe_align_block_size(ids, e, b, *outs, cumsum, True)
        want = [torch.empty_like(o) for o in outs]
        torch_op("moe.align_block_size")(ids, *want, e, b, "reference")
        check(ret is None and all(torch.equal(a, w) for a, w in zip(outs, want)) and bool((cumsum == -3).all()),
              f"sgl_kernel.moe_align_block_size [{t}, {k}] of {e}, block {b}, {ids_dtype}: reference")


def test_spellings():
    fi = flashinfer
    pairs = [(fi.norm.rmsnorm, fi.rmsnorm), (fi.norm.fused_add_rmsnorm, fi.fused_add_rmsnorm),
             (fi.norm.gemma_rmsnorm, fi.gemma_rmsnorm), (fi.norm.gemma_fused_add_rmsnorm, fi.gemma_fused_add_rmsnorm),
             (fi.norm.layernorm, fi.layernorm), (fi.activation.silu_and_mul, fi.silu_and_mul),
             (fi.activation.gelu_and_mul, fi.gelu_and_mul), (fi.activation.gelu_tanh_and_mul, fi.gelu_tanh_and_mul),
             (fi.rope.apply_rope_with_cos_sin_cache, fi.apply_rope_with_cos_sin_cache),
             (fi.rope.apply_rope_with_cos_sin_cache_inplace, fi.apply_rope_with_cos_sin_cache_inplace)]
    check(all(a is b for a, b in pairs), "flashinfer: the submodule and top-level spellings are the same functions")
    check(sys.modules["kdispatch.compat.flashinfer.norm"] is fi.norm, "import kdispatch.compat.flashinfer.norm")
    from kdispatch.compat.flashinfer.activation import silu_and_mul
    check(silu_and_mul is fi.silu_and_mul, "from kdispatch.compat.flashinfer.activation import silu_and_mul")
    for name in sgl_kernel.__all__:
        check(callable(getattr(sgl_kernel, name)), f"sgl_kernel.{name}")


def test_refusals():
    x64, w64 = randn(3, 8, dtype=torch.float64), randn(8, dtype=torch.float64)
    x, w = randn(3, 8, dtype=torch.bfloat16), randn(8, dtype=torch.bfloat16)
    wide = randn(3, 16, dtype=torch.bfloat16)
    for mname, mod in MODULES:
        for name in ("rmsnorm", "gemma_rmsnorm"):
            fn, f = getattr(mod, name), f"{mname}.{name}"
            refused(fn, "input", f, x64, w64)
            refused(fn, "input", f, wide[:, ::2], w)                    # a strided last dim
            refused(fn, "weight", f, x, randn(8, dtype=torch.float16))  # neither input's dtype nor float32
            refused(fn, "weight", f, x, randn(16, dtype=torch.bfloat16)[::2])
            refused(fn, "out", f, x, w, out=torch.empty(3, 8, dtype=torch.float32))
            refused(fn, "out", f, x, w, out=torch.empty(3, 9, dtype=torch.bfloat16))
            refused(fn, "enable_pdl", f, x, w, enable_pdl="yes")
        for name in ("fused_add_rmsnorm", "gemma_fused_add_rmsnorm"):
            fn, f = getattr(mod, name), f"{mname}.{name}"
            refused(fn, "input", f, x64, x64.clone(), w64)
            refused(fn, "residual", f, x.clone(), x.float(), w)
            refused(fn, "residual", f, x.clone(), wide[:, ::2], w)
        for name in ACTS:
            fn, f = getattr(mod, name), f"{mname}.{name}"
            refused(fn, "input", f, randn(3, 8, dtype=torch.float64))
            refused(fn, "input", f, wide[:, ::2])
            refused(fn, "out", f, x, out=torch.empty(3, 4, dtype=torch.float16))
            refused(fn, "out", f, x, out=torch.empty(3, 5, dtype=torch.bfloat16))
        f = f"{mname}.apply_rope_with_cos_sin_cache_inplace"
        fn = mod.apply_rope_with_cos_sin_cache_inplace
        pos, cache = torch.arange(3), kdispatch.rotary.cos_sin_cache(8, 4)
        refused(fn, "query", f, pos, randn(3, 16, dtype=torch.float64), randn(3, 8, dtype=torch.float64), 8, cache)
        refused(fn, "query", f, pos, randn(3, 12), randn(3, 8), 8, cache)          # 12 is not H * 8
        refused(fn, "key", f, pos, randn(3, 16), randn(3, 8, dtype=torch.float16), 8, cache)
        refused(fn, "cos_sin_cache", f, pos, randn(3, 16), randn(3, 8), 8, cache.double())
        refused(fn, "positions", f, pos.float(), randn(3, 16), randn(3, 8), 8, cache)
        refused(fn, "query", f, pos, randn(3, 32)[:, ::2], randn(3, 8), 8, cache)  # strided within a head
        refused(fn, "head_size", f, pos, randn(3, 16), randn(3, 8), 0, cache)
        refused(fn, "query", f, pos, randn(3, 2, 16), randn(3, 8), 8, cache)      # [*, H, D] with D != 8
        refused(fn, "key", f, pos, randn(3, 16), randn(3, 12), 8, cache)          # 12 is not H * 8
    refused(sgl_kernel.apply_rope_with_cos_sin_cache_inplace, "fused_set_kv_buffer_arg",
            "sgl_kernel.apply_rope_with_cos_sin_cache_inplace", torch.arange(3), randn(3, 16), randn(3, 8), 8,
            kdispatch.rotary.cos_sin_cache(8, 4), True, object())
    refused(flashinfer.apply_rope_with_cos_sin_cache, "backend", "flashinfer.apply_rope_with_cos_sin_cache",
            torch.arange(3), randn(3, 16), randn(3, 8), 8, kdispatch.rotary.cos_sin_cache(8, 4), backend="triton")
    refused(flashinfer.layernorm, "input", "flashinfer.layernorm", x64, w64, w64)
    refused(flashinfer.layernorm, "gemma", "flashinfer.layernorm", x, randn(8, dtype=torch.float16), w.float())
    refused(flashinfer.layernorm, "beta", "flashinfer.layernorm", x, w, randn(8, dtype=torch.float16))
    f = "sgl_kernel.topk_softmax"
    g = randn(4, 6)
    w_, i_ = torch.empty(4, 2), torch.empty(4, 2, dtype=torch.int32)
    refused(sgl_kernel.topk_softmax, "gating_output", f, w_, i_, g.double())
    refused(sgl_kernel.topk_softmax, "correction_bias", f, w_, i_, g, False, 0.0, randn(6, dtype=torch.bfloat16))
    refused(sgl_kernel.topk_softmax, "topk_weights", f, torch.empty(4, 2, dtype=torch.bfloat16), i_, g)
    refused(sgl_kernel.topk_softmax, "topk_ids", f, w_, torch.empty(4, 2, dtype=torch.int16), g)
    refused(sgl_kernel.topk_softmax, "token_expert_indices", f, w_, i_, torch.empty(4, 2, dtype=torch.int64), g)
    refused(sgl_kernel.topk_softmax, "renormalize", f, w_, i_, g, "yes")
    # K = 7 top experts of E = 6.
    refused(sgl_kernel.topk_softmax, "topk_weights", f, torch.empty(4, 7), torch.empty(4, 7, dtype=torch.int32), g)
    refused(sgl_kernel.topk_softmax, "gating_output", f, w_, i_, randn(4, 12)[:, ::2])


# ---------------------------------------------------------------- fp8 quantisers

FP8S = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))
NO_FP8 = f"torch {torch.__version__} has no float8 dtypes"
# The quantisers' inputs come from a generator of their own, so that the
# other tests' inputs are the same with and without float8 dtypes.
qgen = torch.Generator().manual_seed(20261205)
PER_TENSOR = "quantization.per_tensor_quant_fp8"
PER_TOKEN = "quantization.per_token_quant_fp8"
GROUP = "quantization.per_token_group_quant_fp8"


def qrandn(*shape, dtype=torch.float32, scale=1.0):
    """Random normal values (never all zeros) rounded to dtype, from qgen."""
    return (torch.randn(*shape, generator=qgen, dtype=torch.float64) * scale + 0.01).to(dtype)


def fp8_max(dtype):
    return {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}[str(dtype).split(".")[1]]


def poisoned_fp8(shape, dtype):
    """An fp8 tensor of code 0x7f, NaN in float8_e4m3fn and in float8_e5m2."""
    return torch.full(shape, 0x7F, dtype=torch.uint8).view(dtype)


def f_quant(x, s, dtype):
    """The peers' conversion: the float32 product x * (1 / s), clamped to the format's range and rounded."""
    top = fp8_max(dtype)
    return (x.float() * (1.0 / s)).clamp(-top, top).to(dtype)


def f_group_scales(x, group_size, eps, dtype, ue8m0):
    """max(absmax of each group, eps) / fp8_max, [*, G]; with ue8m0 rounded up to a power of two."""
    g = x.float().reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)
    s = g.abs().amax(-1).clamp(min=eps) / fp8_max(dtype)
    if ue8m0:
        mantissa, exponent = torch.frexp(s)
        s = torch.where(mantissa == 0.5, s, torch.ldexp(torch.ones_like(s), exponent))
    return s


def f_group_quant(x, s, group_size, dtype):
    return f_quant(x, s.repeat_interleave(group_size, dim=-1), dtype)


GROUP_CASES = ((1, 16, 16), (7, 96, 32), (3, 21, 7), (33, 256, 128), (5, 896, 128))  # rows, N, group_size


def group_scales_buffer(rows, groups, layout):
    """output_s [rows, G] poisoned with -1: row-major, column-major (a [G, rows] buffer's .t()) or
    SGLang's TMA-aligned column-major (rows padded to a multiple of 4); also returns the buffer's
    padding (columns past rows, empty but for the TMA-aligned layout)."""
    if layout == "row":
        return torch.full((rows, groups), -1.0), torch.empty(0)
    padded = rows if layout == "column" else (rows + 3) // 4 * 4
    buf = torch.full((groups, padded), -1.0)
    return buf.t()[:rows], buf[:, rows:]


def test_quantizers():
    if not FP8S:
        print(f"skip sgl_kernel.sgl_per_tensor_quant_fp8, sgl_per_token_quant_fp8, sgl_per_token_group_quant_fp8: "
              f"{NO_FP8}")
        return
    for dtype, odtype, (rows, n) in itertools.product(DTYPES, FP8S, SIZES):
        top = fp8_max(odtype)
        x = qrandn(rows, n, dtype=dtype, scale=3.0)
        x0 = x.clone()
        what = f"{dtype} -> {odtype} [{rows}, {n}]"
        # Per tensor, dynamic: output_s (poisoned) written.
        q, s = poisoned_fp8((rows, n), odtype), torch.full([1], -1.0)
        ret = sgl_kernel.sgl_per_tensor_quant_fp8(x, q, s, False)
        want = reference(PER_TENSOR, [x, poisoned_fp8((rows, n), odtype), torch.full([1], -1.0)], False)
        matches_reference(PER_TENSOR, [x, q, s], want, f"sgl_per_tensor_quant_fp8 dynamic {what}")
        check(ret is None and torch.equal(x, x0) and torch.equal(s, (x.float().abs().max() / top).reshape(1))
              and fp8_apart(q, f_quant(x, s, odtype)) <= 1, f"sgl_per_tensor_quant_fp8 dynamic {what}: formula")
        # Static: a 0-dim scale (1.5 times the dynamic one) read, left as it is.
        scale = (s * 1.5).reshape(())
        scale0 = scale.clone()
        q2 = poisoned_fp8((rows, n), odtype)
        sgl_kernel.sgl_per_tensor_quant_fp8(x, q2, scale, True)
        want = reference(PER_TENSOR, [x, poisoned_fp8((rows, n), odtype), scale.reshape(1)], True)
        matches_reference(PER_TENSOR, [x, q2, scale.reshape(1)], want, f"sgl_per_tensor_quant_fp8 static {what}")
        check(torch.equal(scale, scale0) and fp8_apart(q2, f_quant(x, scale, odtype)) <= 1,
              f"sgl_per_tensor_quant_fp8 static {what}: scale only read, formula")
        # Per token: output_s [T] and SGLang's [T, 1].
        q3, s3 = poisoned_fp8((rows, n), odtype), torch.full([rows], -1.0)
        ret = sgl_kernel.sgl_per_token_quant_fp8(x, q3, s3)
        want = reference(PER_TOKEN, [x, poisoned_fp8((rows, n), odtype), torch.full([rows], -1.0)])
        matches_reference(PER_TOKEN, [x, q3, s3], want, f"sgl_per_token_quant_fp8 {what}")
        check(ret is None and torch.equal(s3, x.float().abs().amax(-1) / top)
              and fp8_apart(q3, f_quant(x, s3[:, None], odtype)) <= 1, f"sgl_per_token_quant_fp8 {what}: formula")
        q4, s4 = poisoned_fp8((rows, n), odtype), torch.full([rows, 1], -1.0)
        sgl_kernel.sgl_per_token_quant_fp8(x, q4, s4)
        check(torch.equal(codes(q4), codes(q3)) and torch.equal(s4[:, 0], s3),
              f"sgl_per_token_quant_fp8 {what}: output_s [T, 1]")
        # Column slices in and out, the memory around them untouched.
        xb = qrandn(rows, n + 5, dtype=dtype, scale=3.0)
        xs = xb[:, 2:n + 2]
        for name, fn, extra in (("sgl_per_tensor_quant_fp8", sgl_kernel.sgl_per_tensor_quant_fp8, (False,)),
                                ("sgl_per_token_quant_fp8", sgl_kernel.sgl_per_token_quant_fp8, ())):
            ob = poisoned_fp8((rows, n + 3), odtype)
            os_ = ob[:, 1:n + 1]
            s5, s6 = torch.empty(1 if extra else rows), torch.empty(1 if extra else rows)
            q6 = poisoned_fp8((rows, n), odtype)
            with Spy() as spy:
                fn(xs, os_, s5, *extra)
            fn(xs.contiguous(), q6, s6, *extra)
            check(spy.reached(xs) and spy.reached(os_) and torch.equal(codes(os_), codes(q6)) and torch.equal(s5, s6)
                  and bool((codes(ob[:, :1]) == 0x7F).all() and (codes(ob[:, n + 1:]) == 0x7F).all()),
                  f"{name} {what}: strided input and output_q where they are, the memory around untouched")
    for dtype, odtype, (rows, n, g), ue8m0, eps in itertools.product(DTYPES, FP8S, GROUP_CASES, (False, True),
                                                                     (1e-10, 0.25)):
        top, groups = fp8_max(odtype), n // g
        x = qrandn(rows, n, dtype=dtype, scale=3.0)
        x[:, :g] *= 0.01  # a first group below eps 0.25
        what = f"sgl_per_token_group_quant_fp8 {dtype} -> {odtype} [{rows}, {n}] group {g} ue8m0={ue8m0} eps={eps}"
        want_s = f_group_scales(x, g, eps, odtype, ue8m0)
        want = reference(GROUP, [x, poisoned_fp8((rows, n), odtype), torch.full((rows, groups), -1.0)], g, eps,
                         ue8m0)
        for layout in ("row", "column", "tma"):
            s, padding = group_scales_buffer(rows, groups, layout)
            q = poisoned_fp8((rows, n), odtype)
            with Spy() as spy:
                ret = sgl_kernel.sgl_per_token_group_quant_fp8(x, q, s, g, eps, -top, top, ue8m0)
            check(ret is None and spy.reached(s), f"{what} {layout}: output_s reaches the op as it is")
            matches_reference(GROUP, [x, q, s.contiguous()], want, f"{what} {layout}")
            check(torch.equal(s, want_s) and fp8_apart(q, f_group_quant(x, want_s, g, odtype)) <= 1,
                  f"{what} {layout}: formula")
            check(bool((padding == -1).all()), f"{what} {layout}: the padding of the scale buffer untouched")
        # The current name with its keywords.
        q2, s2 = poisoned_fp8((rows, n), odtype), torch.full((rows, groups), -1.0)
        sgl_kernel.sgl_per_token_group_quant_8bit(input=x, output_q=q2, output_s=s2, group_size=g, eps=eps,
                                                  fp8_min=-top, fp8_max=top, scale_ue8m0=ue8m0, enable_v2=True)
        matches_reference(GROUP, [x, q2, s2], want, f"{what}: sgl_per_token_group_quant_8bit by keyword")
    # Refusals that need an fp8 tensor.
    e4, e5 = FP8S
    x = qrandn(4, 16)
    refused(sgl_kernel.sgl_per_token_group_quant_fp8, "fp8_max", "sgl_kernel.sgl_per_token_group_quant_8bit", x,
            torch.empty(4, 16, dtype=e5), torch.empty(4, 2), 8, 1e-10, -448.0, 448.0)
    refused(sgl_kernel.sgl_per_token_group_quant_fp8, "output_s", "sgl_kernel.sgl_per_token_group_quant_8bit", x,
            torch.empty(4, 16, dtype=e4), torch.empty(4, 1, dtype=torch.int32), 16, 1e-10, -448.0, 448.0, True)
    refused(sgl_kernel.sgl_per_token_group_quant_fp8, "output_s", "sgl_kernel.sgl_per_token_group_quant_8bit", x,
            torch.empty(4, 16, dtype=e4), torch.empty(4, 2, dtype=torch.float16), 8, 1e-10, -448.0, 448.0)
    refused(sgl_kernel.sgl_per_tensor_quant_fp8, "output_s", "sgl_kernel.sgl_per_tensor_quant_fp8", x,
            torch.empty(4, 16, dtype=e4), torch.ones(2), True)
    refused(sgl_kernel.sgl_per_token_quant_fp8, "output_s", "sgl_kernel.sgl_per_token_quant_fp8", x,
            torch.empty(4, 16, dtype=e4), torch.empty(4, 2))
    refused(sgl_kernel.sgl_per_token_quant_fp8, "input", "sgl_kernel.sgl_per_token_quant_fp8", x.double(),
            torch.empty(4, 16, dtype=e4), torch.empty(4))
    refused(sgl_kernel.sgl_per_token_quant_fp8, "output_q", "sgl_kernel.sgl_per_token_quant_fp8", x,
            torch.empty(4, 17, dtype=e4), torch.empty(4))


def test_quant_refusals():
    """The quantisers' refusals that come before any fp8 tensor is needed (or
    from the op's dtype check of output_q): they run on a torch without float8."""
    x = qrandn(4, 16)
    q = torch.empty(4, 16)  # float32: not an fp8 output
    f = "sgl_kernel.sgl_per_token_group_quant_8bit"
    group = sgl_kernel.sgl_per_token_group_quant_fp8
    check(group is sgl_kernel.sgl_per_token_group_quant_8bit, "sgl_per_token_group_quant_fp8 is the _8bit function")
    refused(group, "fp8_max", f, x, q, torch.empty(4, 2), 8, 1e-10, -240.0, 240.0)   # ROCm's fnuz range
    refused(group, "fp8_min", f, x, q, torch.empty(4, 2), 8, 1e-10, -447.0, 448.0)
    refused(group, "output_q", f, x, torch.empty(4, 16, dtype=torch.int8), torch.empty(4, 2), 8, 1e-10, -128.0,
            127.0)
    refused(group, "group_size", f, x, q, torch.empty(4, 2), 0, 1e-10, -448.0, 448.0)
    refused(group, "group_size", f, x, q, torch.empty(4, 2), 5, 1e-10, -448.0, 448.0)
    refused(group, "group_size", f, x, q, torch.empty(4, 4), 8, 1e-10, -448.0, 448.0)  # 16 / 8 is not 4 groups
    refused(group, "fuse_silu_and_mul", f, x, q, torch.empty(4, 2), 8, 1e-10, -448.0, 448.0, False, True)
    refused(group, "masked_m", f, x, q, torch.empty(4, 2), 8, 1e-10, -448.0, 448.0, masked_m=torch.ones(1))
    refused(group, "enable_v2", f, x, q, torch.empty(4, 2), 8, 1e-10, -448.0, 448.0, enable_v2="yes")
    refused(group, "scale_ue8m0", f, x, q, torch.empty(4, 2), 8, 1e-10, -448.0, 448.0, 1)
    refused(group, "output_s", f, x, q, torch.empty(4, 1, dtype=torch.int32), 8, 1e-10, -448.0, 448.0, True)
    # Valid otherwise: the op refuses the float32 output_q, after output_s reached it as given.
    s = torch.empty(2, 4).t()
    with Spy() as spy:
        refused(group, "output_q", f, x, q, s, 8, 1e-10, -57344.0, 57344.0, True, enable_v2=False)
    check(spy.reached(s), "sgl_per_token_group_quant_fp8: a column-major output_s reaches the op as it is")
    f = "sgl_kernel.sgl_per_token_quant_fp8"
    s = torch.empty(4, 1)
    with Spy() as spy:
        refused(sgl_kernel.sgl_per_token_quant_fp8, "output_q", f, x, q, s)
    check(spy.reached(s[:, 0]), "sgl_per_token_quant_fp8: output_s [T, 1] reaches the op as its [T] view")
    f = "sgl_kernel.sgl_per_tensor_quant_fp8"
    refused(sgl_kernel.sgl_per_tensor_quant_fp8, "is_static", f, x, q, torch.zeros(1), "yes")
    s = torch.zeros(())
    with Spy() as spy:
        refused(sgl_kernel.sgl_per_tensor_quant_fp8, "output_q", f, x, q, s, False)
    check(spy.reached(s.reshape(1)), "sgl_per_tensor_quant_fp8: a 0-dim output_s reaches the op as a [1] view")
    import inspect
    want = {"sgl_per_tensor_quant_fp8": ["input", "output_q", "output_s", "is_static"],
            "sgl_per_token_quant_fp8": ["input", "output_q", "output_s"],
            "sgl_per_token_group_quant_8bit": ["input", "output_q", "output_s", "group_size", "eps", "fp8_min",
                                               "fp8_max", "scale_ue8m0=False", "fuse_silu_and_mul=False",
                                               "masked_m=None", "enable_v2=None"]}
    for name, params in want.items():
        got = [p.name if p.default is p.empty else f"{p.name}={p.default!r}"
               for p in inspect.signature(getattr(sgl_kernel, name)).parameters.values()]
        check(got == params, f"sgl_kernel.{name}{tuple(got)} is not sgl_kernel's {tuple(params)}")


def peer_quant_cases():
    """sgl-kernel's tests of its fp8 quantisers: the per-tensor and per-token ones compare sgl_kernel with vLLM's
    scaled_fp8_quant (here kdispatch.compat.sgl_kernel against kdispatch.compat.vllm), the per-token-group one
    with SGLang's triton kernel (here its formula)."""
    import kdispatch.compat.vllm as vllm_ops
    fp8 = getattr(torch, "float8_e4m3fn", None)
    no_fp8 = NO_FP8

    def rand(*shape, dtype):
        return torch.rand(*shape, generator=qgen, dtype=torch.float32).to(dtype)

    pf = PeerFile("sglang sgl-kernel/tests/test_per_tensor_quant_fp8.py (sgl_kernel against vllm)")
    for t, h in itertools.product((128, 256, 512), (512, 2048, 4096)) if fp8 is not None else ():
        def run(c):
            _, t, h = c
            x = rand(t, h, dtype=torch.float16)
            vq, vs = vllm_ops.scaled_fp8_quant(x)
            sq, ss = torch.empty(t, h, dtype=fp8), torch.zeros(1)
            sgl_kernel.sgl_per_tensor_quant_fp8(x, sq, ss, False)
            ok = assert_close(ss, vs, 1e-3, 1e-3) and assert_close(sq.float(), vq.float(), 1e-3, 1e-3)
            scale = torch.rand(1, generator=qgen)
            vq, vs = vllm_ops.scaled_fp8_quant(x, scale)
            sq = torch.empty(t, h, dtype=fp8)
            sgl_kernel.sgl_per_tensor_quant_fp8(x, sq, scale, True)
            return ok and vs is scale and assert_close(sq.float(), vq.float(), 1e-3, 1e-3)
        pf.run(("test_per_tensor_quant_compare_implementations", t, h), run)
    if fp8 is None:
        pf.skip(9, no_fp8)
    pf.report()

    pf = PeerFile("sglang sgl-kernel/tests/test_per_token_quant_fp8.py (sgl_kernel against vllm)")
    for t, h in itertools.product((128, 256, 512), (512, 2048, 4096)) if fp8 is not None else ():
        def run(c):
            _, t, h = c
            x = rand(t, h, dtype=torch.float16)
            vq, vs = vllm_ops.scaled_fp8_quant(x, use_per_token_if_dynamic=True)
            sq, ss = torch.empty(t, h, dtype=fp8), torch.zeros(t)
            sgl_kernel.sgl_per_token_quant_fp8(x, sq, ss)
            return assert_close(ss.reshape(-1, 1), vs, 1e-3, 1e-3) and assert_close(sq.float(), vq.float(), 1e-3,
                                                                                      1e-3)
        pf.run(("test_per_token_quant_compare_implementations", t, h), run)
    if fp8 is None:
        pf.skip(9, no_fp8)
    pf.report()

    pf = PeerFile("sglang sgl-kernel/tests/test_per_token_group_quant_8bit.py")
    shapes = list(itertools.product((1, 4, 16, 64, 127, 128, 512, 1024, 4096, 8192),
                                    (512, 1024, 1536, 2048, 4096, 7168, 16384)))
    group_size = 128

    def tiny_diff(a, b):
        """sgl_kernel.test_utils.assert_all_close_or_tiny_diff: codes one apart in few places."""
        diff = (codes(a).to(torch.int16) - codes(b).to(torch.int16)).abs()
        tiny, large = int((diff == 1).sum()), int((diff >= 2).sum())
        return large == 0 and (tiny / a.numel() < 0.005 or (tiny / a.numel() < 0.04 and a.numel() <= 4096))

    for (num_tokens, hidden), layout in itertools.product(shapes, ("row", "column", "tma")) if fp8 is not None else ():
        def run(c):
            num_tokens, hidden, layout = fit((c[1], c[2])) + (c[6],)
            x = qrandn(num_tokens, hidden, dtype=torch.bfloat16)
            x[torch.randn(x.shape, generator=qgen) < 0.001] *= 10
            s, _ = group_scales_buffer(num_tokens, hidden // group_size, layout)
            q = torch.empty(num_tokens, hidden, dtype=fp8)
            sgl_kernel.sgl_per_token_group_quant_8bit(x, q, s, group_size, 1e-10, -448.0, 448.0, False)
            # SGLang's triton reference: max(absmax, eps) / fp8_max, x * (1 / s), clamped.
            want_s = f_group_scales(x, group_size, 1e-10, fp8, False)
            want = f_group_quant(x, want_s, group_size, fp8)
            return tiny_diff(q, want) and assert_close(s.contiguous(), want_s, 1e-3, 1e-5)
        pf.run(("test_per_token_group_quant_with_column_major", num_tokens, hidden, group_size, None,
                "float8_e4m3fn", layout), run, (num_tokens, hidden))
    if fp8 is None:
        pf.skip(3 * len(shapes), f"float8_e4m3fn with row-major, column-major and TMA-aligned scales: {no_fp8}")
    pf.skip(len(shapes), "float8_e4m3fn with TMA-aligned UE8M0 scales (refused: SGLang's packed int32 UE8M0 "
                         "scales; kdispatch stores them as float32 powers of two)")
    pf.skip(len(shapes), "int8 (kdispatch has no int8 quantiser)")
    pf.skip(3 * len(shapes), "int8 with column-major scales (skipped by the peer test itself)")
    pf.skip(7 * 4 * 4, "fuse_silu_and_mul and the masked layouts (refused: no fused silu_and_mul quantiser, no "
                       "masked_m)")
    pf.report()
    # The refusals those lines count, on a case of each kind.
    x = qrandn(4, 256, dtype=torch.bfloat16)
    refused(sgl_kernel.sgl_per_token_group_quant_8bit, "output_q", "sgl_kernel.sgl_per_token_group_quant_8bit", x,
            torch.empty(4, 256, dtype=torch.int8), torch.empty(4, 2), 128, 1e-10, -128.0, 127.0)
    refused(sgl_kernel.sgl_per_token_group_quant_8bit, "fuse_silu_and_mul",
            "sgl_kernel.sgl_per_token_group_quant_8bit", x, torch.empty(4, 128), torch.empty(4, 1), 128, 1e-10,
            -448.0, 448.0, True, True)
    packed = torch.empty(1, 4, dtype=torch.int32).t()  # [T, ceil(G / 4)] of a [ceil(G / 4), T] buffer
    refused(sgl_kernel.sgl_per_token_group_quant_8bit, "output_s", "sgl_kernel.sgl_per_token_group_quant_8bit", x,
            torch.empty(4, 256, dtype=fp8 or torch.float32), packed, 128, 1e-10, -448.0, 448.0, True)


# ---------------------------------------------------------------- the peers' own cases

LIMIT = int(os.environ.get("KD_COMPAT_PEER_ELEMENTS", str(1 << 20)))


def fit(shape):
    """shape with its leading dims cut (the first first) until it has at most LIMIT elements."""
    shape = list(shape)
    for i in range(len(shape) - 1):
        while LIMIT and math.prod(shape) > LIMIT and shape[i] > 1:
            shape[i] = max(1, shape[i] // 2)
    return tuple(shape)


def in_dtype(dtype, f, *xs):
    """f computed in float32 on xs and rounded to dtype: one CUDA op of that dtype."""
    return f(*[x.float() for x in xs]).to(dtype)


def assert_close(got, want, rtol, atol):
    return bool(((got.double() - want.double()).abs() <= atol + rtol * want.double().abs()).all())


class PeerFile:
    def __init__(self, name):
        self.name, self.total, self.passed, self.cut, self.failed, self.skipped = name, 0, 0, 0, [], []

    def run(self, case, fn, shape=None):
        self.total += 1
        was_cut = shape is not None and fit(shape) != tuple(shape)
        try:
            ok = fn(case)
        except Exception as e:  # noqa: BLE001 - an exception is a failed case, reported with its words
            ok = f"{type(e).__name__}: {e}"
        if ok is True:
            self.passed += 1
            self.cut += was_cut
        else:
            self.failed.append(f"{case}: {ok or 'mismatch'}")

    def skip(self, count, why):
        """Cases not translated: `count` of them (None: not counted, the test names said)."""
        if count is None:
            self.skipped.append(why)
        else:
            self.total += count
            self.skipped.append(f"{count} {why}")

    def report(self):
        line = f"peer {self.name}: {self.passed} of {self.total} cases pass"
        if self.cut:
            line += f" ({self.cut} on their leading rows only, at most {LIMIT} elements a tensor)"
        if self.failed:
            line += f"; {len(self.failed)} fail: " + "; ".join(self.failed[:5])
        if self.skipped:
            line += "; not run: " + "; ".join(self.skipped)
        print(line)
        check(not self.failed, f"peer {self.name}: every translated case passes")


def peer_norm_cases(mod, label, pdl_and_contiguous):
    """sgl-kernel/tests/test_norm.py and FlashInfer's tests/utils/test_norm.py: the same four tests, FlashInfer's
    with enable_pdl and contiguous as well."""
    pf = PeerFile(label)
    batches, hiddens = (1, 19, 99, 989), (111, 500, 1024, 3072, 3584, 4096, 8192, 16384)
    extra = list(itertools.product((True, False), (True, False))) if pdl_and_contiguous else [(None, True)]
    dtype = torch.float16

    def make(b, h, contiguous):
        b, h = fit((b, h))
        if contiguous:
            return randn(b, h, dtype=dtype)
        return randn(b, 2 * h, dtype=dtype)[:, :h]

    def norm_case(gemma, fn):
        def run(c):
            b, h, specify_out, pdl, contiguous = c
            x = make(b, h, contiguous)
            w = randn(h, dtype=dtype)
            ref = f_norm(x, w, 1e-6, gemma)
            if specify_out:
                y = torch.empty_like(x)
                fn(x, w, out=y, enable_pdl=pdl)
            else:
                y = fn(x, w, enable_pdl=pdl)
            return assert_close(y, ref, 1e-3, 1e-3)
        return run

    def fused_case(gemma, fn):
        def run(c):
            b, h, pdl, contiguous = c
            x = make(b, h, contiguous)
            r = randn(*x.shape, dtype=dtype)
            w = randn(h, dtype=dtype)
            if gemma:  # the peers' gemma reference adds in float16, then normalises the rounded sum
                s = in_dtype(dtype, torch.add, x, r)
                rx, rr = f_norm(s, w, 1e-6, True), s
            else:
                rx, rr = f_fused(x, r, w, 1e-6, False)
            xf, rf = x.clone(), r.clone()
            fn(xf, rf, w, 1e-6, enable_pdl=pdl)
            return assert_close(xf, rx, 1e-3, 1e-3) and assert_close(rf, rr, 1e-3, 1e-3)
        return run

    mods = (mod.norm if hasattr(mod, "norm") else mod)
    for b, h, so, (pdl, cont) in itertools.product(batches, hiddens, (True, False), extra):
        pf.run(("test_norm", b, h, so, pdl, cont), lambda c: norm_case(False, mods.rmsnorm)(c[1:]), (b, h))
    for b, h, (pdl, cont) in itertools.product(batches, hiddens, extra):
        pf.run(("test_fused_add_rmsnorm", b, h, pdl, cont), lambda c: fused_case(False, mod.fused_add_rmsnorm)(c[1:]),
               (b, h))
    for b, h, so, (pdl, cont) in itertools.product(batches, hiddens, (True, False), extra):
        pf.run(("test_gemma_norm", b, h, so, pdl, cont), lambda c: norm_case(True, mods.gemma_rmsnorm)(c[1:]), (b, h))
    for b, h, (pdl, cont) in itertools.product(batches, hiddens, extra):
        pf.run(("test_gemma_fused_add_rmsnorm", b, h, pdl, cont),
               lambda c: fused_case(True, mod.gemma_fused_add_rmsnorm)(c[1:]), (b, h))
    pf.report()


def peer_activation_cases(mod, label, with_pdl):
    """sgl-kernel/tests/test_activation.py and FlashInfer's tests/utils/test_activation.py."""
    pf = PeerFile(label)
    acts = (("test_fused_silu_mul", "silu_and_mul", torch.nn.functional.silu),
            ("test_fused_gelu_tanh_mul", "gelu_tanh_and_mul",
             lambda a: torch.nn.functional.gelu(a, approximate="tanh")),
            ("test_fused_gelu_mul", "gelu_and_mul", torch.nn.functional.gelu))
    dims, batches = (128, 256, 512, 2048, 4096, 11008, 16384), (1, 2, 4, 8, 16)
    seqs = (1, 2, 4, 8, 16, 32, 64, 128, 512)
    pdls = (True, False) if with_pdl else (None,)
    fmod = mod.activation if hasattr(mod, "activation") else mod
    for (test, name, act), dim, b, s, pdl in itertools.product(acts, dims, batches, seqs, pdls):
        def run(c, name=name, act=act):
            _, dim, b, s, pdl = c
            b, s, _ = fit((b, s, 2 * dim))
            x = randn(b, s, 2 * dim, dtype=torch.float16)
            # The peers' reference: the activation, then the product, each a float16 op.
            ref = in_dtype(torch.float16, torch.mul, x[..., dim:], in_dtype(torch.float16, act, x[..., :dim]))
            y = getattr(fmod, name)(x, enable_pdl=pdl) if with_pdl else getattr(fmod, name)(x)
            return assert_close(y, ref, 1e-3, 1e-3)
        pf.run((test, dim, b, s, pdl), run, (b, s, 2 * dim))
    pf.report()


def peer_cross_cases():
    """SGLang's jit_kernel tests that compare an SGLang kernel with FlashInfer's: here
    kdispatch.compat.sgl_kernel against kdispatch.compat.flashinfer."""
    pf = PeerFile("sglang python/sglang/jit_kernel/tests/test_activation.py (sgl_kernel against flashinfer)")
    shapes = ((1, 1, 128), (2, 4, 256), (4, 8, 512), (8, 16, 2048), (1, 1, 4096), (16, 32, 11008))
    for name, (b, s, dim), dtype in itertools.product(ACTS, shapes, (torch.float16, torch.bfloat16)):
        def run(c, name=name):
            _, b, s, dim, dtype = c
            b, s, _ = fit((b, s, 2 * dim))
            x = randn(b, s, 2 * dim, dtype=getattr(torch, dtype))
            return assert_close(getattr(flashinfer, name)(x), getattr(sgl_kernel, name)(x), 1e-3, 1e-3)
        pf.run((f"test_{name}", b, s, dim, str(dtype).split(".")[1]), run, (b, s, 2 * dim))
    pf.report()

    pf = PeerFile("sglang python/sglang/jit_kernel/tests/test_fused_add_rmsnorm.py (sgl_kernel against flashinfer)")
    batches = [2 ** n for n in range(14)]
    batches += [x + 1 + i for i, x in enumerate(batches)]
    for b, h in itertools.product(batches, (512, 1024, 1536, 2048, 3072, 4096, 5120, 6144, 7168, 8192)):
        def run(c):
            _, b, h = c
            b, h = fit((b, h))
            bf16 = torch.bfloat16
            x, r, w = randn(b, h, dtype=bf16), randn(b, h, dtype=bf16), randn(h, dtype=bf16)
            xs, rs, xf, rf = x.clone(), r.clone(), x.clone(), r.clone()
            eps = torch.finfo(torch.bfloat16).eps
            sgl_kernel.fused_add_rmsnorm(xs, rs, w, eps)
            flashinfer.norm.fused_add_rmsnorm(xf, rf, w, eps=eps)
            return assert_close(xs, xf, 1e-2, 1e-2) and assert_close(rs, rf, 1e-2, 1e-2)
        pf.run(("test_fused_add_rmsnorm", b, h), run, (b, h))
    pf.report()


def peer_rope_cache(rotary_dim, max_position, base):
    """The float32 cache of the peers' RotaryEmbedding, computed as they do (float32 throughout)."""
    inv = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
    freqs = torch.einsum("i,j -> ij", torch.arange(max_position, dtype=torch.float), inv)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def peer_rope_cases(fn, label, cases, untranslated):
    """test_correctness (sgl-kernel) / test_rope_cos_sin_cache (FlashInfer): the in-place function against the
    peers' float32 forward_native, rounded to the dtype, atol = rtol = 1e-2."""
    pf = PeerFile(label)
    for c in cases:
        def run(c):
            head, rot, maxpos, base, neox, dtype, _, b, s, hq, hk = c
            cache = peer_rope_cache(rot, maxpos, base)
            pos = torch.arange(s).repeat(b)
            q, k = randn(b * s, hq * head, dtype=dtype), randn(b * s, hk * head, dtype=dtype)
            rq = f_rope(pos, q.float(), head, cache, neox).to(dtype)
            rk = f_rope(pos, k.float(), head, cache, neox).to(dtype)
            fn(positions=pos, query=q, key=k, head_size=head, cos_sin_cache=cache, is_neox=neox)
            return assert_close(q, rq, 1e-2, 1e-2) and assert_close(k, rk, 1e-2, 1e-2)
        pf.run(tuple(str(v) if isinstance(v, torch.dtype) else v for v in c), lambda _c, c=c: run(c))
    for count, why in untranslated:
        pf.skip(count, why)
    pf.report()


def topk_check(gating, k, renorm, w, ids, exact_ids, softcap=0.0, bias=None, sort=False):
    """Weights as the formula's; with exact_ids the same experts, or experts
    whose probabilities in torch's float32 softmax are within 2 ulps of the
    formula's picks (a near-tie that the rounding of torch's softmax orders,
    and which differs between torch versions)."""
    rw, rids, p = f_topk(gating, k, renorm, softcap, bias)
    if sort:
        ok = torch.allclose(w.sort(-1)[0], rw.sort(-1)[0], atol=1e-3, rtol=1e-3)
    else:
        ok = torch.allclose(w, rw, atol=1e-3, rtol=1e-3)
    if not exact_ids or torch.equal(ids, rids.int()):
        return ok
    return ok and torch.allclose(p.gather(-1, ids.long()), p.gather(-1, rids), rtol=2.4e-7, atol=0)


def peer_topk_cases():
    # sgl-kernel/tests/test_moe_topk_softmax.py: the form with token_expert_indices, float32, ids exact.
    pf = PeerFile("sglang sgl-kernel/tests/test_moe_topk_softmax.py")
    for t, e, k in itertools.product((1, 16, 128, 512, 1024, 2048), (4, 8, 16, 32, 64, 128, 256), (1, 2, 4)):
        def run(c):
            _, t, e, k = c
            g = randn(t, e)
            w, ids, tei = torch.empty(t, k), torch.empty(t, k, dtype=torch.int32), torch.empty(t, k, dtype=torch.int32)
            sgl_kernel.topk_softmax(w, ids, tei, g)
            return topk_check(g, k, False, w, ids, True)
        pf.run(("test_topk_softmax", t, e, k), run)
    pf.report()

    # python/sglang/jit_kernel tests: test_moe_topk_softmax.py (the full, non-CI parametrisation).
    pf = PeerFile("sglang python/sglang/jit_kernel/tests/test_moe_topk_softmax.py")
    tokens, experts, topks = (1, 16, 128, 512, 1024, 2048), (4, 8, 16, 32, 64, 128, 256, 48), (1, 2, 4)
    for (t, e, k), dtype, renorm in itertools.product(itertools.product(tokens, experts, topks), DTYPES[::-1],
                                                      (False, True)):
        def run(c):
            _, t, e, k, dtype, renorm = c
            g = randn(t, e, dtype=getattr(torch, dtype))
            w, ids = torch.empty(t, k), torch.empty(t, k, dtype=torch.int32)
            sgl_kernel.topk_softmax(w, ids, g, renormalize=renorm)
            return topk_check(g, k, renorm, w, ids, dtype == "float32", sort=True)
        pf.run(("test_topk_softmax_vs_ref", t, e, k, str(dtype).split(".")[1], renorm), run)
    for (t, e, k), renorm in itertools.product(itertools.product(tokens, experts, topks), (False, True)):
        def run(c):
            _, t, e, k, renorm = c
            g, bias = randn(t, e), randn(e)
            w, ids = torch.empty(t, k), torch.empty(t, k, dtype=torch.int32)
            sgl_kernel.topk_softmax(w, ids, g, renormalize=renorm, correction_bias=bias)
            return topk_check(g, k, renorm, w, ids, True, bias=bias)
        pf.run(("test_topk_softmax_with_correction_bias", t, e, k, renorm), run)
    for cap, (t, e, k) in itertools.product((0.0, 30.0, 50.0), ((128, 64, 4), (64, 8, 2))):
        def run(c):
            _, cap, t, e, k = c
            g = randn(t, e)
            w, ids = torch.empty(t, k), torch.empty(t, k, dtype=torch.int32)
            sgl_kernel.topk_softmax(w, ids, g, moe_softcapping=cap)
            return topk_check(g, k, False, w, ids, True, softcap=cap)
        pf.run(("test_topk_softmax_with_softcapping", cap, t, e, k), run)
    for t, e, k in ((128, 64, 4), (1, 8, 2)):
        def run(c):
            _, t, e, k = c
            w, ids = torch.empty(t, k), torch.empty(t, k, dtype=torch.int32)
            sgl_kernel.topk_softmax(w, ids, randn(t, e), renormalize=True)
            return torch.allclose(w.sum(-1), torch.ones(t), rtol=1e-4, atol=1e-4)
        pf.run(("test_renormalize_sums_to_one", t, e, k), run)

    def shapes(_c):
        w, ids = torch.empty(64, 4), torch.empty(64, 4, dtype=torch.int32)
        sgl_kernel.topk_softmax(w, ids, randn(64, 128))
        return w.shape == (64, 4) and ids.shape == (64, 4) and w.dtype == torch.float32 and ids.dtype == torch.int32
    pf.run(("test_output_shapes_and_dtypes",), shapes)
    for e in (48, 96):
        def run(c):
            w, ids = torch.empty(64, 2), torch.empty(64, 2, dtype=torch.int32)
            sgl_kernel.topk_softmax(w, ids, randn(64, c[1]), renormalize=True)
            return bool((w > 0).all()) and torch.allclose(w.sum(-1), torch.ones(64), rtol=1e-4, atol=1e-4)
        pf.run(("test_fallback_non_power_of_two", e), run)
    pf.skip(3 * 3 * 2 * 2 * 2, "test_topk_softmax_vs_aot: compares SGLang's JIT and AOT kernels with each other")
    pf.report()


def test_peers():
    peer_norm_cases(sgl_kernel, "sglang sgl-kernel/tests/test_norm.py", False)
    peer_norm_cases(flashinfer, "flashinfer tests/utils/test_norm.py", True)
    peer_activation_cases(sgl_kernel, "sglang sgl-kernel/tests/test_activation.py", False)
    peer_activation_cases(flashinfer, "flashinfer tests/utils/test_activation.py", True)
    bf16 = torch.bfloat16
    peer_rope_cases(sgl_kernel.apply_rope_with_cos_sin_cache_inplace,
                    "sglang sgl-kernel/tests/test_rotary_embedding.py",
                    [(64, 64, 32, 8000, True, bf16, "cuda", 32, 32, 1, 1),
                     (256, 128, 4096, 10000, True, bf16, "cuda", 2, 512, 4, 2),
                     (512, 128, 311, 10000, True, bf16, "cuda", 3, 39, 4, 2),
                     (128, 128, 2048, 10000, False, bf16, "cuda", 2, 512, 32, 8),
                     (128, 128, 2048, 10000, False, bf16, "cuda", 2, 512, 16, 4),
                     (512, 128, 311, 10000, False, bf16, "cuda", 3, 39, 4, 2)], [])
    peer_rope_cases(flashinfer.apply_rope_with_cos_sin_cache_inplace, "flashinfer tests/attention/test_rope.py",
                    [(64, 64, 32, 8000, True, bf16, "cuda", 32, 32, 1, 1),
                     (256, 128, 4096, 10000, True, bf16, "cuda", 2, 512, 4, 2),
                     (64, 32, 2048, 8432, True, bf16, "cuda", 2, 199, 4, 1),
                     (64, 64, 32, 8000, False, bf16, "cuda", 32, 32, 1, 1),
                     (64, 64, 32, 8000, False, bf16, "cuda", 32, 32, 1, 1),
                     (256, 128, 4096, 9231, False, bf16, "cuda", 3, 231, 4, 2),
                     (192, 128, 4096, 9231, True, bf16, "cuda", 3, 231, 3, 2),
                     (80, 64, 1024, 10000, False, bf16, "cuda", 4, 64, 2, 2),
                     (112, 64, 2048, 12000, True, bf16, "cuda", 5, 77, 2, 1),
                     (160, 96, 8192, 10000, False, bf16, "cuda", 2, 128, 6, 3)],
                    [(4 * 4 * 2 * 3 * 3 * 2 * 4 * 2, "test_rope (apply_rope, apply_llama31_rope: indptr/offsets forms "
                      "kdispatch has not)"),
                     (4 * 4 * 2 * 3 * 3 * 2 * 4 * 2 * 2 * 2, "test_rope_pos_ids (apply_rope_pos_ids and the llama31 "
                      "forms: cos/sin computed from rope_theta, not a cache)"),
                     (13 * 6 * 2 * 2 * 2 * 2, "test_generalized_rope_quantize (rope_quantize_fp8: fp8 outputs "
                      "kdispatch has not)"),
                     (None, "the fp8 and paged KV-cache tests after them (rope_quantize_fp8_append_paged_kv_cache, "
                      "mla_rope_quantize_fp8: functions kdispatch has not)")])
    peer_topk_cases()
    peer_cross_cases()
    peer_quant_cases()


def main():
    for test in (test_norms, test_flashinfer_3d_norm, test_fused, test_quant_norms, test_activations, test_layernorm,
                 test_rope, test_topk, test_moe_align, test_quantizers, test_quant_refusals, test_spellings,
                 test_refusals, test_peers):
        before = results["failed"]
        test()
        if results["failed"] != before:
            print(f"{test.__name__}: {results['failed'] - before} failed")
    print(f"compat sgl_kernel/flashinfer (torch {torch.__version__}): {results['passed']} passed, "
          f"{results['failed']} failed")
    return 1 if results["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
