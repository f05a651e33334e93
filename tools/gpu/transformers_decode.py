#!/usr/bin/env python3
"""transformers models with and without kdispatch.integrations.transformers.kernelize,
on a GPU: accuracy of a prefill and the time of one decode step.

For a Llama-3-8B-shaped and a Qwen3-MoE-shaped (Qwen3-30B-A3B) model with
random weights, a few layers, bfloat16:

- accuracy: logits of a 64-token prefill at batch 4, relative L2 against the
  original model run in float32, for the original and the kernelized model;
- speed: one decode step (static cache of 512 tokens, the step at position
  511) at batch 1 and 32, under CUDA-graph replay (and back to back without
  a graph), original vs kernelized, then both under torch.compile (the
  compiled step captured in a CUDA graph the same way), the kernelized model
  once for each --when-compiled value of kernelize (torch: the replaced
  modules' original forwards in the compiled graph; kdispatch: kdispatch's
  ops).

    python3 tools/gpu/transformers_decode.py [--layers 4] [--models llama,qwen3_moe] [--batches 1,32]
                                             [--when-compiled torch,kdispatch]

Prints the kernelize reports, then a table. Needs transformers and CUDA.
"""
import argparse
import copy
import sys
import time
import warnings

import torch
import transformers

import kdispatch.integrations.transformers as kt

warnings.filterwarnings("ignore")

SHAPES = {
    "llama": ("LlamaConfig", dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                  num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
                                  rms_norm_eps=1e-5, max_position_embeddings=8192)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                         moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                                         norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                                         num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                         rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=8192)),
}
KV_LENGTH = 512


def build(name, layers):
    cls, shape = SHAPES[name]
    config = getattr(transformers, cls)(num_hidden_layers=layers, **shape)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    try:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    except TypeError:
        model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    return model.cuda().eval()


def rel_l2(got, want):
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm()).item()


def static_cache(model, batch):
    from transformers import StaticCache
    for kwargs in (dict(config=model.config, max_cache_len=KV_LENGTH),
                   dict(config=model.config, max_batch_size=batch, max_cache_len=KV_LENGTH, device="cuda",
                        dtype=torch.bfloat16)):
        try:
            return StaticCache(**kwargs)
        except TypeError:
            continue
    raise RuntimeError("no StaticCache constructor fits")


