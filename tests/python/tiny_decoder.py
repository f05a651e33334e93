"""A tiny decoder-only model laid out as Hugging Face transformers' Llama,
Gemma and Qwen3-MoE models are (class names, attributes, the pre-norm
residual layer, the model-level rotary module, the module-level
apply_rotary_pos_emb, the MoE router and experts interface), written for
the tests of kdispatch.integrations.transformers where transformers is not
installed. Plain torch, float math as the originals do it.
"""
import math

import torch
from torch import nn
import torch.nn.functional as F


class Config:
    def __init__(self, **kw):
        self.vocab_size = 97
        self.hidden_size = 64
        self.intermediate_size = 96
        self.num_attention_heads = 4
        self.num_key_value_heads = 2
        self.head_dim = 16
        self.num_hidden_layers = 3
        self.rms_norm_eps = 1e-6
        self.rope_theta = 10000.0
        self.max_position_embeddings = 256
        self.hidden_act = "silu"
        self.num_experts = 0
        self.num_experts_per_tok = 2
        self.moe_intermediate_size = 32
        self.norm_topk_prob = True
        self._experts_implementation = "grouped_mm"
        self.router_logits_float32 = False
        self.__dict__.update(kw)


class SiLUActivation(nn.Module):
    def forward(self, x):
        return F.silu(x)


class GELUTanh(nn.Module):
    def forward(self, x):
        return F.gelu(x, approximate="tanh")


ACTIVATIONS = {"silu": SiLUActivation, "gelu_pytorch_tanh": GELUTanh}


class LlamaRMSNorm(nn.Module):
    def __init__(self, size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        dtype = hidden_states.dtype
        h = hidden_states.float()
        h = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)


class GemmaRMSNorm(nn.Module):
    def __init__(self, size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, config, scaling=1.0):
        super().__init__()
        self.rope_type = "default"
        self.config = config
        self.original_max_seq_len = config.max_position_embeddings
        dim = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_scaling = scaling

    @torch.no_grad()
    def forward(self, x, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return ((emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype))


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)
        self.act_fn = ACTIVATIONS[config.hidden_act]()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LlamaAttention(nn.Module):
    def __init__(self, config, norm_heads=False):
        super().__init__()
        self.head_dim = config.head_dim
        self.groups = config.num_attention_heads // config.num_key_value_heads
        h = config.hidden_size
        self.q_proj = nn.Linear(h, config.num_attention_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, config.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, config.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, h, bias=False)
        self.q_norm = LlamaRMSNorm(self.head_dim, config.rms_norm_eps) if norm_heads else nn.Identity()
        self.k_norm = LlamaRMSNorm(self.head_dim, config.rms_norm_eps) if norm_heads else nn.Identity()

    def forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query_states = self.q_norm(self.q_proj(hidden_states).view(shape)).transpose(1, 2)
        key_states = self.k_norm(self.k_proj(hidden_states).view(shape)).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        key_states = key_states.repeat_interleave(self.groups, dim=1)
        value_states = value_states.repeat_interleave(self.groups, dim=1)
        scores = query_states @ key_states.transpose(-1, -2) / math.sqrt(self.head_dim)
        length = scores.shape[-1]
        causal = torch.ones(length, length, dtype=torch.bool, device=scores.device).tril()
        scores = scores.float().masked_fill(~causal, float("-inf"))
        out = scores.softmax(-1).to(value_states.dtype) @ value_states
        out = out.transpose(1, 2).reshape(*hidden_states.shape[:-1], -1)
        return self.o_proj(out), None


