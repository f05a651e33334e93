#!/usr/bin/env python3
"""kdispatch.call and kdispatch.op on NumPy arrays write the right values:
every op (or the one of --op) in float32 and float16 (NumPy has no
bfloat16: test_torch_ops.py covers it), or int32 and int64 for an op whose
call dtype is an integer one (moe.align_block_size's ids), at the sizes, attribute values and
special values of the op schema's "tests", against the op's reference
backend with the schema's tolerances (kdispatch.testing), outputs poisoned
first. NumPy has no 8-bit floats: an op with a float8 tensor is skipped
(test_torch_ops.py covers it where torch has them)."""
import argparse
import sys

try:
    import numpy as np  # noqa: F401  kdispatch.testing makes NumPy arrays
except ImportError:
    print("SKIPPED: this python has no numpy (Debian: python3-numpy)")
    sys.exit(77)

import kdispatch
import kdispatch.testing as kt

NUMPY_DTYPES = ("float32", "float16", "int32", "int64")
# The Python tests check the bindings, not the kernels at every size (the
# conformance suite does): cases of more elements than this are left out.
MAX_ELEMENTS = 1 << 20


def float8_tensor(op):
    """The name of a tensor of `op` that is a float8 in every call, or None."""
    for t in kdispatch.schema(op)["tensors"]:
        if all(d.startswith("float8") for d in [t["dtype"], *t["dtype_alternatives"]]):
            return t["name"]
    return None


def check_op(op):
    missing = kt.unavailable_dtypes(op, kind="numpy")
    if missing:
        print(f"skip {op}: NumPy has no {', '.join(missing)} (test_torch_ops.py covers it)")
        return 0, 0
    handle = kdispatch.op(op)
    checked = failed = 0
    for dtype in [d for d in kt.dtypes(op) if d in NUMPY_DTYPES]:
        for case in kt.cases(op):
            if case.elements > MAX_ELEMENTS:
                continue
            inputs = kt.inputs(op, dtype, case, seed=case.index, kind="numpy")
            want = kt.reference(op, inputs, case)
            for path in ("call", "op"):
                got = [a.copy() for a in inputs]
                if path == "call":
                    kdispatch.call(op, *got, **case.attrs)
                else:
                    handle(*got, **case.attrs)
                verdict = kt.compare(op, got, want, case)
                checked += 1
                failed += not verdict.ok
                if not verdict.ok:
                    print(f"FAIL {case} {dtype} via {path}: {verdict.first_mismatch}")
    print(f"{'ok  ' if failed == 0 else 'FAIL'} {op}: {checked - failed} of {checked} calls match the reference")
    return checked, failed


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--op", help="only this op (default: every op kdispatch.ops() lists)")
    args = parser.parse_args()
    ops = [args.op] if args.op else kdispatch.ops()
    total = bad = 0
    for op in ops:
        if float8_tensor(op):
            print(f"skip {op}: NumPy has no float8 for its tensor {float8_tensor(op)}")
            if args.op:
                print(f"SKIPPED: NumPy has no float8 for {op}'s tensor {float8_tensor(op)}")
                return 77
            continue
        checked, failed = check_op(op)
        total += checked
        bad += failed
    print(f"numpy: {total - bad} passed, {bad} failed ({len(ops)} ops; float32 and float16, or int32 and int64)")
    if total == 0 and all(kt.unavailable_dtypes(op, kind="numpy") for op in ops):
        return 77  # skipped
    return 1 if bad or total == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
