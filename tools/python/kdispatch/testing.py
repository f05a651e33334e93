"""The checks of kdispatch's own tests, for any op and backend, the
built-in ones and a plugin's alike:

- cases from the op schema's "tests": its sizes, the combinations of its
  attribute values, and its sets of special values (NaN, infinities, ties,
  every 16-bit value, ...);
- inputs from the generator of `kdispatch run` and the conformance suite:
  random and never all zeros, index tensors within their range, outputs
  poisoned, special values planted;
- expected values from the op's reference backend (float64, rounded once);
- the verdict of the one comparison every check uses, with the tolerances
  of the op schema.

    import kdispatch, kdispatch.testing as kt

    op = "layernorm.rmsnorm"
    for case in kt.cases(op):
        inputs = kt.inputs(op, "bfloat16", case)            # torch CPU tensors
        want = kt.reference(op, inputs, case)
        got = [t.clone() for t in inputs]
        kdispatch.call(op, *got, **case.attrs)
        verdict = kt.compare(op, got, want, case)
        assert verdict.ok, verdict.first_mismatch

Nothing here knows an op's formula: that lives in its reference kernel.
"""
import types as _types
import warnings as _warnings

from . import _kdispatch
from ._errors import Error, KernelError

_UNSUPPORTED = 2  # KD_STATUS_UNSUPPORTED, in a KernelError's "(status N)"

__all__ = ["Case", "cases", "dtypes", "variants", "inputs", "reference", "compare", "check", "conformance"]


class Case:
    """One call of an op's "tests": `sizes` ({"*": [...], symbol: size}),
    `attrs` (the attribute values given; the others keep their defaults),
    `special` (what the planted special values exercise, or None),
    `unchecked` (outputs those values leave unspecified) and `elements`
    (of all its tensors)."""

    def __init__(self, op, index, entry):
        self.op = op
        self.index = index
        self.sizes = entry["sizes"]
        self.attrs = entry["attrs"]
        self.special = entry["special"]
        self.unchecked = tuple(entry["unchecked"])
        self.elements = entry["elements"]

    def __repr__(self):
        text = " ".join(f"{k}={v}" for k, v in self.sizes.items())
        text += "".join(f" {k}={v}" for k, v in self.attrs.items())
        if self.special:
            text += f" (special: {self.special})"
        return f"<{self.op} case {self.index}: {text}>"


def cases(op):
    """Every call the op schema's "tests" ask for, as the conformance suite
    runs them."""
    return [Case(op, i, entry) for i, entry in enumerate(_kdispatch._test_cases(op))]


def dtypes(op, backend=None):
    """The dtypes a call of the op may have (its dtype variable that selects
    the kernel), narrowed to those `backend`'s kernel declares."""
    return _kdispatch._call_dtypes(op, backend)


_TORCH_NAMES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16", "float64": "float64",
                "int32": "int32", "int64": "int64", "uint8": "uint8", "bool": "bool",
                "float8_e4m3fn": "float8_e4m3fn", "float8_e5m2": "float8_e5m2"}
_NUMPY_NAMES = {"float32": "float32", "float16": "float16", "float64": "float64", "int32": "int32",
                "int64": "int64", "uint8": "uint8", "bool": "bool_"}


def unavailable_dtypes(op, kind="torch", alternatives=False):
    """The dtype names the op's tensors take (given by name, not a dtype
    variable: a tensor's first dtype, and with `alternatives` the others it
    may take instead) that `kind` ("torch" or "numpy") cannot make here: the
    8-bit floats of the quantisation ops' outputs (and of the KV cache's
    alternatives) with NumPy or a torch before 2.1. inputs() raises TypeError
    for a call that needs one; the tests leave such calls out."""
    schema = _kdispatch.schema(op)
    missing = []
    names = [n for arg in schema["tensors"]
             for n in [arg["dtype"]] + (list(arg.get("dtype_alternatives", ())) if alternatives else [])]
    for name in names:
        if name in schema["dtypes"] or name in missing:
            continue
        if kind == "numpy":
            ok = name in _NUMPY_NAMES
        else:
            import torch
            ok = getattr(torch, _TORCH_NAMES.get(name, name), None) is not None
        if not ok:
            missing.append(name)
    return missing


def _as_torch(data, dtype, shape):
    import torch
    torch_dtype = getattr(torch, _TORCH_NAMES[dtype], None)
    if torch_dtype is None:
        raise TypeError(f"this torch ({torch.__version__}) has no {dtype}: float8 needs torch >= 2.1")
    if len(data) == 0:
        return torch.empty(shape, dtype=torch_dtype)
    if dtype.startswith("float8"):
        # The raw bytes viewed as the 8-bit float.
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(torch_dtype).reshape(shape)
    return torch.frombuffer(bytearray(data), dtype=torch_dtype).reshape(shape)


def _as_numpy(data, dtype, shape):
    import numpy
    if dtype not in _NUMPY_NAMES:
        raise TypeError(f"NumPy has no {dtype}: ask for torch tensors (kind='torch')")
    return numpy.frombuffer(data, dtype=getattr(numpy, _NUMPY_NAMES[dtype])).reshape(shape).copy()


def variants(op, dtype):
    """The choices a call in `dtype` can make beyond its dtype, as the
    conformance suite runs them: dicts with "dtypes" ({tensor: dtype} for
    each tensor whose schema lists several dtypes) and "absent" (the
    optional tensors left out), every combination, the plain call first."""
    schema = _kdispatch.schema(op)
    from ._schema import tensor_dtypes
    combos = [({}, ())]
    for arg in schema["tensors"]:
        choices = tensor_dtypes(schema, arg, dtype)
        if len(choices) > 1:
            combos = [({**d, arg["name"]: c}, a) for d, a in combos for c in choices]
    for arg in schema["tensors"]:
        if arg.get("optional"):
            combos = combos + [(d, a + (arg["name"],)) for d, a in combos]
    return [{"dtypes": d, "absent": a} for d, a in combos]


