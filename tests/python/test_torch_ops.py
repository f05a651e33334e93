#!/usr/bin/env python3
"""kdispatch.torch on torch CPU tensors: torch.ops.kdispatch.* and the
functional variants write the right values for every op (or the one of
--op), in every dtype the op takes, at the sizes, attribute values and
special values of the op schema's "tests", against the op's reference
backend with the schema's tolerances (kdispatch.testing), outputs poisoned
first (an op with a float8 tensor is skipped on a torch without float8,
before 2.1); meta tensors go through the fake implementation, which refuses every
kind of bad call with the words of the dispatcher's own check; torch's own
DLPack capsules work with kdispatch.call."""
import argparse
import sys

try:
    import torch
except ImportError as e:
    print(f"SKIPPED: {e} (Debian: python3-torch)")
    sys.exit(77)

import kdispatch
import kdispatch.torch as kdt
import kdispatch.testing as kt

# The Python tests check the bindings, not the kernels at every size (the
# conformance suite does): cases of more elements than this are left out.
MAX_ELEMENTS = 1 << 20


def float8_missing(op):
    """A float8 dtype a tensor of `op` always has and this torch lacks, or None."""
    for t in kdispatch.schema(op)["tensors"]:
        dtypes = [t["dtype"], *t["dtype_alternatives"]]
        if all(d.startswith("float8") for d in dtypes) and not hasattr(torch, dtypes[0]):
            return dtypes[0]
    return None


def usable_ops():
    """kdispatch.ops() less those this torch cannot make tensors for (float8_missing)."""
    return [op for op in kdispatch.ops() if not float8_missing(op)]


def check_op(op):
    schema = kdispatch.schema(op)
    opfn = getattr(torch.ops.kdispatch, kdt.registered[op])
    group, short = op.split(".", 1)
    functional = getattr(getattr(kdt, group), short)
    keyword_symbols = kdt._schema.Functional(schema).keyword_symbols
    inputs_of = [i for i, t in enumerate(schema["tensors"]) if not t["written"] or t["inplace"]]
    outputs_of = [i for i, t in enumerate(schema["tensors"]) if t["written"]]
    # Optional outputs are not allocated by the functional variant: given by keyword.
    optional_outputs = [i for i in outputs_of if schema["tensors"][i].get("optional")
                        and not schema["tensors"][i]["inplace"]]
    returned = [i for i in outputs_of if i not in optional_outputs]
    checked = failed = 0
    for dtype in kt.dtypes(op):
        for case in kt.cases(op):
            if case.elements > MAX_ELEMENTS:
                continue
            inputs = kt.inputs(op, dtype, case, seed=case.index)
            want = kt.reference(op, inputs, case)
            attrs = {a["name"]: case.attrs.get(a["name"], a["default"]) for a in schema["attrs"]}
            for path in ("torch.ops", "functional"):
                got = [t.clone() for t in inputs]
                if path == "torch.ops":
                    opfn(*got, *attrs.values())
                else:
                    before = [got[i].clone() for i in inputs_of]
                    keywords = {s: case.sizes[s] for s in keyword_symbols}
                    keywords.update({schema["tensors"][i]["name"]: got[i] for i in optional_outputs})
                    result = functional(*[got[i] for i in inputs_of], **keywords, **case.attrs)
                    result = result if isinstance(result, tuple) else (result,)
                    for i, b in zip(inputs_of, before):  # a functional variant leaves its inputs alone
                        if not (torch.equal(b, got[i]) or torch.allclose(b, got[i], rtol=0, atol=0, equal_nan=True)):
                            print(f"FAIL {case} {dtype}: the functional variant changed its input {i}")
                            failed += 1
                    for i, r in zip(returned, result):
                        got[i] = r
                verdict = kt.compare(op, got, want, case)
                checked += 1
                failed += not verdict.ok
                if not verdict.ok:
                    print(f"FAIL {case} {dtype} via {path}: {verdict.first_mismatch}")
    # Meta tensors: the fake implementation, no kernel.
    case = kt.cases(op)[0]
    opfn(*[t.to("meta") for t in kt.inputs(op, kt.dtypes(op)[0], case)])
    checked += 1
    print(f"{'ok  ' if failed == 0 else 'FAIL'} {op}: {checked - failed} of {checked} checks pass")
    return checked, failed


