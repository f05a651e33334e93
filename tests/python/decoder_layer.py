"""A decoder-layer-like function built from the kdispatch ops (rmsnorm,
fused_add_rmsnorm, rotary_embedding, silu_and_mul, topk_softmax) with
matmuls and a stand-in for attention between them, for the torch.compile
and CUDA-graph checks and the graph-replay benchmark.

Two forms of the same layer:
- `functional(...)`: the functional variants of kdispatch.torch (they
  allocate or clone their outputs), as a torch.compile user writes it;
- `Inplace(...)`: the ops writing into buffers made once, through one of two
  callers of the same kernels: torch.ops.kdispatch.* (the torch custom ops)
  or kdispatch.op handles (the dispatcher's own checked call, no torch
  dispatcher)."""
import torch

import kdispatch
import kdispatch.torch as kt


class Weights:
    def __init__(self, tokens=256, hidden=1024, heads=8, kv_heads=2, head_dim=128, inter=2048, experts=64,
                 max_pos=4096, dtype=torch.float32, device="cuda", seed=0):
        g = torch.Generator(device=device).manual_seed(seed)

        def rand(*shape, scale=1.0):
            return (scale * torch.randn(*shape, generator=g, device=device, dtype=torch.float32)).to(dtype)

        self.tokens, self.hidden, self.heads, self.kv_heads = tokens, hidden, heads, kv_heads
        self.head_dim, self.inter, self.experts, self.top_k = head_dim, inter, experts, 8
        self.ln1 = (1 + rand(hidden, scale=0.1))
        self.ln2 = (1 + rand(hidden, scale=0.1))
        self.ln_final = (1 + rand(hidden, scale=0.1))
        self.wq = rand(hidden, heads * head_dim, scale=hidden ** -0.5)
        self.wk = rand(hidden, kv_heads * head_dim, scale=hidden ** -0.5)
        self.wo = rand(heads * head_dim, hidden, scale=(heads * head_dim) ** -0.5)
        self.w_gate_up = rand(hidden, 2 * inter, scale=hidden ** -0.5)
        self.w_down = rand(inter, hidden, scale=inter ** -0.5)
        self.w_router = rand(hidden, experts, scale=hidden ** -0.5)
        self.cos_sin = rand(max_pos, head_dim, scale=0.7)
        self.max_pos = max_pos
        self.dtype, self.device = dtype, device

    def inputs(self, seed=1):
        g = torch.Generator(device=self.device).manual_seed(seed)
        x = torch.randn(self.tokens, self.hidden, generator=g, device=self.device).to(self.dtype)
        residual = torch.randn(self.tokens, self.hidden, generator=g, device=self.device).to(self.dtype)
        positions = torch.randint(0, self.max_pos, (self.tokens,), generator=g, device=self.device)
        return x, residual, positions


def functional(x, residual, positions, w):
    t = x.shape[0]
    h, residual = kt.layernorm.fused_add_rmsnorm(x, residual, w.ln1)
    q = (h @ w.wq).view(t, w.heads, w.head_dim)
    k = (h @ w.wk).view(t, w.kv_heads, w.head_dim)
    q, k = kt.embeddings.rotary_embedding(positions, q, k, w.cos_sin)
    attn = q.reshape(t, -1) @ w.wo + k.reshape(t, -1).mean(-1, keepdim=True)  # stands in for attention
    h2, residual = kt.layernorm.fused_add_rmsnorm(attn, residual, w.ln2)
    act = kt.activation.silu_and_mul(h2 @ w.w_gate_up)
    weights, ids = kt.moe.topk_softmax(h2 @ w.w_router, K=w.top_k, renormalize=True)
    out = (act @ w.w_down) * weights[:, :1].to(act.dtype)
    return kt.layernorm.rmsnorm(out, w.ln_final), residual, ids


class Inplace:
    """The same layer writing into buffers made once. `caller` is "torch"
    (torch.ops.kdispatch.*) or "kdispatch" (kdispatch.op handles)."""

    def __init__(self, w, caller):
        self.w = w
        t, dt, dev = w.tokens, w.dtype, w.device
        self.h = torch.empty(t, w.hidden, dtype=dt, device=dev)
        self.act = torch.empty(t, w.inter, dtype=dt, device=dev)
        self.final = torch.empty(t, w.hidden, dtype=dt, device=dev)
        self.weights = torch.empty(t, w.top_k, dtype=torch.float32, device=dev)
        self.ids = torch.empty(t, w.top_k, dtype=torch.int32, device=dev)
        if caller == "torch":
            ops = torch.ops.kdispatch
            self.rmsnorm = ops.layernorm_rmsnorm
            self.fused_add_rmsnorm = ops.layernorm_fused_add_rmsnorm
            self.rotary = ops.embeddings_rotary_embedding
            self.silu_and_mul = ops.activation_silu_and_mul
            self.topk = lambda w_, i_, g_: ops.moe_topk_softmax(w_, i_, g_, renormalize=True)
        else:
            self.rmsnorm = kdispatch.op("layernorm.rmsnorm")
            self.fused_add_rmsnorm = kdispatch.op("layernorm.fused_add_rmsnorm")
            self.rotary = kdispatch.op("embeddings.rotary_embedding")
            self.silu_and_mul = kdispatch.op("activation.silu_and_mul")
            topk = kdispatch.op("moe.topk_softmax")
            self.topk = lambda w_, i_, g_: topk(w_, i_, g_, renormalize=True)

    def __call__(self, x, residual, positions):
        """Updates x (to the first norm's output) and residual in place;
        returns (final, residual, ids)."""
        w = self.w
        t = x.shape[0]
        self.fused_add_rmsnorm(x, residual, w.ln1)
        q = (x @ w.wq).view(t, w.heads, w.head_dim)
        k = (x @ w.wk).view(t, w.kv_heads, w.head_dim)
        self.rotary(positions, q, k, w.cos_sin)
        attn = q.reshape(t, -1) @ w.wo + k.reshape(t, -1).mean(-1, keepdim=True)
        self.fused_add_rmsnorm(attn, residual, w.ln2)
        self.silu_and_mul(self.act, attn @ w.w_gate_up)
        self.topk(self.weights, self.ids, attn @ w.w_router)
        out = (self.act @ w.w_down) * self.weights[:, :1].to(self.act.dtype)
        self.rmsnorm(self.final, out, w.ln_final)
        return self.final, residual, self.ids
