#!/usr/bin/env python3
"""GPU time per call of the kdispatch ops and of the same formulas in PyTorch
eager and torch.compile, measured the way inference engines run kernels.

For each op, dtype and shape, and for each of kdispatch (a kdispatch.op handle:
the core's dispatcher, resolved once, on torch tensors), torch eager and
torch.compile:
  graph  CUDA-graph replay of --calls captured calls: GPU time per call;
  b2b    --calls back-to-back launches between two CUDA events, per call;
  sync   median host time of one call followed by a synchronisation (host
         latency: launch, Python, guards; not a kernel figure).
Inputs rotate among several sets when one set is smaller than 3x the L2
cache (outputs stay one buffer, as torch's allocator gives torch.compile's
kernels); values are random normals, never zeros. TB/s counts bytes read plus
bytes written per call, against the device-to-device copy measured in the
same run and the H200's 4.8 TB/s HBM3e peak. Each case first checks that
kdispatch's result agrees with torch eager.

Decode-size cases (1 and 64 rows) are timed once more as a model runs them,
for kdispatch, torch eager and torch.compile alike (the "+mm" columns): a
CUDA graph of --calls calls with a bf16 [rows x 4096] @ [4096 x 4096] matmul
captured before each call (its result feeds nothing: stream order alone
separates it from the op), so that no call overlaps an identical neighbour,
as programmatic dependent launch lets back-to-back calls of one kernel do.
The figure is the graph's time per call minus the matmul's own, from a graph
of --calls matmuls alone timed just before it.

  PYTHONPATH=build/cuda/python python3 tools/gpu/bench.py [--csv F] [--only SUBSTR]

With --device cpu it times the cpu backend against PyTorch eager on the CPU
instead (torch.compile is left out: Debian's torch 1.13 has none), at the
cpu kernel benchmark's sizes, both with the same number of threads
(KDISPATCH_CPU_THREADS, default: every CPU the process may run on):

  PYTHONPATH=build/default/python /usr/bin/python3 tools/gpu/bench.py --device cpu

The table printed last is the one to quote; --csv keeps every column.
"""
import argparse
import csv
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import kdispatch

DEVICE = "cuda"  # --device
L2_BYTES = 60e6  # H200: 50 MiB of L2, rounded up
DECODE_ROWS = (1, 64)  # rows (tokens) of the decode-size cases
GEMM_K = GEMM_N = 4096  # the matmul between decode-size calls: [rows x K] @ [K x N], bf16
PEAK_TBS = 4.8   # H200 HBM3e
EPS = 1e-6
LAYERNORM_EPS = 1e-5
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


# --- the ops as a PyTorch user writes them (float32 math, as the kernels) ------

def rmsnorm(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * w.float()).to(x.dtype)


def fused_add_rmsnorm(x, residual, w):
    # The float32 sum is normalised; the updated residual is its rounding.
    r = x.float() + residual.float()
    return (r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + EPS) * w.float()).to(x.dtype), r.to(x.dtype)


def gemma_rmsnorm(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * (1.0 + w.float())).to(x.dtype)


def layernorm(x, w, b):
    return F.layer_norm(x.float(), (x.shape[-1],), w.float(), b.float(), LAYERNORM_EPS).to(x.dtype)


def act_and_mul(act):
    def fn(x):
        d = x.shape[-1] // 2
        return (act(x[..., :d].float()) * x[..., d:].float()).to(x.dtype)
    return fn


def rotary(neox):
    # The first rotary_dim (the cache's width) elements of each head rotate,
    # the rest pass through: the peers' native form (vLLM's and SGLang's
    # forward_native), which returns new tensors.
    def fn(positions, q, k, cache):
        rot = cache.shape[-1]
        cos, sin = cache[positions].float().unsqueeze(-2).chunk(2, dim=-1)

        def rotate(x):
            xf = x[..., :rot].float()
            if neox:
                x1, x2 = xf.chunk(2, dim=-1)
                y = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
            else:
                x1, x2 = xf[..., ::2], xf[..., 1::2]
                y = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2).to(x.dtype)
            return y if rot == x.shape[-1] else torch.cat((y, x[..., rot:]), dim=-1)

        return rotate(q), rotate(k)
    return fn


def topk_softmax(k):
    def fn(gating):
        p = torch.softmax(gating.float(), dim=-1)
        weights, ids = torch.topk(p, k, dim=-1)
        return weights / weights.sum(dim=-1, keepdim=True), ids.to(torch.int32)
    return fn


def topk_softmax_biased(k):
    # SGLang's order (the schema's doc): correction_bias is added to the
    # float32 logits before the softmax, so the experts and their weights
    # come from the biased probabilities, then renormalised.
    def fn(gating, bias):
        p = torch.softmax(gating.float() + bias, dim=-1)
        ids = torch.topk(p, k, dim=-1).indices
        weights = p.gather(-1, ids)
        return weights / weights.sum(dim=-1, keepdim=True), ids.to(torch.int32)
    return fn


# --- cases --------------------------------------------------------------------------

