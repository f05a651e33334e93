#!/usr/bin/env python3
"""kdispatch.call and kdispatch.op on NumPy arrays write the right values:
every built-in op (or the one of --op), float32 and float16 (NumPy has no
bfloat16: test_torch_ops.py covers it), odd sizes, checked in float64
against the op's formula (kd_cases.py), outputs poisoned with NaN first."""
import argparse
import sys

try:
    import numpy as np
except ImportError:
    print("SKIPPED: this python has no numpy (Debian: python3-numpy)")
    sys.exit(77)

import kdispatch
import kd_cases

NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16}


def numpy_dtype(name):
    return {"int32": np.int32, "int64": np.int64, "uint8": np.uint8, **NUMPY_DTYPES}[name]


def round_to(dtype):
    return lambda v: v.astype(NUMPY_DTYPES[dtype]).astype(np.float64)


def check_op(op, rng):
    schema = kdispatch.schema(op)
    case = kd_cases.CASES.get(op)
    if case is None:
        print(f"FAIL {op}: no case in tests/python/kd_cases.py (sizes and formula)")
        return 1, 1  # one check, failed
    (var, allowed), = schema["dtypes"].items()
    handle = kdispatch.op(op)
    checked = failed = 0
    for dtype in [d for d in allowed if d in NUMPY_DTYPES]:
        for sizes in case.sizes:
            for given in case.attrs:
                for path in ("call", "op"):
                    values = kd_cases.make_inputs(schema, sizes, rng)
                    arrays = {n: v.astype(numpy_dtype(c or dtype)) for n, (v, c) in values.items()}
                    exact = {n: a.astype(np.float64) for n, a in arrays.items()}
                    args = [arrays[t["name"]] for t in schema["tensors"]]
                    if path == "call":
                        kdispatch.call(op, *args, **given)
                    else:
                        handle(*args, **given)
                    want = case.formula(exact, kd_cases.full_attrs(schema, given), round_to(dtype))
                    for name, value in want.items():
                        out_dtype = values[name][1] or dtype
                        ok, err = kd_cases.compare(schema, arrays[name], value, out_dtype)
                        checked += 1
                        failed += not ok
                        if not ok:
                            print(f"FAIL {op} {dtype} {sizes} {given} via {path}: {name} max abs err {err:.3g}")
    print(f"{'ok  ' if failed == 0 else 'FAIL'} {op}: {checked - failed} of {checked} outputs match")
    return checked, failed


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--op", help="only this op (default: every op kdispatch.ops() lists)")
    args = parser.parse_args()
    ops = [args.op] if args.op else kdispatch.ops()
    rng = np.random.default_rng(19)
    total = bad = 0
    for op in ops:
        checked, failed = check_op(op, rng)
        total += checked
        bad += failed
    print(f"numpy: {total - bad} passed, {bad} failed ({len(ops)} ops; float32 and float16)")
    return 1 if bad or total == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
