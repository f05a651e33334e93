#!/usr/bin/env python3
"""The GPU half of the Python tests (skipped without CUDA):
- every op on CUDA float32, bfloat16 and float16 tensors, through
  torch.ops.kdispatch, kdispatch.call, torch's own DLPack capsules and CuPy
  arrays (when CuPy is there), matches the op's formula in float64
  (kd_cases.py);
- the ops run on torch's current stream (a side stream);
- a decoder-layer-like function of the ops (decoder_layer.py) compiles with
  torch.compile(fullgraph=True) and matches eager;
- the same function captured in a torch.cuda.CUDAGraph and replayed on new
  inputs matches eager (and says whether bit for bit);
- every op alone, at every size of its cases, each dtype and attribute set,
  captured in a CUDA graph (through a kdispatch.op handle and through
  torch.ops.kdispatch) and replayed on new inputs gives, bit for bit, what
  the same call gives eagerly;
- moe.topk_softmax on rows whose largest logits tie, exactly or within a
  few float32 ulps, picks the experts the cpu backend picks.
Each check that raises counts as failed; the others still run."""
import sys
import traceback

try:
    import numpy as np
    import torch
except ImportError as e:
    print(f"SKIPPED: {e}")
    sys.exit(77)
if not torch.cuda.is_available():
    print("SKIPPED: no CUDA device")
    sys.exit(77)

import kdispatch
import kdispatch.torch as kt
import decoder_layer
import kd_cases

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "int32": torch.int32, "int64": torch.int64}
results = []


def report(ok, what):
    results.append(ok)
    print(f"{'ok  ' if ok else 'FAIL'} {what}", flush=True)


def round_to(dtype):
    return lambda v: torch.from_numpy(v).to(TORCH_DTYPES[dtype]).double().numpy()


def capsule(t, stream):
    """A DLPack capsule of a torch tensor: versioned where torch makes them."""
    try:
        return t.__dlpack__(stream=stream, max_version=(1, 0))
    except TypeError:
        return t.__dlpack__(stream=stream)


def check_ops():
    rng = np.random.default_rng(2024)
    try:
        import cupy
    except ImportError:
        cupy = None
    for op in kdispatch.ops():
        schema = kdispatch.schema(op)
        case = kd_cases.CASES[op]
        opfn = getattr(torch.ops.kdispatch, kt.registered[op])
        names = [t["name"] for t in schema["tensors"]]
        checked = failed = 0
        for dtype in ("float32", "bfloat16", "float16"):
            sizes_list = case.sizes + [{**case.sizes[0], "*": (1000,)}]
            for sizes in sizes_list:
                for given in case.attrs:
                    attrs = kd_cases.full_attrs(schema, given)
                    for path in ("torch.ops", "kdispatch.call", "capsules", "cupy"):
                        if path == "cupy" and (cupy is None or dtype == "bfloat16"):
                            continue
                        values = kd_cases.make_inputs(schema, sizes, rng)
                        cpu = {n: torch.from_numpy(np.asarray(v)).to(TORCH_DTYPES[c or dtype])
                               for n, (v, c) in values.items()}
                        exact = {n: t.double().numpy() for n, t in cpu.items()}
                        dev = {n: t.cuda() for n, t in cpu.items()}
                        if path == "torch.ops":
                            opfn(*[dev[n] for n in names], *[attrs[a["name"]] for a in schema["attrs"]])
                        elif path == "kdispatch.call":
                            kdispatch.call(op, *[dev[n] for n in names], **given)
                        elif path == "capsules":
                            stream = torch.cuda.current_stream().cuda_stream or 1  # 1: the legacy default stream
                            kdispatch.call(op, *[capsule(dev[n], stream) for n in names], stream=stream, **given)
                        else:
                            arrays = {n: cupy.from_dlpack(t) for n, t in dev.items()}
                            kdispatch.call(op, *[arrays[n] for n in names], **given)
                        torch.cuda.synchronize()
                        want = case.formula(exact, attrs, round_to(dtype))
                        for out, value in want.items():
                            ok, err = kd_cases.compare(schema, dev[out].double().cpu().numpy(), value,
                                                       values[out][1] or dtype)
                            checked += 1
                            failed += not ok
                            if not ok:
                                print(f"  {op} {dtype} {sizes} {given} via {path}: {out} max abs err {err:.3g}")
        report(failed == 0, f"{op} on CUDA: {checked - failed} of {checked} outputs match the float64 formula "
                            f"(float32, bfloat16, float16; torch.ops, kdispatch.call, torch's DLPack capsules"
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
    want = kd_cases.rmsnorm(x.double().cpu().numpy(), w.double().cpu().numpy(), 1e-6)
    ok, err = kd_cases.compare(kdispatch.schema("layernorm.rmsnorm"), out.double().cpu().numpy(), want, "bfloat16")
    report(ok, f"kernels launch on torch's current stream (a side stream, captured in a graph; max abs err {err:.3g})")


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


def check_capture_each_op():
    for op in kdispatch.ops():
        schema = kdispatch.schema(op)
        case = kd_cases.CASES[op]
        names = [t["name"] for t in schema["tensors"]]
        handle = kdispatch.op(op)
        opfn = getattr(torch.ops.kdispatch, kt.registered[op])
        callers = {
            "kdispatch.op": lambda ts, given: handle(*ts, **given),
            "torch.ops": lambda ts, given: opfn(*ts, *[kd_cases.full_attrs(schema, given)[a["name"]]
                                                       for a in schema["attrs"]]),
        }
        replays = differing = 0
        for dtype in ("float32", "bfloat16", "float16"):
            for sizes in case.sizes + [{**case.sizes[0], "*": (64,)}]:
                for given in case.attrs:
                    def device_inputs(seed):
                        values = kd_cases.make_inputs(schema, sizes, np.random.default_rng(seed))
                        return [torch.from_numpy(np.asarray(values[n][0])).to(TORCH_DTYPES[values[n][1] or dtype])
                                .cuda() for n in names]
                    for label, call in callers.items():
                        static = device_inputs(1)
                        side = torch.cuda.Stream()
                        side.wait_stream(torch.cuda.current_stream())
                        with torch.cuda.stream(side):
                            call([t.clone() for t in static], given)  # warm-up outside the capture
                        torch.cuda.current_stream().wait_stream(side)
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph):
                            call(static, given)
                        for seed in (2, 3):
                            fresh = device_inputs(seed)
                            for s_, f in zip(static, fresh):
                                s_.copy_(f)
                            graph.replay()
                            call(fresh, given)  # eager, on a copy of the same inputs
                            torch.cuda.synchronize()
                            replays += 1
                            same = all(torch.equal(a, b) for a, b in zip(static, fresh))
                            if not same:
                                differing += 1
                                print(f"  {op} {dtype} {sizes} {given} via {label}: the replay differs from eager")
        report(differing == 0, f"{op} captured in a CUDA graph: {replays - differing} of {replays} replays equal "
                               f"the eager call bit for bit (float32, bfloat16, float16; kdispatch.op, torch.ops)")