class Case:
    """One op, dtype and shape. make() returns (torch_args, kd_args): the
    inputs of the PyTorch formula and the kdispatch tensors in schema order
    (sharing storage; in-place kdispatch ops update their inputs, which
    changes values but not the work)."""

    def __init__(self, op, dtype, shape, nbytes, make, torch_fn, attrs, compare, outputs=(0,), rows=None,
                 baseline=None, tol=None):
        self.op, self.dtype, self.shape, self.nbytes = op, dtype, shape, nbytes
        self.make, self.torch_fn, self.attrs, self.compare = make, torch_fn, attrs, compare
        self.outputs = outputs  # kd_args written only: one buffer for every input set
        self.rows = rows  # rows (tokens) of the call
        self.baseline = baseline  # the shape of the same op's contiguous case, timed beside a strided one
        self.tol = tol  # agree()'s bound, where the dtype's default does not fit (fp8 outputs: one step)

    @property
    def decode(self):
        return self.rows in DECODE_ROWS


def randn(*shape, dtype):
    return torch.randn(*shape, device=DEVICE, dtype=torch.float32).to(dtype)


def column_slice(rows, cols, dtype, pad=512):
    """A [rows, cols] view of the first columns of a random [rows, cols + pad]
    matrix: rows `cols + pad` elements apart, as a norm's input sliced from a
    wider activation."""
    return randn(rows, cols + pad, dtype=dtype)[:, :cols]


def tensor_index(op):
    """Name -> position of each tensor of `op`'s schema."""
    schema = next(s for s in kdispatch.schemas() if s["op"] == op)
    return {t["name"]: i for i, t in enumerate(schema["tensors"])}


def in_schema_order(op, **tensors):
    """The tensors of `op` by name, in its schema's order; None for an
    optional tensor left out."""
    at = tensor_index(op)
    unknown = set(tensors) - set(at)
    if unknown:
        raise KeyError(f"{op} has no tensor {sorted(unknown)} (its tensors: {list(at)})")
    return [tensors.get(name) for name in sorted(at, key=at.get)]


def norm_case(fused, dtype, rows, hidden, strided=False, gemma=False):
    """rmsnorm, fused_add_rmsnorm or gemma_rmsnorm; strided: x (and the
    residual) are column slices of wider matrices."""
    t = DTYPES[dtype]
    size = torch.finfo(t).bits // 8
    nbytes = size * (rows * hidden * (4 if fused else 2) + hidden)
    inputs = (lambda: column_slice(rows, hidden, t)) if strided else (lambda: randn(rows, hidden, dtype=t))

    def make():
        x = inputs()
        w = (0.25 * torch.randn(hidden, device=DEVICE) + (0 if gemma else 1)).to(t)
        if fused:
            r = inputs()
            return (x, r, w), (x, r, w)
        return (x, w), (torch.empty(rows, hidden, device=DEVICE, dtype=t), x, w)

    def compare(kd, got_torch):  # kd: tensors after the call; got_torch: the formula's outputs
        if fused:
            return [(kd[0], got_torch[0]), (kd[1], got_torch[1])]
        return [(kd[0], got_torch)]

    if gemma:
        op, fn = "layernorm.gemma_rmsnorm", gemma_rmsnorm
    else:
        op, fn = ("layernorm.fused_add_rmsnorm", fused_add_rmsnorm) if fused else ("layernorm.rmsnorm", rmsnorm)
    shape = f"{rows}x{hidden}"
    return Case(op, dtype, shape + (" strided" if strided else ""), nbytes, make, fn, {"eps": EPS}, compare,
                () if fused else (0,), rows=rows, baseline=shape if strided else None)


