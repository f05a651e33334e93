#!/usr/bin/env python3
"""`kdispatch run --save DIR` writes what the kernel read and wrote: the
saved inputs, run again through the op's reference backend, give the saved
outputs within the op schema's tolerances (kdispatch.testing). Every op
`run --all` checks, in every dtype (bfloat16 is saved as float32, exactly;
the 8-bit floats as their raw bytes; an op with an 8-bit float tensor is
skipped on a torch without them, before 2.1).
Usage: test_saved_files.py KDISPATCH_BINARY"""
import json
import pathlib
import subprocess
import sys
import tempfile

try:
    import numpy as np
    import torch
except ImportError as e:
    print(f"SKIPPED: {e} (Debian: python3-numpy, python3-torch)")
    sys.exit(77)

import kdispatch
import kdispatch.testing as kt


def load(path, dtype):
    """A saved array as a torch tensor of the call's dtype."""
    array = torch.from_numpy(np.load(path))
    if dtype.startswith("float8"):
        return array.view(getattr(torch, dtype))  # the raw bytes (uint8)
    return array.to(getattr(torch, dtype))


def check(binary, save):
    run = subprocess.run([binary, "run", "--all", "--backend", "cpu", "--save", str(save), "--json",
                          "--shape", "*=5,3"], capture_output=True, text=True)
    if run.returncode != 0:
        print(run.stdout, run.stderr)
        return 1
    checked = failed = 0
    for r in json.loads(run.stdout)["results"]:
        op, dtype = r["op"], r["dtype"]
        if kt.unavailable_dtypes(op):  # 8-bit floats before torch 2.1
            print(f"skip {op:30} {dtype:9}: this torch ({torch.__version__}) has no {', '.join(kt.unavailable_dtypes(op))}")
            continue
        stem = save / f"{op}.cpu.{dtype}"
        attrs = json.loads(pathlib.Path(f"{stem}.attrs.json").read_text())
        lacking = [t["dtype"] for t in kdispatch.schema(op)["tensors"]
                   if t["dtype"].startswith("float8") and not hasattr(torch, t["dtype"])]
        if lacking:
            print(f"skip {op:30} {dtype:9} this torch ({torch.__version__}) has no {lacking[0]}")
            continue
        saved_in, saved_out = [], []
        for arg in kdispatch.schema(op)["tensors"]:
            name = arg["name"]
            arg_dtype = dtype if arg["dtype"] in kdispatch.schema(op)["dtypes"] else arg["dtype"]
            out = load(f"{stem}.{name}.out.npy", arg_dtype) if arg["written"] else None
            given = load(f"{stem}.{name}.in.npy", arg_dtype) if not arg["written"] or arg["inplace"] else None
            saved_in.append(given if given is not None else torch.full_like(out, float("nan")) if out.is_floating_point()
                            else torch.full_like(out, -7))
            saved_out.append(out if out is not None else given)
        verdict = kt.check(op, saved_out, saved_in, attrs)
        checked += 1
        failed += not verdict.ok
        print(f"{'ok  ' if verdict.ok else 'FAIL'} {op:30} {dtype:9} max abs err {verdict.max_abs_err:.3g}"
              f"{'' if verdict.ok else ': ' + verdict.first_mismatch}")
    print(f"saved files: {checked - failed} passed, {failed} failed")
    return 1 if failed or checked == 0 else 0


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        sys.exit(check(sys.argv[1], pathlib.Path(d)))
