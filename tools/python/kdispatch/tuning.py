"""Measured selection from Python: time every backend of an op at given
sizes, the way calls will run, and write a tuning file the selector follows
(the ``tuned`` rule; docs/tuning.md).

    import kdispatch, kdispatch.native, kdispatch.tuning
    kdispatch.native.register()                       # a second backend
    result = kdispatch.tuning.tune("layernorm.rmsnorm",
                                   [{"rows": 1, "H": 4096}, {"rows": 4096, "H": 4096}],
                                   dtype="bfloat16", out="tuning.json")
    print(result.table())

Each backend that can run the op on the device (opt-in ones included, the
reference excluded) is first checked against the reference backend with the
op schema's tolerances on random inputs of the timed sizes (at most 4096
rows); one that fails is left out and reported. The others are timed on torch tensors:

- on a CPU, wall clock over batches of calls, inputs rotated over enough
  copies to exceed the last-level cache, the median batch;
- on a GPU, CUDA graphs of n and 2n calls over rotated inputs, replayed and
  timed with CUDA events: the difference per call, what one more call adds
  to a graph (the ``graph`` column, which decides), and the same calls
  launched back to back (the ``eager`` column).

The measurements go to the core, which builds the choices and the key
(device, driver and runtime, each plugin library's hash) and writes the
file (``kdispatch.write_tuning``); with ``apply`` (the default) the file
is then used by the calls that follow (``kdispatch.set_tuning_file``).
"""
import math as _math
import statistics as _statistics
import sys as _sys
import time as _time

from . import _kdispatch, testing as _testing
from ._errors import Error

__all__ = ["tune", "candidates", "Result"]

# Bytes the rotated inputs of one call should exceed, so that timings are
# not those of a warm cache (an H200's L2 is 50 MiB; CPU caches are smaller).
_ROTATE_BYTES = 128 << 20
_MAX_SETS = 64
# The correctness check runs at the timed sizes with at most this many rows
# (leading dims): kernels choose their paths by the row's size and by the
# row count up to a few thousand rows, and the float64 reference of a
# 32768-row call costs more than the timing of every backend.
_CHECK_ROWS = 4096


def _size_overrides(sizes):
    """{"rows": 64, "H": 4096} -> ["*=64", "H=4096"] (harness overrides)."""
    out = []
    for name, value in sizes.items():
        name = "*" if name == "rows" else name
        if isinstance(value, (list, tuple)):
            out.append(f"{name}={','.join(str(int(v)) for v in value)}")
        else:
            out.append(f"{name}={int(value)}")
    return out


def _symbol_sizes(sizes):
    """The sizes as a tuned choice reads them: the leading dims ("*") as
    "rows", their product."""
    out = {}
    for name, value in sizes.items():
        if name in ("*", "rows") and isinstance(value, (list, tuple)):
            out["rows"] = _math.prod(int(v) for v in value)
        else:
            out["rows" if name == "*" else name] = int(value)
    return out


def _check_sizes(sizes):
    """`sizes` with its rows capped at _CHECK_ROWS."""
    rows = _symbol_sizes(sizes).get("rows")
    if rows is None or rows <= _CHECK_ROWS:
        return sizes
    out = {k: v for k, v in sizes.items() if k not in ("rows", "*")}
    out["rows"] = _CHECK_ROWS
    return out


def sized_inputs(op, dtype, sizes, seed=0):
    """Random inputs and poisoned outputs of one call of `op` in `dtype` at
    `sizes` ({"rows": 64, "H": 4096}: the schema's symbols, "rows" for the
    leading dims, the others at its example sizes), as torch CPU tensors in
    schema order."""
    made = _kdispatch._make_sized_inputs(op, dtype, _size_overrides(sizes), seed)
    return [None if entry is None else _testing._as_torch(*entry) for entry in made]


def candidates(op, device="cpu"):
    """The backends tune() times for `op` on `device`: each that can run
    there, opt-in ones included, the op's reference excluded."""
    reference = _kdispatch._reference_backend(op)
    out = []
    for entry in _kdispatch.backends(op, device):
        if entry["backend"] == reference:
            continue
        if entry["eligible"] or (entry["reason"] or "").startswith("opt-in"):
            out.append(entry["backend"])
    return out