def check_topk_ties():
    """Rows whose twelve largest logits tie exactly (every third row) or
    differ in their last bits: the cuda kernel ranks float32 logits by keys
    whose low bits hold the expert index, and ranks such rows again
    exactly. Its ids must be the cpu backend's (ties: lower index first)."""
    rng = np.random.default_rng(11)
    handle = kdispatch.op("moe.topk_softmax")
    rows, k = 64, 8
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for experts in (256, 200, 64):
            g = rng.standard_normal((rows, experts)).astype(np.float32)
            for r in range(rows):
                chosen = rng.choice(experts, size=12, replace=False)
                bits = np.full(12, g[r].max() + 0.5, dtype=np.float32).view(np.int32)
                bits += rng.integers(-3, 4, size=12).astype(np.int32) * (r % 3)
                g[r, chosen] = bits.view(np.float32)
            gating = torch.from_numpy(g).to(dtype)
            for renormalize in (False, True):
                got = {}
                for device in ("cpu", "cuda"):
                    w = torch.full((rows, k), float("nan"), dtype=torch.float32, device=device)
                    i = torch.full((rows, k), -1, dtype=torch.int32, device=device)
                    handle(w, i, gating.to(device), renormalize=renormalize)
                    got[device] = (w.cpu(), i.cpu())
                same_ids = torch.equal(got["cpu"][1], got["cuda"][1])
                err = (got["cpu"][0] - got["cuda"][0]).abs().max().item()
                report(same_ids and err <= 1e-5,
                       f"moe.topk_softmax {str(dtype).split('.')[1]} {rows}x{experts} k={k} renormalize={renormalize}, "
                       f"tied and nearly tied top logits: ids as on cpu: {same_ids}, max weight difference {err:.3g}")


def run(check, *args):
    """Runs one check; an exception is its failure, and the others still run."""
    try:
        check(*args)
    except Exception:
        traceback.print_exc()
        report(False, f"{check.__name__}{args}: raised (traceback above)")


def main():
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, kdispatch {kdispatch.version}")
    run(check_ops)
    run(check_current_stream)
    if hasattr(torch, "compile"):
        run(check_compile, torch.float32, 1e-4, 1e-4, 0.005)
        run(check_compile, torch.bfloat16, 3e-2, 3e-2, 0.02)
        run(check_compile_inplace)
    else:
        print("SKIPPED torch.compile checks: this torch has no torch.compile")
    run(check_graph)
    run(check_capture_each_op)
    run(check_topk_ties)
    print(f"gpu: {sum(results)} passed, {len(results) - sum(results)} failed")
    return 0 if results and all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