def layernorm_case(dtype, rows, hidden):
    t = DTYPES[dtype]
    nbytes = (torch.finfo(t).bits // 8) * (rows * hidden * 2 + 2 * hidden)

    def make():
        x = randn(rows, hidden, dtype=t)
        w = (1 + 0.25 * torch.randn(hidden, device=DEVICE)).to(t)
        b = (0.25 * torch.randn(hidden, device=DEVICE)).to(t)
        return (x, w, b), (torch.empty_like(x), x, w, b)

    return Case("layernorm.layernorm", dtype, f"{rows}x{hidden}", nbytes, make, layernorm,
                {"eps": LAYERNORM_EPS}, lambda kd, want: [(kd[0], want)], rows=rows)


def act_case(name, act, dtype, rows, d):
    t = DTYPES[dtype]
    nbytes = (torch.finfo(t).bits // 8) * rows * d * 3

    def make():
        x = randn(rows, 2 * d, dtype=t)
        return (x,), (torch.empty(rows, d, device=DEVICE, dtype=t), x)

    return Case(f"activation.{name}", dtype, f"{rows}x{d}", nbytes, make, act_and_mul(act), {},
                lambda kd, want: [(kd[0], want)], rows=rows)


def rotary_case(dtype, neox, tokens, hq, hk, dim, rotary_dim=None, cache_dtype=None, fused_qkv=False):
    """Rotary of q [tokens, hq, dim] and k [tokens, hk, dim] in place, the
    first rotary_dim (default: dim) elements of each head, with a cache of
    cache_dtype (default: dtype). fused_qkv: q and k are views of the
    columns of a [tokens, (hq + 2 hk) dim] fused QKV projection's output."""
    t = DTYPES[dtype]
    size = torch.finfo(t).bits // 8
    rot = rotary_dim or dim
    ct = DTYPES[cache_dtype] if cache_dtype else t
    max_pos = 8192
    # The rotated elements of q and k read and written, a cache row and a position per token.
    nbytes = size * tokens * (hq + hk) * rot * 2 + (torch.finfo(ct).bits // 8) * tokens * rot + 8 * tokens

    def make():
        positions = torch.randint(0, max_pos, (tokens,), device=DEVICE)
        if fused_qkv:
            qkv = randn(tokens, (hq + 2 * hk) * dim, dtype=t)
            q = qkv[:, :hq * dim].view(tokens, hq, dim)
            k = qkv[:, hq * dim:(hq + hk) * dim].view(tokens, hk, dim)
        else:
            q, k = randn(tokens, hq, dim, dtype=t), randn(tokens, hk, dim, dtype=t)
        cache = (0.7 * torch.randn(max_pos, rot, device=DEVICE)).to(ct)
        kd = in_schema_order("embeddings.rotary_embedding", positions=positions, query=q, key=k, cos_sin_cache=cache)
        return (positions, q, k, cache), kd

    at = tensor_index("embeddings.rotary_embedding")

    def compare(kd, want):
        return [(kd[at["query"]], want[0]), (kd[at["key"]], want[1])]

    shape = f"{'neox' if neox else 'gptj'} {tokens}x{hq}x{hk}x{dim}" + (f" rot{rot}" if rot != dim else "")
    if cache_dtype:
        shape += f" cache {cache_dtype[:1]}{torch.finfo(ct).bits}"
    return Case("embeddings.rotary_embedding", dtype, shape + (" qkv-view" if fused_qkv else ""), nbytes, make,
                rotary(neox), {"is_neox": neox}, compare, (), rows=tokens, baseline=shape if fused_qkv else None)


def topk_case(dtype, rows, experts, k):
    t = DTYPES[dtype]
    nbytes = (torch.finfo(t).bits // 8) * rows * experts + rows * k * 8

    op = "moe.topk_softmax"
    at = tensor_index(op)

    def make():
        g = 2 * randn(rows, experts, dtype=t)
        return (g,), in_schema_order(op, topk_weights=torch.empty(rows, k, device=DEVICE),
                                     topk_ids=torch.empty(rows, k, device=DEVICE, dtype=torch.int32), gating_output=g)

    def compare(kd, want):  # ids by the logits they select: ties may pick either expert
        g = kd[at["gating_output"]].float()
        ids = kd[at["topk_ids"]].long()
        return [(kd[at["topk_weights"]], want[0]), (g.gather(-1, ids), g.gather(-1, want[1].long()))]

    return Case(op, dtype, f"{rows}x{experts} k{k}", nbytes, make, topk_softmax(k),
                {"renormalize": True}, compare, (at["topk_weights"], at["topk_ids"]), rows=rows)


def topk_bias_case(dtype, rows, experts, k):
    """topk_softmax with a float32 correction_bias [E], renormalised;
    token_expert_indices left out."""
    t = DTYPES[dtype]
    nbytes = (torch.finfo(t).bits // 8) * rows * experts + 4 * experts + rows * k * 8
    op = "moe.topk_softmax"
    at = tensor_index(op)

    def make():
        g = 2 * randn(rows, experts, dtype=t)
        bias = 0.05 * torch.randn(experts, device=DEVICE)
        weights = torch.empty(rows, k, device=DEVICE)
        ids = torch.empty(rows, k, device=DEVICE, dtype=torch.int32)
        return (g, bias), in_schema_order(op, topk_weights=weights, topk_ids=ids, gating_output=g,
                                          correction_bias=bias)

    def compare(kd, want):  # ids by the biased scores they select: ties may pick either expert
        scores = torch.softmax(kd[at["gating_output"]].float(), dim=-1) + kd[at["correction_bias"]]
        return [(kd[at["topk_weights"]], want[0]),
                (scores.gather(-1, kd[at["topk_ids"]].long()), scores.gather(-1, want[1].long()))]

    return Case(op, dtype, f"{rows}x{experts} k{k} bias", nbytes, make, topk_softmax_biased(k),
                {"renormalize": True}, compare, (at["topk_weights"], at["topk_ids"]), rows=rows)


def kvcache_case(dtype, tokens, heads, dim, block_size=16, cache_dtype=None):
    """reshape_and_cache_flash of key and value [tokens, heads, dim] into
    paged caches [blocks, block_size, heads, dim] of cache_dtype (default:
    dtype; an fp8 dtype divides by k_scale / v_scale), every slot distinct.
    The formula: the caches' rows indexed by the slots, assigned."""
    t = DTYPES[dtype]
    c = getattr(torch, cache_dtype) if cache_dtype else t
    blocks = max(1024, 2 * tokens // block_size)
    es, cs = torch.finfo(t).bits // 8, torch.finfo(c).bits // 8
    nbytes = 2 * tokens * heads * dim * (es + cs) + 8 * tokens
    op = "kvcache.reshape_and_cache_flash"
    key_cache = torch.zeros(blocks, block_size, heads, dim, device=DEVICE, dtype=c)
    value_cache = torch.zeros_like(key_cache)
    scales = (torch.tensor([0.05], device=DEVICE), torch.tensor([0.07], device=DEVICE))

    def make():
        k, v = randn(tokens, heads, dim, dtype=t), randn(tokens, heads, dim, dtype=t)
        slots = torch.randperm(blocks * block_size, device=DEVICE)[:tokens]
        kd = in_schema_order(op, key=k, value=v, key_cache=key_cache, value_cache=value_cache, slot_mapping=slots,
                             k_scale=scales[0], v_scale=scales[1])
        return (k, v, key_cache, value_cache, slots, *scales), kd

    def fn(k, v, kc, vc, slots, k_scale, v_scale):
        if c.itemsize == 1:
            limit = torch.finfo(c).max
            k = (k.float() / k_scale).clamp(-limit, limit).to(c)
            v = (v.float() / v_scale).clamp(-limit, limit).to(c)
        kc.view(-1, heads, dim)[slots] = k
        vc.view(-1, heads, dim)[slots] = v
        return kc, vc

    def compare(kd, want):
        slots = kd[tensor_index(op)["slot_mapping"]]
        return [(kd[2].view(-1, heads, dim)[slots].float(), want[0].view(-1, heads, dim)[slots].float()),
                (kd[3].view(-1, heads, dim)[slots].float(), want[1].view(-1, heads, dim)[slots].float())]

    return Case(op, dtype, f"{tokens}x{heads}x{dim}" + (f" {cache_dtype}" if cache_dtype else ""), nbytes, make, fn,
                {"kv_cache_dtype": "auto"}, compare, (), rows=tokens)


def moe_align_case(tokens, k, experts, block_size):
    """moe.align_block_size of int32 ids [tokens, k]; the formula: the
    peers' algorithm in torch (counts by scatter_add, padded offsets by
    cumsum, a stable sort by expert)."""
    op = "moe.align_block_size"
    n = tokens * k
    padded = n + experts * (block_size - 1)
    blocks = -(-padded // block_size)
    nbytes = 4 * n + 4 * padded + 4 * blocks + 4

    def make():
        ids = torch.randint(0, experts, (tokens, k), device=DEVICE, dtype=torch.int32)
        outs = dict(sorted_token_ids=torch.empty(padded, device=DEVICE, dtype=torch.int32),
                    expert_ids=torch.empty(blocks, device=DEVICE, dtype=torch.int32),
                    num_tokens_post_pad=torch.empty(1, device=DEVICE, dtype=torch.int32))
        return (ids,), in_schema_order(op, topk_ids=ids, **outs)

    def fn(ids):
        flat = ids.flatten().long()
        counts = torch.zeros(experts, device=ids.device, dtype=torch.long).scatter_add_(0, flat, torch.ones_like(flat))
        sizes = (counts + block_size - 1) // block_size * block_size
        ends = torch.cumsum(sizes, 0)
        order = torch.sort(flat, stable=True).indices
        by_expert = flat[order]
        first = torch.cumsum(counts, 0) - counts  # each expert's first position in `order`
        dest = (ends - sizes)[by_expert] + torch.arange(n, device=ids.device) - first[by_expert]
        sorted_ids = torch.full((padded,), n, device=ids.device, dtype=torch.int32)
        sorted_ids[dest] = order.int()
        starts = torch.arange(blocks, device=ids.device) * block_size
        expert_ids = torch.searchsorted(ends, starts, right=True).int()
        total = ends[-1:].int()
        expert_ids = torch.where(starts < total, expert_ids, torch.full_like(expert_ids, -1))
        return sorted_ids, expert_ids, total

    def compare(kd, want):
        at = tensor_index(op)
        return [(kd[at["sorted_token_ids"]], want[0]), (kd[at["expert_ids"]], want[1]),
                (kd[at["num_tokens_post_pad"]], want[2])]

    at = tensor_index(op)
    return Case(op, "int32", f"{tokens}x{k} of {experts} b{block_size}", nbytes, make, fn,
                {"num_experts": experts, "block_size": block_size}, compare,
                (at["sorted_token_ids"], at["expert_ids"], at["num_tokens_post_pad"]), rows=tokens)


FP8 = "float8_e4m3fn"


def to_fp8(v):
    """float32 -> float8_e4m3fn, saturating at 448 as the peers' quantisers."""
    return v.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def quant_formula(kind, group=128):
    """The fp8 quantiser `kind` as torch code: (input[, scale]) -> (q, scales)."""
    def per_tensor_static(x, s):
        return to_fp8(x.float() / s), s

    def per_tensor_dynamic(x, s):
        scale = (x.abs().amax().float() / 448.0).reshape(1)
        return to_fp8(x.float() / scale), scale

    def per_token(x, s):
        scale = x.abs().amax(-1).float() / 448.0
        return to_fp8(x.float() / scale[:, None]), scale

    def per_token_group(x, s):
        g = x.float().reshape(x.shape[0], -1, group)
        scale = g.abs().amax(-1).clamp(min=1e-10) / 448.0
        return to_fp8(g / scale[..., None]).reshape(x.shape), scale

    return {"static": per_tensor_static, "dynamic": per_tensor_dynamic, "token": per_token,
            "group": per_token_group}[kind]


def quant_case(kind, dtype, rows, n, group=128):
    """quantization.* of a [rows, n] activation into float8_e4m3fn:
    per-tensor with a given (static) or computed (dynamic) scale, per
    token, per group of `group` values."""
    t = DTYPES[dtype]
    op = {"static": "quantization.per_tensor_quant_fp8", "dynamic": "quantization.per_tensor_quant_fp8",
          "token": "quantization.per_token_quant_fp8", "group": "quantization.per_token_group_quant_fp8"}[kind]
    scales = {"static": 1, "dynamic": 1, "token": rows, "group": rows * (n // group)}[kind]
    nbytes = rows * n * (torch.finfo(t).bits // 8 + 1) + 4 * scales
    at = tensor_index(op)

    def make():
        x = randn(rows, n, dtype=t)
        s = torch.full([1], 0.05, device=DEVICE) if kind in ("static", "dynamic") else \
            torch.empty(rows, device=DEVICE) if kind == "token" else torch.empty(rows, n // group, device=DEVICE)
        q = torch.empty(rows, n, device=DEVICE, dtype=torch.float8_e4m3fn)
        return (x, s), in_schema_order(op, input=x, output_q=q, output_s=s)

    def compare(kd, want):
        return [(kd[at["output_q"]].float(), want[0].float()), (kd[at["output_s"]], want[1])]

    attrs = {"static": {"is_static": True}, "dynamic": {"is_static": False}, "token": {},
             "group": {"group_size": group, "eps": 1e-10}}[kind]
    outputs = (at["output_q"],) if kind == "static" else (at["output_q"], at["output_s"])
    return Case(op, dtype, f"{rows}x{n}" + ("" if kind == "token" else f" {kind}"), nbytes, make,
                quant_formula(kind, group), attrs, compare, outputs, rows=rows, tol=0.13)


def norm_quant_case(fused, dtype, rows, hidden):
    """layernorm.rmsnorm_quant_fp8 / fused_add_rmsnorm_quant_fp8 with a
    static scale, float8_e4m3fn out."""
    t = DTYPES[dtype]
    size = torch.finfo(t).bits // 8
    nbytes = rows * hidden * (size * (3 if fused else 1) + 1) + size * hidden
    op = "layernorm.fused_add_rmsnorm_quant_fp8" if fused else "layernorm.rmsnorm_quant_fp8"
    at = tensor_index(op)

    def make():
        x, w = randn(rows, hidden, dtype=t), (1 + 0.25 * torch.randn(hidden, device=DEVICE)).to(t)
        scale = torch.full([1], 0.02, device=DEVICE)
        out = torch.empty(rows, hidden, device=DEVICE, dtype=torch.float8_e4m3fn)
        if fused:
            r = randn(rows, hidden, dtype=t)
            return (x, r, w, scale), in_schema_order(op, out=out, x=x, residual=r, weight=w, scale=scale)
        return (x, w, scale), in_schema_order(op, out=out, x=x, weight=w, scale=scale)

    def normed(v, w):  # float32 throughout: quantised from the unrounded value
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + EPS) * w.float()

    def fn(*a):
        if fused:
            x, r, w, scale = a
            total = x.float() + r.float()
            return to_fp8(normed(total, w) * (1.0 / scale)), total.to(x.dtype)
        x, w, scale = a
        return to_fp8(normed(x.float(), w) * (1.0 / scale))

    def compare(kd, want):
        out = want[0] if fused else want
        return [(kd[at["out"]].float(), out.float())]

    return Case(op, dtype, f"{rows}x{hidden}", nbytes, make, fn, {"eps": EPS}, compare, (at["out"],), rows=rows,
                tol=0.13)


def cases():
    if DEVICE == "cpu":  # the sizes of kdispatch-bench-kernels (the schemas' "bench")
        return cpu_cases()
    large, decode = (32768, 8192), tuple((rows, 4096) for rows in DECODE_ROWS)
    out = []
    for fused in (False, True):
        out += [norm_case(fused, dt, *large) for dt in DTYPES]
        out += [norm_case(fused, "bfloat16", r, h) for r, h in decode]
    out += [layernorm_case(dt, *large) for dt in DTYPES]
    for name, act in ACTIVATIONS:
        out += [act_case(name, act, dt, *large) for dt in DTYPES]
        out += [act_case(name, act, "bfloat16", r, d) for r, d in decode]
    out += [rotary_case(dt, True, 32768, 32, 8, 128) for dt in DTYPES]
    out += [rotary_case("bfloat16", False, 32768, 32, 8, 128)]
    out += [rotary_case("bfloat16", True, tokens, 32, 8, 128) for tokens in DECODE_ROWS]
    out += [topk_case(dt, 32768, 256, 8) for dt in ("bfloat16", "float32")]
    out += [topk_case("bfloat16", rows, 256, 8) for rows in DECODE_ROWS]
    # As models call them: row-strided norm inputs, q and k as views of a
    # fused QKV output with a float32 cache and partial rotary (each beside
    # the same call on contiguous tensors), a correction bias, gemma's norm.
    for rows in (32768, 64):
        hidden = 8192 if rows > 64 else 4096
        out += [norm_case(False, "bfloat16", rows, hidden, strided=True),
                norm_case(True, "bfloat16", rows, hidden, strided=True)]
    for tokens in (32768, 64):
        out += [rotary_case("bfloat16", True, tokens, 32, 8, 128, rotary_dim=64, cache_dtype="float32",
                            fused_qkv=fused) for fused in (False, True)]
    out += [topk_bias_case("bfloat16", rows, 256, 8) for rows in (32768, 64)]
    out += [norm_case(False, "bfloat16", rows, hidden, gemma=True) for rows, hidden in ((32768, 8192), (64, 4096))]
    # The KV-cache write (8 kv heads x 128, 16-token pages) in the
    # activation dtype and in fp8; the MoE block alignment.
    for tokens in (4096, 64):
        out += [kvcache_case("bfloat16", tokens, 8, 128, cache_dtype=c) for c in (None, "float8_e4m3fn")]
    out += [moe_align_case(tokens, 8, 256, 64) for tokens in (32768, 64)]
    # The fp8 quantisers and the norms fused with one, bf16 in, e4m3 out.
    for rows in (16384, 1, 64):
        out += [quant_case(kind, "bfloat16", rows, 8192) for kind in ("static", "dynamic", "token", "group")]
        out += [norm_quant_case(fused, "bfloat16", rows, 8192) for fused in (False, True)]
    return out


def cpu_cases():
    out = []
    for dt in DTYPES:
        out += [norm_case(False, dt, 8192, 4096), norm_case(True, dt, 8192, 4096), layernorm_case(dt, 8192, 4096)]
        out += [act_case(name, act, dt, 8192, 4096) for name, act in ACTIVATIONS]
        out += [rotary_case(dt, True, 8192, 32, 8, 128), topk_case(dt, 65536, 256, 8)]
    return out


ACTIVATIONS = (("silu_and_mul", F.silu), ("gelu_and_mul", F.gelu),
               ("gelu_tanh_and_mul", lambda a: F.gelu(a, approximate="tanh")))


# --- timing -------------------------------------------------------------------------

def capture(call, sets, calls):
    """A CUDA graph of `calls` calls, rotating among the input sets."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(3):
            call(sets[i % len(sets)])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            call(sets[i % len(sets)])
    return graph


def events():
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def graph_us(graph, calls, repeats):
    graph.replay()
    times = []
    for _ in range(repeats):
        a, b = events()
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(times)


def b2b_us(call, sets, calls, repeats):
    for i in range(3):
        call(sets[i % len(sets)])
    times = []
    for _ in range(repeats):
        a, b = events()
        a.record()
        for i in range(calls):
            call(sets[i % len(sets)])
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(times)


def sync_us(call, sets, samples):
    torch.cuda.synchronize()
    times = []
    for i in range(samples):
        started = time.perf_counter()
        call(sets[i % len(sets)])
        torch.cuda.synchronize()
        times.append((time.perf_counter() - started) * 1e6)
    return statistics.median(times)


def measure(call, sets, calls, repeats):
    graph = capture(call, sets, calls)
    g = graph_us(graph, calls, repeats)
    del graph
    return g, b2b_us(call, sets, calls, repeats), sync_us(call, sets, 30)


class Gemm:
    """The matmul between decode-size calls: a bf16 [rows x K] @ [K x N]
    into a preallocated output that nothing reads. One weight for every row
    count."""

    def __init__(self):
        self.weight = randn(GEMM_K, GEMM_N, dtype=torch.bfloat16)
        self.by_rows = {}

    def __call__(self, rows):
        if rows not in self.by_rows:
            a = randn(rows, GEMM_K, dtype=torch.bfloat16)
            self.by_rows[rows] = (a, torch.empty(rows, GEMM_N, device=DEVICE, dtype=torch.bfloat16))
        a, out = self.by_rows[rows]
        return lambda: torch.mm(a, self.weight, out=out)


def measure_with_gemm(call, sets, gemm, calls, repeats):
    """GPU us per call of `call` with `gemm` before each call, in one CUDA
    graph of `calls` (matmul, call) pairs, minus the matmul's own time (a
    graph of `calls` matmuls alone, timed just before); and that time."""
    alone = capture(lambda s: gemm(), [()], calls)
    gemm_us = graph_us(alone, calls, repeats)
    del alone

    def pair(s):
        gemm()
        call(s)

    graph = capture(pair, sets, calls)
    both = graph_us(graph, calls, repeats)
    del graph
    return both - gemm_us, gemm_us


def copy_tbs(calls):
    a = torch.randn(1 << 28, device="cuda")  # 1 GiB
    b = torch.empty_like(a)
    started = time.time()
    while time.time() - started < 2:  # clocks up before anything is timed
        b.copy_(a)
    torch.cuda.synchronize()
    call = lambda s: b.copy_(a)  # noqa: E731
    nbytes = 2 * a.numel() * a.element_size()
    graph = capture(call, [()], calls)
    return nbytes / (graph_us(graph, calls, 3) * 1e-6) / 1e12, nbytes / (b2b_us(call, [()], calls, 3) * 1e-6) / 1e12


def same_bytes_copy_tbs(nbytes, nsets, calls, repeats):
    """TB/s of a device-to-device copy_ moving `nbytes` a call (read plus
    written), rotating among `nsets` source/destination pairs as the cases
    rotate their inputs: the copy a memory-bound op of that size is held
    to, launch and tail included."""
    n = max(1, nbytes // 8)  # bytes: half read, half written, as float32
    pairs = [(torch.randn(n, device="cuda"), torch.empty(n, device="cuda")) for _ in range(nsets)]
    graph = capture(lambda p: p[1].copy_(p[0]), pairs, calls)
    us = graph_us(graph, calls, repeats)
    del graph, pairs
    return 8 * n / (us * 1e-6) / 1e12


def agree(case, kd_args, torch_args):
    """kdispatch's result on set 0 against torch eager's, within a loose
    bound (the exact checks are the conformance suite's); ids of topk may
    differ on near-ties."""
    fresh = [t.clone() for t in torch_args]
    want = case.torch_fn(*fresh)
    kd = list(kd_args)
    op = kdispatch.op(case.op)
    op(*kd, **case.attrs)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    worst = 0.0
    for got, expect in case.compare(kd, want):
        tol = case.tol or (1e-4 if got.dtype == torch.float32 else 2e-2)
        err = ((got.double() - expect.double()).abs() / (1 + expect.double().abs())).max().item()
        worst = max(worst, err)
        if not err <= tol:
            return False, f"rel err {err:.3g}"
    return True, f"{worst:.2g}"


def cpu_seconds(fn, repeats):
    """Median seconds per call of `fn` over `repeats` samples of back-to-back
    calls (enough for about 50 ms a sample)."""
    started = time.perf_counter()
    fn()
    calls = max(1, int(0.05 / max(time.perf_counter() - started, 1e-6)))
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - started) / calls)
    return statistics.median(times)


def cpu_main(args):
    threads = int(os.environ.get("KDISPATCH_CPU_THREADS", "0")) or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    print(f"torch {torch.__version__} on the CPU and kdispatch {kdispatch.version} (cpu backend), "
          f"{threads} threads each", flush=True)
    rows = []
    for case in cases():
        label = f"{case.op} {case.dtype} {case.shape}"
        if args.only and not any(s in label for s in args.only):
            continue
        torch_args, kd_args = case.make()
        ok, detail = agree(case, kd_args, torch_args)
        op = kdispatch.op(case.op)
        fns = {"kdispatch": lambda: op(*kd_args, **case.attrs), "eager": lambda: case.torch_fn(*torch_args)}
        samples = {name: [] for name in fns}
        for r in range(args.repeats):  # the two take turns
            for name in (fns if r % 2 == 0 else reversed(list(fns))):
                samples[name].append(cpu_seconds(fns[name], 3))
        kd, eager = statistics.median(samples["kdispatch"]), statistics.median(samples["eager"])
        rows.append({"op": case.op, "dtype": case.dtype, "shape": case.shape, "bytes": case.nbytes,
                     "agrees": ok, "agreement": detail, "kdispatch_ms": kd * 1e3, "eager_ms": eager * 1e3,
                     "kd_gbs": case.nbytes / kd / 1e9})
        print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in rows[-1].items()),
              flush=True)
    if args.csv and rows:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    print(f"\nms per call on the CPU ({threads} threads each), median of {args.repeats} samples taken in turns; "
          f"ratio = eager / kdispatch (> 1: kdispatch faster)")
    print(f"{'op':30} {'dtype':9} {'shape':22} {'kdispatch':>10} {'eager':>10} {'ratio':>7} {'GB/s':>6} {'check':>6}")
    for r in rows:
        print(f"{r['op'].split('.')[1]:30} {r['dtype']:9} {r['shape']:22} {r['kdispatch_ms']:10.2f} "
              f"{r['eager_ms']:10.2f} {r['eager_ms'] / r['kdispatch_ms']:7.2f} {r['kd_gbs']:6.1f} "
              f"{'ok' if r['agrees'] else 'FAIL':>6}")
    failed = sum(not r["agrees"] for r in rows)
    slower = sum(r["eager_ms"] < r["kdispatch_ms"] for r in rows)
    print(f"bench: {len(rows)} cases, kdispatch slower than eager in {slower}, disagreeing with eager in {failed}")
    return 1 if failed else 0


def main():
    global DEVICE
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", help="write every column here")
    parser.add_argument("--only", action="append", default=[], help="run the cases whose label contains this")
    parser.add_argument("--calls", type=int, default=100, help="calls per graph and per back-to-back run")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: the cpu backend against PyTorch eager on the CPU")
    args = parser.parse_args()
    DEVICE = args.device
    torch.manual_seed(0)
    if DEVICE == "cpu":
        return cpu_main(args)
    torch._dynamo.config.cache_size_limit = 256  # one compiled graph per case
    copy_graph, copy = copy_tbs(args.calls)
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}, kdispatch {kdispatch.version}; "
          f"device-to-device copy_ {copy:.2f} TB/s back to back, {copy_graph:.2f} TB/s as graph memcpy nodes "
          f"(peak {PEAK_TBS} TB/s)", flush=True)
    rows = []
    impls = ["kdispatch", "eager"] + ([] if args.no_compile else ["compile"])
    gemm = Gemm()
    for case in cases():
        label = f"{case.op} {case.dtype} {case.shape}"
        if args.only and not any(s in label for s in args.only):
            continue
        nsets = int(min(64, max(1, math.ceil(3 * L2_BYTES / case.nbytes))))
        sets = [case.make() for _ in range(nsets)]
        # Inputs rotate; outputs are one buffer, as torch's allocator hands
        # torch.compile's kernels the same block call after call.
        sets = [(t, [sets[0][1][i] if i in case.outputs else a for i, a in enumerate(kd)]) for t, kd in sets]
        ok, detail = agree(case, sets[0][1], sets[0][0])
        op = kdispatch.op(case.op)
        fns = {
            "kdispatch": lambda s, op=op, case=case: op(*s[1], **case.attrs),
            "eager": lambda s, case=case: case.torch_fn(*s[0]),
        }
        if "compile" in impls:
            compiled = torch.compile(case.torch_fn, dynamic=False)
            fns["compile"] = lambda s, fn=compiled: fn(*s[0])
        result = {"op": case.op, "dtype": case.dtype, "shape": case.shape, "rows": case.rows, "bytes": case.nbytes,
                  "agrees": ok, "agreement": detail, "baseline": case.baseline or ""}
        for name in impls:
            try:
                g, b, s = measure(fns[name], sets, args.calls, args.repeats)
            except Exception as e:  # report and go on: the other rows still count
                print(f"{name} failed on {label}: {e}", file=sys.stderr)
                g = b = s = float("nan")
            result[f"{name}_graph_us"], result[f"{name}_b2b_us"], result[f"{name}_sync_us"] = g, b, s
        # Decode sizes again with a matmul between the calls (NaN elsewhere,
        # so that every row has every CSV column); gemm_us is the matmul's
        # own time, measured beside each implementation's (the last kept).
        result["gemm_us"] = float("nan")
        for name in impls:
            m = float("nan")
            if case.decode:
                try:
                    m, result["gemm_us"] = measure_with_gemm(fns[name], sets, gemm(case.rows), args.calls,
                                                             args.repeats)
                except Exception as e:  # as above
                    print(f"{name} with a matmul failed on {label}: {e}", file=sys.stderr)
            result[f"{name}_gemm_graph_us"] = m
        kd = result["kdispatch_graph_us"]
        result["kd_tbs"] = case.nbytes / (kd * 1e-6) / 1e12
        result["copy_same_bytes_tbs"] = (float("nan") if case.decode else
                                         same_bytes_copy_tbs(case.nbytes, nsets, args.calls, args.repeats))
        rows.append(result)
        print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()),
              flush=True)
        del sets, fns
        torch.cuda.empty_cache()
    if args.csv and rows:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    peer = "compile" if "compile" in impls else "eager"
    gemm_times = {}  # rows -> the matmul's own times, one per decode-size case
    for r in rows:
        if not math.isnan(r["gemm_us"]):
            gemm_times.setdefault(r["rows"], []).append(r["gemm_us"])
    print(f"\nGPU us per call under CUDA-graph replay ({args.calls} calls per graph); ratio = {peer} / "
          f"kdispatch (>= 1: kdispatch as fast or faster); copy_ {copy:.2f} TB/s, peak {PEAK_TBS} TB/s; "
          f"copy: TB/s of a copy_ of the case's bytes, inputs rotated alike (not at decode sizes)")
    print(f"+mm (decode sizes): the same with a bf16 [rows x {GEMM_K}] @ [{GEMM_K} x {GEMM_N}] matmul before each "
          f"call in the graph, minus the matmul's own time (" +
          ", ".join(f"median {statistics.median(t):.2f} us at rows={n}" for n, t in sorted(gemm_times.items())) +
          f"); ratio +mm = {peer} +mm / kd +mm")

    def us(value, width):
        return f"{'-':>{width}}" if math.isnan(value) else f"{value:{width}.2f}"

    print(f"{'op':30} {'dtype':9} {'shape':22} {'kdispatch':>9} {'kd +mm':>8} {peer:>9} {peer + ' +mm':>11} "
          f"{'ratio':>6} {'+mm':>6} {'TB/s':>5} {'copy':>5} {'eager':>9} {'kd b2b':>8} {'kd sync':>8} {'check':>6}")
    slower = slower_mm = 0
    for r in rows:
        ratio = r[f"{peer}_graph_us"] / r["kdispatch_graph_us"]
        kd_mm = r["kdispatch_gemm_graph_us"]
        ratio_mm = r[f"{peer}_gemm_graph_us"] / kd_mm if kd_mm > 0 else float("nan")
        slower += not ratio >= 1.0
        slower_mm += not math.isnan(ratio_mm) and not ratio_mm >= 1.0
        ratio_mm_text = "-" if math.isnan(ratio_mm) else f"{ratio_mm:.3f}"
        print(f"{r['op'].split('.')[1]:30} {r['dtype']:9} {r['shape']:22} {r['kdispatch_graph_us']:9.2f} "
              f"{us(kd_mm, 8)} {r[f'{peer}_graph_us']:9.2f} {us(r[f'{peer}_gemm_graph_us'], 11)} "
              f"{ratio:6.3f} {ratio_mm_text:>6} {r['kd_tbs']:5.2f} {us(r['copy_same_bytes_tbs'], 5)} "
              f"{r['eager_graph_us']:9.2f} "
              f"{r['kdispatch_b2b_us']:8.2f} {r['kdispatch_sync_us']:8.2f} {'ok' if r['agrees'] else 'FAIL':>6}")
    # Strided calls against the same call on contiguous tensors, when both ran.
    by_shape = {(r["op"], r["dtype"], r["shape"]): r for r in rows}
    for r in rows:
        base = by_shape.get((r["op"], r["dtype"], r["baseline"])) if r["baseline"] else None
        if base is not None:
            ratio = r["kdispatch_graph_us"] / base["kdispatch_graph_us"]
            print(f"strided vs contiguous: {r['op'].split('.')[1]} {r['dtype']} {r['shape']}: "
                  f"{r['kdispatch_graph_us']:.2f} us against {base['kdispatch_graph_us']:.2f} us ({base['shape']}), "
                  f"x{ratio:.3f}, {'within' if ratio <= 1.05 else 'NOT within'} 5%")
    failed = sum(not r["agrees"] for r in rows)
    print(f"bench: {len(rows)} cases, kdispatch slower than {peer} under graph replay in {slower} "
          f"(with a matmul between decode-size calls: {slower_mm}), disagreeing with eager in {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
