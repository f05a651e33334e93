#!/usr/bin/env python3
"""A Llama-style decoder layer with kdispatch's ops, as a model runs it:

  h        = rmsnorm(x, input_norm)                       float32 weight, bf16 x
  qkv      = h @ w_qkv                                    one fused projection
  q, k, v  = views of qkv's columns, [T, heads, head_size] (no copy)
  q, k     = rotary in place on those views               float32 cos_sin_cache
  attn     = scaled_dot_product_attention(q, k, v)        causal, grouped-query
  o        = attn @ w_o
  h2, res  = fused_add_rmsnorm(o, x, post_norm)           float32 weight
  out      = silu_and_mul(h2 @ w_gate_up) @ w_down

The user code holds no .contiguous() and no dtype cast: the kernels take the
row-strided views and the float32 parameters as they come. The layer runs
eagerly, under torch.compile(fullgraph=True) and captured in a CUDA graph
(replayed on new inputs copied into the captured ones); each result is
compared with the eager one, and the eager one with the same layer written
as plain torch formulas (float32 math, rounded where the kernels round).
Prints the largest absolute difference of each and exits 1 when one is
above its bound, 77 (skipped, with the reason) without CUDA.

With --tuning FILE, the torch backend (kdispatch.native) and the triton
backend (kdispatch.triton) are registered beside the plugins (not opt-in,
ranked by a priority below theirs) and the selector follows the tuning file
(kdispatch.set_tuning_file): each op the file has a choice for runs on the
backend it chooses for the shape (rule "tuned"), the others by priority. With KDISPATCH_TRACE set,
the backend and rule of each op's calls are printed from the trace.

  PYTHONPATH=build/cuda/python python3 tools/gpu/decoder_layer.py [--tokens N] [--rotary-dim R] [--tuning FILE]
"""
import argparse
import collections
import json
import os
import sys

try:
    import torch
    import torch.nn.functional as F
except ImportError as e:
    print(f"decoder_layer: SKIPPED: no torch ({e})")
    sys.exit(77)
if not torch.cuda.is_available():
    print("decoder_layer: SKIPPED: no CUDA device")
    sys.exit(77)

import kdispatch.torch as kt

EPS = 1e-5
DTYPE = torch.bfloat16
# |got - want| <= ATOL + RTOL * |want|, elementwise: the compiled and graph
# runs call the same kernels and matmuls as eager; the formulas round in
# other places (matmul inputs of one bfloat16 step apart), so they get more.
SAME_RUN_BOUND = (1e-2, 1e-2)
FORMULA_BOUND = (6e-2, 6e-2)


