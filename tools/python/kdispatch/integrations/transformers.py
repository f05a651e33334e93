"""kdispatch in a loaded Hugging Face transformers model, in one call.

    import torch, transformers
    import kdispatch.integrations.transformers as kd_transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16).cuda()
    report = kd_transformers.kernelize(model)
    print(report)                       # what was replaced, what was left and why
    with torch.inference_mode():
        logits = model(input_ids).logits

``kernelize(model)`` swaps kdispatch's ops into the model's modules, in place:

- the RMSNorm modules (``layernorm.rmsnorm``; Gemma's ``1 + weight`` form,
  ``layernorm.gemma_rmsnorm``), q/k norms included;
- the decoder layers' residual adds with the norms after them
  (``layernorm.fused_add_rmsnorm_out``): the attention output's add with the
  post-attention norm, and the MLP output's add with the next layer's input
  norm (or the model's final norm), which a layer hands on unadded;
- the gated MLPs (``activation.silu_and_mul``, ``gelu_tanh_and_mul``,
  ``gelu_and_mul``): gate and up projections become one matmul over a fused
  weight, built once, whose halves the two projections' weights then view
  (no second copy); the MoE experts' gate (``_apply_gate``) alike;
- rotary embedding (``embeddings.rotary_embedding``), from the model's own
  ``inv_freq`` and ``attention_scaling`` (a float32 cos/sin cache built once,
  in float64) and the call's position ids: q and k are rotated in place in
  the projections' output, transposed views included;
- the MoE routers' softmax, top-k and renormalisation (``moe.topk_softmax``,
  int64 expert ids; the weights stay float32 where transformers' router
  rounds them to the activation dtype).

Modules are recognised by class (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE and
Gemma) and checked before they are swapped: each kind of module is run once,
original against kdispatch, on random inputs with the first instance's
weights, and a decoder layer's forward must be the standard pre-norm residual
layout. What does not match is left as it is, with the reason in the report.
Nothing here imports transformers.

The model keeps its parameters (state_dict, loading, tying are unchanged);
only the classes of the replaced modules change, to subclasses of the
originals whose forward calls kdispatch. Under autograd (grad mode on and a
tensor requiring grad) each replaced module runs its original forward, so
training still works. Under torch.compile they run their original forward
too by default (``when_compiled="torch"``): the compiled model is the
compiled original, whose torch code inductor fuses with the code around it,
as vLLM leaves its custom ops to inductor;
``kernelize(model, when_compiled="kdispatch")`` keeps kdispatch's ops in the
compiled graph instead. Outside torch.compile, CUDA graphs included,
kdispatch's ops run. Call ``kernelize`` after the model is on its device and
in its dtype: a later ``.to()`` separates the fused gate/up weight from the
projections' weights. ``restore(model)`` gives the modules their original
classes back.
"""
import inspect as _inspect
import sys as _sys
import typing as _typing

import torch as _torch
import torch.nn.functional as _F

from .. import rotary as _rotary
from .. import torch as _kdt

__all__ = ["Report", "WHEN_COMPILED", "kernelize", "restore"]

_ops = _torch.ops.kdispatch

# The model families kernelize recognises, by the prefix of their classes.
FAMILIES = ("Llama", "Mistral", "Qwen2", "Qwen3", "Qwen3Moe", "Gemma")

# RMSNorm classes and their formula: "rmsnorm" (x * rsqrt(mean x^2 + eps) *
# weight) or "gemma" (* (1 + weight)).
_NORM_FORMULA = {f"{family}RMSNorm": ("gemma" if family == "Gemma" else "rmsnorm") for family in FAMILIES}

# An activation module's class name -> the kdispatch activation op.
_ACTIVATIONS = {
    "SiLU": "silu_and_mul", "SiLUActivation": "silu_and_mul",
    "GELUTanh": "gelu_tanh_and_mul", "PytorchGELUTanh": "gelu_tanh_and_mul", "NewGELUActivation": "gelu_tanh_and_mul",
    "GELUActivation": "gelu_and_mul", "GELU": "gelu_and_mul",
}

# The largest float32 cos/sin cache kernelize builds for a model's rotary
# embedding (max_position_embeddings rows).
_MAX_COS_SIN_CACHE_BYTES = 1 << 30

# Rotary types whose inv_freq changes with the sequence length.
_DYNAMIC_ROPE = ("dynamic", "longrope")


