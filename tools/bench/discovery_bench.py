#!/usr/bin/python3
"""Whole-process time of `kdispatch select OP` over many plugin manifests.

Builds a plugin folder of MANIFESTS manifests with KERNELS kernels each
(every plugin its own backend, ops and library file), then runs
`kdispatch select` of one of its ops RUNS times in each mode and prints the
median and the fastest run in milliseconds:

  warm   registry cache filled by one run beforehand (KDISPATCH_SCAN=cache)
  cold   the registry cache removed before every run
  off    KDISPATCH_SCAN=off (no registry cache read or written)
  empty  the same select over an empty plugin folder: start-up and the
         built-in op schemas, the floor under the other three

Each run is timed from spawn to exit with a monotonic clock in this
process, and its CPU time (user + system, from wait4) is reported beside
it: on a shared machine the CPU time varies less. The tool's output goes
to /dev/null. The cache lives in a
temporary XDG_CACHE_HOME, so the user's cache is never touched. The select
asks for `--device cpu`, so no GPU driver is probed.

  tools/bench/discovery_bench.py [--tool build/default/bin/kdispatch]
      [--manifests 1000] [--kernels 20] [--runs 21] [--keep DIR] [--json]
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

DTYPES = ["float32", "float16", "bfloat16"]


def write_fixture(folder, manifests, kernels):
    """MANIFESTS plugins, each with KERNELS kernels of ops of its own group.

    The libraries are small placeholder files: select never opens one, it
    only checks where the file is and who may write it.
    """
    os.makedirs(folder, exist_ok=True)
    os.chmod(folder, 0o755)
    for i in range(manifests):
        name = f"bench{i:04d}"
        library = f"libkdispatch-{name}.so"
        doc = {
            "kdispatch_manifest": "1.0",
            "plugin": name,
            "backend": name,
            "library": library,
            "abi": "1.0",
            "description": f"generated plugin {i} of {manifests}",
            "targets": [{"device": "cpu"}],
            "kernels": [
                {
                    "op": f"{name}.op{j:02d}",
                    "symbol": f"kd_{name}_op{j:02d}",
                    "dtypes": DTYPES,
                    "targets": ([{"device": "cuda", "min_arch": "8.0", "max_arch": "12.0"}]
                                if j % 4 == 3 else [{"device": "cpu"}]),
                    "description": f"kernel {j} of plugin {i}",
                }
                for j in range(kernels)
            ],
        }
        with open(os.path.join(folder, f"{name}.json"), "w") as f:
            json.dump(doc, f, indent=2)
        with open(os.path.join(folder, library), "wb") as f:
            f.write(b"\x7fELF placeholder: never opened by select\n")


def time_runs(argv, env, runs, before_each=None, expect=0):
    """Wall-clock and CPU (user + system) milliseconds of each run."""
    wall, cpu = [], []
    for _ in range(runs):
        if before_each:
            before_each()
        start = time.perf_counter()
        child = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _, status, usage = os.wait4(child.pid, 0)
        wall.append((time.perf_counter() - start) * 1000.0)
        cpu.append((usage.ru_utime + usage.ru_stime) * 1000.0)
        child.returncode = os.waitstatus_to_exitcode(status)
        err = child.stderr.read().decode(errors="replace")
        child.stderr.close()
        if child.returncode != expect:
            sys.exit(f"{' '.join(argv)} exited {child.returncode}: {err}")
    return wall, cpu


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    default_tool = os.path.normpath(os.path.join(here, "..", "..", "build", "default", "bin", "kdispatch"))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tool", default=default_tool, help="the kdispatch program (default: %(default)s)")
    parser.add_argument("--manifests", type=int, default=1000)
    parser.add_argument("--kernels", type=int, default=20)
    parser.add_argument("--runs", type=int, default=21, help="runs per mode (default: %(default)s)")
    parser.add_argument("--modes", default="warm,cold,off,empty", help="comma-separated (default: %(default)s)")
    parser.add_argument("--keep", metavar="DIR", help="write the fixture into DIR and keep it")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args()
    if not os.access(args.tool, os.X_OK):
        sys.exit(f"{args.tool}: not an executable; build it first (cmake --build --preset default --target kdispatch)")

    scratch = tempfile.mkdtemp(prefix="kdispatch-discovery-bench-")
    try:
        plugins = args.keep or os.path.join(scratch, "plugins")
        empty = os.path.join(scratch, "empty")
        cache_home = os.path.join(scratch, "cache")
        os.makedirs(empty)
        write_fixture(plugins, args.manifests, args.kernels)
        # The registry cache leaves out files changed in the last 100 ms
        # (they may change again within the same timestamp).
        time.sleep(0.2)
        op = f"bench{args.manifests // 2:04d}.op{args.kernels // 2:02d}"

        env = {k: v for k, v in os.environ.items() if not k.startswith("KDISPATCH_")}
        env["XDG_CACHE_HOME"] = cache_home
        select = [args.tool, "select", op, "--device", "cpu", "--plugin-path"]

        def clear_cache():
            shutil.rmtree(cache_home, ignore_errors=True)

        results = {}
        for mode in args.modes.split(","):
            if mode == "warm":
                clear_cache()
                time_runs(select + [plugins], env, 1)
                times = time_runs(select + [plugins], env, args.runs)
            elif mode == "cold":
                times = time_runs(select + [plugins], env, args.runs, clear_cache)
            elif mode == "off":
                times = time_runs(select + [plugins], dict(env, KDISPATCH_SCAN="off"), args.runs, clear_cache)
            elif mode == "empty":
                # No plugin has the op, so the tool exits 2 (KD-E001).
                times = time_runs([args.tool, "select", op, "--device", "cpu", "--plugin-path", empty], env,
                                  args.runs, expect=2)
            else:
                sys.exit(f"unknown mode '{mode}' (warm, cold, off, empty)")
            wall, cpu = times
            results[mode] = {"median_ms": statistics.median(wall), "min_ms": min(wall),
                             "cpu_median_ms": statistics.median(cpu), "runs": len(wall)}

        if args.json:
            print(json.dumps({"manifests": args.manifests, "kernels": args.kernels, "op": op,
                              "tool": args.tool, "modes": results}, indent=2))
        else:
            print(f"kdispatch select {op}: {args.manifests} manifests x {args.kernels} kernels, "
                  f"median of {args.runs} runs")
            for mode, r in results.items():
                print(f"  {mode:6s} {r['median_ms']:7.1f} ms   (fastest {r['min_ms']:.1f} ms, "
                      f"CPU {r['cpu_median_ms']:.1f} ms)")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