class Layer:
    """Weights of one layer (Llama-3-8B's shapes by default), random with the
    scale of a trained layer's: unit-size activations throughout."""

    def __init__(self, hidden, heads, kv_heads, head_size, inter, rotary_dim, max_pos, device="cuda"):
        g = torch.Generator(device=device).manual_seed(0)

        def rand(*shape, scale=1.0, dtype=DTYPE):
            return (scale * torch.randn(*shape, generator=g, device=device)).to(dtype)

        self.hidden, self.heads, self.kv_heads, self.head_size = hidden, heads, kv_heads, head_size
        self.input_norm = 1 + rand(hidden, scale=0.1, dtype=torch.float32)
        self.post_norm = 1 + rand(hidden, scale=0.1, dtype=torch.float32)
        self.w_qkv = rand(hidden, (heads + 2 * kv_heads) * head_size, scale=hidden ** -0.5)
        self.w_o = rand(heads * head_size, hidden, scale=(heads * head_size) ** -0.5)
        self.w_gate_up = rand(hidden, 2 * inter, scale=hidden ** -0.5)
        self.w_down = rand(inter, hidden, scale=inter ** -0.5)
        # Llama's: cos | sin of position * base^(-2i/rotary_dim), float32.
        inv_freq = 1.0 / (500000.0 ** (torch.arange(0, rotary_dim, 2, device=device, dtype=torch.float32)
                                      / rotary_dim))
        angles = torch.outer(torch.arange(max_pos, device=device, dtype=torch.float32), inv_freq)
        self.cos_sin_cache = torch.cat((angles.cos(), angles.sin()), dim=-1)
        self.max_pos = max_pos

    def split_qkv(self, qkv):
        """q [T, heads, D], k and v [T, kv_heads, D]: views of qkv's columns."""
        t, d = qkv.shape[0], self.head_size
        q_end, k_end = self.heads * d, (self.heads + self.kv_heads) * d
        return (qkv[:, :q_end].view(t, self.heads, d), qkv[:, q_end:k_end].view(t, self.kv_heads, d),
                qkv[:, k_end:].view(t, self.kv_heads, d))

    def attention(self, q, k, v):
        """Causal grouped-query attention of [T, H, D] views, [T, H * D] out."""
        t = q.shape[0]
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             is_causal=True, enable_gqa=True)
        return out.transpose(0, 1).reshape(t, self.heads * self.head_size)

    def kdispatch(self, x, positions):
        """The layer with kdispatch's ops; returns (out, residual)."""
        h = kt.layernorm.rmsnorm(x, self.input_norm, eps=EPS)
        qkv = h @ self.w_qkv
        q, k, v = self.split_qkv(qkv)
        torch.ops.kdispatch.embeddings_rotary_embedding(positions, q, k, self.cos_sin_cache, is_neox=True)
        o = self.attention(q, k, v) @ self.w_o
        h2, residual = kt.layernorm.fused_add_rmsnorm(o, x, self.post_norm, eps=EPS)
        return kt.activation.silu_and_mul(h2 @ self.w_gate_up) @ self.w_down, residual

    def formulas(self, x, positions):
        """The same layer in plain torch: float32 math, rounded to the
        activations' dtype where the kernels round."""
        def rmsnorm(a, w):
            return (a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + EPS) * w).to(x.dtype)

        def rotary(a):
            rot = self.cos_sin_cache.shape[-1]
            cos, sin = self.cos_sin_cache[positions].unsqueeze(-2).chunk(2, dim=-1)
            af = a.float()
            a1, a2 = af[..., :rot].chunk(2, dim=-1)
            return torch.cat((a1 * cos - a2 * sin, a2 * cos + a1 * sin, af[..., rot:]), dim=-1).to(a.dtype)

        h = rmsnorm(x.float(), self.input_norm)
        q, k, v = self.split_qkv(h @ self.w_qkv)
        o = self.attention(rotary(q), rotary(k), v) @ self.w_o
        residual = o.float() + x.float()
        h2 = rmsnorm(residual, self.post_norm)
        gate, up = (h2 @ self.w_gate_up).float().chunk(2, dim=-1)
        return (F.silu(gate) * up).to(x.dtype) @ self.w_down, residual.to(x.dtype)


def inputs(layer, tokens, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, layer.hidden, generator=g, device="cuda").to(DTYPE)
    positions = torch.randint(0, layer.max_pos, (tokens,), generator=g, device="cuda")
    return x, positions


def max_diff(got, want):
    return max((a.double() - b.double()).abs().max().item() for a, b in zip(got, want))


def within(got, want, bound):
    atol, rtol = bound
    return all(bool(((a.double() - b.double()).abs() <= atol + rtol * b.double().abs()).all())
               for a, b in zip(got, want))