def check_capsules_of_torch():
    """torch's own DLPack capsules go through kdispatch.call too (the path of
    a producer kdispatch knows nothing about), in every dtype of every op."""
    checked = failed = 0
    for op in usable_ops():
        # The largest small case: leading dims above 1, where torch's strides
        # of an empty tensor differ from a dense layout's.
        case = max((c for c in kt.cases(op) if c.elements <= 1 << 16 and not c.special), key=lambda c: c.elements)
        for dtype in kt.dtypes(op):
            inputs = kt.inputs(op, dtype, case, seed=3)
            got = [t.clone() for t in inputs]
            kdispatch.call(op, *[t.__dlpack__() for t in got], **case.attrs)
            verdict = kt.check(op, got, inputs, case)
            checked += 1
            failed += not verdict.ok
            if not verdict.ok:
                print(f"FAIL {case} {dtype} through torch's capsules: {verdict.first_mismatch}")
    print(f"{'ok  ' if failed == 0 else 'FAIL'} torch's DLPack capsules: {checked - failed} of {checked}")
    return checked, failed


def bad_calls(device):
    """Bad calls of every kind the checker words, each refusing one rule,
    on `device` (argument counts are torch's own schema's to refuse)."""
    f32, f16, f64, i64 = torch.float32, torch.float16, torch.float64, torch.int64

    def e(*shape, dtype=f32):
        return torch.empty(*shape, dtype=dtype, device=device)

    return [
        ("a dtype outside the variable's list", "layernorm.rmsnorm", (e(3, 7, dtype=f64), e(3, 7, dtype=f64),
                                                                      e(7, dtype=f64))),
        ("a dtype differing from its variable's", "layernorm.rmsnorm", (e(3, 7), e(3, 7, dtype=f16), e(7))),
        ("a concrete dtype", "moe.topk_softmax", (e(3, 2), e(3, 2, dtype=f32), e(3, 8))),
        ("a rank", "layernorm.rmsnorm", (e(3, 7), e(3, 7), e(7, 1))),
        ("too few dims for a pattern with leading dims", "layernorm.rmsnorm", (e(()), e(3, 7), e(7))),
        ("leading dims", "layernorm.rmsnorm", (e(3, 7), e(4, 7), e(7))),
        ("a symbol", "layernorm.rmsnorm", (e(3, 7), e(3, 7), e(6))),
        ("a multiple of a bound symbol", "activation.silu_and_mul", (e(3, 3), e(3, 8))),
        ("a multiple that binds its symbol", "embeddings.rotary_embedding",
         (e(3, dtype=i64), e(3, 2, 7), e(3, 1, 7), e(16, 7))),
        ("the leading dims of an integer input", "embeddings.rotary_embedding",
         (e(4, dtype=i64), e(3, 2, 8), e(3, 1, 8), e(16, 8))),
        ("a relation between sizes (a cos_sin_cache wider than the head)", "embeddings.rotary_embedding",
         (e(3, dtype=i64), e(3, 2, 8), e(3, 1, 8), e(16, 10))),
        ("a layout", "layernorm.rmsnorm", (e(3, 7), e(3, 14)[:, ::2], e(7))),
    ]


def check_fake_words_as_cpp():
    """Each bad call refused on CPU tensors (the dispatcher's check) and on
    meta tensors (the fake implementation, which asks the same check) with
    the same KD-E030 message."""
    checked = failed = 0
    for (kind, op, cpu_args), (_, _, meta_args) in zip(bad_calls("cpu"), bad_calls("meta")):
        opfn = getattr(torch.ops.kdispatch, kdt.registered[op])
        messages = []
        for args in (cpu_args, meta_args):
            try:
                opfn(*args)
                messages.append(None)
            except kdispatch.CallError as e:
                messages.append((e.code, e.message))
        checked += 1
        if messages[0] is None or messages[0] != messages[1]:
            failed += 1
            print(f"FAIL {kind}: cpu and meta disagree: {messages}")
        else:
            print(f"ok   {kind}: {messages[0][1]}")
    print(f"{'ok  ' if failed == 0 else 'FAIL'} fake implementation words errors as the C++ check: "
          f"{checked - failed} of {checked}")
    return checked, failed


