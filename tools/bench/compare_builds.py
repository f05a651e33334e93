#!/usr/bin/env python3
"""Times the cpu kernels of two or more builds in one run: each build's
kdispatch-bench-kernels (kernels only, one repetition of each) in turn, the
order of the builds alternating from round to round, so that every build sees
the same stretch of a shared machine; then the median of the rounds per op
and dtype, and each build's ratio to the first.

  compare_builds.py [--rounds N] [--threads N] [--filter REGEX] [--markdown]
                    [--bench BUILD_DIR] LABEL=BUILD_DIR LABEL=BUILD_DIR [...]

BUILD_DIR is a build tree with bin/kdispatch-bench-kernels and its cpu plugin
in lib/kdispatch/plugins. By default each build's benchmark loads its own
plugin; with --bench, the benchmark of that one build (one that knows
--plugin-dir) times every build's plugin, so that only the kernels differ
(not the harness that makes the inputs and calls them). The shapes printed are the op schemas'
"bench" sizes of the source tree of the second build (the first one after the
baseline); every build times the same shapes when its schemas agree.
Exit status 1 when a ratio exceeds --limit (default: no limit)."""
import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile


def source_dir(build):
    for line in (build / "CMakeCache.txt").read_text().splitlines():
        if line.startswith("CMAKE_HOME_DIRECTORY:"):
            return pathlib.Path(line.split("=", 1)[1])
    raise SystemExit(f"{build}: no CMAKE_HOME_DIRECTORY in CMakeCache.txt")


def bench_shapes(source):
    """{op: "8192x4096"-like text} from the schemas' "bench" sizes."""
    shapes = {}
    for path in sorted((source / "manifests" / "ops").glob("*.json")):
        for schema in json.loads(path.read_text()):
            bench = schema.get("bench")
            if bench:
                rows = "x".join(str(d) for d in bench.get("*", []))
                symbols = " ".join(f"{k}={v}" for k, v in bench.items() if k != "*")
                shapes[schema["op"]] = f"{rows} {symbols}".strip()
    return shapes


def run_bench(build, bench, threads, regex, out):
    """{(op, dtype): ns per call} of one run of the kernel benchmark of
    `bench` (None: the build's own) over the build's cpu plugin."""
    env = dict(os.environ)
    if threads:
        env["KDISPATCH_CPU_THREADS"] = str(threads)
    program = (bench or build) / "bin" / "kdispatch-bench-kernels"
    plugin_dir = [f"--plugin-dir={build / 'lib' / 'kdispatch' / 'plugins'}"] if bench else []
    cmd = [str(program)] + plugin_dir + [f"--benchmark_filter={regex}",
           "--benchmark_repetitions=1", "--benchmark_enable_random_interleaving=false",
           f"--benchmark_out={out}", "--benchmark_out_format=json"]
    done = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{cmd[0]} failed ({done.returncode}):\n{done.stderr}")
    times = {}
    for b in json.loads(pathlib.Path(out).read_text())["benchmarks"]:
        if b.get("run_type") != "iteration":
            continue
        _, op, dtype = b["run_name"].split("/")[:3]
        scale = {"ns": 1, "us": 1e3, "ms": 1e6, "s": 1e9}[b["time_unit"]]
        times[(op, dtype)] = b["real_time"] * scale
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("builds", nargs="+", metavar="LABEL=BUILD_DIR")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="KDISPATCH_CPU_THREADS (default: the plugin's)")
    parser.add_argument("--filter", default="", help="ops to time, a regex on '<op>/<dtype>' (default: all)")
    parser.add_argument("--limit", type=float, default=0.0, help="fail when a ratio exceeds this")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    parser.add_argument("--bench", type=pathlib.Path, help="time every build's plugin with this build's benchmark")
    args = parser.parse_args()
    builds = []
    for spec in args.builds:
        label, _, path = spec.partition("=")
        if not path:
            parser.error(f"{spec}: expected LABEL=BUILD_DIR")
        builds.append((label, pathlib.Path(path).resolve()))
    if len(builds) < 2:
        parser.error("two builds at least")
    regex = "^kernel/" + (f".*({args.filter})" if args.filter else "")
    shapes = bench_shapes(source_dir(builds[1][1]))

    samples = {}  # (label, op, dtype) -> [ns]
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = builds if r % 2 == 0 else builds[::-1]
            for label, build in order:
                for key, ns in run_bench(build, args.bench.resolve() if args.bench else None, args.threads, regex, f"{tmp}/{label}.json").items():
                    samples.setdefault((label,) + key, []).append(ns)
            print(f"round {r + 1} of {args.rounds} done", file=sys.stderr, flush=True)

    base = builds[0][0]
    keys = sorted({(op, dtype) for (label, op, dtype) in samples if label != base})
    header = ["op", "dtype", "shape"] + [f"{label} ns" for label, _ in builds] + \
             [f"{label}/{base}" for label, _ in builds[1:]]
    rows = []
    worst = 0.0
    for op, dtype in keys:
        medians = [statistics.median(samples[(label, op, dtype)]) if (label, op, dtype) in samples else None
                   for label, _ in builds]
        row = [op, dtype, shapes.get(op, "")] + [f"{m:.0f}" if m is not None else "-" for m in medians]
        for m in medians[1:]:
            if m is None or medians[0] is None:
                row.append("-")
            else:
                worst = max(worst, m / medians[0])
                row.append(f"{m / medians[0]:.2f}")
        rows.append(row)
    threads = args.threads or "the plugin's default"
    harness = f"the benchmark of {args.bench}" if args.bench else "each build's own benchmark"
    print(f"median of {args.rounds} alternating rounds; cpu kernel threads: {threads}; {harness}")
    if args.markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for row in rows:
            print("| " + " | ".join(row) + " |")
    else:
        widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
        for row in [header] + rows:
            print("  ".join(str(x).ljust(w) if i < 3 else str(x).rjust(w) for i, (x, w) in enumerate(zip(row, widths))))
    print(f"largest ratio: {worst:.2f}")
    return 1 if args.limit and worst > args.limit else 0


if __name__ == "__main__":
    sys.exit(main())
