#!/usr/bin/env python3
"""kdispatch.integrations.transformers.kernelize on real transformers
models (random weights, 2 layers, small sizes) of the families it serves:
Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE and Gemma, in bfloat16 on CUDA
(float32 on the CPU):

- the report replaces every norm, both residual adds of every layer, every
  gated MLP, the rotary embedding, the MoE routers and experts (all three
  of transformers' experts implementations), and leaves nothing;
- the logits against the original run in float32 are no further off than
  the original's own (a quarter more, or 2e-3, allowed);
- output_hidden_states gives the original's hidden states;
- on CUDA: torch.compile (with each of kernelize's when_compiled values)
  and a CUDA graph of the kernelized model match its eager output; the MoE
  experts under each of transformers' experts implementations match too.

Skipped (exit 77) without transformers (Debian does not package it)."""
import copy
import sys
import warnings

try:
    import torch
except ImportError as e:
    print(f"SKIPPED: {e} (Debian: python3-torch)")
    sys.exit(77)
try:
    import transformers
except ImportError as e:
    print(f"SKIPPED: {e} (transformers is not packaged for Debian; this runs where it is installed)")
    sys.exit(77)

import kdispatch.integrations.transformers as kt

warnings.filterwarnings("ignore")
failures = []
passed = 0
cuda = torch.cuda.is_available()
device = "cuda" if cuda else "cpu"
dtype = torch.bfloat16 if cuda else torch.float32


def check(ok, what):
    global passed
    if ok:
        passed += 1
    else:
        failures.append(what)
        print("FAIL", what)


def rel_l2(got, want):
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm()).item()


COMMON = dict(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, max_position_embeddings=1024)
FAMILIES = {
    "llama": ("LlamaConfig", dict(rope_theta=500000.0)),
    "mistral": ("MistralConfig", dict(sliding_window=None)),
    "qwen2": ("Qwen2Config", dict()),
    "qwen3": ("Qwen3Config", dict()),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
                                         decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)),
    "gemma": ("GemmaConfig", dict(hidden_activation="gelu_pytorch_tanh", hidden_act="gelu_pytorch_tanh")),
}


def build(family):
    name, extra = FAMILIES[family]
    config = getattr(transformers, name)(**COMMON, **extra)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    try:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    except TypeError:
        model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    return model.to(device).eval()


print(f"transformers {transformers.__version__}, torch {torch.__version__}, {device} {dtype}")
ids = torch.randint(0, 1000, (4, 16), generator=torch.Generator().manual_seed(1)).to(device)
for family in FAMILIES:
    original = build(family)
    model = copy.deepcopy(original)
    report = kt.kernelize(model)
    print(report)
    counts = report.counts()
    layers = 2
    check(counts.get("RMSNorm", 0) >= 2 * layers + 1, f"{family}: norms {counts}")
    check(counts.get("decoder layer residual adds") == layers, f"{family}: layers {counts}")
    check(all(op.endswith("x2") for _, what, op in report.replaced if what == "decoder layer residual adds"),
          f"{family}: both adds of every layer fused")
    check(counts.get("rotary embedding") == 1, f"{family}: rotary {counts}")
    if family == "qwen3_moe":
        check(counts.get("MoE router") == layers, f"{family}: routers {counts}")
        check(counts.get("MoE experts (grouped_mm, batched_mm and eager)") == layers, f"{family}: experts {counts}")
    else:
        check(counts.get("gated MLP") == layers, f"{family}: MLPs {counts}")
    check(not report.left, f"{family}: left {report.left}")
    with torch.no_grad():
        want = original(ids).logits
        got = model(ids).logits
        exact = copy.deepcopy(original).float()(ids).logits
    err, err_original = rel_l2(got, exact), rel_l2(want, exact)
    check(err <= 1.25 * err_original + 2e-3, f"{family}: logits error {err:.3g}, the original's {err_original:.3g}")
    print(f"ok   {family}: logits relative L2 against float32 {err:.2e} (the original {err_original:.2e})")

    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states
        hidden_want = original(ids, output_hidden_states=True).hidden_states
    worst = max(rel_l2(a, b) for a, b in zip(hidden, hidden_want))
    check(len(hidden) == len(hidden_want) and worst <= 5e-2,
          f"{family}: output_hidden_states differ (worst relative L2 {worst:.3g})")

    if cuda:
        with torch.no_grad():
            eager = model(ids).logits
            got_compiled = {}
            for when in kt.WHEN_COMPILED:
                kt.kernelize(model, when_compiled=when)
                torch._dynamo.reset()
                got_compiled[when] = torch.compile(model)(ids).logits
            torch._dynamo.reset()
            static = ids.clone()
            for _ in range(2):
                model(static)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                graphed = model(static).logits
            graph.replay()
            torch.cuda.synchronize()
        err_c = {when: rel_l2(got, eager) for when, got in got_compiled.items()}
        err_g = rel_l2(graphed, eager)
        for when, err in err_c.items():
            check(err <= 1e-2, f"{family}: torch.compile (when_compiled={when}) differs from eager ({err:.3g})")
        check(err_g <= 1e-6, f"{family}: CUDA graph replay differs from eager ({err_g:.3g})")
        print(f"ok   {family}: torch.compile vs eager " + ", ".join(f"{e:.2e} (when_compiled={w})" for w, e in err_c.items())
              + f"; CUDA graph replay vs eager {err_g:.2e}")

    if family == "qwen3_moe":
        config = model.config
        for implementation in ("eager", "batched_mm", "grouped_mm"):
            try:
                config._experts_implementation = implementation
                original.config._experts_implementation = implementation
                with torch.no_grad():
                    got = model(ids).logits
                    want = original(ids).logits
            except Exception as e:  # noqa: BLE001 - an implementation this torch lacks
                print(f"skip {family} experts '{implementation}': {type(e).__name__}: {e}")
                continue
            err = rel_l2(got, want)
            check(err <= 5e-2, f"{family} experts '{implementation}': kernelized vs original {err:.3g}")
            print(f"ok   {family} experts '{implementation}': kernelized vs original logits {err:.2e}")

print(f"transformers models: {passed} passed, {len(failures)} failed")
sys.exit(1 if failures else 0)
