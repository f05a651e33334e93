#!/usr/bin/env python3
"""Checks `kdispatch run --save DIR` output against float64 NumPy versions of
the formulas documented in manifests/ops/*.json, computed from the saved
inputs. Usage: check_saved.py KDISPATCH_BINARY WORK_DIR"""
import json
import math
import pathlib
import subprocess
import sys

try:
    import numpy as np
except ImportError:
    print("numpy: SKIPPED, this python has no numpy (Debian: python3-numpy)")
    sys.exit(77)

# Significand bits of each float dtype, the implicit one included.
PRECISION = {"float32": 24, "float16": 11, "bfloat16": 8}
SCHEMAS = pathlib.Path(__file__).resolve().parents[2] / "manifests" / "ops"


def tolerances():
    """{op: {dtype: (atol, rtol)}}: each op schema's "tolerance" in relative form,
    rtol = ulps * 2^(1 - precision), for comparison with unrounded float64 values."""
    out = {}
    for path in SCHEMAS.glob("*.json"):
        for schema in json.loads(path.read_text()):
            out[schema["op"]] = {d: (t["atol"], t["ulps"] * 2.0 ** (1 - PRECISION[d]))
                                 for d, t in schema.get("tolerance", {}).items()}
    return out


TOLERANCES = tolerances()


def round_to(dtype, x):
    """Rounds float64 values to what `dtype` stores (bfloat16: nearest even)."""
    if dtype == "float32":
        return x.astype(np.float32).astype(np.float64)
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float64)
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32).astype(np.float64)


def rmsnorm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def layernorm(x, w, b, eps):
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


def gelu(a):
    return 0.5 * a * (1.0 + np.vectorize(math.erf)(a / math.sqrt(2.0)))


def gelu_tanh(a):
    return 0.5 * a * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (a + 0.044715 * a ** 3)))


def silu(a):
    return a / (1.0 + np.exp(-a))


def act_and_mul(act, x):
    d = x.shape[-1] // 2
    return act(x[..., :d]) * x[..., d:]


def rotary(pos, q, k, cache, neox):
    r = cache.shape[-1] // 2
    cos = cache[pos, :r][..., None, :]
    sin = cache[pos, r:][..., None, :]

    def rotate(t):
        t = t.copy()
        if neox:
            a, b = t[..., :r].copy(), t[..., r:].copy()
            t[..., :r], t[..., r:] = a * cos - b * sin, b * cos + a * sin
        else:
            a, b = t[..., 0::2].copy(), t[..., 1::2].copy()
            t[..., 0::2], t[..., 1::2] = a * cos - b * sin, b * cos + a * sin
        return t

    return rotate(q), rotate(k)


def topk_softmax(gating, k, renormalize):
    p = np.exp(gating - gating.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    ids = np.argsort(-p, axis=-1, kind="stable")[..., :k]
    w = np.take_along_axis(p, ids, axis=-1)
    if renormalize:
        w = w / w.sum(axis=-1, keepdims=True)
    return w, ids


def expected(op, dtype, t, attrs):
    """Expected outputs {arg: float64 array} from the saved inputs `t`."""
    if op == "layernorm.rmsnorm":
        return {"out": rmsnorm(t["x"], t["weight"], attrs["eps"])}
    if op == "layernorm.fused_add_rmsnorm":
        residual = round_to(dtype, t["x"] + t["residual"])
        return {"x": rmsnorm(residual, t["weight"], attrs["eps"]), "residual": residual}
    if op == "layernorm.layernorm":
        return {"out": layernorm(t["x"], t["weight"], t["bias"], attrs["eps"])}
    if op == "activation.silu_and_mul":
        return {"out": act_and_mul(silu, t["x"])}
    if op == "activation.gelu_and_mul":
        return {"out": act_and_mul(gelu, t["x"])}
    if op == "activation.gelu_tanh_and_mul":
        return {"out": act_and_mul(gelu_tanh, t["x"])}
    if op == "embeddings.rotary_embedding":
        q, k = rotary(t["positions"].astype(np.int64), t["query"], t["key"], t["cos_sin_cache"], attrs["is_neox"])
        return {"query": q, "key": k}
    raise KeyError(op)


def check(work):
    binary = sys.argv[1]
    save = work / "saved"
    run = subprocess.run([binary, "run", "--all", "--backend", "cpu", "--save", str(save), "--json",
                          "--shape", "*=5,3"], capture_output=True, text=True)
    if run.returncode != 0:
        print(run.stdout, run.stderr)
        return 1
    results = json.loads(run.stdout)["results"]
    checked = failed = 0
    for r in results:
        op, dtype = r["op"], r["dtype"]
        stem = f"{op}.cpu.{dtype}"
        attrs = json.loads((save / f"{stem}.attrs.json").read_text())
        inputs = {p.name[len(stem) + 1:-len(".in.npy")]: np.load(p).astype(np.float64)
                  for p in save.glob(f"{stem}.*.in.npy")}
        outputs = {p.name[len(stem) + 1:-len(".out.npy")]: np.load(p) for p in save.glob(f"{stem}.*.out.npy")}
        if op == "moe.topk_softmax":
            k = outputs["topk_ids"].shape[-1]
            w, ids = topk_softmax(inputs["gating_output"], k, attrs["renormalize"])
            want = {"topk_weights": w, "topk_ids": ids}
        else:
            want = expected(op, dtype, inputs, attrs)
        for arg, value in want.items():
            got = outputs[arg].astype(np.float64)
            if arg == "topk_ids":
                ok = np.array_equal(got, value)
                err = float(np.abs(got - value).max())
            else:
                # topk_weights are float32 whatever the input dtype.
                atol, rtol = TOLERANCES[op]["float32" if arg == "topk_weights" else dtype]
                ok = bool(np.all(np.abs(got - value) <= atol + rtol * np.abs(value)))
                err = float(np.abs(got - value).max())
            checked += 1
            failed += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {op:30} {dtype:9} {arg:14} max abs err {err:.3g}")
    print(f"numpy: {checked - failed} passed, {failed} failed")
    return 1 if failed or checked == 0 else 0


if __name__ == "__main__":
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        sys.exit(check(pathlib.Path(d)))
