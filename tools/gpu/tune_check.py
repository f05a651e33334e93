#!/usr/bin/env python3
"""Measured selection on the GPU: the cuda plugin, the torch backend
(kdispatch.native) and the triton backend (kdispatch.triton), tuned per op
at 1, 64 and 32768 rows by kdispatch.tuning.tune (CUDA-graph replay over
rotated inputs, after a check against the reference), then timed again by
an independent measurement in the same run: the torch custom ops
(torch.ops.kdispatch.*, naming each backend) on inputs made apart from the
tuner's, a CUDA graph of 200 calls over inputs rotated past 3x the L2,
replayed 10 times, the median. Prints both tables and, per shape, whether
the tuned choice is the independently fastest (or how far from it).

  PYTHONPATH=build/cuda/python python3 tools/gpu/tune_check.py --out tuning.json [--rows 1,64,32768]

Exit status: 0 when every choice is the fastest of the independent timing or
within --slack (default 5%) of it, 1 otherwise; 77 (skipped) without CUDA.
"""
import argparse
import math
import statistics
import sys

try:
    import torch
except ImportError as e:
    print(f"tune_check: SKIPPED: no torch ({e})")
    sys.exit(77)
if not torch.cuda.is_available():
    print("tune_check: SKIPPED: no CUDA device")
    sys.exit(77)

import kdispatch
import kdispatch.native
import kdispatch.torch as ktorch
import kdispatch.triton
import kdispatch.tuning

OPS = {
    "layernorm.rmsnorm": "H",
    "layernorm.fused_add_rmsnorm": "H",
    "activation.silu_and_mul": "D",
    "activation.gelu_tanh_and_mul": "D",
}
WIDTH = 4096
ROTATE_BYTES = 150 << 20  # 3x the H200's 50 MiB L2
CALLS = 200


def own_inputs(op, rows, dtype):
    """One call's tensors, made here with torch (not the tuner's generator)."""
    def rand(*shape):
        return (torch.rand(*shape, device="cuda") * 4 - 2).to(dtype)
    weight = torch.rand(WIDTH, device="cuda").to(dtype) + 0.5
    if op == "layernorm.rmsnorm":
        return [torch.empty(rows, WIDTH, device="cuda", dtype=dtype), rand(rows, WIDTH), weight]
    if op == "layernorm.fused_add_rmsnorm":
        return [rand(rows, WIDTH), rand(rows, WIDTH), weight]
    return [torch.empty(rows, WIDTH, device="cuda", dtype=dtype), rand(rows, 2 * WIDTH)]


def independent_us(op, rows, backend, dtype):
    """Graph-replay us per call of torch.ops.kdispatch.<op> naming `backend`."""
    fn = getattr(torch.ops.kdispatch, ktorch.op_name(op))
    first = own_inputs(op, rows, dtype)
    nbytes = sum(t.numel() * t.element_size() for t in first)
    copies = max(1, min(64, math.ceil(ROTATE_BYTES / nbytes)))
    sets = [first] + [own_inputs(op, rows, dtype) for _ in range(copies - 1)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for s in sets[:2]:
            fn(*s, backend=backend)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS):
            fn(*sets[i % copies], backend=backend)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / CALLS)
    del graph, sets
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--rows", default="1,64,32768")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--slack", type=float, default=0.05)
    parser.add_argument("--budget", type=float, default=120, help="seconds, per op")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    native = kdispatch.native.register()
    triton = kdispatch.triton.register()
    print(f"tune_check: torch {torch.__version__} on {torch.cuda.get_device_name()}; torch backend: {len(native)} "
          f"ops, triton backend: {len(triton)} ops")
    results = []
    for op, symbol in OPS.items():
        sizes = [{"rows": r, symbol: WIDTH} for r in rows]
        result = kdispatch.tuning.tune(op, sizes, dtype=args.dtype, device="cuda", out=None, apply=False,
                                       budget=args.budget, progress=False)
        results.append(result)
        print(result.table(), flush=True)
    measured = [{"op": r["op"], "dtype": r["dtype"], "sizes": kdispatch.tuning._symbol_sizes(r["sizes"]),
                 "us": dict(r["us"])} for res in results for r in res.rows]
    kdispatch.write_tuning(args.out, "cuda", measured)
    print(f"tune_check: tuning file {args.out}")

    lines = [("op", "sizes", "tuned (graph us)", "independent (graph us)", "choice", "fastest", "verdict")]
    bad = 0
    for res in results:
        for r in res.rows:
            dtype = getattr(torch, args.dtype)
            indep = {b: independent_us(r["op"], r["sizes"]["rows"], b, dtype) for b in r["us"]}
            fastest = min(indep, key=indep.get)
            gap = indep[r["choice"]] / indep[fastest] - 1
            verdict = "same" if fastest == r["choice"] else (f"within {gap:.1%}" if gap <= args.slack
                                                             else f"OFF by {gap:.1%}")
            bad += gap > args.slack
            lines.append((r["op"], " ".join(f"{k}={v}" for k, v in r["sizes"].items()),
                          " ".join(f"{b} {u:.2f}" for b, u in sorted(r["us"].items())),
                          " ".join(f"{b} {u:.2f}" for b, u in sorted(indep.items())), r["choice"], fastest, verdict))
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    print("\ntuned choices against an independent timing (CUDA-graph replay, us per call):")
    for line in lines:
        print("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip())
    print(f"tune_check: {len(lines) - 1 - bad} of {len(lines) - 1} choices are the fastest or within "
          f"{args.slack:.0%} of it")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