class Report:
    """What ``kernelize`` did: ``replaced`` [(module path, what, kdispatch op)],
    ``left`` [(module path, what, reason)], ``when_compiled`` (what the
    replaced modules run under torch.compile). ``str(report)`` summarises
    them."""

    def __init__(self, when_compiled="torch"):
        self.replaced = []
        self.left = []
        self.when_compiled = when_compiled

    def _replace(self, path, what, op):
        self.replaced.append((path, what, op))

    def _leave(self, path, what, reason):
        self.left.append((path, what, reason))

    def counts(self):
        """{what: number of modules replaced}."""
        out = {}
        for _, what, _ in self.replaced:
            out[what] = out.get(what, 0) + 1
        return out

    def __str__(self):
        lines = [f"kdispatch.kernelize: {len(self.replaced)} replaced, {len(self.left)} left; under torch.compile "
                 f"the replaced modules run {WHEN_COMPILED[self.when_compiled]} (when_compiled={self.when_compiled!r})"]
        grouped = {}
        for path, what, op in self.replaced:
            grouped.setdefault((what, op), []).append(path)
        for (what, op), paths in grouped.items():
            lines.append(f"  replaced {len(paths):3d} {what} -> {op}  (e.g. {paths[0] or '<model>'})")
        reasons = {}
        for path, what, reason in self.left:
            reasons.setdefault((what, reason), []).append(path)
        for (what, reason), paths in reasons.items():
            lines.append(f"  left     {len(paths):3d} {what}: {reason}  (e.g. {paths[0] or '<model>'})")
        return "\n".join(lines)

    __repr__ = __str__


class PendingAdd(_typing.NamedTuple):
    """A decoder layer's output whose last residual add is left to the norm
    that follows it: the hidden state is ``x + residual``."""
    x: _torch.Tensor
    residual: _torch.Tensor

    def materialize(self):
        return self.residual + self.x


def _materialize(hidden_states):
    return hidden_states.materialize() if isinstance(hidden_states, PendingAdd) else hidden_states


def _needs_grad(*tensors):
    return _torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# torch.compiler.is_compiling (torch >= 2.3): True while torch.compile traces
# a call, a constant to the trace; older torch has no torch.compile.
_is_compiling = getattr(getattr(_torch, "compiler", None), "is_compiling", None) or (lambda: False)

# kernelize's when_compiled values: what the replaced modules run under
# torch.compile.
WHEN_COMPILED = {"torch": "their original forward, fused by inductor", "kdispatch": "kdispatch's ops"}


def _compiled_in_torch(module):
    """Whether torch.compile is tracing a call that kernelize left to torch
    (when_compiled="torch"): the module's original forward goes into the
    trace, where inductor fuses it with its neighbours."""
    return _is_compiling() and getattr(module, "_kd_when_compiled", "torch") == "torch"


def _original_path(module, *tensors):
    """Whether `module` runs its original forward for this call: under
    autograd, and under torch.compile with when_compiled="torch"."""
    return _needs_grad(*tensors) or _compiled_in_torch(module)


def _rel_l2(got, want):
    got = got.detach().double()
    want = want.detach().double()
    scale = want.norm().item()
    return (got - want).norm().item() / (scale if scale > 0 else 1.0)


def _tolerance(dtype):
    return 1e-4 if dtype in (_torch.float32, _torch.float64) else 2e-2


# Subclasses of the originals, one per (original class, role).
_subclasses = {}


def _swap_class(module, role, namespace):
    original = type(module)
    key = (original, role)
    cls = _subclasses.get(key)
    if cls is None:
        cls = type(original.__name__, (original,), dict(namespace, _kd_original_class=original, _kd_role=role,
                                                        __module__=__name__))
        cls.__qualname__ = original.__qualname__
        _subclasses[key] = cls
    module.__class__ = cls


def restore(model):
    """Gives every module kernelize replaced its original class back (the
    fused gate/up weights stay: the projections still view them)."""
    count = 0
    for module in model.modules():
        original = type(module).__dict__.get("_kd_original_class")
        if original is not None:
            module.__class__ = original
            count += 1
    return count


# ---------------------------------------------------------------------------
# RMSNorm


def _eps_of(norm):
    for name in ("variance_epsilon", "eps", "epsilon"):
        value = getattr(norm, name, None)
        if isinstance(value, (int, float)):
            return float(value)
    return None


def _norm_forward(self, hidden_states):
    if isinstance(hidden_states, PendingAdd):
        return self._kd_add_norm(hidden_states.x, hidden_states.residual)[0]
    if _original_path(self, hidden_states, self.weight):
        return self._kd_original_class.forward(self, hidden_states)
    out = _torch.empty_like(hidden_states)
    self._kd_norm_op(out, hidden_states, self.weight, self._kd_eps, None)
    return out


def _norm_add_norm(self, x, residual):
    """(norm(x + residual), x + residual)."""
    if _original_path(self, x, residual, self.weight):
        s = residual + x
        return self._kd_original_class.forward(self, s), s
    out = _torch.empty_like(x)
    residual_out = _torch.empty_like(residual)
    self._kd_add_norm_op(out, residual_out, x, residual, self.weight, self._kd_eps, None)
    return out, residual_out


_NORM_NAMESPACE = {"forward": _norm_forward, "_kd_add_norm": _norm_add_norm}