def graph_of(fn, static_args):
    """A CUDA graph of fn on static_args (warmed up on a side stream) and its outputs."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn(*static_args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn(*static_args)
    return graph, outputs


def gpu_us(fn, repeats=20):
    """Median GPU time of one call, in us."""
    fn()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return sorted(times)[len(times) // 2]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--inter", type=int, default=14336)
    parser.add_argument("--rotary-dim", type=int, default=None, help="default: the head size")
    parser.add_argument("--max-pos", type=int, default=8192)
    parser.add_argument("--tuning", help="a tuning file the selector follows, with the torch and triton backends")
    args = parser.parse_args()
    if args.tuning:
        import kdispatch
        import kdispatch.native
        import kdispatch.triton
        # Not opt-in, ranked below the plugins: on an op the file has a
        # choice for, the tuned rule decides among all three backends.
        kdispatch.native.register(opt_in=False, priority=-1)
        if kdispatch.triton.available() is None:
            kdispatch.triton.register(opt_in=False, priority=-1)
        kdispatch.set_tuning_file(args.tuning)
    torch.manual_seed(0)
    layer = Layer(args.hidden, args.heads, args.kv_heads, args.head_size, args.inter,
                  args.rotary_dim or args.head_size, args.max_pos)
    shape = (f"tokens {args.tokens}, hidden {args.hidden}, heads {args.heads}/{args.kv_heads} x {args.head_size}, "
             f"rotary_dim {args.rotary_dim or args.head_size}, inter {args.inter}, {str(DTYPE)[6:]}")
    print(f"decoder_layer: torch {torch.__version__} on {torch.cuda.get_device_name()}; {shape}")
    x, positions = inputs(layer, args.tokens, 1)
    results = []  # (what, max abs diff, ok)

    eager = layer.kdispatch(x, positions)
    want = layer.formulas(x, positions)
    results.append(("eager vs the torch formulas", max_diff(eager, want), within(eager, want, FORMULA_BOUND)))

    compiled_fn = torch.compile(layer.kdispatch, fullgraph=True)
    compiled = compiled_fn(x, positions)
    results.append(("torch.compile(fullgraph=True) vs eager", max_diff(compiled, eager),
                    within(compiled, eager, SAME_RUN_BOUND)))

    static_x, static_pos = x.clone(), positions.clone()
    graph, graph_out = graph_of(layer.kdispatch, (static_x, static_pos))
    graph_diffs, graph_ok = [], True
    for seed in (2, 3):  # new inputs into the captured ones, then replay
        x2, pos2 = inputs(layer, args.tokens, seed)
        static_x.copy_(x2)
        static_pos.copy_(pos2)
        graph.replay()
        want2 = layer.kdispatch(x2, pos2)
        graph_diffs.append(max_diff(graph_out, want2))
        graph_ok = graph_ok and within(graph_out, want2, SAME_RUN_BOUND)
    results.append(("CUDA graph replays on new inputs vs eager", max(graph_diffs), graph_ok))

    failed = 0
    for what, diff, ok in results:
        failed += not ok
        print(f"decoder_layer: {'ok  ' if ok else 'FAIL'} {what}: max abs diff {diff:.3g}")

    # GPU time per layer, for scale (not checked).
    formulas_compiled = torch.compile(layer.formulas, fullgraph=True)
    formulas_compiled(x, positions)
    timing = {"kdispatch eager": lambda: layer.kdispatch(x, positions),
              "kdispatch compiled": lambda: compiled_fn(x, positions),
              "kdispatch graph": graph.replay,
              "formulas compiled": lambda: formulas_compiled(x, positions)}
    print("decoder_layer: GPU us per layer: " +
          ", ".join(f"{name} {gpu_us(fn):.1f}" for name, fn in timing.items()))
    trace = os.environ.get("KDISPATCH_TRACE")
    if trace and os.path.exists(trace):
        chosen = collections.Counter()
        with open(trace) as f:
            for line in f:
                entry = json.loads(line)
                chosen[(entry["op"], entry["backend"], entry["rule"])] += 1
        print("decoder_layer: backends of the calls made from Python (eager, compiled, captured): " +
              "; ".join(f"{op} -> {backend} ({rule}) x{n}" for (op, backend, rule), n in sorted(chosen.items())))
    print(f"decoder_layer: {len(results) - failed} of {len(results)} checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
