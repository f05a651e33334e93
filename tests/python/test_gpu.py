#!/usr/bin/env python3
"""The GPU half of the Python tests (skipped without CUDA):
- every op on CUDA tensors, in every dtype it takes, at the sizes,
  attribute values and special values of its schema's "tests", through
  torch.ops.kdispatch, kdispatch.call, torch's own DLPack capsules and CuPy
  arrays (when CuPy is there), matches the op's reference backend within
  the schema's tolerances (kdispatch.testing);
- the ops run on torch's current stream (a side stream);
- a decoder-layer-like function of the ops (decoder_layer.py) compiles with
  torch.compile(fullgraph=True) and matches eager;
- the same function captured in a torch.cuda.CUDAGraph and replayed on new
  inputs matches eager (and says whether bit for bit);
- every op alone, at every size of its cases, each dtype and attribute set,
  captured in a CUDA graph (through a kdispatch.op handle and through
  torch.ops.kdispatch) and replayed on new inputs gives, bit for bit, what
  the same call gives eagerly;
- every op alone, at up to three sizes of its cases in each dtype, through
  torch.ops.kdispatch inside torch.compile(fullgraph=True) gives, bit for
  bit, what the same call gives eagerly (mutated inputs included).
Each check that raises counts as failed; the others still run."""
import argparse
import sys
import traceback

try:
    import torch
except ImportError as e:
    print(f"SKIPPED: {e}")
    sys.exit(77)
if not torch.cuda.is_available():
    print("SKIPPED: no CUDA device")
    sys.exit(77)

import kdispatch
import kdispatch.testing as ktest
import kdispatch.torch as kt
import decoder_layer

# Cases of more elements than this are left to the conformance suite.
MAX_ELEMENTS = 1 << 22
results = []


def report(ok, what):
    results.append(ok)
    print(f"{'ok  ' if ok else 'FAIL'} {what}", flush=True)


def capsule(t, stream):
    """A DLPack capsule of a torch tensor: versioned where torch makes them."""
    try:
        return t.__dlpack__(stream=stream, max_version=(1, 0))
    except TypeError:
        return t.__dlpack__(stream=stream)


def check_ops(ops):
    try:
        import cupy
    except ImportError:
        cupy = None
    for op in ops:
        schema = kdispatch.schema(op)
        opfn = getattr(torch.ops.kdispatch, kt.registered[op])
        checked = failed = 0
        for dtype in ktest.dtypes(op, "cuda"):
            for case in ktest.cases(op):
                if case.elements > MAX_ELEMENTS:
                    continue
                inputs = ktest.inputs(op, dtype, case, seed=case.index)
                want = ktest.reference(op, inputs, case)
                attrs = [case.attrs.get(a["name"], a["default"]) for a in schema["attrs"]]
                for path in ("torch.ops", "kdispatch.call", "capsules", "cupy"):
                    if path == "cupy" and (cupy is None or dtype == "bfloat16" or
                                           any(str(t.dtype).startswith("torch.float8") for t in inputs if t is not None)):
                        continue  # CuPy has no bfloat16 and no float8
                    dev = [t.cuda() for t in inputs]
                    if path == "torch.ops":
                        opfn(*dev, *attrs)
                    elif path == "kdispatch.call":
                        kdispatch.call(op, *dev, **case.attrs)
                    elif path == "capsules":
                        stream = torch.cuda.current_stream().cuda_stream or 1  # 1: the legacy default stream
                        kdispatch.call(op, *[capsule(t, stream) for t in dev], stream=stream, **case.attrs)
                    else:
                        kdispatch.call(op, *[cupy.from_dlpack(t) for t in dev], **case.attrs)
                    torch.cuda.synchronize()
                    verdict = ktest.compare(op, dev, want, case)
                    checked += 1
                    failed += not verdict.ok
                    if not verdict.ok:
                        print(f"  {case} {dtype} via {path}: {verdict.first_mismatch}")
        report(failed == 0, f"{op} on CUDA: {checked - failed} of {checked} calls match the reference backend "
                            f"(every dtype; torch.ops, kdispatch.call, torch's DLPack capsules"
                            f"{', CuPy' if cupy else ''})")


