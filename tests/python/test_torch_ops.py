#!/usr/bin/env python3
"""kdispatch.torch on torch CPU tensors: torch.ops.kdispatch.* and the
functional variants write the right values for every built-in op (or the
one of --op) in float32, float16 and bfloat16, checked in float64 against
the op's formula (kd_cases.py) with outputs poisoned first; meta tensors go
through the fake implementation, whose errors read as the C++ check's;
torch's own DLPack capsules work with kdispatch.call."""
import argparse
import sys

try:
    import numpy as np
    import torch
except ImportError as e:
    print(f"SKIPPED: {e} (Debian: python3-numpy, python3-torch)")
    sys.exit(77)

import kdispatch
import kdispatch.torch as kt
import kd_cases

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "int32": torch.int32, "int64": torch.int64, "uint8": torch.uint8}


def round_to(dtype):
    return lambda v: torch.from_numpy(v).to(TORCH_DTYPES[dtype]).double().numpy()


def make(schema, sizes, dtype, rng):
    values = kd_cases.make_inputs(schema, sizes, rng)
    tensors = {n: torch.from_numpy(np.asarray(v)).to(TORCH_DTYPES[c or dtype]) for n, (v, c) in values.items()}
    return values, tensors


def check_op(op, rng):
    schema = kdispatch.schema(op)
    case = kd_cases.CASES.get(op)
    if case is None:
        print(f"FAIL {op}: no case in tests/python/kd_cases.py (sizes and formula)")
        return 1, 1  # one check, failed
    name = kt.registered[op]
    opfn = getattr(torch.ops.kdispatch, name)
    group, short = op.split(".", 1)
    functional = getattr(getattr(kt, group), short)
    (var, allowed), = schema["dtypes"].items()
    names = [t["name"] for t in schema["tensors"]]
    inputs = [t["name"] for t in schema["tensors"] if not t["written"] or t["inplace"]]
    outputs = [t["name"] for t in schema["tensors"] if t["written"]]
    checked = failed = 0
    for dtype in allowed:
        for sizes in case.sizes:
            for given in case.attrs:
                attrs = kd_cases.full_attrs(schema, given)
                for path in ("torch.ops", "functional"):
                    values, tensors = make(schema, sizes, dtype, rng)
                    exact = {n: t.double().numpy() for n, t in tensors.items()}
                    if path == "torch.ops":
                        opfn(*[tensors[n] for n in names], *[attrs[a["name"]] for a in schema["attrs"]])
                        got = tensors
                    else:
                        before = {n: tensors[n].clone() for n in inputs}
                        keywords = {s: sizes[s] for s in kt._schema.Functional(schema).keyword_symbols}
                        result = functional(*[tensors[n] for n in inputs], **keywords, **given)
                        result = result if isinstance(result, tuple) else (result,)
                        got = dict(zip(outputs, result))
                        for n in inputs:  # a functional variant leaves its inputs alone
                            if not torch.equal(before[n], tensors[n]):
                                print(f"FAIL {op} {dtype}: the functional variant changed its input '{n}'")
                                failed += 1
                    want = case.formula(exact, attrs, round_to(dtype))
                    for out, value in want.items():
                        ok, err = kd_cases.compare(schema, got[out].double().numpy(), value, values[out][1] or dtype)
                        checked += 1
                        failed += not ok
                        if not ok:
                            print(f"FAIL {op} {dtype} {sizes} {given} via {path}: {out} max abs err {err:.3g}")
    # Meta tensors: the fake implementation, no kernel.
    sizes = case.sizes[0]
    meta = {n: t.to("meta") for n, t in make(schema, sizes, allowed[0], rng)[1].items()}
    opfn(*[meta[n] for n in names])
    checked += 1
    print(f"{'ok  ' if failed == 0 else 'FAIL'} {op}: {checked - failed} of {checked} checks pass")
    return checked, failed


def check_capsules_of_torch(rng):
    """torch's own DLPack capsules go through kdispatch.call too (the path of
    a producer kdispatch knows nothing about), each dtype."""
    schema = kdispatch.schema("layernorm.rmsnorm")
    checked = failed = 0
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = torch.from_numpy(rng.uniform(0.5, 2.0, (3, 37))).to(dtype)
        w = torch.from_numpy(rng.uniform(0.5, 2.0, 37)).to(dtype)
        out = torch.full_like(x, float("nan"))
        kdispatch.call("layernorm.rmsnorm", out.__dlpack__(), x.__dlpack__(), w.__dlpack__())
        want = kd_cases.rmsnorm(x.double().numpy(), w.double().numpy(), 1e-6)
        ok, err = kd_cases.compare(schema, out.double().numpy(), want, str(dtype).replace("torch.", ""))
        checked += 1
        failed += not ok
        if not ok:
            print(f"FAIL rmsnorm {dtype} through torch's capsules: max abs err {err:.3g}")
    print(f"{'ok  ' if failed == 0 else 'FAIL'} torch's DLPack capsules: {checked - failed} of {checked}")
    return checked, failed


def check_fake_words_as_cpp(rng):
    """A wrong shape is refused on CPU (the C++ check) and on meta tensors
    (the fake implementation) with the same KD-E030 message."""
    checked = failed = 0
    schema = kdispatch.schema("layernorm.rmsnorm")
    bad = [
        (torch.empty(3, 7), torch.empty(3, 7), torch.empty(6)),                       # H differs
        (torch.empty(3, 7), torch.empty(4, 7), torch.empty(7)),                       # leading dims
        (torch.empty(3, 7), torch.empty(3, 7, dtype=torch.float16), torch.empty(7)),  # dtype variable
        (torch.empty(3, 7), torch.empty(3, 7), torch.empty(7, 1)),                    # rank
    ]
    for args in bad:
        messages = []
        for device in ("cpu", "meta"):
            try:
                torch.ops.kdispatch.layernorm_rmsnorm(*[a.to(device) for a in args])
                messages.append(None)
            except kdispatch.CallError as e:
                messages.append((e.code, e.message))
        checked += 1
        if messages[0] is None or messages[0] != messages[1]:
            failed += 1
            print(f"FAIL cpu and meta disagree: {messages}")
    print(f"{'ok  ' if failed == 0 else 'FAIL'} fake implementation words errors as the C++ check: "
          f"{checked - failed} of {checked}")
    return checked, failed


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--op", help="only this op (default: every op kdispatch.ops() lists, then --fake-words)")
    parser.add_argument("--fake-words", action="store_true", help="only compare the errors of the fake "
                        "implementation with the C++ check's, and call through torch's own DLPack capsules")
    args = parser.parse_args()
    ops = [] if args.fake_words else [args.op] if args.op else kdispatch.ops()
    rng = np.random.default_rng(1913)
    total = bad = 0
    for op in ops:
        c, f = check_op(op, rng)
        total, bad = total + c, bad + f
    if not args.op:
        for check in (check_fake_words_as_cpp, check_capsules_of_torch):
            c, f = check(rng)
            total, bad = total + c, bad + f
    print(f"torch {torch.__version__}: {total - bad} passed, {bad} failed ({len(ops)} ops; "
          "float32, float16, bfloat16)")
    return 1 if bad or total == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
