#!/usr/bin/env python3
"""What the functional form of an in-place op costs against the in-place
call: kdispatch.torch.layernorm.fused_add_rmsnorm(x, residual, w) (which
calls layernorm.fused_add_rmsnorm_out into fresh outputs) beside
torch.ops.kdispatch.layernorm_fused_add_rmsnorm on the same tensors, and
beside cloning both inputs then calling in place. GPU microseconds per
call, bf16, under CUDA-graph replay of 100 calls (the graph's pool
allocates once, at capture) and back to back (each functional call
allocates from torch's caching allocator), inputs rotated when smaller
than 3x the L2 cache.

  PYTHONPATH=build/cuda/python python3 tools/gpu/functional_cost.py
"""
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402  (the timers of tools/gpu/bench.py)

import kdispatch.torch as kdt  # noqa: E402

CALLS, REPEATS = 100, 20


def sets_for(rows, hidden):
    nbytes = 4 * rows * hidden * 2
    count = int(min(64, max(1, math.ceil(3 * bench.L2_BYTES / nbytes))))
    return [(bench.randn(rows, hidden, dtype=torch.bfloat16), bench.randn(rows, hidden, dtype=torch.bfloat16),
             (1 + 0.25 * torch.randn(hidden, device="cuda")).to(torch.bfloat16)) for _ in range(count)]


def main():
    in_place = torch.ops.kdispatch.layernorm_fused_add_rmsnorm
    functional = kdt.layernorm.fused_add_rmsnorm
    calls = {
        "in place": lambda s: in_place(s[0], s[1], s[2], 1e-6),
        "functional": lambda s: functional(s[0], s[1], s[2], eps=1e-6),
        "clone + in place": lambda s: in_place(s[0].clone(), s[1].clone(), s[2], 1e-6),
    }
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}: fused_add_rmsnorm, bf16, us per call")
    print(f"| shape | timing | {' | '.join(calls)} | functional / in place |")
    print("|---|---|" + "---|" * len(calls) + "---|")
    for rows, hidden in ((32768, 8192), (64, 4096), (1, 4096)):
        sets = sets_for(rows, hidden)
        graph = {name: bench.graph_us(bench.capture(call, sets, CALLS), CALLS, REPEATS) for name, call in calls.items()}
        b2b = {name: bench.b2b_us(call, sets, CALLS, REPEATS) for name, call in calls.items()}
        for label, t in (("graph replay", graph), ("back to back", b2b)):
            cells = " | ".join(f"{t[name]:.2f}" for name in calls)
            print(f"| {rows}x{hidden} | {label} | {cells} | {t['functional'] / t['in place']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
