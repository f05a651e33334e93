#!/usr/bin/env python3
"""Joins the kdispatch benchmark (gpu_bench --csv) and the PyTorch one
(torch_bench.py --csv) into one table: kdispatch us, torch eager us,
torch.compile us, kdispatch % of the device copy bandwidth, and speed-ups.

    tools/gpu/report.py kdispatch_bench.csv torch_bench.csv
"""
import csv
import math
import sys


def read(path):
    try:
        with open(path, newline="") as f:
            return {(r["op"], r["dtype"], r["shape"]): r for r in csv.DictReader(f)}
    except OSError:
        return {}


def number(row, key):
    try:
        return float(row[key])
    except (KeyError, TypeError, ValueError):
        return math.nan


def main():
    ours = read(sys.argv[1])
    torch = read(sys.argv[2]) if len(sys.argv) > 2 else {}
    if not ours:
        sys.exit(f"report: no kdispatch results in {sys.argv[1]}")
    copy = number(next(iter(ours.values())), "copy_gbps")
    print(f"device-to-device copy bandwidth: {copy:.0f} GB/s (read + write); "
          f"speed-up = torch us / kdispatch us")
    header = (f"{'op':18} {'dtype':8} {'shape':24} {'kdispatch':>10} {'eager':>9} {'compile':>9} "
              f"{'%copy':>6} {'x eager':>8} {'x compile':>9}")
    print(header)
    print("-" * len(header))
    for key, row in ours.items():
        us = number(row, "us")
        theirs = torch.get(key, {})
        eager, compiled = number(theirs, "eager_us"), number(theirs, "compile_us")
        pct = 100 * number(row, "gbps") / copy
        print(f"{key[0]:18} {key[1]:8} {key[2]:24} {us:10.2f} {eager:9.2f} {compiled:9.2f} "
              f"{pct:5.1f}% {eager / us:8.2f} {compiled / us:9.2f}")
    print("(us per call, CUDA-event median; nan: not measured)")


if __name__ == "__main__":
    main()
