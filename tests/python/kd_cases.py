"""What the Python tests run for each built-in op: the sizes and attributes
to try, and the op's formula in float64 NumPy (one small case per op, as in
ggml's test-backend-ops). Inputs are made from the op schema: random,
never zero, in the op's index ranges; outputs are poisoned first."""
import math

import numpy as np

# Significand bits of each float dtype, the implicit one included: what turns
# a tolerance in ulps into a relative one.
PRECISION = {"float64": 53, "float32": 24, "float16": 11, "bfloat16": 8}


def rmsnorm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def layernorm(x, w, b, eps):
    mean = np.mean(x, axis=-1, keepdims=True)
    var = np.mean((x - mean) ** 2, axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


def silu(a):
    return a / (1.0 + np.exp(-a))


def gelu(a):
    return 0.5 * a * (1.0 + np.vectorize(math.erf)(a / math.sqrt(2.0)))


def gelu_tanh(a):
    return 0.5 * a * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (a + 0.044715 * a ** 3)))


def act_and_mul(act):
    def formula(t, attrs, round_to):
        d = t["x"].shape[-1] // 2
        return {"out": act(t["x"][..., :d]) * t["x"][..., d:]}
    return formula


def rotary(t, attrs, round_to):
    cache = t["cos_sin_cache"]
    r = cache.shape[-1] // 2
    pos = t["positions"].astype(np.int64)
    cos = cache[pos, :r][..., None, :]
    sin = cache[pos, r:][..., None, :]

    def rotate(v):
        v = v.copy()
        if attrs["is_neox"]:
            a, b = v[..., :r].copy(), v[..., r:].copy()
            v[..., :r], v[..., r:] = a * cos - b * sin, b * cos + a * sin
        else:
            a, b = v[..., 0::2].copy(), v[..., 1::2].copy()
            v[..., 0::2], v[..., 1::2] = a * cos - b * sin, b * cos + a * sin
        return v

    return {"query": rotate(t["query"]), "key": rotate(t["key"])}


def topk_softmax(t, attrs, round_to):
    g = t["gating_output"]
    k = t["topk_ids"].shape[-1]
    p = np.exp(g - g.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    ids = np.argsort(-p, axis=-1, kind="stable")[..., :k]
    w = np.take_along_axis(p, ids, axis=-1)
    if attrs["renormalize"]:
        w = w / w.sum(axis=-1, keepdims=True)
    return {"topk_weights": w, "topk_ids": ids}


def fused_add_rmsnorm(t, attrs, round_to):
    residual = round_to(t["x"] + t["residual"])  # stored in T before the norm
    return {"x": rmsnorm(residual, t["weight"], attrs["eps"]), "residual": residual}


class Case:
    def __init__(self, formula, sizes, attrs=({},)):
        self.formula = formula  # (float64 inputs by name, attrs, round_to) -> {output name: float64}
        self.sizes = sizes      # list of {"*": leading dims, symbol: size}
        self.attrs = attrs      # attribute sets to call with ({} = the defaults)


CASES = {
    "layernorm.rmsnorm": Case(lambda t, a, r: {"out": rmsnorm(t["x"], t["weight"], a["eps"])},
                              [{"*": (1,), "H": 4097}, {"*": (3, 5), "H": 37}], ({}, {"eps": 1e-5})),
    "layernorm.layernorm": Case(lambda t, a, r: {"out": layernorm(t["x"], t["weight"], t["bias"], a["eps"])},
                                [{"*": (1,), "H": 4097}, {"*": (3, 5), "H": 37}], ({}, {"eps": 1e-6})),
    "layernorm.fused_add_rmsnorm": Case(fused_add_rmsnorm, [{"*": (1,), "H": 4097}, {"*": (7,), "H": 129}]),
    "activation.silu_and_mul": Case(act_and_mul(silu), [{"*": (1,), "D": 4097}, {"*": (2, 3), "D": 67}]),
    "activation.gelu_and_mul": Case(act_and_mul(gelu), [{"*": (1,), "D": 1031}, {"*": (2, 3), "D": 67}]),
    "activation.gelu_tanh_and_mul": Case(act_and_mul(gelu_tanh), [{"*": (1,), "D": 4097}, {"*": (2, 3), "D": 67}]),
    "embeddings.rotary_embedding": Case(rotary, [{"*": (7,), "HQ": 3, "HK": 1, "R": 32, "P": 41},
                                                 {"*": (1,), "HQ": 4, "HK": 2, "R": 8, "P": 5}],
                                        ({"is_neox": True}, {"is_neox": False})),
    "moe.topk_softmax": Case(topk_softmax, [{"*": (7,), "E": 64, "K": 8}, {"*": (1,), "E": 257, "K": 5},
                                            {"*": (3,), "E": 16, "K": 1}],
                             ({"renormalize": False}, {"renormalize": True})),
}


def full_attrs(schema, given):
    """Every attribute of the schema with its default, `given` applied."""
    attrs = {a["name"]: a["default"] for a in schema["attrs"]}
    attrs.update(given)
    return attrs


def shape_of(tokens, sizes):
    shape = []
    for tok in tokens:
        if tok == "*":
            shape.extend(sizes["*"])
        elif tok.isdigit():
            shape.append(int(tok))
        elif "*" in tok:
            factor, name = tok.split("*", 1)
            shape.append(int(factor) * sizes[name])
        else:
            shape.append(sizes[tok])
    return tuple(shape)


def make_inputs(schema, sizes, rng):
    """{name: (float64 or int64 NumPy array, concrete dtype name or None)}
    for every tensor: inputs random and away from zero (index tensors within
    their range), outputs poisoned (NaN, or -7 for integers). A None dtype
    means the op's dtype variable."""
    values = {}
    for arg in schema["tensors"]:
        shape = shape_of(arg["shape"], sizes)
        concrete = None if arg["dtype"] in schema["dtypes"] else arg["dtype"]
        integer = concrete is not None and concrete.startswith(("int", "uint"))
        if arg["written"] and not arg["inplace"]:
            values[arg["name"]] = (np.full(shape, -7 if integer else np.nan), concrete)
            continue
        if integer:
            low, high = arg["range"] or (0, "2")
            high = int(high) if high.isdigit() else sizes[high]
            values[arg["name"]] = (rng.integers(low, high, size=shape), concrete)
        else:
            v = rng.uniform(-2.0, 2.0, size=shape)
            v[np.abs(v) < 0.05] = 0.5
            values[arg["name"]] = (v, concrete)
    return values


def compare(schema, got, want, dtype):
    """(ok, max abs error) of one output of `schema`'s op, whose dtype is
    `dtype`, against unrounded float64 values. Float outputs get the op
    schema's tolerance for that dtype (schema["tolerance"], as the C++ checks
    use it) in relative form, |got - want| <= atol + ulps * 2^(1 - precision) *
    |want|, which ulps * ulp(want) never exceeds; other dtypes compare exactly."""
    got = np.asarray(got, dtype=np.float64)
    tolerance = schema["tolerance"].get(dtype)
    if tolerance is None:
        return bool(np.array_equal(got, want)), float(np.abs(got - want).max())
    atol = tolerance["atol"]
    rtol = tolerance["ulps"] * 2.0 ** (1 - PRECISION[dtype])
    err = np.abs(got - want)
    ok = bool(np.all(err <= atol + rtol * np.abs(want)))  # NaN (a poisoned output left) fails
    return ok, float(np.nanmax(err)) if not np.all(np.isnan(err)) else float("nan")