def _check_norm(norm, formula, eps):
    weight = norm.weight
    x = _torch.randn(3, weight.shape[0], dtype=weight.dtype if weight.dtype != _torch.float32 else _torch.float32,
                     device=weight.device) * 2 + 0.5
    r = _torch.randn_like(x)
    want = norm.forward(x)
    op = _ops.layernorm_gemma_rmsnorm if formula == "gemma" else _ops.layernorm_rmsnorm
    got = _torch.empty_like(x)
    op(got, x, weight, eps, None)
    err = _rel_l2(got, want)
    if err > _tolerance(x.dtype):
        return f"differs from the original on random input (relative L2 error {err:.3g})"
    add_op = (_ops.layernorm_gemma_fused_add_rmsnorm_out if formula == "gemma"
              else _ops.layernorm_fused_add_rmsnorm_out)
    out, residual_out = _torch.empty_like(x), _torch.empty_like(x)
    add_op(out, residual_out, x, r, weight, eps, None)
    err = max(_rel_l2(residual_out, r + x), _rel_l2(out, norm.forward(r + x)))
    if err > _tolerance(x.dtype):
        return f"its fused add + norm differs from the original on random input (relative L2 error {err:.3g})"
    return None


def _kernelize_norms(model, report, device_ok):
    checked = {}
    done = set()
    for path, module in model.named_modules():
        name = type(module).__name__
        if "_kd_original_class" in type(module).__dict__ or not name.endswith("RMSNorm"):
            continue
        formula = _NORM_FORMULA.get(name)
        if formula is None:
            report._leave(path, "RMSNorm", f"class {name} is not one whose formula kdispatch knows")
            continue
        weight = getattr(module, "weight", None)
        eps = _eps_of(module)
        if not isinstance(weight, _torch.Tensor) or weight.dim() != 1 or eps is None:
            report._leave(path, "RMSNorm", "no 1-d weight and eps")
            continue
        if not device_ok(weight):
            report._leave(path, "RMSNorm", f"weight on {weight.device}, kdispatch serves cpu and cuda")
            continue
        key = (type(module), weight.dtype)
        if key not in checked:
            with _torch.no_grad():
                checked[key] = _check_norm(module, formula, eps)
        if checked[key] is not None:
            report._leave(path, "RMSNorm", checked[key])
            continue
        gemma = formula == "gemma"
        module._kd_eps = eps
        module._kd_norm_op = _ops.layernorm_gemma_rmsnorm if gemma else _ops.layernorm_rmsnorm
        module._kd_add_norm_op = (_ops.layernorm_gemma_fused_add_rmsnorm_out if gemma
                                  else _ops.layernorm_fused_add_rmsnorm_out)
        _swap_class(module, "norm", _NORM_NAMESPACE)
        report._replace(path, "RMSNorm", "layernorm.gemma_rmsnorm" if gemma else "layernorm.rmsnorm")
        done.add(module)
    return done


# ---------------------------------------------------------------------------
# Gated MLPs and the MoE experts' gate


def _act_op(module):
    """(op id, torch op) of the kdispatch gated activation of module.act_fn, or None."""
    act = getattr(module, "act_fn", None)
    name = _ACTIVATIONS.get(type(act).__name__) if act is not None else None
    if name == "gelu_and_mul" and getattr(act, "approximate", "none") == "tanh":
        name = "gelu_tanh_and_mul"
    return None if name is None else (f"activation.{name}", getattr(_ops, f"activation_{name}"))