def check_current_stream():
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        # Captured on the side stream: a kernel launched on any other stream
        # would make the capture fail.
        graph = torch.cuda.CUDAGraph()
        out = torch.empty_like(x)
        torch.ops.kdispatch.layernorm_rmsnorm(out, x, w, 1e-6)  # warm-up outside the capture
        with torch.cuda.graph(graph, stream=side):
            torch.ops.kdispatch.layernorm_rmsnorm(out, x, w, 1e-6)
            kdispatch.call("layernorm.rmsnorm", out, x, w)
    torch.cuda.current_stream().wait_stream(side)
    graph.replay()
    torch.cuda.synchronize()
    verdict = ktest.check("layernorm.rmsnorm", [out, x, w], [torch.empty_like(out), x, w])
    report(verdict.ok, f"kernels launch on torch's current stream (a side stream, captured in a graph; "
                       f"max abs err {verdict.max_abs_err:.3g})")


def close(a, b, rtol, atol):
    a, b = a.double(), b.double()
    return bool(torch.all((a - b).abs() <= atol + rtol * b.abs())), (a - b).abs().max().item()


def check_compile(dtype, rtol, atol, ids_slack):
    torch._dynamo.reset()
    w = decoder_layer.Weights(dtype=dtype)
    x, residual, positions = w.inputs()
    want = decoder_layer.functional(x, residual, positions, w)
    compiled = torch.compile(decoder_layer.functional, fullgraph=True)
    got = compiled(x, residual, positions, w)
    x2, residual2, positions2 = w.inputs(seed=5)  # a second call with other values, same shapes
    want2 = decoder_layer.functional(x2, residual2, positions2, w)
    got2 = compiled(x2, residual2, positions2, w)
    torch.cuda.synchronize()
    for label, g, e in (("first", got, want), ("second", got2, want2)):
        ok_out, err_out = close(g[0], e[0], rtol, atol)
        ok_res, err_res = close(g[1], e[1], rtol, atol)
        # Near-ties of the router logits may order differently when the
        # compiled glue rounds differently (bfloat16 above all).
        mismatched = (g[2] != e[2]).sum().item()
        ok = ok_out and ok_res and mismatched <= ids_slack * g[2].numel()
        report(ok, f"torch.compile(fullgraph=True) of the decoder layer ({dtype}, {label} call) matches eager: "
                   f"max abs err out {err_out:.3g}, residual {err_res:.3g}, topk ids differing {mismatched} "
                   f"of {g[2].numel()}")


def check_compile_inplace():
    torch._dynamo.reset()
    w = decoder_layer.Weights(dtype=torch.float32)
    layer = decoder_layer.Inplace(w, "torch")
    x, residual, positions = w.inputs()
    xe, re_ = x.clone(), residual.clone()
    want = [t.clone() for t in layer(xe, re_, positions)]
    compiled = torch.compile(layer.__call__, fullgraph=True)
    xc, rc = x.clone(), residual.clone()
    got = compiled(xc, rc, positions)
    torch.cuda.synchronize()
    ok_out, err = close(got[0], want[0], 1e-4, 1e-4)
    ok_res, err_res = close(rc, re_, 1e-5, 1e-5)  # the mutation of an input survives compilation
    report(ok_out and ok_res, f"torch.compile(fullgraph=True) of the in-place layer (torch.ops.kdispatch.*, "
                              f"mutated inputs) matches eager: max abs err {err:.3g}, residual {err_res:.3g}")


def check_graph():
    for dtype in (torch.float32, torch.bfloat16):
        w = decoder_layer.Weights(dtype=dtype)
        static = w.inputs()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                decoder_layer.functional(*static, w)  # warm-up: plugin load, cuBLAS handles
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = decoder_layer.functional(*static, w)
        ok = True
        identical = True
        worst = 0.0
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        for seed in (11, 12, 13):
            fresh = w.inputs(seed=seed)
            for s, f in zip(static, fresh):
                s.copy_(f)
            graph.replay()
            want = decoder_layer.functional(*fresh, w)
            torch.cuda.synchronize()
            for g, e in zip(outputs, want):
                worst = max(worst, (g.double() - e.double()).abs().max().item())
                identical = identical and torch.equal(g, e)
                ok = ok and close(g, e, tol, tol)[0]
        report(ok, f"the decoder layer ({dtype}) captured in a torch.cuda.CUDAGraph and replayed on three new "
                   f"inputs matches eager (max abs difference {worst:.3g}; bit for bit: "
                   f"{'yes' if identical else 'no'})")


