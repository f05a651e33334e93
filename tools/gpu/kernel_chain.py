#!/usr/bin/env python3
"""What one decode-size kernel adds to a CUDA graph, by the company it keeps.

Graphs of 64 calls of tiny kernels (one row), alone or alternating, timed
by replay: microseconds per kernel = replay time / 64. The kernels:

  T  Triton rmsnorm (kdispatch's triton backend kernel, launched directly)
  K  kdispatch cuda rmsnorm (torch.ops.kdispatch.layernorm_rmsnorm)
  A  aten add (torch.add, out=)
  S  kdispatch cuda silu_and_mul, 1 x 768
  R  kdispatch cuda rotary, 1 token, 32 + 4 heads of 128

A pattern such as "TK" alternates T and K. For two-letter patterns the
"pair penalty" is the pattern's time per kernel minus the mean of its two
letters alone: what the pairing costs beyond each kernel in a chain of its
own kind. Run it twice, with and without KDISPATCH_CUDA_PDL=0, to see what
programmatic dependent launch gives a kdispatch kernel next to another
kdispatch kernel and next to a kernel launched without it.

    PYTHONPATH=build/cuda/python python3 tools/gpu/kernel_chain.py [--hidden 2048] [PATTERN...]

Needs CUDA and triton.
"""
import argparse
import os
import statistics
import sys

import torch
import triton

import kdispatch.torch  # noqa: F401 - registers torch.ops.kdispatch
from kdispatch import _triton_kernels
from python_graph_bench import capture, time_replays  # this folder's graph capture and replay timing

CHAIN = 64


def kernels(hidden):
    dt = torch.bfloat16
    dev = "cuda"
    x = torch.randn(1, hidden, device=dev, dtype=dt)
    w = torch.randn(hidden, device=dev, dtype=dt)
    out = torch.empty_like(x)
    y = torch.empty_like(x)
    gate_up = torch.randn(1, 2 * 768, device=dev, dtype=dt)
    act = torch.empty(1, 768, device=dev, dtype=dt)
    positions = torch.full((1,), 7, device=dev, dtype=torch.long)
    q = torch.randn(1, 32, 128, device=dev, dtype=dt)
    k = torch.randn(1, 4, 128, device=dev, dtype=dt)
    cos_sin = torch.randn(4096, 128, device=dev, dtype=torch.float32)
    ops = torch.ops.kdispatch
    block = triton.next_power_of_2(hidden)
    return {
        "T": lambda: _triton_kernels.rmsnorm_kernel[(1,)](out, hidden, x, hidden, w, hidden, 1e-6, GEMMA=False,
                                                          BLOCK=block),
        "K": lambda: ops.layernorm_rmsnorm(out, x, w),
        "A": lambda: torch.add(x, 1, out=y),
        "S": lambda: ops.activation_silu_and_mul(act, gate_up),
        "R": lambda: ops.embeddings_rotary_embedding(positions, q, k, cos_sin, True),
    }


def us_per_kernel(graph, replays=20, repeats=7):
    return statistics.median(time_replays(graph, replays) for _ in range(repeats)) / CHAIN


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=2048, help="row length of the norms and the add")
    parser.add_argument("patterns", nargs="*", default=["T", "K", "A", "S", "R", "TK", "TA", "AK", "TS", "TR", "KS",
                                                        "AS"])
    args = parser.parse_args()
    fns = kernels(args.hidden)
    unknown = sorted({c for p in args.patterns for c in p} - set(fns))
    if unknown:
        parser.error(f"unknown kernel letters {unknown}; known: {''.join(fns)}")
    result = {}
    keep = []
    for pattern in args.patterns:
        seq = [fns[c] for c in (pattern * CHAIN)[:CHAIN]]

        def run(seq=seq):
            for f in seq:
                f()

        graph = capture(run)
        keep.append(graph)
        result[pattern] = us_per_kernel(graph)
    print(f"kernel_chain: {torch.cuda.get_device_name()}, hidden {args.hidden}, "
          f"KDISPATCH_CUDA_PDL={os.environ.get('KDISPATCH_CUDA_PDL', '(unset)')}; us per kernel in graphs of {CHAIN}")
    for pattern in args.patterns:
        line = f"  {pattern:4} {result[pattern]:.3f}"
        if len(pattern) == 2 and all(c in result for c in pattern):
            penalty = result[pattern] - (result[pattern[0]] + result[pattern[1]]) / 2
            line += f"  pair penalty {penalty:+.3f}"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
