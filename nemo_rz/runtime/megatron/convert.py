"""Weights between nemo-rz / Hugging Face names and Megatron's, both ways, and across tensor-parallel ranks.

Megatron fuses q, k and v into one `linear_qkv` weight laid out by query group (for each kv head g: the query
heads of g, then k_g, then v_g), and gate and up into `linear_fc1` ([gate; up]). Under tensor parallelism a
rank holds whole query groups of linear_qkv, and its own rows of gate followed by its own rows of up.
Conversion only moves and concatenates tensors: the bits never change.
"""
from __future__ import annotations

import torch

from nemo_rz.models.config import DecoderConfig


def _qkv_groups(cfg: DecoderConfig) -> tuple[int, int]:
    return cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads * cfg.head_dim


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: DecoderConfig) -> torch.Tensor:
    groups, q_rows = _qkv_groups(cfg)
    d = cfg.head_dim
    parts = (q.reshape(groups, q_rows, *q.shape[1:]), k.reshape(groups, d, *k.shape[1:]), v.reshape(groups, d, *v.shape[1:]))
    return torch.cat(parts, dim=1).reshape(-1, *q.shape[1:])


def split_qkv(qkv: torch.Tensor, cfg: DecoderConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, q_rows = _qkv_groups(cfg)
    d = cfg.head_dim
    q, k, v = qkv.reshape(groups, q_rows + 2 * d, *qkv.shape[1:]).split([q_rows, d, d], dim=1)
    return (q.reshape(-1, *qkv.shape[1:]), k.reshape(-1, *qkv.shape[1:]), v.reshape(-1, *qkv.shape[1:]))


def _one(parts):
    return parts[0]


def _rules(cfg: DecoderConfig):
    """(Megatron name, its Hugging Face names, join them into it, split it into them) for every weight."""
    same = (_one, lambda t: [t])
    qkv = (lambda parts: fuse_qkv(*parts, cfg), lambda t: split_qkv(t, cfg))
    gate_up = (torch.cat, lambda t: t.chunk(2))
    yield "embedding.word_embeddings.weight", ["model.embed_tokens.weight"], *same
    yield "decoder.final_layernorm.weight", ["model.norm.weight"], *same
    if not cfg.tie_word_embeddings:
        yield "output_layer.weight", ["lm_head.weight"], *same
    for i in range(cfg.num_layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        yield m + "input_layernorm.weight", [h + "input_layernorm.weight"], *same
        yield m + "pre_mlp_layernorm.weight", [h + "post_attention_layernorm.weight"], *same
        if cfg.qk_norm:
            yield m + "self_attention.q_layernorm.weight", [h + "self_attn.q_norm.weight"], *same
            yield m + "self_attention.k_layernorm.weight", [h + "self_attn.k_norm.weight"], *same
        for kind in ("weight", "bias") if cfg.attention_bias else ("weight",):
            yield m + f"self_attention.linear_qkv.{kind}", [h + f"self_attn.{p}_proj.{kind}" for p in "qkv"], *qkv
        yield m + "self_attention.linear_proj.weight", [h + "self_attn.o_proj.weight"], *same
        yield m + "mlp.linear_fc1.weight", [h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"], *gate_up
        yield m + "mlp.linear_fc2.weight", [h + "mlp.down_proj.weight"], *same


def to_megatron(hf: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    """Hugging Face-named weights (the built-in Decoder's state_dict) -> Megatron GPTModel names, whole tensors."""
    return {m: join([hf[n] for n in names]) for m, names, join, _ in _rules(cfg)}


def to_hf(meg: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    """Megatron names, whole tensors -> Hugging Face names (what the rollout engines load)."""
    return {n: t for m, names, _, split in _rules(cfg) for n, t in zip(names, split(meg[m]))}


def _is_gated(name: str) -> bool:
    return name.endswith("linear_fc1.weight") or name.endswith("linear_fc1.bias")


def shard(name: str, full: torch.Tensor, param: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's part of a whole Megatron tensor, as `param` (a model parameter) is split."""
    if world == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    dim = param.partition_dim
    if _is_gated(name):  # [gate; up]: this rank's gate rows, then its up rows
        return torch.cat([half.chunk(world, dim)[rank] for half in full.chunk(2, 0)], dim=0)
    return full.chunk(world, dim)[rank]


def unshard(name: str, parts: list[torch.Tensor], param: torch.Tensor) -> torch.Tensor:
    """The whole tensor from every rank's part (rank order), the inverse of `shard`."""
    if len(parts) == 1 or not getattr(param, "tensor_model_parallel", False):
        return parts[0]
    dim = param.partition_dim
    if _is_gated(name):
        halves = [p.chunk(2, 0) for p in parts]
        return torch.cat([torch.cat([h[0] for h in halves], dim), torch.cat([h[1] for h in halves], dim)], dim=0)
    return torch.cat(parts, dim)
