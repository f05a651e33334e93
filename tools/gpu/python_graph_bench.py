#!/usr/bin/env python3
"""GPU time per CUDA-graph replay of the same kernels issued two ways:
through the torch custom ops (torch.ops.kdispatch.*) and through the
dispatcher's own checked call (kdispatch.op handles, the C++ OpHandle with
no torch dispatcher in between). Under replay only the captured kernels
run, so the two must take the same time: a difference would be work the
torch path adds (copies, allocations, syncs).

Two graphs per caller: the decoder-layer-like function of
tests/python/decoder_layer.py (in-place form; matmuls between the ops) and
the kdispatch ops alone on the layer's buffers. Timing: CUDA events around
--replays back-to-back replays, --repeats times, the callers alternating;
the median per replay.

  PYTHONPATH=build/cuda/python python3 tools/gpu/python_graph_bench.py
"""
import argparse
import pathlib
import statistics
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests" / "python"))
import decoder_layer  # noqa: E402


def ops_only(layer):
    """The kdispatch calls of the layer, without the matmuls."""
    w = layer.w
    t = w.tokens
    x = torch.randn(t, w.hidden, device="cuda").to(w.dtype)
    residual = torch.randn(t, w.hidden, device="cuda").to(w.dtype)
    positions = torch.randint(0, w.max_pos, (t,), device="cuda")
    q = torch.randn(t, w.heads, w.head_dim, device="cuda").to(w.dtype)
    k = torch.randn(t, w.kv_heads, w.head_dim, device="cuda").to(w.dtype)
    gate_up = torch.randn(t, 2 * w.inter, device="cuda").to(w.dtype)
    logits = torch.randn(t, w.experts, device="cuda").to(w.dtype)

    def run():
        layer.fused_add_rmsnorm(x, residual, w.ln1)
        layer.rotary(positions, q, k, w.cos_sin)
        layer.fused_add_rmsnorm(x, residual, w.ln2)
        layer.silu_and_mul(layer.act, gate_up)
        layer.topk(layer.weights, layer.ids, logits)
        layer.rmsnorm(layer.final, x, w.ln_final)

    return run


def capture(fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def time_replays(graph, replays):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0 / replays


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 4096])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"GPU time per graph replay (us), {args.dtype}, {torch.cuda.get_device_name()}, median of "
          f"{args.repeats} x {args.replays} replays")
    print(f"{'graph':28} {'tokens':>6} {'torch.ops':>10} {'kdispatch.op':>13} {'ratio':>7}  within 5%")
    worst = 0.0
    for tokens in args.tokens:
        w = decoder_layer.Weights(tokens=tokens, dtype=dtype)
        x, residual, positions = w.inputs()
        for label in ("decoder layer", "kdispatch ops only"):
            graphs = {}
            # A graph reads and writes the tensors its function captured: the
            # function is kept beside it, so they outlive every replay.
            keep = []
            for caller in ("torch", "kdispatch"):
                layer = decoder_layer.Inplace(w, caller)
                if label == "decoder layer":
                    xs, rs = x.clone(), residual.clone()
                    fn = lambda layer=layer, xs=xs, rs=rs: layer(xs, rs, positions)  # noqa: E731
                else:
                    fn = ops_only(layer)
                keep.append(fn)
                graphs[caller] = capture(fn)
            times = {c: [] for c in graphs}
            for c, g in graphs.items():
                time_replays(g, args.replays)  # warm
            for _ in range(args.repeats):
                for c, g in graphs.items():
                    times[c].append(time_replays(g, args.replays))
            t_torch = statistics.median(times["torch"])
            t_kd = statistics.median(times["kdispatch"])
            ratio = t_torch / t_kd
            worst = max(worst, abs(ratio - 1.0))
            print(f"{label:28} {tokens:6} {t_torch:10.2f} {t_kd:13.2f} {ratio:7.3f}  "
                  f"{'yes' if abs(ratio - 1) <= 0.05 else 'NO'}")
    return 0 if worst <= 0.05 else 1


if __name__ == "__main__":
    sys.exit(main())