def check_backend_argument():
    """torch.ops.kdispatch.* and the functional forms take the backend to run
    as their last argument: the reference backend's result bit for bit, and
    an unknown backend refused as kdispatch.call refuses it."""
    checked = failed = 0
    for op in usable_ops():
        # The largest small case: leading dims above 1, where torch's strides
        # of an empty tensor differ from a dense layout's.
        case = max((c for c in kt.cases(op) if c.elements <= 1 << 16 and not c.special), key=lambda c: c.elements)
        dtype = kt.dtypes(op)[0]
        schema = kdispatch.schema(op)
        inputs = kt.inputs(op, dtype, case, seed=7)
        want = kt.reference(op, inputs, case)
        got = [t.clone() for t in inputs]
        attrs = [case.attrs.get(a["name"], a["default"]) for a in schema["attrs"]]
        getattr(torch.ops.kdispatch, kdt.registered[op])(*got, *attrs, "reference")
        written = [i for i, t in enumerate(schema["tensors"]) if t["written"]]
        same = all(torch.equal(got[i], want[i]) or torch.allclose(got[i], want[i], rtol=0, atol=0, equal_nan=True)
                   for i in written)
        group, short = op.split(".", 1)
        inputs_of = [i for i, t in enumerate(schema["tensors"]) if not t["written"] or t["inplace"]]
        keywords = {s: case.sizes[s] for s in kdt._schema.Functional(schema).keyword_symbols}
        result = getattr(getattr(kdt, group), short)(*[inputs[i] for i in inputs_of], **keywords, **case.attrs,
                                                     backend="reference")
        result = result if isinstance(result, tuple) else (result,)
        same = same and all(torch.equal(r, want[i]) or torch.allclose(r, want[i], rtol=0, atol=0, equal_nan=True)
                            for r, i in zip(result, written))
        try:
            getattr(torch.ops.kdispatch, kdt.registered[op])(*[t.clone() for t in inputs], *attrs, "no_such_backend")
            refused = False
        except kdispatch.SelectionError as e:
            refused = e.code == "KD-E002"
        checked += 1
        failed += not (same and refused)
        if not (same and refused):
            print(f"FAIL {op}: backend='reference' gives the reference's result: {same}; an unknown backend "
                  f"is KD-E002: {refused}")
    print(f"{'ok  ' if failed == 0 else 'FAIL'} the backend argument of the torch ops and functional forms: "
          f"{checked - failed} of {checked} ops")
    return checked, failed


def check_unknown_names():
    """A misspelt op or group is an AttributeError that names what exists
    and the configure-before-import rule, not a bare one."""
    checked = failed = 0
    for spelt, want in ((lambda: kdispatch.torch.layernorm.rmsnrom, "did you mean 'rmsnorm'?"),
                        (lambda: kdispatch.torch.layernrom, "did you mean 'layernorm'?")):
        checked += 1
        try:
            spelt()
            message = "no error"
        except AttributeError as e:
            message = str(e)
        ok = want in message and "kdispatch.configure(add_plugin_path=[...]) before importing" in message
        failed += not ok
        if not ok:
            print(f"FAIL an unknown name: {message}")
    ok = hasattr(kdispatch.torch.layernorm, "rmsnorm") and not hasattr(kdispatch.torch, "no_such_group")
    checked, failed = checked + 1, failed + (not ok)
    print(f"{'ok  ' if failed == 0 else 'FAIL'} unknown ops and groups of kdispatch.torch: {checked - failed} of "
          f"{checked}")
    return checked, failed


def refused_by_reference(op, schema, tensors, case):
    """Whether the op's reference kernel refuses the call as well."""
    attrs = [case.attrs.get(a["name"], a["default"]) for a in schema["attrs"]]
    try:
        getattr(torch.ops.kdispatch, kdispatch.torch.op_name(op))(*[t.clone() for t in tensors], *attrs, "reference")
    except Exception:  # noqa: BLE001 - any refusal counts
        return True
    return False


