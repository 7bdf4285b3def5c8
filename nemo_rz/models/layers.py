"""The decoder's building blocks, all computed by nemo_rz.ops: linear layers, norms, attention, the dense MLP,
and the two layer shapes (pre-norm, as Qwen/Llama/Mistral/gpt-oss; sandwich, as Gemma). `block(cfg, i)` picks
what layer i is made of: its attention window and RoPE, and a dense MLP or a mixture of experts (models/moe.py).

Parameter names are the Hugging Face ones (`self_attn.q_proj.weight`, `mlp.gate_proj.weight`, ...).

A linear weight is the usual [N, K] parameter (names, state dicts, autograd, checkpoints and Hugging Face export
see nothing else) over contiguous [K, N] storage: `weight.t()` is the GEMM operand ops/gemm.py wants, so the
weight is held once, not once more as a copy. In-place writes (`copy_`, optimizer steps) keep the layout.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from nemo_rz import ops
from nemo_rz.models.config import DecoderConfig


def forward_layout(n_out: int, n_in: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized [n_out, n_in] tensor over contiguous [n_in, n_out] storage (the Linear weight layout)."""
    return torch.empty(n_in, n_out, dtype=dtype).t()


def laid_out_like(t: torch.Tensor, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An owned `dtype` copy of t with the strides of `like` (a parameter, possibly on the meta device), for
    load_state_dict(assign=True) to keep the parameter's layout; 64-byte aligned, as the CPU allocator gives."""
    if tuple(t.shape) != tuple(like.shape):
        raise ValueError(f"laid_out_like: tensor of shape {list(t.shape)} for a parameter of shape {list(like.shape)}")
    return torch.empty_strided(like.shape, like.stride(), dtype=dtype, device=t.device).copy_(t)


class Linear(nn.Module):
    def __init__(self, n_in: int, n_out: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(forward_layout(n_out, n_in, dtype))
        self.bias = nn.Parameter(torch.zeros(n_out, dtype=dtype)) if bias else None
        with torch.no_grad():  # drawn in [N, K] order, so a seed gives the values it gave a contiguous weight
            self.weight.copy_(nn.init.normal_(torch.empty(n_out, n_in, dtype=dtype), std=0.02))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """weight * x / rms(x), the weight applied in the model dtype (Qwen, Llama, Mistral)."""

    init = 1.0

    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.full((size,), self.init, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class RMSNormF32(RMSNorm):
    """The weight applied in float32, then cast (gpt-oss)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return ops.rms_norm(x, self.weight.float(), self.eps)
        return ops.rms_norm(x.float(), self.weight.float(), self.eps).to(x.dtype)


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + weight), all in float32, then cast (Gemma; the weight starts at 0)."""

    init = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = ops.rms_norm(x.float(), 1.0 + self.weight.float(), self.eps)
        return y if y.dtype == x.dtype else y.to(x.dtype)


_NORMS = {"rms": RMSNorm, "rms_f32": RMSNormF32, "gemma": GemmaRMSNorm}


def norm(cfg: DecoderConfig, size: int | None = None) -> RMSNorm:
    return _NORMS[cfg.norm](size or cfg.hidden_size, cfg.rms_norm_eps, cfg.torch_dtype)


class Attention(nn.Module):
    """GQA attention of one layer: full or sliding-window (cfg.window(layer)), with optional q/k norms and
    learned sinks; its keys/values go to the layer's KV cache (or, for a learner batch, stay in the batch)."""

    def __init__(self, cfg: DecoderConfig, layer: int):
        super().__init__()
        dt, h, d = cfg.torch_dtype, cfg.num_heads, cfg.head_dim
        self.layer, self.cfg = layer, cfg
        self.q_proj = Linear(cfg.hidden_size, h * d, cfg.attention_bias, dt)
        self.k_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * d, cfg.attention_bias, dt)
        self.v_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * d, cfg.attention_bias, dt)
        self.o_proj = Linear(h * d, cfg.hidden_size, cfg.o_proj_bias, dt)
        if cfg.qk_norm:
            self.q_norm = norm(cfg, d)
            self.k_norm = norm(cfg, d)
        if cfg.attention_sinks:
            self.sinks = nn.Parameter(torch.zeros(h, dtype=dt))

    def forward(self, x: torch.Tensor, t) -> torch.Tensor:
        cfg, n = self.cfg, x.shape[0]
        q = self.q_proj(x).view(n, cfg.num_heads, cfg.head_dim)
        k = self.k_proj(x).view(n, cfg.num_kv_heads, cfg.head_dim)
        v = self.v_proj(x).view(n, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        out = attend(cfg, self.layer, q, k, v, t, self.sinks if cfg.attention_sinks else None)
        return self.o_proj(out.reshape(n, cfg.num_heads * cfg.head_dim))


def attend(cfg: DecoderConfig, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, t,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Layer `layer`'s RoPE and attention of the tokens `t` (a prepared decoder.Tokens): q [N, H, D], k and v
    [N, Hkv, D] -> [N, H, D]. H may be a slice of the model's heads (a tensor-parallel rank's; `sinks` then the
    same slice): the arithmetic of a head does not depend on the others. The one attention both the built-in
    Decoder and the Megatron learner's layer spec run."""
    return attend_rotated(cfg, layer, rotated(cfg, layer, q, t), rotated(cfg, layer, k, t), v, t, sinks)


def rotated(cfg: DecoderConfig, layer: int, x: torch.Tensor, t) -> torch.Tensor:
    """x [N, heads, D] rotated by layer `layer`'s RoPE at the positions of `t` (x itself without RoPE: use_rope)."""
    if not cfg.use_rope:
        return x
    rope = cfg.rope(layer)
    return ops.rope(x, t.positions, rope[0], t.ropes[rope])


def attend_rotated(cfg: DecoderConfig, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, t,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
    """`attend` after RoPE: q [N, H, D], k [N, Hkv, D] already rotated, v [N, Hkv, D] (for multi-head latent
    attention, models/mla.py, k and v are one latent tensor) -> [N, H, D]; the keys/values go to the cache."""
    window = cfg.window(layer)
    if t.attend is not None:  # attention computed elsewhere: over context-parallel ranks (parallel/context.py)
        return t.attend(q, k, v, cfg.attention_scale)
    if t.cache is None:
        b, length = t.dense
        pad = (-length) % ops.KV_BLOCK
        k_all = F.pad(k.view(b, length, -1, k.shape[-1]), (0, 0, 0, 0, 0, pad)).transpose(1, 2)
        v_all = k_all if v is k else F.pad(v.view(b, length, -1, v.shape[-1]), (0, 0, 0, 0, 0, pad)).transpose(1, 2)
        table = None
    else:
        t.cache.write(layer, k, v, t)
        k_all, v_all, table = t.cache.view(layer)
    return ops.attention(q, k_all, v_all, t.seq_idx, t.positions, cfg.attention_scale, window,
                         block_table=table, plan=t.plan, sinks=sinks)


def gated(act: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """act(gate) * up for the configured activation."""
    if act == "gelu_tanh":
        return ops.gelu_tanh_and_mul(gate, up)
    return ops.silu_and_mul(gate, up)


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x))."""

    def __init__(self, cfg: DecoderConfig, intermediate_size: int | None = None):
        super().__init__()
        dt, size = cfg.torch_dtype, intermediate_size or cfg.intermediate_size
        self.act = cfg.hidden_act
        self.gate_proj = Linear(cfg.hidden_size, size, False, dt)
        self.up_proj = Linear(cfg.hidden_size, size, False, dt)
        self.down_proj = Linear(size, cfg.hidden_size, False, dt)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated(self.act, self.gate_proj(x), self.up_proj(x)))


def mlp(cfg: DecoderConfig, layer: int) -> nn.Module:
    """Layer `layer`'s MLP: a mixture of experts where the config puts one, else dense."""
    if not cfg.is_moe(layer):
        return MLP(cfg)
    from nemo_rz.models import moe

    return moe.KINDS[cfg.moe_kind](cfg)


def attention(cfg: DecoderConfig, layer: int) -> nn.Module:
    """Layer `layer`'s attention: GQA, multi-head latent attention (models/mla.py), or a hybrid model's layers
    (models/linear_attention.py: Gated DeltaNet or Kimi Delta Attention by linear_kind, the output-gated full
    attention)."""
    if cfg.is_linear(layer) or cfg.attention_output_gate:
        from nemo_rz.models.linear_attention import LINEAR_LAYERS, GatedAttention

        return LINEAR_LAYERS[cfg.linear_kind](cfg, layer) if cfg.is_linear(layer) else GatedAttention(cfg, layer)
    if cfg.attention_kind == "mla":
        from nemo_rz.models.mla import LatentAttention

        return LatentAttention(cfg, layer)
    return Attention(cfg, layer)


class Block(nn.Module):
    """Pre-norm layer: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: DecoderConfig, layer: int):
        super().__init__()
        self.input_layernorm = norm(cfg)
        mixer = attention(cfg, layer)
        self.mixer = getattr(mixer, "hf_name", "self_attn")  # transformers' name ("linear_attn": Gated DeltaNet)
        self.add_module(self.mixer, mixer)
        self.post_attention_layernorm = norm(cfg)
        self.mlp = mlp(cfg, layer)

    def forward(self, x: torch.Tensor, t) -> torch.Tensor:
        x = x + getattr(self, self.mixer)(self.input_layernorm(x), t)
        return x + self.mlp(self.post_attention_layernorm(x))


class SandwichBlock(nn.Module):
    """Gemma's layer: x + norm(attn(norm(x))), then x + norm(mlp(norm(x)))."""

    def __init__(self, cfg: DecoderConfig, layer: int):
        super().__init__()
        self.input_layernorm = norm(cfg)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = norm(cfg)
        self.pre_feedforward_layernorm = norm(cfg)
        self.mlp = mlp(cfg, layer)
        self.post_feedforward_layernorm = norm(cfg)

    def forward(self, x: torch.Tensor, t) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), t))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


def block(cfg: DecoderConfig, layer: int) -> nn.Module:
    if cfg.attention_kind == "deepseek_v4":  # hyper-connected streams, its own attention and MoE
        from nemo_rz.models.deepseek_v4 import DeepseekV4Block

        return DeepseekV4Block(cfg, layer)
    return SandwichBlock(cfg, layer) if cfg.sandwich_norm else Block(cfg, layer)


def embed_scale(cfg: DecoderConfig) -> torch.Tensor:
    """The embedding multiplier of cfg.embed_scale: sqrt(hidden_size) rounded to float32, then to the model
    dtype (as transformers does for Gemma)."""
    return torch.tensor(math.sqrt(cfg.hidden_size), dtype=torch.float32).to(cfg.torch_dtype)
