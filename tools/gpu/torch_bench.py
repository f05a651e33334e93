#!/usr/bin/env python3
"""PyTorch eager and torch.compile timings of the kdispatch GPU ops.

The shapes, shape labels and byte counts are those of tools/bench/gpu_bench.cpp
so that tools/gpu/report.py can join the two result files. Timing: CUDA
events around each call, median of many calls after warm-up, inputs rotated
among several sets when one set is smaller than 3x the L2 cache.

    python3 tools/gpu/torch_bench.py --csv torch_bench.csv
"""
import argparse
import csv
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F

L2_BYTES = 60e6  # H200
EPS = 1e-6
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


# --- the ops, as a PyTorch user writes them (float32 math as the kernels) ----

def rmsnorm(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * w.float()).to(x.dtype)


def fused_add_rmsnorm(x, residual, w):
    residual = x + residual
    return rmsnorm(residual, w), residual


def silu_and_mul(x):
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def gelu_and_mul(x):
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d]) * x[..., d:]


def gelu_tanh_and_mul(x):
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]


def rotary_neox(positions, q, k, cache):
    cos, sin = cache[positions].unsqueeze(-2).chunk(2, dim=-1)

    def rotate(x):
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def rotary_gptj(positions, q, k, cache):
    cos, sin = cache[positions].unsqueeze(-2).chunk(2, dim=-1)

    def rotate(x):
        xf = x.float()
        x1, x2 = xf[..., ::2], xf[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2).to(x.dtype)

    return rotate(q), rotate(k)


def topk_softmax(gating, k):
    p = torch.softmax(gating.float(), dim=-1)
    weights, ids = torch.topk(p, k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), ids.to(torch.int32)


# --- the cases of gpu_bench.cpp --------------------------------------------------

def norm_case(fused, dtype, rows, hidden):
    t = DTYPES[dtype]
    size = torch.finfo(t).bits // 8
    nbytes = size * (rows * hidden * (4 if fused else 2) + hidden)

    def make():
        x = torch.randn(rows, hidden, device="cuda", dtype=t)
        w = (1 + 0.25 * torch.randn(hidden, device="cuda")).to(t)
        if fused:
            return (x, torch.randn(rows, hidden, device="cuda", dtype=t), w)
        return (x, w)

    op = "fused_add_rmsnorm" if fused else "rmsnorm"
    return op, dtype, f"{rows}x{hidden}", nbytes, make, fused_add_rmsnorm if fused else rmsnorm


def act_case(name, fn, dtype, rows, d):
    t = DTYPES[dtype]
    nbytes = (torch.finfo(t).bits // 8) * rows * d * 3
    return name, dtype, f"{rows}x{d}", nbytes, lambda: (torch.randn(rows, 2 * d, device="cuda", dtype=t),), fn


def rotary_case(dtype, neox, tokens, hq, hk, dim):
    t = DTYPES[dtype]
    size = torch.finfo(t).bits // 8
    max_pos = 8192
    nbytes = size * (tokens * (hq + hk) * dim * 2 + tokens * dim) + 8 * tokens

    def make():
        return (torch.randint(0, max_pos, (tokens,), device="cuda"),
                torch.randn(tokens, hq, dim, device="cuda", dtype=t),
                torch.randn(tokens, hk, dim, device="cuda", dtype=t),
                (0.7 * torch.randn(max_pos, dim, device="cuda")).to(t))

    label = f"{'neox' if neox else 'gptj'} {tokens}x{hq}x{hk}x{dim}"
    return "rotary_embedding", dtype, label, nbytes, make, rotary_neox if neox else rotary_gptj


def topk_case(dtype, rows, experts, k):
    t = DTYPES[dtype]
    nbytes = (torch.finfo(t).bits // 8) * rows * experts + rows * k * 8

    def fn(gating):
        return topk_softmax(gating, k)

    return ("topk_softmax", dtype, f"{rows}x{experts} k{k}", nbytes,
            lambda: (2 * torch.randn(rows, experts, device="cuda", dtype=t),), fn)


def cases():
    out = [norm_case(False, dt, 32768, 8192) for dt in ("float32", "float16", "bfloat16")]
    out += [norm_case(False, "bfloat16", 1, 4096),
            norm_case(True, "bfloat16", 32768, 8192), norm_case(True, "bfloat16", 1, 4096)]
    for name, fn in (("silu_and_mul", silu_and_mul), ("gelu_and_mul", gelu_and_mul),
                     ("gelu_tanh_and_mul", gelu_tanh_and_mul)):
        out += [act_case(name, fn, "bfloat16", 32768, 8192), act_case(name, fn, "bfloat16", 1, 4096)]
    out += [rotary_case("bfloat16", True, 32768, 32, 8, 128),
            rotary_case("bfloat16", False, 32768, 32, 8, 128),
            rotary_case("bfloat16", True, 1, 32, 8, 128)]
    out += [topk_case("bfloat16", 32768, 256, 8), topk_case("float32", 32768, 256, 8),
            topk_case("bfloat16", 1, 256, 8)]
    return out


# --- timing ------------------------------------------------------------------------

def time_us(fn, sets, iterations):
    for i in range(5):
        fn(*sets[i % len(sets)])
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    stop = torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(iterations):
        args = sets[i % len(sets)]
        start.record()
        fn(*args)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1000.0)
    return statistics.median(times)


def copy_gbps():
    a = torch.ones(1 << 29, dtype=torch.int16, device="cuda")  # 1 GiB
    b = torch.empty_like(a)
    us = time_us(lambda: b.copy_(a), [()], 20)
    return 2 * a.numel() * a.element_size() / (us * 1e-6) / 1e9


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", help="write op,dtype,shape,eager_us,compile_us here")
    parser.add_argument("--no-compile", action="store_true", help="time eager mode only")
    args = parser.parse_args()
    torch.manual_seed(0)
    copy = copy_gbps()
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}; "
          f"device-to-device copy {copy:.0f} GB/s", flush=True)
    writer = None
    if args.csv:
        out = open(args.csv, "w", newline="")
        writer = csv.writer(out)
        writer.writerow(["op", "dtype", "shape", "eager_us", "compile_us"])
    print(f"{'op':20} {'dtype':9} {'shape':26} {'eager us':>10} {'compile us':>11} "
          f"{'eager %copy':>11} {'compile %copy':>13}", flush=True)
    for op, dtype, shape, nbytes, make, fn in cases():
        sets = [make() for _ in range(int(min(64, max(1, math.ceil(3 * L2_BYTES / nbytes)))))]
        iterations = 50 if nbytes > 1e8 else 400
        eager = time_us(fn, sets, iterations)
        compiled = float("nan")
        if not args.no_compile:
            started = time.time()
            try:
                compiled = time_us(torch.compile(fn, dynamic=False), sets, iterations)
            except Exception as e:  # report and go on: the other rows still count
                print(f"torch.compile failed for {op} {dtype} {shape}: {e}", file=sys.stderr)
            print(f"  (torch.compile of {op} {shape}: {time.time() - started:.0f} s incl. compile)",
                  file=sys.stderr, flush=True)

        def pct(us):
            return 100 * nbytes / (us * 1e-6) / 1e9 / copy

        print(f"{op:20} {dtype:9} {shape:26} {eager:10.2f} {compiled:11.2f} "
              f"{pct(eager):10.1f}% {pct(compiled):12.1f}%", flush=True)
        if writer:
            writer.writerow([op, dtype, shape, f"{eager:.3f}", f"{compiled:.3f}"])
            out.flush()
        del sets
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
