#!/usr/bin/env python3
"""kdispatch.integrations.transformers.kernelize on tiny models laid out as
transformers' (tiny_decoder.py: Llama, Gemma's norm and activation, Qwen3's
q/k norms, a Qwen3-MoE router and experts), on the CPU:

- the kernelized model's output matches the original's (float32 and
  bfloat16, relative L2 within the dtype's precision), and the report names
  every replacement;
- gate and up weights are fused once and the projections view the fused
  weight (no second copy);
- the residual adds fuse with the norms after them: a layer hands its last
  add on to the next layer's input norm and the last one to the final norm,
  but returns a plain tensor to a forward hook;
- under autograd the original forwards run, and the gradients match;
- what does not match is left with its reason (a norm whose formula is not
  the one its class name promises, a layer with a norm after its MLP, a
  rotary type whose frequencies change with the length);
- restore() gives the original classes back.

The same function on real transformers models runs in
test_transformers_models.py (where transformers is installed)."""
import copy
import os
import sys

try:
    import torch
except ImportError as e:
    print(f"SKIPPED: {e} (Debian: python3-torch)")
    sys.exit(77)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny_decoder as td  # noqa: E402

import kdispatch.integrations.transformers as kt  # noqa: E402

failures = []
passed = 0


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


def pair(make, dtype, norm_center=1.0, seed=0):
    """(original, kernelized copy, report), same weights."""
    torch.manual_seed(seed)
    original = td.randomize(make(), seed, norm_center).to(dtype)
    model = copy.deepcopy(original)
    report = kt.kernelize(model)
    return original, model, report


def tokens(batch=3, length=11, vocab=97, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g)


def compare(name, original, model, dtype, **kw):
    """float32: kernelized against original. 16-bit: both against the original
    run in float32 with the same weights; the kernelized model may be no
    further off than the original (within a quarter more)."""
    ids = tokens(**kw)
    with torch.no_grad():
        want = original(ids)
        got = model(ids)
        if dtype == torch.float32:
            err = rel_l2(got, want)
            check(err <= 1e-5, f"{name} {dtype}: logits relative L2 {err:.3g} > 1e-5")
            print(f"ok   {name} float32: logits relative L2 error {err:.2e} against the original")
            return
        exact = copy.deepcopy(original).float()(ids)
    err, err_original = rel_l2(got, exact), rel_l2(want, exact)
    check(err <= 1.25 * err_original + 1e-3,
          f"{name} {dtype}: logits relative L2 {err:.3g} against float32, the original's {err_original:.3g}")
    print(f"ok   {name} {str(dtype)[6:]}: logits relative L2 error against float32 {err:.2e} "
          f"(the original {err_original:.2e})")


def llama(**kw):
    return lambda: td.LlamaForCausalLM(td.Config(**kw))


for dtype in (torch.float32, torch.bfloat16):
    layers = 3
    original, model, report = pair(llama(), dtype)
    counts = report.counts()
    check(counts.get("RMSNorm") == 2 * layers + 1, f"llama: RMSNorms replaced {counts}")
    check(counts.get("decoder layer residual adds") == layers, f"llama: layers replaced {counts}")
    check(counts.get("gated MLP") == layers, f"llama: MLPs replaced {counts}")
    check(counts.get("rotary embedding") == 1, f"llama: rotary replaced {counts}")
    check(counts.get("attention's rotary (q, k in place)") == layers, f"llama: attentions {counts}")
    check(not report.left, f"llama: nothing left, got {report.left}")
    check(all(op == "layernorm.fused_add_rmsnorm_out x2" for _, what, op in report.replaced
              if what == "decoder layer residual adds"), f"llama: every layer fuses both adds {report.replaced}")
    compare("llama", original, model, dtype)
    compare("llama, one row", original, model, dtype, batch=1, length=1)
    print(report)

    # No second copy of the MLP weights: the projections view the fused one.
    mlp = model.model.layers[0].mlp
    fused = mlp._kd_gate_up
    width = mlp.gate_proj.weight.shape[0]
    check(mlp.gate_proj.weight.data_ptr() == fused.data_ptr(), "gate_proj.weight views the fused weight")
    check(mlp.up_proj.weight.data_ptr() == fused.data_ptr() + width * fused.shape[1] * fused.element_size(),
          "up_proj.weight views the fused weight's second half")
    check(torch.equal(mlp.gate_proj.weight, original.model.layers[0].mlp.gate_proj.weight),
          "gate_proj.weight keeps its values")
    check(set(model.state_dict()) == set(original.state_dict()), "state_dict keys unchanged")