def check_capture_each_op(ops):
    for op in ops:
        schema = kdispatch.schema(op)
        handle = kdispatch.op(op)
        opfn = getattr(torch.ops.kdispatch, kt.registered[op])
        replays = differing = 0
        for dtype in ktest.dtypes(op, "cuda"):
            for case in ktest.cases(op):
                if case.elements > MAX_ELEMENTS or case.special:
                    continue
                attrs = [case.attrs.get(a["name"], a["default"]) for a in schema["attrs"]]
                callers = {
                    "kdispatch.op": lambda ts: handle(*ts, **case.attrs),
                    "torch.ops": lambda ts: opfn(*ts, *attrs),
                }

                def device_inputs(seed):
                    return [t.cuda() for t in ktest.inputs(op, dtype, case, seed=seed)]

                for label, call in callers.items():
                    static = device_inputs(1)
                    side = torch.cuda.Stream()
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        call([t.clone() for t in static])  # warm-up outside the capture
                    torch.cuda.current_stream().wait_stream(side)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        call(static)
                    for seed in (2, 3):
                        fresh = device_inputs(seed)
                        for s_, f in zip(static, fresh):
                            s_.copy_(f)
                        graph.replay()
                        call(fresh)  # eager, on a copy of the same inputs
                        torch.cuda.synchronize()
                        replays += 1
                        same = all(torch.equal(a, b) for a, b in zip(static, fresh))
                        if not same:
                            differing += 1
                            print(f"  {case} {dtype} via {label}: the replay differs from eager")
        report(differing == 0, f"{op} captured in a CUDA graph: {replays - differing} of {replays} replays equal "
                               f"the eager call bit for bit (every dtype; kdispatch.op, torch.ops)")


def check_compile_each_op(ops):
    for op in ops:
        schema = kdispatch.schema(op)
        opfn = getattr(torch.ops.kdispatch, kt.registered[op])
        calls = differing = 0
        for dtype in ktest.dtypes(op, "cuda"):
            shapes = set()
            for case in ktest.cases(op):
                if case.elements > MAX_ELEMENTS or case.special or len(shapes) == 3:
                    continue
                shapes.add(str(case))
                attrs = [case.attrs.get(a["name"], a["default"]) for a in schema["attrs"]]
                torch._dynamo.reset()
                compiled = torch.compile(lambda *ts: opfn(*ts, *attrs), fullgraph=True, dynamic=False)
                inputs = [t.cuda() for t in ktest.inputs(op, dtype, case, seed=case.index)]
                eager = [t.clone() for t in inputs]
                got = compiled(*inputs)
                want = opfn(*eager, *attrs)
                torch.cuda.synchronize()
                calls += 1
                same = all(torch.equal(a, b) for a, b in zip(inputs, eager))
                if got is not None or want is not None:
                    got_list = list(got) if isinstance(got, (tuple, list)) else [got]
                    want_list = list(want) if isinstance(want, (tuple, list)) else [want]
                    same = same and all(torch.equal(a, b) for a, b in zip(got_list, want_list))
                if not same:
                    differing += 1
                    print(f"  {case} {dtype}: the compiled call differs from eager")
        report(differing == 0, f"{op} under torch.compile(fullgraph=True): {calls - differing} of {calls} calls equal "
                               f"the eager call bit for bit (every dtype, torch.ops, mutated inputs compared)")


def run(check, *args):
    """Runs one check; an exception is its failure, and the others still run."""
    try:
        check(*args)
    except Exception:
        traceback.print_exc()
        report(False, f"{check.__name__}{args}: raised (traceback above)")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--op", action="append", help="only the checks of each op, for this op (repeatable)")
    args = parser.parse_args()
    ops = args.op or kdispatch.ops()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, kdispatch {kdispatch.version}")
    run(check_ops, ops)
    if args.op:
        run(check_capture_each_op, ops)
        if hasattr(torch, "compile"):
            run(check_compile_each_op, ops)
        print(f"gpu: {sum(results)} passed, {len(results) - sum(results)} failed")
        return 0 if results and all(results) else 1
    run(check_current_stream)
    if hasattr(torch, "compile"):
        run(check_compile, torch.float32, 1e-4, 1e-4, 0.005)
        run(check_compile, torch.bfloat16, 3e-2, 3e-2, 0.02)
        run(check_compile_inplace)
    else:
        print("SKIPPED torch.compile checks: this torch has no torch.compile")
    run(check_graph)
    run(check_capture_each_op, ops)
    if hasattr(torch, "compile"):
        run(check_compile_each_op, ops)
    print(f"gpu: {sum(results)} passed, {len(results) - sum(results)} failed")
    return 0 if results and all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
