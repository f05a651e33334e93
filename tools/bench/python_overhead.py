#!/usr/bin/env python3
"""Host time per call from Python of one op on the same small tensors,
through every kdispatch path and through torch's own function:

  kdispatch.call          kdispatch.call("layernorm.rmsnorm", out, x, w, eps=...)
  kdispatch.op            op = kdispatch.op("layernorm.rmsnorm"); op(out, x, w, eps=...)
  torch.ops.kdispatch     torch.ops.kdispatch.layernorm_rmsnorm(out, x, w, eps)
  kdispatch.torch (func)  kdispatch.torch.layernorm.rmsnorm(x, w, eps=...)  (allocates out)
  torch                   torch.nn.functional.rms_norm (torch 2.x), else the
                          formula composed of torch ops (torch 1.13)

Method: each sample times --calls back-to-back calls with perf_counter_ns
and divides; the paths take turns sample by sample, so that a change in the
machine's load hits them alike; the table gives the median over --samples
samples (at least 1000 calls per path by default) and the ratio to torch's
function. On CUDA the calls of a sample only queue launches (no
synchronisation inside a sample; the device is synchronised between samples,
outside the timing), so this is host time, not kernel time. On the CPU the
kernel runs inside the call and is part of the time, for every path alike.

Targets (docs/performance.md): torch.ops.kdispatch no
slower than torch's function; the pre-resolved op at most 0.6x of it.

  PYTHONPATH=build/default/python /usr/bin/python3 tools/bench/python_overhead.py [--device cuda]
"""
import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import kdispatch
import kdispatch.testing as ktest
import kdispatch.torch as kt


def torch_function(hidden, eps):
    if hasattr(F, "rms_norm"):
        return "F.rms_norm", lambda out, x, w: F.rms_norm(x, (hidden,), w, eps)

    def composed(out, x, w):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w

    return "torch formula (no F.rms_norm)", composed


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--calls", type=int, default=100, help="calls per sample")
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()

    dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    eps = 1e-6
    x = torch.randn(args.rows, args.hidden, dtype=dtype, device=device)
    w = torch.randn(args.hidden, dtype=dtype, device=device)
    out = torch.empty_like(x)
    handle = kdispatch.op("layernorm.rmsnorm")
    custom = torch.ops.kdispatch.layernorm_rmsnorm
    functional = kt.layernorm.rmsnorm
    peer_name, peer = torch_function(args.hidden, eps)

    paths = {
        "kdispatch.call": lambda: kdispatch.call("layernorm.rmsnorm", out, x, w, eps=eps),
        "kdispatch.op (pre-resolved)": lambda: handle(out, x, w, eps=eps),
        "torch.ops.kdispatch": lambda: custom(out, x, w, eps),
        "kdispatch.torch functional": lambda: functional(x, w, eps=eps),
        peer_name: lambda: peer(out, x, w),
    }
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    # Each kdispatch path gives the reference backend's answer first.
    for name, fn in paths.items():
        if name == peer_name:
            continue
        out.fill_(float("nan"))
        result = fn()
        got = result if isinstance(result, torch.Tensor) else out
        verdict = ktest.check("layernorm.rmsnorm", [got, x, w], [torch.empty_like(x), x, w], {"eps": eps})
        if not verdict.ok:
            print(f"{name}: the result is not the reference backend's: {verdict.first_mismatch}")
            return 1

    times = {name: [] for name in paths}
    for _ in range(3):  # warm-up: plugin loads, caches, allocator
        for fn in paths.values():
            fn()
    sync()
    for _ in range(args.samples):
        for name, fn in paths.items():
            sync()
            start = time.perf_counter_ns()
            for _ in range(args.calls):
                fn()
            times[name].append((time.perf_counter_ns() - start) / args.calls / 1000.0)
        sync()

    medians = {name: statistics.median(t) for name, t in times.items()}
    base = medians[peer_name]
    targets = {"torch.ops.kdispatch": 1.0, "kdispatch.op (pre-resolved)": 0.6}
    print(f"host time per call, layernorm.rmsnorm {args.rows}x{args.hidden} {args.dtype} on {args.device}, "
          f"torch {torch.__version__}, median of {args.samples} samples x {args.calls} calls")
    print(f"{'path':32} {'us/call':>9} {'vs torch':>9}  target")
    for name, us in medians.items():
        target = targets.get(name)
        verdict = "" if target is None else f"<= {target:.1f}x {'met' if us / base <= target else 'MISSED'}"
        print(f"{name:32} {us:9.2f} {us / base:8.2f}x  {verdict}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "dtype": args.dtype, "rows": args.rows, "hidden": args.hidden,
                       "torch": torch.__version__, "us_per_call": medians, "peer": peer_name}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