# The layer hands its MLP add on to the next norm as a PendingAdd ...
original, model, _ = pair(llama(), torch.float32)
seen = []
hook = model.model.layers[1].register_forward_pre_hook(lambda m, args: seen.append(type(args[0])))
with torch.no_grad():
    model(tokens())
hook.remove()
check(seen == [kt.PendingAdd], f"layer 0 hands a PendingAdd to layer 1, got {seen}")
# ... but returns a tensor where a hook records its output.
outputs = []
hook = model.model.layers[0].register_forward_hook(lambda m, args, out: outputs.append(out))
with torch.no_grad():
    got = model(tokens())
    want = original(tokens())
hook.remove()
check(len(outputs) == 1 and isinstance(outputs[0], torch.Tensor), f"a hooked layer returns a tensor: {outputs}")
check(rel_l2(got, want) <= 1e-5, "outputs match with a hooked layer")
print("ok   residual adds: handed on to the next norm, materialized for a hook")

# Gemma's norm (1 + weight) and the tanh GELU; Qwen3's q/k norms.
for name, make, center, extra_norms in [
        ("gemma", lambda: td.LlamaForCausalLM(td.Config(hidden_act="gelu_pytorch_tanh"), norm=td.GemmaRMSNorm), 0.0, 0),
        ("qwen3 (q/k norms)", lambda: td.LlamaForCausalLM(td.Config(), norm_heads=True), 1.0, 6)]:
    for dtype in (torch.float32, torch.bfloat16):
        original, model, report = pair(make, dtype, center)
        ops = {op for _, _, op in report.replaced}
        check(not report.left, f"{name}: nothing left, got {report.left}")
        check(report.counts().get("RMSNorm") == 7 + extra_norms, f"{name}: norms {report.counts()}")
        if name == "gemma":
            check({"layernorm.gemma_rmsnorm", "activation.gelu_tanh_and_mul"} <= ops, f"gemma ops {ops}")
        compare(name, original, model, dtype)