def check_zero_size():
    """Tensors with no element are valid: for each op, a case of its schema
    with the leading dims, then each size symbol, set to 0, in tensors
    torch.empty makes (strides no dense layout has, e.g. [1, 1] for [3, 0]),
    the other tensors as the case has them, through kdispatch.call and the
    torch op; unless the reference kernel refuses the call too."""
    import re
    checked = failed = 0
    for op in usable_ops():
        schema = kdispatch.schema(op)
        dtype = "float32" if "float32" in kt.dtypes(op) else kt.dtypes(op)[0]
        # The largest small case: leading dims above 1, where torch's strides
        # of an empty tensor differ from a dense layout's.
        case = max((c for c in kt.cases(op) if c.elements <= 1 << 16 and not c.special), key=lambda c: c.elements)
        inputs = kt.inputs(op, dtype, case)
        bounds = {str(t["range"][1]) for t in schema["tensors"] if t["range"]}
        symbols = sorted({name for t in schema["tensors"] for dim in t["shape"] if dim != "*"
                          for name in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", dim)} - bounds)
        for zero in ["*"] + symbols:
            tensors = []
            for arg, x in zip(schema["tensors"], inputs):
                dims = arg["shape"]
                star = bool(dims) and dims[0] == "*"
                leading = x.dim() - (len(dims) - 1) if star else 0
                shape = list(x.shape)
                if zero == "*" and leading > 0:
                    shape[0] = 0
                for j, dim in enumerate(dims[1:] if star else dims):
                    if zero != "*" and re.search(rf"\b{zero}\b", dim):
                        shape[leading + j] = 0
                tensors.append(torch.empty(shape, dtype=x.dtype) if 0 in shape else x.clone())
            empty = [t.numel() == 0 for t in tensors]
            written = [arg["written"] for arg in schema["tensors"]]
            if not any(empty) or any(w and not e for w, e in zip(written, empty)) and \
                    any(not w and e for w, e in zip(written, empty)):
                continue  # nothing empty, or an output to compute from an empty input (K > E = 0)
            checked += 1
            try:
                kdispatch.call(op, *tensors, **case.attrs)
                getattr(torch.ops.kdispatch, kdispatch.torch.op_name(op))(*tensors)
            except Exception as e:  # noqa: BLE001 - any refusal is the failure
                if "breaks the schema's requirement" in str(e):
                    checked -= 1  # a 0 on one side of a requirement (2*R <= D) is refused, rightly
                    continue
                if refused_by_reference(op, schema, tensors, case):
                    # Refused by the oracle too: a size the call's data or attributes
                    # need (slots beyond an empty cache, outputs below a worst case
                    # that depends on attributes, which no requirement can name).
                    checked -= 1
                    continue
                failed += 1
                print(f"FAIL {op} with {zero} = 0, shapes {[list(t.shape) for t in tensors]}: "
                      f"{type(e).__name__}: {e}")
    print(f"{'ok  ' if failed == 0 else 'FAIL'} tensors with no element: {checked - failed} of {checked} calls")
    return checked, failed


def check_out_of_place():
    """The functional variant of an op whose schema names an out-of-place
    form calls that op on the inputs as given: no clone, no copy, no other
    op (torch's dispatcher sees every call)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Calls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else func))
            return func(*args, **(kwargs or {}))

    checked = failed = 0
    for schema in kdispatch.schemas():
        target = schema.get("out_of_place")
        if target is None:
            continue
        op = schema["op"]
        group, short = op.split(".", 1)
        functional = getattr(getattr(kdt, group), short)
        x = torch.randn(5, 3, 64)[:, 1]  # a row-strided view, as a model passes it
        residual = torch.randn(5, 64, dtype=torch.float32)
        weight = torch.rand(64) + 0.5
        x_before, residual_before = x.clone(), residual.clone()
        with Calls() as calls:
            out, residual_out = functional(x, residual, weight, eps=1e-6)
        want_x, want_residual = x.clone(), residual.clone()
        getattr(torch.ops.kdispatch, kdt.registered[op])(want_x, want_residual, weight, 1e-6, "reference")
        checked += 1
        problems = []
        wanted_call = kdt.registered[target]
        if [n for n in calls.names if "empty" not in n] != [wanted_call]:
            problems.append(f"torch saw {calls.names}, expected allocations and one {wanted_call}")
        if not (torch.equal(x, x_before) and torch.equal(residual, residual_before)):
            problems.append("it changed its inputs")
        if not (torch.allclose(out, want_x, rtol=1e-5, atol=1e-6) and torch.equal(residual_out, want_residual)):
            problems.append("its results differ from the in-place op's on the reference backend")
        if problems:
            failed += 1
            print(f"FAIL the functional form of {op}: {'; '.join(problems)}")
    print(f"{'ok  ' if failed == 0 and checked else 'FAIL'} out-of-place functional forms: "
          f"{checked - failed} of {checked} call their out-of-place op without copying")
    return checked, failed + (checked == 0)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--op", help="only this op (default: every op kdispatch.ops() lists, then --fake-words)")
    parser.add_argument("--fake-words", action="store_true", help="only compare the errors of the fake "
                        "implementation with the C++ check's, and call through torch's own DLPack capsules")
    args = parser.parse_args()
    ops = [] if args.fake_words else [args.op] if args.op else kdispatch.ops()
    total = bad = 0
    for op in ops:
        missing = float8_missing(op)
        if missing:
            print(f"skip {op}: this torch ({torch.__version__}) has no {missing}")
            if args.op:
                print(f"SKIPPED: this torch ({torch.__version__}) has no {missing}, which {op} needs")
                return 77
            continue
        c, f = check_op(op)
        total, bad = total + c, bad + f
    if not args.op:
        for check in (check_fake_words_as_cpp, check_capsules_of_torch, check_backend_argument, check_unknown_names,
                      check_zero_size, check_out_of_place):
            c, f = check()
            total, bad = total + c, bad + f
    print(f"torch {torch.__version__}: {total - bad} passed, {bad} failed ({len(ops)} ops)")
    return 1 if bad or total == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