def inputs(op, dtype, case, seed=0, kind="torch", dtypes=None, absent=()):
    """The tensors of `case` in `dtype`, in schema order, on the host:
    torch tensors (kind="torch") or NumPy arrays (kind="numpy"). `dtypes`
    ({tensor name: dtype name}) picks another dtype of a tensor whose schema
    lists several; the optional tensors named in `absent` are None."""
    convert = {"torch": _as_torch, "numpy": _as_numpy}[kind]
    made = _kdispatch._make_inputs(op, dtype, case.index, seed, dict(dtypes or {}), list(absent))
    return [None if entry is None else convert(*entry) for entry in made]


def _host_copy(t):
    if t is None:  # an optional tensor left out
        return None
    if hasattr(t, "detach"):  # torch
        return t.detach().to("cpu", copy=True)
    return t.copy()


def _attrs(case):
    if case is None:
        return {}
    return dict(case.attrs) if isinstance(case, Case) else dict(case)


def reference(op, tensors, case=None):
    """The op's reference backend run on host copies of `tensors` (schema
    order), with the attributes of `case` (a Case or a dict); returns the
    copies, their outputs written."""
    copies = [_host_copy(t) for t in tensors]
    _kdispatch.call(op, *copies, backend=_kdispatch._reference_backend(op), **_attrs(case))
    return copies


def compare(op, got, want, case=None):
    """The tensors an op writes in `got` against those in `want` (both in
    schema order; device tensors are copied to the host), with the op
    schema's tolerances. Returns an object with `ok`, `max_abs_err`,
    `max_rel_err`, `max_ulps`, `mean_ulps` and `first_mismatch`."""
    unchecked = case.unchecked if isinstance(case, Case) else ()
    verdict = _kdispatch._compare(op, [_host_copy(t) for t in got], [_host_copy(t) for t in want], list(unchecked))
    return _types.SimpleNamespace(**verdict)


def check(op, got, inputs, case=None):
    """compare(op, got, reference(op, inputs, case), case): `got` are the
    tensors after a call on copies of `inputs`."""
    return compare(op, got, reference(op, inputs, case), case)


Error = Error  # errors of these functions are kdispatch errors


def _cases_of_variant(all_cases, vi, others):
    """The cases variant `vi` of `others` + 1 runs, as kdispatch-conformance
    shares them: the plain variant (0) runs every case; the others share the
    cases in turn, each running every `others`-th (one case each, in turn,
    when there are fewer cases than variants)."""
    if vi == 0:
        return all_cases
    if len(all_cases) >= others:
        return [c for ci, c in enumerate(all_cases) if ci % others == vi - 1]
    return [all_cases[(vi - 1) % len(all_cases)]]


def conformance(op, backend, device="cpu", dtypes=None, seed=0):
    """The conformance checks of one backend's kernel for `op`, run from
    Python (for backends registered at run time as for plugins): every case
    of the schema's "tests" in each dtype (`dtypes`, default those the
    backend's kernel declares and torch can make), each variant (dtype
    alternatives, optional tensors left out; the plain variant on every
    case, the others sharing the cases in turn, as kdispatch-conformance
    does), on torch tensors on `device`,
    against the reference. Returns (calls checked, failures), each failure
    (case, dtype, variant, verdict). Calls the backend passes on as
    unsupported (KD_STATUS_UNSUPPORTED, kdispatch.Unsupported) are not
    checked and not failures: a warning counts them. The outcome is recorded as the
    kernel's conformance verdict on `device` (docs/internals.md,
    Conformance verdicts): fallback never passes a call to a kernel that
    failed."""
    import torch
    checked, failures, passed_on = 0, [], []
    missing = set(unavailable_dtypes(op, alternatives=True))
    all_cases = cases(op)
    for dtype in (dtypes or [d for d in _kdispatch._call_dtypes(op, backend) if d not in missing]):
        op_variants = variants(op, dtype)
        for vi, variant in enumerate(op_variants):
            if any(d in missing for d in variant["dtypes"].values()):
                continue
            for case in _cases_of_variant(all_cases, vi, len(op_variants) - 1):
                host = inputs(op, dtype, case, seed, dtypes=variant["dtypes"], absent=variant["absent"])
                want = reference(op, host, case)
                got = [None if t is None else t.to(device, copy=True) for t in host]
                try:
                    _kdispatch.call(op, *got, backend=backend, **_attrs(case))
                except KernelError as e:
                    if f"(status {_UNSUPPORTED})" not in e.message:
                        raise
                    passed_on.append(f"{dtype} {variant['dtypes']} {case}: {e.message}")
                    continue
                if device != "cpu":
                    torch.cuda.synchronize()
                verdict = compare(op, got, want, case)
                checked += 1
                if not verdict.ok:
                    if not failures:
                        _kdispatch._record_verdict(op, backend, str(device), False, "kdispatch.testing.conformance",
                                                   f"{dtype} {case}: {getattr(verdict, 'first_mismatch', '')}")
                    failures.append((case, dtype, variant, verdict))
    if checked and not failures:
        _kdispatch._record_verdict(op, backend, str(device), True, "kdispatch.testing.conformance")
    if passed_on:
        _warnings.warn(f"kdispatch.testing.conformance: backend '{backend}' passed {len(passed_on)} calls of {op} on "
                       f"as unsupported (not checked; first: {passed_on[0]})", stacklevel=2)
    return checked, failures