# Qwen3-MoE: router (softmax, top-k, renormalise) and the experts' gate. In
# 16 bits a token whose top-k experts are nearly tied may route differently
# in any two runs (the original against float32 too): the errors against
# float32 are compared summed over several models.
for renormalize, logits_float32 in ((True, False), (False, False), (True, True)):
    def make():
        return td.LlamaForCausalLM(td.Config(num_experts=8, norm_topk_prob=renormalize,
                                             router_logits_float32=logits_float32), moe=True, norm_heads=True)

    original, model, report = pair(make, torch.float32)
    counts = report.counts()
    check(counts.get("MoE router") == 3, f"moe: routers {counts}")
    check(counts.get("MoE experts (grouped_mm, batched_mm and eager)") == 3, f"moe: experts {counts}")
    check(not report.left, f"moe: nothing left, got {report.left}")
    routers = {op for _, what, op in pair(make, torch.bfloat16)[2].replaced if what == "MoE router"}
    check(routers == {"moe.topk_softmax" + (" (float32 logits)" if logits_float32 else "")},
          f"moe: router logits in float32 where the original computes them so: {routers}")
    compare(f"qwen3-moe renormalize={renormalize}", original, model, torch.float32, batch=2, length=5)
    errors, errors_original = [], []
    for seed in range(4):
        original, model, _ = pair(make, torch.bfloat16, seed=seed)
        ids = tokens(batch=2, length=5)
        with torch.no_grad():
            exact = copy.deepcopy(original).float()(ids)
            errors.append(rel_l2(model(ids), exact))
            errors_original.append(rel_l2(original(ids), exact))
    mean, mean_original = sum(errors) / 4, sum(errors_original) / 4
    check(mean <= 1.25 * mean_original + 1e-3, f"qwen3-moe bf16: mean error {mean:.3g}, the original's {mean_original:.3g}")
    print(f"ok   qwen3-moe renormalize={renormalize} bfloat16: mean logits relative L2 error against float32 over 4 "
          f"models {mean:.2e} (the original {mean_original:.2e})")
    # The eager form of the experts (the activation inline in transformers)
    # goes through kdispatch too.
    for form in ("eager", "grouped_mm"):
        original.model.config._experts_implementation = form
        model.model.config._experts_implementation = form
        ids = tokens(batch=2, length=5)
        with torch.no_grad():
            exact = copy.deepcopy(original).float()(ids)
            err, err_original = rel_l2(model(ids), exact), rel_l2(original(ids), exact)
        check(err <= 1.25 * err_original + 1e-3, f"experts form {form}: error {err:.3g}, original {err_original:.3g}")
    calls = []
    experts = model.model.layers[0].mlp.experts
    experts._kd_act_op = lambda *args, op=experts._kd_act_op: (calls.append(1), op(*args))
    with torch.no_grad():
        model(tokens(batch=1, length=3))
    check(len(calls) > 0, "the eager experts form calls kdispatch's activation")
    del experts._kd_act_op
    experts._kd_act_op = getattr(torch.ops.kdispatch, "activation_silu_and_mul")
    router = model.model.layers[0].mlp.gate
    with torch.no_grad():
        _, weights, ids = router(torch.randn(4, 64, dtype=torch.bfloat16))
    check(ids.dtype == torch.int64 and weights.dtype == torch.float32, f"router outputs {ids.dtype} {weights.dtype}")

# Under autograd the original forwards run: gradients match.
original, model, _ = pair(llama(), torch.float32)
ids = tokens()
original(ids).square().mean().backward()
model(ids).square().mean().backward()
for (name, p), (_, q) in zip(original.named_parameters(), model.named_parameters()):
    if p.grad is None or q.grad is None:
        check(p.grad is None and q.grad is None, f"grad of {name}")
        continue
    err = rel_l2(q.grad, p.grad)
    check(err <= 1e-5, f"grad of {name}: relative L2 {err:.3g}")
print("ok   autograd: gradients through the original forwards")

# What does not match is left, with the reason.


class WrongNorm(td.LlamaRMSNorm):
    """Named like Llama's norm, computing something else."""

    def forward(self, hidden_states):
        return super().forward(hidden_states) * 1.5


WrongNorm.__name__ = "LlamaRMSNorm"
original, model, report = pair(lambda: td.LlamaForCausalLM(td.Config(), norm=WrongNorm), torch.float32)
left = {what: reason for _, what, reason in report.left}
check("differs from the original" in left.get("RMSNorm", ""), f"a wrong norm is left: {report.left}")
check("its input_layernorm is not replaced" in left.get("decoder layer residual adds", ""),
      f"layers over a wrong norm are left: {report.left}")
compare("llama with a norm kdispatch does not know", original, model, torch.float32)

original, model, report = pair(lambda: td.LlamaForCausalLM(td.Config(), layer=td.SandwichDecoderLayer),
                               torch.float32)
reasons = [reason for _, what, reason in report.left if what == "decoder layer residual adds"]
check(len(reasons) == 3 and all("post_feedforward_layernorm" in r for r in reasons),
      f"sandwich layers are left: {report.left}")
compare("sandwich layers", original, model, torch.float32)

original, model_dyn, _ = pair(llama(), torch.float32)
model_dyn = copy.deepcopy(original)
model_dyn.model.rotary_emb.rope_type = "dynamic"
report = kt.kernelize(model_dyn)
check(any(what == "rotary embedding" and "changes inv_freq" in reason for _, what, reason in report.left),
      f"dynamic rope is left: {report.left}")
