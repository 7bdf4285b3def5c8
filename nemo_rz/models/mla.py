"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2), in one formulation: weight-absorbed, everywhere.

Each token's keys and values are one latent row: c_kv = norm(kv_a(x))[:kv_lora_rank] and the decoupled RoPE key
k_pe (head_dim wide, shared by all heads). Head h's key would be [W_UK[h] c_kv, k_pe] and its value W_UV[h] c_kv
(kv_b_proj's rows). Absorbed, the query moves into the latent instead: q_h = [W_UK[h]^T q_nope_h, q_pe_h], so

    score(h, p) = q_h . [c_kv(p), k_pe(p)]        out_h = W_UV[h] (sum_p softmax_p c_kv(p))

is one multi-query attention (ops.attention, one key head of kv_lora_rank + head_dim) over the latent rows, whose
values are the same rows (their first kv_lora_rank columns are kept). Why absorbed, not the per-head keys
expanded from the latent: the cache holds only the latent (kv_lora_rank + head_dim per token per layer instead
of heads * (qk_nope_head_dim + head_dim + v_head_dim)), and attention reads it as it is, so decode, prefill,
chunked prefill and a prefix-cache continuation run the same arithmetic on the same cached bits (an expanded
formulation would recompute every cached key each step, or cache per-head keys). The learner runs the same
forward, so its logprobs are the rollout's. The per-head products W_UK[h]^T q and W_UV[h] o are ops.expert_linear
with the head as the expert (row-invariant, float32).

Parameter names are transformers' (`self_attn.q_a_proj`, `q_a_layernorm`, `q_b_proj` or `q_proj`,
`kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`). Interleaved RoPE (rope_interleave: adjacent
dimension pairs rotate together) is the rotate-half RoPE of ops.rope on the dimensions taken evens first, then
odds: a reordering of q_pe and k_pe alike, which leaves every score as transformers computes it.
"""
from __future__ import annotations

import torch
from torch import nn

from nemo_rz import ops
from nemo_rz.models.config import DecoderConfig
from nemo_rz.models.layers import _NORMS, Linear, attend_rotated, rotated
from nemo_rz.ops.weight_cache import derived

LATENT_NORM_EPS = 1e-6  # transformers' q_a_layernorm / kv_a_layernorm ignore rms_norm_eps


def latent_dim(cfg: DecoderConfig) -> int:
    """The width of a cached latent row: kv_lora_rank + the RoPE key's head_dim."""
    return cfg.kv_lora_rank + cfg.head_dim


def cache_elements_per_token(cfg: DecoderConfig) -> tuple[int, int]:
    """(latent cache, per-head cache) elements per token per layer: what the latent saves."""
    return latent_dim(cfg), cfg.num_heads * (cfg.qk_nope_head_dim + cfg.head_dim + cfg.v_head_dim)


class LatentAttention(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer: int):
        super().__init__()
        dt, h, bias = cfg.torch_dtype, cfg.num_heads, cfg.attention_bias
        self.layer, self.cfg = layer, cfg
        qk = cfg.qk_nope_head_dim + cfg.head_dim
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(cfg.hidden_size, h * qk, False, dt)
        else:
            self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank, bias, dt)
            self.q_a_layernorm = _NORMS[cfg.norm](cfg.q_lora_rank, LATENT_NORM_EPS, dt)
            self.q_b_proj = Linear(cfg.q_lora_rank, h * qk, False, dt)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, latent_dim(cfg), bias, dt)
        self.kv_a_layernorm = _NORMS[cfg.norm](cfg.kv_lora_rank, LATENT_NORM_EPS, dt)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), False, dt)
        self.o_proj = Linear(h * cfg.v_head_dim, cfg.hidden_size, bias, dt)

    # -- the absorbed per-head weights, [heads, in, out] for ops.expert_linear --------------------------------
    def _kv_b(self) -> torch.Tensor:
        """kv_b_proj's weight as the absorbed products use it: under a precision recipe (kv_b_proj a
        quant.linear.QuantizedLinear) Q(W)'s dequantized float32 values, gradient straight through to the master
        weight: dequantize, then absorb (the split is exact, so W_UK and W_UV are the quantized weight's own
        values, and each is made once per weight version, as the quantized weight is); else the weight."""
        values = getattr(self.kv_b_proj, "weight_values", None)
        return self.kv_b_proj.weight if values is None else values()

    def _split(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        w = weight.view(cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        return w[:, : cfg.qk_nope_head_dim], w[:, cfg.qk_nope_head_dim :]

    def absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, qk_nope, kv_lora], W_UV^T [H, kv_lora, v_head_dim]), contiguous: kv_b_proj's (`_kv_b`).
        Without autograd kept on kv_b_proj's weight until it changes (ops.weight_cache). A quantized kv_b_proj's
        are float32 (the dequantized values), and the per-head products then run in float32 on the model-dtype
        queries and outputs cast up (their inputs are not quantized: in the absorbed form kv_b_proj's own input,
        the latent, never meets it as a product operand)."""
        weight = self.kv_b_proj.weight
        if torch.is_grad_enabled() and weight.requires_grad:
            uk, uv = self._split(self._kv_b())
            return uk.contiguous(), uv.transpose(1, 2).contiguous()
        recipe = getattr(getattr(self.kv_b_proj, "precision", None), "recipe", None)
        return (derived(weight, "mla.uk", lambda: self._split(self._kv_b())[0].detach().contiguous(), recipe),
                derived(weight, "mla.uv", lambda: self._split(self._kv_b())[1].detach().transpose(1, 2).contiguous(),
                        recipe))

    def _rope(self, x: torch.Tensor, t) -> torch.Tensor:
        if self.cfg.rope_interleave:
            x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
        return rotated(self.cfg, self.layer, x, t)

    def forward(self, x: torch.Tensor, t) -> torch.Tensor:
        cfg, n, h = self.cfg, x.shape[0], self.cfg.num_heads
        nope, lora = cfg.qk_nope_head_dim, cfg.kv_lora_rank
        q = self.q_proj(x) if cfg.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(n, h, nope + cfg.head_dim)
        kv = self.kv_a_proj_with_mqa(x)
        c_kv = self.kv_a_layernorm(kv[:, :lora])
        k_pe = self._rope(kv[:, lora:].reshape(n, 1, cfg.head_dim), t)
        q_pe = self._rope(q[..., nope:], t)
        uk, uv = self.absorbed()
        heads = torch.arange(h, device=x.device).repeat(n)
        q_lat = ops.expert_linear(q[..., :nope].reshape(n * h, nope).to(uk.dtype), heads, uk).to(q.dtype).view(n, h, lora)
        latent = torch.cat([c_kv.unsqueeze(1), k_pe.to(c_kv.dtype)], dim=-1)  # [N, 1, kv_lora + head_dim]
        out = attend_rotated(cfg, self.layer, torch.cat([q_lat, q_pe.to(q_lat.dtype)], dim=-1), latent, latent, t)
        o = ops.expert_linear(out[..., :lora].reshape(n * h, lora).to(uv.dtype), heads, uv).to(out.dtype)
        return self.o_proj(o.reshape(n, h * cfg.v_head_dim))
