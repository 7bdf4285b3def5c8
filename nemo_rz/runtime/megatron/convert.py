"""Weights between nemo-rz / Hugging Face names and Megatron's, both ways, and across tensor-parallel ranks.

Megatron fuses q, k and v into one `linear_qkv` weight laid out by query group (for each kv head g: the query
heads of g, then k_g, then v_g), and gate and up into `linear_fc1` ([gate; up]). Under tensor parallelism a
rank holds whole query groups of linear_qkv, and its own rows of gate followed by its own rows of up.
Conversion only moves and concatenates tensors: the bits never change.
"""
from __future__ import annotations

import torch

from nemo_rz.models.config import DecoderConfig

_RENAMED = {"input_layernorm.weight": "input_layernorm.weight",
                "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
                "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
                "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
                "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
                "mlp.down_proj.weight": "mlp.linear_fc2.weight"}


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


def to_megatron(hf: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    """Hugging Face-named weights (the built-in Decoder's state_dict) -> Megatron GPTModel names, whole tensors."""
    out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": hf["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["output_layer.weight"] = hf["lm_head.weight"]
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        for name, mname in _RENAMED.items():
            if src + name in hf:
                out[dst + mname] = hf[src + name]
        a = src + "self_attn."
        out[dst + "self_attention.linear_qkv.weight"] = fuse_qkv(hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"], cfg)
        if cfg.attention_bias:
            out[dst + "self_attention.linear_qkv.bias"] = fuse_qkv(hf[a + "q_proj.bias"], hf[a + "k_proj.bias"], hf[a + "v_proj.bias"], cfg)
        out[dst + "mlp.linear_fc1.weight"] = torch.cat([hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"]])
    return out


def to_hf(meg: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    """Megatron names, whole tensors -> Hugging Face names (what the rollout engines load)."""
    out = {"model.embed_tokens.weight": meg["embedding.word_embeddings.weight"],
           "model.norm.weight": meg["decoder.final_layernorm.weight"]}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = meg["output_layer.weight"]
    for i in range(cfg.num_layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        for name, mname in _RENAMED.items():
            if src + mname in meg:
                out[dst + name] = meg[src + mname]
        a = dst + "self_attn."
        for part, t in zip("qkv", split_qkv(meg[src + "self_attention.linear_qkv.weight"], cfg)):
            out[a + f"{part}_proj.weight"] = t
        if cfg.attention_bias:
            for part, t in zip("qkv", split_qkv(meg[src + "self_attention.linear_qkv.bias"], cfg)):
                out[a + f"{part}_proj.bias"] = t
        gate, up = meg[src + "mlp.linear_fc1.weight"].chunk(2)
        out[dst + "mlp.gate_proj.weight"], out[dst + "mlp.up_proj.weight"] = gate, up
    return out


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