def graph_of(step):
    """The replay of a CUDA graph of one call of step."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def time_graph(step, replays=50):
    """us per step: CUDA-graph replay, and back to back without a graph."""
    replay = graph_of(step)
    replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        replay()
    end.record()
    torch.cuda.synchronize()
    in_graph = start.elapsed_time(end) * 1000 / replays
    start.record()
    for _ in range(replays):
        step()
    end.record()
    torch.cuda.synchronize()
    eager = start.elapsed_time(end) * 1000 / replays
    return in_graph, eager


def decode_step(model, batch):
    cache = static_cache(model, batch)
    ids = torch.randint(0, model.config.vocab_size, (batch, 1), device="cuda")
    position = KV_LENGTH - 1
    position_ids = torch.full((batch, 1), position, device="cuda", dtype=torch.long)
    cache_position = torch.tensor([position], device="cuda")

    def step():
        return model(input_ids=ids, position_ids=position_ids, cache_position=cache_position, past_key_values=cache,
                     use_cache=True).logits

    return step


def profile(title, step, steps=5, rows=25):
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    attr = "device_time_total" if hasattr(events[0], "device_time_total") else "cuda_time_total"
    events.sort(key=lambda e: -getattr(e, attr))
    total = sum(getattr(e, attr) for e in events) / steps
    count = sum(e.count for e in events) / steps
    print(f"\nprofile {title}: {count:.0f} kernels, {total:.1f} us of GPU time per step")
    for e in events[:rows]:
        print(f"  {getattr(e, attr) / steps:8.1f} us {e.count / steps:5.0f}x  {e.key[:110]}")
    # The GPU's idle time between consecutive kernels of the last step, the
    # largest gaps first, with the kernels on either side.
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)[-int(count):]
    gaps = [(b.time_range.start - a.time_range.end, a.name, b.name) for a, b in zip(kernels, kernels[1:])]
    idle = sum(g for g, _, _ in gaps if g > 0)
    print(f"  idle between kernels in the last step: {idle:.1f} us; the largest gaps:")
    for g, a, b in sorted(gaps, reverse=True)[:12]:
        print(f"  {g:8.1f} us  after {a[:60]}  before {b[:60]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--models", default="llama,qwen3_moe")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile columns")
    parser.add_argument("--when-compiled", default="torch,kdispatch",
                        help="kernelize's when_compiled values to time the compiled kernelized model with")
    parser.add_argument("--profile", action="store_true",
                        help="print the GPU kernels of one decode step at the first batch size, by total time, "
                             "eager and compiled")
    args = parser.parse_args()
    whens = args.when_compiled.split(",")
    for when in whens:
        if when not in kt.WHEN_COMPILED:
            parser.error(f"--when-compiled: {when!r} is not one of {', '.join(kt.WHEN_COMPILED)}")
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}")
    accuracy = []
    rows = []
    for name in args.models.split(","):
        original = build(name, args.layers)
        kernelized = copy.deepcopy(original)
        started = time.time()
        report = kt.kernelize(kernelized)
        print(f"{name}: kernelize took {time.time() - started:.2f} s")
        print(report)
        ids = torch.randint(0, original.config.vocab_size, (4, 64), device="cuda",
                            generator=torch.Generator(device="cuda").manual_seed(1))
        with torch.inference_mode():
            exact = copy.deepcopy(original).float()(ids).logits
            err_original = rel_l2(original(ids).logits, exact)
            err_kernelized = rel_l2(kernelized(ids).logits, exact)
        torch.cuda.empty_cache()
        accuracy.append((name, err_original, err_kernelized))
        batches = [int(b) for b in args.batches.split(",")]
        if args.profile:
            for label, model in (("original", original), ("kernelized", kernelized)):
                with torch.inference_mode():
                    profile(f"{name} {label} batch {batches[0]}", decode_step(model, batches[0]))
        for batch in batches:
            times = {}
            for label, model in (("original", original), ("kernelized", kernelized)):
                with torch.inference_mode():
                    times[label] = time_graph(decode_step(model, batch))
                if args.no_compile:
                    continue
                for when in (whens if label == "kernelized" else [None]):
                    key = label + "+compile" + (f" {when}" if when else "")
                    if when:
                        kt.kernelize(model, when_compiled=when)
                    torch._dynamo.reset()
                    with torch.inference_mode():
                        try:
                            compiled = torch.compile(model)
                            times[key] = time_graph(decode_step(compiled, batch))
                            if args.profile and batch == batches[0]:
                                profile(f"{name} {key} batch {batch}", decode_step(compiled, batch))
                                profile(f"{name} {key} batch {batch} graph replay",
                                        graph_of(decode_step(compiled, batch)), rows=200)
                        except Exception as e:  # noqa: BLE001 - reported in the table
                            print(f"{name} b{batch} {key} torch.compile: {type(e).__name__}: {str(e)[:400]}")
                            times[key] = (float("nan"), float("nan"))
                torch._dynamo.reset()
            rows.append((name, batch, times))
            print(f"{name} batch {batch}: " + ", ".join(f"{key} {g:.1f} us" for key, (g, _) in times.items()))
        del original, kernelized
        torch.cuda.empty_cache()

    print("\nprefill 4x64 logits, relative L2 against the original in float32")
    print(f"{'model':10s} {'original bf16':>14s} {'kernelized':>11s}")
    for name, a, b in accuracy:
        print(f"{name:10s} {a:14.3e} {b:11.3e}  {'ok' if b <= 1.25 * a + 2e-3 else 'WORSE'}")
    print(f"\ndecode step, static cache {KV_LENGTH}, {args.layers} layers: us per step, CUDA-graph replay "
          "(back to back without a graph)")
    print("(kd+compile W: the kernelized model compiled with kernelize's when_compiled=W; ratio: the compiled "
          "original's time over it)")
    head = f"{'model':10s} {'batch':>5s} {'original':>17s} {'kernelized':>17s} {'speedup':>7s} {'orig+compile':>17s}"
    for when in whens:
        head += f" {'kd+compile ' + when:>20s} {'ratio':>6s}"
    print(head)
    nan = (float("nan"), float("nan"))
    for name, batch, t in rows:
        def cell(key, width=17):
            g, e = t.get(key, nan)
            return f"{f'{g:8.1f} ({e:6.1f})':>{width}s}"
        line = (f"{name:10s} {batch:5d} {cell('original')} {cell('kernelized')} "
                f"{t['original'][0] / t['kernelized'][0]:6.2f}x {cell('original+compile')}")
        for when in whens:
            key = f"kernelized+compile {when}"
            line += f" {cell(key, 20)} {t.get('original+compile', nan)[0] / t.get(key, nan)[0]:5.2f}x"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