compare("dynamic rope left", original, model_dyn, torch.float32)
model_long = copy.deepcopy(original)
model_long.model.rotary_emb.original_max_seq_len = 1 << 25
report_long = kt.kernelize(model_long)
check(any(what == "rotary embedding" and "MiB" in reason for _, what, reason in report_long.left),
      f"a cos/sin cache over 1 GiB is not built: {report_long.left}")
print("ok   left with reasons:", "; ".join(sorted({f'{w}: {r}' for _, w, r in report.left + report_long.left})))

# Under torch.compile (its tracing stood in for by kt._is_compiling, as Debian's
# torch has no torch.compile): with when_compiled="torch", the default, the
# replaced modules run their original forwards (the original's logits bit for
# bit) and no kdispatch op is called; with "kdispatch" the ops are called as
# outside compile, matching the original.
class CountingOps:
    def __init__(self, ops):
        self.ops = ops
        self.calls = 0

    def __getattr__(self, name):
        op = getattr(self.ops, name)

        def call(*args, **kwargs):
            self.calls += 1
            return op(*args, **kwargs)
        return call


def moe_model():
    return td.LlamaForCausalLM(td.Config(num_experts=8), moe=True, norm_heads=True)


ops, is_compiling = kt._ops, kt._is_compiling
try:
    for name, make in (("llama", llama()), ("qwen3-moe", moe_model)):
        for when in ("torch", "kdispatch"):
            kt._ops, kt._is_compiling = CountingOps(ops), is_compiling
            torch.manual_seed(0)
            original = td.randomize(make(), 0)
            model = copy.deepcopy(original)
            report = kt.kernelize(model, when_compiled=when)
            check(report.when_compiled == when and f"when_compiled={when!r}" in str(report),
                  f"{name}: the report names when_compiled={when!r}: {str(report).splitlines()[0]}")
            for compiling in (False, True):
                kt._is_compiling = lambda c=compiling: c
                kt._ops.calls = 0
                ids = tokens(batch=2, length=5)
                with torch.no_grad():
                    err = rel_l2(model(ids), original(ids))
                kd_calls = kt._ops.calls + 0
                want_kd = not (compiling and when == "torch")
                check(err <= 1e-5, f"{name} when_compiled={when} compiling={compiling}: relative L2 {err:.3g}")
                if compiling and when == "torch":
                    check(err == 0.0, f"{name}: under compile with when_compiled='torch' the original code runs "
                                      f"(bit for bit the original's logits), relative L2 {err:.3g}")
                check((kd_calls > 0) == want_kd,
                      f"{name} when_compiled={when} compiling={compiling}: {kd_calls} kdispatch calls")
            print(f"ok   {name} when_compiled={when!r}: under compile {'no kdispatch call' if when == 'torch' else 'kdispatch ops'}, "
                  "outside it kdispatch ops; matches the original")
finally:
    kt._ops, kt._is_compiling = ops, is_compiling
try:
    kt.kernelize(copy.deepcopy(original), when_compiled="inductor")
    check(False, "kernelize(when_compiled='inductor') raises")
except ValueError as e:
    check("when_compiled='inductor'" in str(e) and "torch, kdispatch" in str(e), f"a bad when_compiled: {e}")

# kernelize twice replaces nothing more; restore gives the classes back.
again = kt.kernelize(model)
check(not again.replaced, f"a second kernelize replaces nothing: {again.replaced}")
original, model, _ = pair(llama(), torch.float32)
restored = kt.restore(model)
check(restored > 0 and all(type(m).__module__ == "tiny_decoder" or type(m).__module__.startswith("torch")
                           for m in model.modules()), "restore: original classes")
with torch.no_grad():
    check(torch.allclose(model(tokens()), original(tokens()), atol=1e-5), "restored model matches")

try:
    kt.kernelize(object())
    check(False, "kernelize(object()) raises")
except TypeError as e:
    check("torch.nn.Module" in str(e), f"kernelize(object()): {e}")

check("transformers" not in sys.modules, "kdispatch.integrations.transformers does not import transformers")

print(f"kernelize: {passed} passed, {len(failures)} failed")
sys.exit(1 if failures else 0)