class Result:
    """What tune() measured: `rows` (dicts with op, dtype, sizes, us per
    backend, graph-less eager us on GPUs, choice), `rejected` (backend,
    op, sizes, why) and `path` (the tuning file, or None)."""

    def __init__(self, rows, rejected, path, stopped):
        self.rows = rows
        self.rejected = rejected
        self.path = path
        self.stopped = stopped

    def table(self):
        backends = sorted({b for r in self.rows for b in r["us"]})
        head = ["op", "dtype", "sizes"] + [f"{b} us" for b in backends] + ["choice"]
        lines = [head]
        for r in self.rows:
            sizes = " ".join(f"{k}={v}" for k, v in r["sizes"].items())
            cells = [r["op"], r["dtype"], sizes]
            for b in backends:
                us = r["us"].get(b)
                eager = r.get("eager_us", {}).get(b)
                text = "-" if us is None else f"{us:.2f}"
                if eager is not None:
                    text += f" ({eager:.2f} eager)"
                cells.append(text)
            cells.append(r["choice"])
            lines.append(cells)
        widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
        text = "\n".join("  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)
        for b, op, sizes, why in self.rejected:
            text += f"\nleft out: {b} for {op} at {sizes}: {why}"
        if self.stopped:
            text += f"\nstopped early: {self.stopped}"
        if self.path:
            text += f"\ntuning file: {self.path}"
        return text

    def __repr__(self):
        return self.table()


def _bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _call(op, tensors, backend, attrs):
    _kdispatch.call(op, *tensors, backend=backend, **attrs)


def _time_cpu(op, sets, backend, attrs, deadline):
    for tensors in sets[:2]:
        _call(op, tensors, backend, attrs)
    # A batch long enough to time (about 2 ms), over the rotated sets.
    start = _time.perf_counter()
    _call(op, sets[0], backend, attrs)
    once = max(_time.perf_counter() - start, 1e-7)
    per_batch = max(len(sets), min(10000, int(2e-3 / once)))
    batches = []
    for _ in range(7):
        start = _time.perf_counter()
        for i in range(per_batch):
            _call(op, sets[i % len(sets)], backend, attrs)
        batches.append((_time.perf_counter() - start) / per_batch)
        if _time.monotonic() > deadline and len(batches) >= 3:
            break
    return _statistics.median(batches) * 1e6, None


def _time_cuda(op, sets, backend, attrs, deadline):
    """Graph replay: the time one more call adds to a graph of calls, from
    graphs of n and 2n calls (n = max(20, len(sets))) replayed in turn, so
    that what a replay costs once whatever its length (its launch, not the
    same for every backend's kernels) does not count. Then n calls launched
    back to back between two events."""
    import torch
    calls = max(len(sets), 20)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for tensors in sets[:2]:
            _call(op, tensors, backend, attrs)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graphs = []
    for n in (calls, 2 * calls):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(n):
                _call(op, sets[i % len(sets)], backend, attrs)
        graph.replay()
        graphs.append(graph)
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def replay_us(graph):
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) * 1e3

    short, long = [], []
    for _ in range(5):
        short.append(replay_us(graphs[0]))
        long.append(replay_us(graphs[1]))
        if _time.monotonic() > deadline and len(short) >= 3:
            break
    del graphs
    graph_us = (_statistics.median(long) - _statistics.median(short)) / calls
    if graph_us <= 0:  # noise over calls that cost next to nothing
        graph_us = _statistics.median(long) / (2 * calls)
    begin.record()
    for i in range(calls):
        _call(op, sets[i % len(sets)], backend, attrs)
    end.record()
    end.synchronize()
    eager = begin.elapsed_time(end) * 1e3 / calls
    return graph_us, eager


def tune(ops, sizes, *, dtype="bfloat16", device="cpu", backends=None, attrs=None, out=None, apply=True,
         budget=60.0, progress=True):
    """Times every candidate backend (candidates(), or `backends`) of each
    op in `ops` at each of `sizes` (dicts of the schema's symbols, "rows"
    for the leading dims) in
    `dtype` on `device` ("cpu", "cuda", "cuda:1"), after checking it
    against the reference; writes the tuning file `out` (when given) and,
    with `apply`, makes the calls that follow use it. `budget` (seconds)
    bounds the whole run: when it is spent, what was measured is kept and
    the rest skipped, and Result.stopped says so. Returns a Result."""
    import torch
    ops = [ops] if isinstance(ops, str) else list(ops)
    attrs = dict(attrs or {})
    target = torch.device(device)
    timer = _time_cuda if target.type == "cuda" else _time_cpu
    if target.type not in ("cpu", "cuda"):
        raise Error(f"tune: device '{device}': expected cpu or cuda[:N]")
    start = _time.monotonic()
    deadline = start + budget
    rows, rejected, measurements = [], [], []
    stopped = None
    steps = [(op, s) for op in ops for s in sizes]
    for step, (op, size) in enumerate(steps):
        if _time.monotonic() > deadline:
            stopped = f"the budget of {budget:g} s was spent after {step} of {len(steps)} shapes"
            break
        names = list(backends) if backends is not None else candidates(op, str(target))
        host = sized_inputs(op, dtype, size)
        check = host if _check_sizes(size) is size else sized_inputs(op, dtype, _check_sizes(size))
        want = _testing.reference(op, check, attrs)
        copies = max(1, min(_MAX_SETS, _math.ceil(_ROTATE_BYTES / max(1, _bytes(host)))))
        sets = [[None if t is None else t.to(target, copy=True) for t in host] for _ in range(copies)]
        row = {"op": op, "dtype": dtype, "sizes": dict(size), "us": {}}
        for backend in names:
            got = [None if t is None else t.to(target, copy=True) for t in check]
            try:
                _call(op, got, backend, attrs)
            except Error as e:
                rejected.append((backend, op, size, f"the call failed: {e}"))
                continue
            verdict = _testing.compare(op, got, want)
            if not verdict.ok:
                rejected.append((backend, op, size, f"differs from the reference: {verdict.first_mismatch}"))
                continue
            us, eager = timer(op, sets, backend, attrs, deadline)
            row["us"][backend] = us
            if eager is not None:
                row.setdefault("eager_us", {})[backend] = eager
            if progress and _time.monotonic() - start > 1.0:
                shape = " ".join(f"{k}={v}" for k, v in size.items())
                print(f"tune: {step + 1}/{len(steps)} {op} {dtype} {shape} {backend} {us:.2f} us", file=_sys.stderr)
        if not row["us"]:
            continue
        row["choice"] = min(row["us"], key=row["us"].get)
        rows.append(row)
        measurements.append({"op": op, "dtype": dtype, "sizes": _symbol_sizes(size), "us": dict(row["us"])})
    path = None
    if out is not None and measurements:
        _kdispatch.write_tuning(str(out), str(target), measurements)
        path = str(out)
        if apply:
            _kdispatch.set_tuning_file(path)
    return Result(rows, rejected, path, stopped)
