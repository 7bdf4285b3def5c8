"""A decoder-only transformer built only from nemo_rz.ops.

Parameter names follow Hugging Face's Qwen2/Qwen3/Llama layout (`model.layers.0.self_attn.q_proj.weight`...),
so checkpoints load without renaming. One forward serves both sides:
- the learner: `token_logprobs(input_ids)` runs the whole [B, T] batch with autograd;
- the rollout engine: `step(ids, positions, seq_idx, cache)` runs any mix of prefill and decode tokens and
  writes their keys/values into a KV cache.
Both end in the same ops, so for the same weights and tokens they compute the same bits (in consistent mode).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from nemo_rz import ops
from nemo_rz.models.config import DecoderConfig


class Linear(nn.Module):
    def __init__(self, n_in: int, n_out: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_out, n_in, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(n_out, dtype=dtype)) if bias else None
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


@dataclasses.dataclass
class KVCache:
    """Per-layer key and value tensors [num_seqs, num_kv_heads, max_len, head_dim] (max_len a multiple of KV_BLOCK)."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]


@dataclasses.dataclass
class Tokens:
    """A flat batch of query tokens: which sequence each belongs to and at what position."""

    ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    seq_idx: torch.Tensor  # [N]
    cache: KVCache | None = None  # None: a dense [B, T] learner batch that is its own cache
    dense: tuple[int, int] | None = None


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer: int):
        super().__init__()
        dt, h, d = cfg.torch_dtype, cfg.num_heads, cfg.head_dim
        self.layer, self.cfg = layer, cfg
        self.q_proj = Linear(cfg.hidden_size, h * d, cfg.attention_bias, dt)
        self.k_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * d, cfg.attention_bias, dt)
        self.v_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * d, cfg.attention_bias, dt)
        self.o_proj = Linear(h * d, cfg.hidden_size, False, dt)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dt)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dt)

    def forward(self, x: torch.Tensor, t: Tokens) -> torch.Tensor:
        cfg, n = self.cfg, x.shape[0]
        q = self.q_proj(x).view(n, cfg.num_heads, cfg.head_dim)
        k = self.k_proj(x).view(n, cfg.num_kv_heads, cfg.head_dim)
        v = self.v_proj(x).view(n, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = ops.rope(q, t.positions, cfg.rope_theta)
        k = ops.rope(k, t.positions, cfg.rope_theta)
        if t.cache is None:
            b, length = t.dense
            pad = (-length) % ops.KV_BLOCK
            k_all = F.pad(k.view(b, length, -1, cfg.head_dim), (0, 0, 0, 0, 0, pad)).transpose(1, 2)
            v_all = F.pad(v.view(b, length, -1, cfg.head_dim), (0, 0, 0, 0, 0, pad)).transpose(1, 2)
        else:
            k_all, v_all = t.cache.k[self.layer], t.cache.v[self.layer]
            k_all[t.seq_idx, :, t.positions] = k.to(k_all.dtype)
            v_all[t.seq_idx, :, t.positions] = v.to(v_all.dtype)
        out = ops.attention(q, k_all, v_all, t.seq_idx, t.positions, cfg.head_dim ** -0.5, cfg.sliding_window)
        return self.o_proj(out.reshape(n, cfg.num_heads * cfg.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        dt = cfg.torch_dtype
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, False, dt)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, False, dt)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, False, dt)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_proj(x), self.up_proj(x)))


class Block(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.torch_dtype)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.torch_dtype)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, t: Tokens) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), t)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=cfg.torch_dtype)
        nn.init.normal_(self.embed_tokens.weight, std=0.02)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.torch_dtype)


class Decoder(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.config = cfg
        self.model = Body(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, False, cfg.torch_dtype)

    # -- shared core -------------------------------------------------------------------------------
    def hidden(self, t: Tokens) -> torch.Tensor:
        """Final-norm hidden states [N, hidden] of the tokens in t."""
        if t.ids.numel() and (int(t.ids.min()) < 0 or int(t.ids.max()) >= self.config.vocab_size):
            raise ValueError(
                f"token id out of range [0, {self.config.vocab_size}) in the model input: "
                "check the tokenizer matches the model's vocab_size"
            )
        x = ops.embedding(t.ids, self.model.embed_tokens.weight)
        for block in self.model.layers:
            x = block(x, t)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return ops.linear(hidden, weight)

    # -- learner path ------------------------------------------------------------------------------
    def _dense(self, input_ids: torch.Tensor) -> Tokens:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, time], got shape {tuple(input_ids.shape)}")
        b, length = input_ids.shape
        dev = input_ids.device
        positions = torch.arange(length, device=dev).repeat(b)
        seq_idx = torch.arange(b, device=dev).repeat_interleave(length)
        return Tokens(input_ids.reshape(-1), positions, seq_idx, None, (b, length))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, V] for a dense batch."""
        b, length = input_ids.shape
        return self.logits(self.hidden(self._dense(input_ids))).view(b, length, -1)

    def token_logprobs(self, input_ids: torch.Tensor, lengths: torch.Tensor | None = None, temperature: float = 1.0) -> torch.Tensor:
        """float32 [B, T-1]: log p(input_ids[:, t+1] | input_ids[:, :t+1]) at `temperature`; 0 past each length."""
        b, length = input_ids.shape
        hid = self.hidden(self._dense(input_ids)).view(b, length, -1)[:, :-1]
        targets = input_ids[:, 1:].reshape(-1)
        lp = ops.token_logprobs(self.logits(hid.reshape(b * (length - 1), -1)), targets, temperature).view(b, length - 1)
        if lengths is not None:
            valid = torch.arange(length - 1, device=input_ids.device)[None, :] < (lengths.to(input_ids.device)[:, None] - 1)
            lp = torch.where(valid, lp, torch.zeros((), dtype=lp.dtype, device=lp.device))
        return lp

    # -- rollout path ------------------------------------------------------------------------------
    def new_cache(self, num_seqs: int, max_len: int, device=None) -> KVCache:
        cfg = self.config
        max_len += (-max_len) % ops.KV_BLOCK
        shape = (num_seqs, cfg.num_kv_heads, max_len, cfg.head_dim)
        dev = device or self.model.embed_tokens.weight.device
        make = lambda: [torch.zeros(shape, dtype=cfg.torch_dtype, device=dev) for _ in range(cfg.num_layers)]
        return KVCache(make(), make())

    def step(self, ids: torch.Tensor, positions: torch.Tensor, seq_idx: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Run query tokens of any mix of sequences against (and into) `cache`; returns hidden [N, hidden]."""
        return self.hidden(Tokens(ids, positions, seq_idx, cache))