def _mlp_forward(self, x):
    if _original_path(self, x, self.gate_proj.weight):
        return self._kd_original_class.forward(self, x)
    gate_up = _F.linear(x, self._kd_gate_up, self._kd_gate_up_bias)
    out = _torch.empty(gate_up.shape[:-1] + (gate_up.shape[-1] // 2,), dtype=gate_up.dtype, device=gate_up.device)
    self._kd_act_op(out, gate_up, None)
    return self.down_proj(out)


def _check_gated(act_op, reference, width, dtype, device):
    gate_up = _torch.randn(5, 2 * width, dtype=dtype, device=device) * 2
    want = reference(gate_up)
    got = _torch.empty(5, width, dtype=dtype, device=device)
    act_op(got, gate_up, None)
    err = _rel_l2(got, want)
    if err > _tolerance(dtype):
        return f"differs from the original on random input (relative L2 error {err:.3g})"
    return None


def _kernelize_mlps(model, report, device_ok):
    checked = {}
    for path, module in model.named_modules():
        name = type(module).__name__
        if "_kd_original_class" in type(module).__dict__ or not name.endswith("MLP"):
            continue
        if not all(hasattr(module, p) for p in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            continue
        gate, up = module.gate_proj, module.up_proj
        if type(gate) is not _torch.nn.Linear or type(up) is not _torch.nn.Linear:
            report._leave(path, "gated MLP", f"gate_proj/up_proj are {type(gate).__name__}/{type(up).__name__}, "
                                             "not torch.nn.Linear")
            continue
        if (gate.bias is None) != (up.bias is None) or gate.weight.shape != up.weight.shape \
                or gate.weight.dtype != up.weight.dtype or gate.weight.device != up.weight.device:
            report._leave(path, "gated MLP", "gate_proj and up_proj differ in shape, dtype, device or bias")
            continue
        if not device_ok(gate.weight):
            report._leave(path, "gated MLP", f"weights on {gate.weight.device}, kdispatch serves cpu and cuda")
            continue
        act = _act_op(module)
        if act is None:
            report._leave(path, "gated MLP", f"activation {type(module.act_fn).__name__} has no kdispatch op")
            continue
        op_name, act_op = act
        key = (type(module), type(module.act_fn), gate.weight.dtype)
        if key not in checked:
            def reference(gate_up, act=module.act_fn):
                g, u = gate_up.chunk(2, dim=-1)
                return act(g) * u
            with _torch.no_grad():
                checked[key] = _check_gated(act_op, reference, 37, gate.weight.dtype, gate.weight.device)
        if checked[key] is not None:
            report._leave(path, "gated MLP", checked[key])
            continue
        with _torch.no_grad():
            fused = _torch.cat([gate.weight.detach(), up.weight.detach()], dim=0)
            width = gate.weight.shape[0]
            gate.weight.data = fused[:width]
            up.weight.data = fused[width:]
            fused_bias = None
            if gate.bias is not None:
                fused_bias = _torch.cat([gate.bias.detach(), up.bias.detach()], dim=0)
                gate.bias.data = fused_bias[:width]
                up.bias.data = fused_bias[width:]
        module.register_buffer("_kd_gate_up", fused, persistent=False)
        module.register_buffer("_kd_gate_up_bias", fused_bias, persistent=False)
        module._kd_act_op = act_op
        _swap_class(module, "mlp", {"forward": _mlp_forward})
        report._replace(path, "gated MLP", op_name)
    return checked


def _experts_apply_gate(self, gate_up_out):
    if _original_path(self, gate_up_out):
        return self._kd_original_class._apply_gate(self, gate_up_out)
    out = _torch.empty(gate_up_out.shape[:-1] + (gate_up_out.shape[-1] // 2,), dtype=gate_up_out.dtype,
                       device=gate_up_out.device)
    self._kd_act_op(out, gate_up_out, None)
    return out


def _experts_eager(self, hidden_states, top_k_index, top_k_weights):
    """The eager experts forward (the one transformers' experts interface
    calls "eager") with the gate through _apply_gate: the routed rows grouped
    by expert, one gate/up and one down matmul per expert hit."""
    out = _torch.zeros_like(hidden_states)
    experts = self.gate_up_proj.shape[0]
    flat = top_k_index.reshape(-1)
    order = _torch.argsort(flat)
    counts = _torch.bincount(flat, minlength=experts).tolist()
    rows = order // top_k_index.shape[-1]
    weights = top_k_weights.reshape(-1)[order]
    start = 0
    for expert, count in enumerate(counts[:experts]):
        if count == 0:
            continue
        take = slice(start, start + count)
        start += count
        tokens = rows[take]
        gate_up = _F.linear(hidden_states[tokens], self.gate_up_proj[expert])
        y = _F.linear(self._apply_gate(gate_up), self.down_proj[expert])
        out.index_add_(0, tokens, (y * weights[take, None]).to(out.dtype))
    return out


def _experts_forward(self, hidden_states, top_k_index, top_k_weights):
    implementation = getattr(getattr(self, "config", None), "_experts_implementation", None)
    if implementation not in (None, "eager") or _original_path(self, hidden_states, self.gate_up_proj):
        return self._kd_original_class.forward(self, hidden_states, top_k_index, top_k_weights)
    return _experts_eager(self, hidden_states, top_k_index, top_k_weights)


def _original_eager(cls):
    """The eager forward of an experts class (the one transformers' experts
    interface wraps), or None where it cannot be told apart."""
    wrapped = getattr(cls.forward, "__wrapped__", None)
    if wrapped is not None:
        return wrapped
    source = _source(cls.forward)
    if source is not None and "_experts_implementation" not in source and "get_interface" not in source:
        return cls.forward
    return None


def _check_experts_eager(module, eager):
    """None when _experts_eager matches the original eager forward on random routing."""
    weight = module.gate_up_proj
    experts, hidden = weight.shape[0], weight.shape[-1]
    x = _torch.randn(7, hidden, dtype=weight.dtype, device=weight.device)
    k = min(2, experts)
    ids = _torch.stack([_torch.randperm(experts, device=weight.device)[:k] for _ in range(7)])
    w = _torch.rand(7, k, dtype=_torch.float32, device=weight.device)
    err = _rel_l2(_experts_eager(module, x, ids, w), eager(module, x, ids, w))
    if err > _tolerance(weight.dtype):
        return f"its eager forward differs from kdispatch's on random routing (relative L2 error {err:.3g})"
    return None


def _kernelize_experts(model, report, device_ok):
    checked = {}
    for path, module in model.named_modules():
        cls = type(module)
        if "_kd_original_class" in cls.__dict__ or not cls.__name__.endswith("Experts"):
            continue
        if not hasattr(cls, "_apply_gate") or not hasattr(module, "act_fn"):
            report._leave(path, "MoE experts", "no _apply_gate (transformers' experts interface) to replace")
            continue
        weight = getattr(module, "gate_up_proj", None)
        down = getattr(module, "down_proj", None)
        if not isinstance(weight, _torch.Tensor) or not isinstance(down, _torch.Tensor) or weight.dim() != 3 \
                or not device_ok(weight):
            report._leave(path, "MoE experts", "no 3-d gate_up_proj and down_proj on cpu or cuda")
            continue
        if getattr(module, "is_transposed", False) or getattr(module, "has_bias", False):
            report._leave(path, "MoE experts", "transposed or biased expert weights")
            continue
        act = _act_op(module)
        if act is None:
            report._leave(path, "MoE experts", f"activation {type(module.act_fn).__name__} has no kdispatch op")
            continue
        op_name, act_op = act
        key = (cls, weight.dtype)
        if key not in checked:
            with _torch.no_grad():
                reason = _check_gated(act_op, lambda g, m=module: cls._apply_gate(m, g), 37, weight.dtype,
                                      weight.device)
                eager = _original_eager(cls)
                if reason is None and eager is not None:
                    module._kd_act_op = act_op
                    try:
                        eager_reason = _check_experts_eager(module, eager)
                    finally:
                        del module._kd_act_op
                else:
                    eager_reason = "its eager forward is not known"
            checked[key] = (reason, eager_reason)
        reason, eager_reason = checked[key]
        if reason is not None:
            report._leave(path, "MoE experts", reason)
            continue
        module._kd_act_op = act_op
        namespace = {"_apply_gate": _experts_apply_gate}
        forms = "grouped_mm and batched_mm"
        if eager_reason is None:
            namespace["forward"] = _experts_forward
            forms = "grouped_mm, batched_mm and eager"
        else:
            report._leave(path, "MoE experts (eager form)", eager_reason)
        _swap_class(module, "experts", namespace)
        report._replace(path, f"MoE experts ({forms})", op_name)


# ---------------------------------------------------------------------------
# MoE routers


def _router_forward(self, hidden_states):
    h = hidden_states.reshape(-1, self.weight.shape[1])
    if _original_path(self, h, self.weight):
        return self._kd_original_class.forward(self, hidden_states)
    if self._kd_weight_float32 is not None:
        logits = _F.linear(h.float(), self._kd_weight_float32)
    else:
        logits = _F.linear(h, self.weight)
    rows = logits.shape[0]
    weights = _torch.empty(rows, self.top_k, dtype=_torch.float32, device=logits.device)
    ids = _torch.empty(rows, self.top_k, dtype=_torch.int64, device=logits.device)
    _ops.moe_topk_softmax(weights, ids, logits, None, None, self._kd_renormalize, 0.0, None)
    # The first output is what a hook records for output_router_logits: the
    # original's probabilities when one is registered, else the logits (the
    # block does not read it).
    first = _torch.softmax(logits, dim=-1, dtype=_torch.float32) if self._forward_hooks else logits
    return first, weights, ids


def _kernelize_routers(model, report, device_ok):
    checked = {}
    for path, module in model.named_modules():
        cls = type(module)
        if "_kd_original_class" in cls.__dict__ or not cls.__name__.endswith("TopKRouter"):
            continue
        weight = getattr(module, "weight", None)
        top_k = getattr(module, "top_k", None)
        if not isinstance(weight, _torch.Tensor) or weight.dim() != 2 or not isinstance(top_k, int):
            report._leave(path, "MoE router", "no 2-d weight and int top_k")
            continue
        if not device_ok(weight):
            report._leave(path, "MoE router", f"weight on {weight.device}, kdispatch serves cpu and cuda")
            continue
        renormalize = bool(getattr(module, "norm_topk_prob", True))
        key = (cls, weight.dtype, renormalize)
        if key not in checked:
            with _torch.no_grad():
                checked[key] = _check_router(module, renormalize)
        logits_float32, reason = checked[key]
        if reason is not None:
            report._leave(path, "MoE router", reason)
            continue
        module._kd_renormalize = renormalize
        # The router's logits in float32 where the original computes them so
        # (a float32 copy of its weight, made once).
        module.register_buffer("_kd_weight_float32", weight.detach().float() if logits_float32 else None,
                               persistent=False)
        _swap_class(module, "router", {"forward": _router_forward})
        report._replace(path, "MoE router", "moe.topk_softmax" + (" (float32 logits)" if logits_float32 else ""))


def _check_router(router, renormalize):
    """(logits in float32, None) for the first form of the router's logits
    (the activation dtype, then float32) that matches the original on random
    input, or (None, why not)."""
    weight = router.weight
    x = _torch.randn(9, weight.shape[1], dtype=weight.dtype, device=weight.device)
    want = router.forward(x)
    if not (isinstance(want, tuple) and len(want) == 3):
        return None, "its forward does not return (logits, weights, ids)"
    _, want_weights, want_ids = want
    dense_want = _torch.zeros(9, weight.shape[0], dtype=_torch.float64, device=weight.device)
    dense_want.scatter_(1, want_ids.long(), want_weights.double())
    # The weights stay float32 where the original rounds them to its
    # activation dtype (transformers' Qwen3-MoE router does): allowed that
    # rounding's error.
    allowed = {_torch.bfloat16: 4e-3, _torch.float16: 5e-4}.get(want_weights.dtype, 1e-5)
    errors = []
    for logits_float32 in ((False, True) if weight.dtype != _torch.float32 else (False,)):
        router._kd_renormalize = renormalize
        router._kd_weight_float32 = weight.detach().float() if logits_float32 else None
        try:
            _, got_weights, got_ids = _router_forward(router, x)
        finally:
            del router._kd_renormalize, router._kd_weight_float32
        dense_got = _torch.zeros_like(dense_want)
        dense_got.scatter_(1, got_ids, got_weights.double())
        errors.append(_rel_l2(dense_got, dense_want))
        if errors[-1] <= allowed:
            return logits_float32, None
    return None, f"differs from the original on random input (relative L2 error {min(errors):.3g})"


# ---------------------------------------------------------------------------
# Rotary embedding


def _rotary_forward(self, x, position_ids):
    """(position ids, float32 cos/sin cache) in place of (cos, sin): the
    attention modules' apply_rotary_pos_emb, replaced too, rotates with them."""
    if _compiled_in_torch(self):
        return self._kd_original_class.forward(self, x, position_ids)
    return position_ids, self._kd_cos_sin_cache


def _apply_rotary(original):
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if cos.dtype not in (_torch.int64, _torch.int32):
            return original(q, k, cos, sin, *args, **kwargs)
        positions, cache = cos, sin
        unsqueeze_dim = kwargs.get("unsqueeze_dim", args[-1] if args else 1)
        if _needs_grad(q, k) or unsqueeze_dim != 1:
            half = cache[positions]
            c, s = half.chunk(2, dim=-1)
            return original(q, k, _torch.cat((c, c), -1).to(q.dtype), _torch.cat((s, s), -1).to(q.dtype),
                            *args, **kwargs)
        # q, k: [B, H, L, D] views; the op takes [B, L, H, D] with positions [B, L].
        qv = q.transpose(1, 2)
        kv = k.transpose(1, 2)
        if positions.shape != qv.shape[:2] or not positions.is_contiguous():
            # e.g. transformers' [1, L] position ids for a batch of B
            positions = positions.expand(qv.shape[:2]).contiguous()
        _ops.embeddings_rotary_embedding(positions, qv, kv, cache, True)
        return q, k

    apply_rotary_pos_emb._kd_original = original
    return apply_rotary_pos_emb


def _kernelize_rotary(model, report, device_ok):
    rotaries = [(p, m) for p, m in model.named_modules()
                if type(m).__name__.endswith("RotaryEmbedding") and hasattr(m, "inv_freq")]
    attentions = [(p, m) for p, m in model.named_modules()
                  if type(m).__name__.endswith("Attention") and hasattr(m, "q_proj") and hasattr(m, "k_proj")]
    if not rotaries:
        return
    for path, rotary in rotaries:
        if "_kd_original_class" in type(rotary).__dict__:
            continue
        reason = _rotary_refusal(rotary, attentions, device_ok)
        if reason is None:
            with _torch.no_grad():
                reason = _check_rotary(rotary, attentions)
        if reason is not None:
            report._leave(path, "rotary embedding", reason)
            continue
        for module in {_sys.modules[type(a).__module__] for _, a in attentions}:
            if not hasattr(module.apply_rotary_pos_emb, "_kd_original"):
                module.apply_rotary_pos_emb = _apply_rotary(module.apply_rotary_pos_emb)
        _swap_class(rotary, "rotary", {"forward": _rotary_forward})
        report._replace(path, "rotary embedding", "embeddings.rotary_embedding")
        for apath, _ in attentions:
            report._replace(apath, "attention's rotary (q, k in place)", "embeddings.rotary_embedding")


def _rotary_refusal(rotary, attentions, device_ok):
    rope_type = str(getattr(rotary, "rope_type", "default"))
    if any(word in rope_type for word in _DYNAMIC_ROPE):
        return f"rope type '{rope_type}' changes inv_freq with the sequence length"
    if not device_ok(rotary.inv_freq):
        return f"inv_freq on {rotary.inv_freq.device}, kdispatch serves cpu and cuda"
    if not attentions:
        return "no attention module with q_proj and k_proj to rotate in"
    for _, attention in attentions:
        module = _sys.modules.get(type(attention).__module__)
        source = _source(type(attention).forward)
        if module is None or not callable(getattr(module, "apply_rotary_pos_emb", None)) or source is None \
                or "apply_rotary_pos_emb(query_states, key_states, cos, sin)" not in source:
            return (f"{type(attention).__name__}.forward does not call its module's "
                    "apply_rotary_pos_emb(query_states, key_states, cos, sin)")
    return None


def _check_rotary(rotary, attentions):
    inv_freq = rotary.inv_freq
    attention = attentions[0][1]
    head_dim = getattr(attention, "head_dim", None)
    if head_dim is None or 2 * inv_freq.numel() > head_dim:
        return "rotary dim does not fit the attention's head_dim"
    config = getattr(rotary, "config", None)
    max_positions = int(getattr(rotary, "original_max_seq_len", 0) or getattr(config, "max_position_embeddings", 0)
                        or 0)
    if max_positions <= 0:
        return "no max_position_embeddings to size the cos/sin cache"
    cache_bytes = max_positions * 2 * inv_freq.numel() * 4
    if cache_bytes > _MAX_COS_SIN_CACHE_BYTES:
        return (f"its cos/sin cache of {max_positions} positions would take {cache_bytes >> 20} MiB "
                f"(more than {_MAX_COS_SIN_CACHE_BYTES >> 20} MiB)")
    scaling = float(getattr(rotary, "attention_scaling", 1.0))
    cache = _rotary.cos_sin_cache_from_inv_freq(inv_freq, max_positions, attention_scaling=scaling)
    dtype = attention.q_proj.weight.dtype
    device = inv_freq.device
    # [B, H, L, D] views of [B, L, H, D] projections, as the attention makes them.
    q = _torch.randn(2, 3, 5, head_dim, dtype=dtype, device=device).transpose(1, 2)
    k = _torch.randn(2, 3, 2, head_dim, dtype=dtype, device=device).transpose(1, 2)
    position_ids = _torch.randint(0, min(max_positions, 4096), (2, 3), device=device)
    cos, sin = rotary.forward(q, position_ids)
    original = _sys.modules[type(attention).__module__].apply_rotary_pos_emb
    original = getattr(original, "_kd_original", original)
    want_q, want_k = original(q, k, cos, sin)
    got_q, got_k = _apply_rotary(original)(q.clone(), k.clone(), position_ids, cache)
    err = max(_rel_l2(got_q, want_q), _rel_l2(got_k, want_k))
    if err > _tolerance(dtype):
        return f"differs from the original on random input (relative L2 error {err:.3g})"
    rotary._kd_cos_sin_cache = cache
    return None


# ---------------------------------------------------------------------------
# Decoder layers: the residual adds fused with the norms after them


_LAYER_NEEDS = ("residual = hidden_states", "hidden_states = self.input_layernorm(hidden_states)", "self.self_attn(",
                "hidden_states = residual + hidden_states", "hidden_states = self.post_attention_layernorm(hidden_states)",
                "hidden_states = self.mlp(hidden_states)")
_LAYER_REFUSES = ("pre_feedforward_layernorm", "post_feedforward_layernorm", "router_logits", "outputs =")


def _source(function):
    try:
        return _inspect.getsource(function)
    except (OSError, TypeError):
        return None


def _layer_refusal(layer, norms):
    cls = type(layer)
    for name in ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp"):
        if not hasattr(layer, name):
            return f"no {name}"
    for name in ("input_layernorm", "post_attention_layernorm"):
        if getattr(layer, name) not in norms:
            return f"its {name} is not replaced"
    source = _source(cls.forward)
    if source is None:
        return "its forward's source is not available"
    code = [line.strip() for line in source.splitlines()]
    body = "\n".join(code)
    for needed in _LAYER_NEEDS:
        if needed not in body:
            return f"its forward is not the standard pre-norm residual layout (no '{needed}')"
    if body.count("hidden_states = residual + hidden_states") != 2:
        return "its forward is not the standard pre-norm residual layout (not two residual adds)"
    for refused in _LAYER_REFUSES:
        if refused in body:
            return f"its forward is not the standard pre-norm residual layout ('{refused}')"
    last = [line for line in code if line and not line.startswith("#")][-1]
    if last != "return hidden_states":
        return f"its forward ends with '{last}', not 'return hidden_states'"
    return None


def _layer_forward(self, hidden_states, *args, **kwargs):
    pending = isinstance(hidden_states, PendingAdd)
    if args or _original_path(self, *(hidden_states if pending else (hidden_states,)),
                              self.post_attention_layernorm.weight):
        return self._kd_original_class.forward(self, _materialize(hidden_states), *args, **kwargs)
    if pending:
        normed, residual = self.input_layernorm._kd_add_norm(hidden_states.x, hidden_states.residual)
    else:
        residual = hidden_states
        normed = self.input_layernorm(hidden_states)
    attention = self.self_attn(hidden_states=normed, **kwargs)
    attention_out = attention[0] if isinstance(attention, tuple) else attention
    normed, residual = self.post_attention_layernorm._kd_add_norm(attention_out, residual)
    mlp_out = self.mlp(normed)
    if self._kd_hand_on and not self._forward_hooks:
        return PendingAdd(mlp_out, residual)
    return residual + mlp_out


def _kernelize_layers(model, report, norms):
    for path, layers in model.named_modules():
        if not isinstance(layers, _torch.nn.ModuleList) or not path.endswith("layers"):
            continue
        parent = model.get_submodule(path.rsplit(".", 1)[0]) if "." in path else model
        final_norm = getattr(parent, "norm", None)
        # Whether the parent's loop hands each layer's output straight to the
        # next layer and the last one's to its final norm.
        loop_ok = _forwards_to_norm(parent, path.rsplit(".", 1)[-1])
        fused = []
        for i, layer in enumerate(layers):
            if not type(layer).__name__.endswith("DecoderLayer"):
                break
            reason = _layer_refusal(layer, norms)
            if reason is not None:
                report._leave(f"{path}.{i}", "decoder layer residual adds", reason)
                fused.append(False)
            else:
                fused.append(True)
        for i, ok in enumerate(fused):
            if not ok:
                continue
            layer = layers[i]
            # The MLP's add goes on unadded to the next layer's input norm, or
            # to the final norm, where they fuse it.
            if i + 1 < len(fused):
                layer._kd_hand_on = loop_ok and fused[i + 1]
            else:
                layer._kd_hand_on = loop_ok and final_norm is not None and final_norm in norms
            _swap_class(layer, "layer", {"forward": _layer_forward})
            what = "decoder layer residual adds"
            report._replace(f"{path}.{i}", what, "layernorm.fused_add_rmsnorm_out x2" if layer._kd_hand_on
                            else "layernorm.fused_add_rmsnorm_out x1 (the last add is a torch add)")


def _forwards_to_norm(parent, layers_name):
    """Whether the parent's forward passes the last layer's output straight to
    self.norm (the loop over its layers, then 'hidden_states = self.norm(hidden_states)')."""
    source = _source(type(parent).forward)
    if source is None:
        return False
    code = "\n".join(line.strip() for line in source.splitlines())
    loops = [line for line in code.splitlines() if line.startswith("for ") and f"self.{layers_name}" in line]
    loop = code.find(loops[0]) if len(loops) == 1 else -1
    norm = code.find("hidden_states = self.norm(hidden_states)")
    if loop < 0 or norm < loop:
        return False
    between = code[loop:norm]
    assignments = [line for line in between.splitlines()[1:] if line.startswith("hidden_states =")]
    return len(assignments) == 1 and assignments[0].startswith("hidden_states = decoder_layer(")


# ---------------------------------------------------------------------------


def kernelize(model, *, norms=True, residual_adds=True, mlps=True, rotary=True, moe=True, when_compiled="torch"):
    """Swaps kdispatch's ops into `model` (a torch.nn.Module from
    transformers), in place, and returns a Report of what it replaced and
    what it left with the reason. Each of norms, residual_adds, mlps, rotary
    and moe turns one kind off. Calling it again replaces only what is not
    replaced yet.

    when_compiled: what a replaced module runs while torch.compile traces it.
    "torch" (the default): its original forward, whose torch code inductor
    fuses with the code around it, as vLLM runs its custom ops' native forms
    under inductor; "kdispatch": kdispatch's ops, as opaque calls in the
    compiled graph. Each call sets it for every module of the model that
    kernelize has replaced."""
    if not isinstance(model, _torch.nn.Module):
        raise TypeError(f"kernelize: expected a torch.nn.Module, got {type(model).__name__}")
    if when_compiled not in WHEN_COMPILED:
        raise ValueError(f"kernelize: when_compiled={when_compiled!r}; expected one of {', '.join(WHEN_COMPILED)}")
    report = Report(when_compiled)

    def device_ok(t):
        return t.device.type in ("cpu", "cuda")

    done_norms = _kernelize_norms(model, report, device_ok) if norms else set()
    if norms:
        done_norms |= {m for m in model.modules() if type(m).__dict__.get("_kd_role") == "norm"}
    if residual_adds and norms:
        _kernelize_layers(model, report, done_norms)
    if mlps:
        _kernelize_mlps(model, report, device_ok)
        if moe:
            _kernelize_experts(model, report, device_ok)
    if moe:
        _kernelize_routers(model, report, device_ok)
    if rotary:
        _kernelize_rotary(model, report, device_ok)
    for module in model.modules():
        if "_kd_role" in type(module).__dict__:
            module._kd_when_compiled = when_compiled
    return report