class Qwen3MoeTopKRouter(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.weight = nn.Parameter(torch.randn(config.num_experts, config.hidden_size) * 0.2)

    def forward(self, hidden_states):
        logits = F.linear(hidden_states.reshape(-1, self.weight.shape[1]), self.weight)
        probs = logits.softmax(-1, dtype=torch.float)
        values, ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            values = values / values.sum(-1, keepdim=True)
        return probs, values.to(logits.dtype), ids


class FloatLogitsTopKRouter(Qwen3MoeTopKRouter):
    """A router computing its logits in float32."""

    def forward(self, hidden_states):
        h = hidden_states.reshape(-1, self.weight.shape[1])
        probs = F.linear(h.float(), self.weight.float()).softmax(-1)
        values, ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            values = values / values.sum(-1, keepdim=True)
        return probs, values, ids


def _eager_experts(self, hidden_states, ids, weights):
    """The eager form: the activation computed inline."""
    out = torch.zeros_like(hidden_states)
    for slot in range(ids.shape[1]):
        for row in range(ids.shape[0]):
            e = int(ids[row, slot])
            gate, up = F.linear(hidden_states[row:row + 1], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(self.act_fn(gate) * up, self.down_proj[e])
            out[row:row + 1] += (y * weights[row, slot]).to(out.dtype)
    return out


def _gated_experts(self, hidden_states, ids, weights):
    """The other forms (transformers' grouped_mm and batched_mm): the gate through _apply_gate."""
    out = torch.zeros_like(hidden_states)
    for slot in range(ids.shape[1]):
        for row in range(ids.shape[0]):
            e = int(ids[row, slot])
            gate_up = F.linear(hidden_states[row:row + 1], self.gate_up_proj[e])
            y = F.linear(self._apply_gate(gate_up), self.down_proj[e])
            out[row:row + 1] += (y * weights[row, slot]).to(out.dtype)
    return out


class Qwen3MoeExperts(nn.Module):
    """Experts behind transformers' experts interface: forward picks the form
    config._experts_implementation names; forward.__wrapped__ is the eager one."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.randn(e, 2 * i, h) * h ** -0.5)
        self.down_proj = nn.Parameter(torch.randn(e, h, i) * i ** -0.5)
        self.act_fn = ACTIVATIONS[config.hidden_act]()

    def _apply_gate(self, gate_up_out):
        gate, up = gate_up_out.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    def forward(self, hidden_states, ids, weights):
        form = _eager_experts if self.config._experts_implementation == "eager" else _gated_experts
        return form(self, hidden_states, ids, weights)

    forward.__wrapped__ = _eager_experts


class Qwen3MoeSparseMoeBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate = (FloatLogitsTopKRouter if config.router_logits_float32 else Qwen3MoeTopKRouter)(config)
        self.experts = Qwen3MoeExperts(config)

    def forward(self, hidden_states):
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        _, weights, ids = self.gate(flat)
        return self.experts(flat, ids, weights).reshape(hidden_states.shape)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, norm=LlamaRMSNorm, moe=False, norm_heads=False):
        super().__init__()
        self.self_attn = LlamaAttention(config, norm_heads)
        self.mlp = Qwen3MoeSparseMoeBlock(config) if moe else LlamaMLP(config)
        self.input_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = norm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, position_embeddings=None, **kwargs):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask,
                                          position_ids=position_ids, position_embeddings=position_embeddings,
                                          **kwargs)
        hidden_states = residual + hidden_states

        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states


class SandwichDecoderLayer(LlamaDecoderLayer):
    """A layer with a norm after the MLP too (Gemma 2's layout): not the
    standard pre-norm layout."""

    def __init__(self, config):
        super().__init__(config)
        self.post_feedforward_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, position_embeddings=None, **kwargs):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, position_embeddings=position_embeddings)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = self.post_feedforward_layernorm(hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states


class LlamaModel(nn.Module):
    def __init__(self, config, layer=LlamaDecoderLayer, norm=LlamaRMSNorm, **layer_kw):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [layer(config, **layer_kw) if layer is not LlamaDecoderLayer else layer(config, norm=norm, **layer_kw)
             for _ in range(config.num_hidden_layers)])
        self.norm = norm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config)

    def forward(self, input_ids, position_ids=None):
        hidden_states = self.embed_tokens(input_ids)
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None].expand_as(input_ids)
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        for i, decoder_layer in enumerate(self.layers[: self.config.num_hidden_layers]):
            hidden_states = decoder_layer(
                hidden_states,
                position_ids=position_ids,
                position_embeddings=position_embeddings,
            )
        hidden_states = self.norm(hidden_states)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    def __init__(self, config, **model_kw):
        super().__init__()
        self.model = LlamaModel(config, **model_kw)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, position_ids=None):
        return self.lm_head(self.model(input_ids, position_ids))


def randomize(model, seed=0, norm_center=1.0):
    """Every parameter random, norm weights around `norm_center` (1 for
    x * weight, 0 for Gemma's x * (1 + weight))."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.dim() == 1:
                p.copy_(norm_center + 0.1 * noise)
            else:
                p.copy_(noise * p.shape[-1] ** -0.5)
    return model
