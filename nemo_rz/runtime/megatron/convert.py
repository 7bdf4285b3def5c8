"""Weights between nemo-rz / Hugging Face names and Megatron's, both ways, and across tensor-parallel ranks.

Megatron fuses q, k and v into one `linear_qkv` weight laid out by query group (for each kv head g: the query
heads of g, then k_g, then v_g), and gate and up into `linear_fc1` ([gate; up]). Under tensor parallelism a
rank holds whole query groups of linear_qkv, and its own rows of gate followed by its own rows of up.
Conversion only moves and concatenates tensors: the bits never change. Which tensors map to which is the model
family's (`Family.megatron_tensors`, models/families/base.py); this module only knows how they join.
"""
from __future__ import annotations

import torch

from nemo_rz.models import families
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


_JOINS = {  # how a Megatron tensor is made of its nemo_rz tensors, and back
    "same": (lambda parts, cfg: parts[0], lambda t, cfg: [t]),
    "qkv": (lambda parts, cfg: fuse_qkv(*parts, cfg), split_qkv),
    "gate_up": (lambda parts, cfg: torch.cat(parts), lambda t, cfg: t.chunk(2)),
}


def _rules(cfg: DecoderConfig) -> list[tuple[str, list[str], str]]:
    """(Megatron name, its nemo_rz names, how they join) for every tensor the model's family maps (its
    `megatron_tensors`; a rule whose tensors a model lacks, such as biases or qk-norms, is skipped by the callers)."""
    family = families.for_config(cfg)
    table = family.megatron_tensors()
    if table is None:
        raise ValueError(f"{family.architecture} models: the Megatron learner does not build this family yet; "
                         "use runtime.learner=builtin")
    out = []
    for meg, (join, names) in table.items():
        for i in range(cfg.num_layers) if "{i}" in meg else (None,):
            # {e}: one Megatron tensor per expert, expert e of a stacked nemo_rz tensor (join "expert:e")
            for e in range(cfg.num_experts) if "{e}" in meg else (None,):
                out.append((meg.format(i=i, e=e), [n.format(i=i) for n in names], join if e is None else f"{join}:{e}"))
    return out


def _expert(join: str) -> int | None:
    """The expert index of an "expert:e" join (one expert of a stacked [E, ...] tensor), else None."""
    kind, _, e = join.partition(":")
    return int(e) if kind == "expert" else None


def joins(cfg: DecoderConfig) -> dict[str, tuple[str, list[str]]]:
    """{Megatron tensor name: (how it joins, its nemo_rz / Hugging Face names)} of every tensor the family maps."""
    return {m: (join, names) for m, names, join in _rules(cfg)}


def split(name: str, t: torch.Tensor, cfg: DecoderConfig, join: str) -> list[torch.Tensor]:
    """A whole Megatron tensor's nemo_rz parts (its `join` undone)."""
    return list(_JOINS[join][1](t, cfg))


def joined(parts: list[torch.Tensor], cfg: DecoderConfig, join: str) -> torch.Tensor:
    """The whole Megatron tensor of its nemo_rz parts."""
    return _JOINS[join][0](parts, cfg)


def _uncovered(given: dict, covered: set, what: str) -> None:
    left = sorted(set(given) - covered)
    if left:
        raise ValueError(f"{what}: {len(left)} tensor(s) the family's Megatron map does not name, first {left[0]!r}")


def to_megatron(hf: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    """Hugging Face-named weights (the built-in Decoder's state_dict) -> Megatron GPTModel names, whole tensors."""
    rules = [(m, names, join) for m, names, join in _rules(cfg) if all(n in hf for n in names)]
    _uncovered(hf, {n for _, names, _ in rules for n in names}, "to_megatron")
    return {m: hf[names[0]][_expert(join)] if _expert(join) is not None else _JOINS[join][0]([hf[n] for n in names], cfg)
            for m, names, join in rules}


def to_hf(meg: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    """Megatron names, whole tensors -> Hugging Face names (what the rollout engines load)."""
    rules = [r for r in _rules(cfg) if r[0] in meg]
    _uncovered(meg, {m for m, _, _ in rules}, "to_hf")
    out, experts = {}, {}
    for m, names, join in rules:
        if _expert(join) is not None:
            experts.setdefault(names[0], {})[_expert(join)] = meg[m]
        else:
            out.update(zip(names, _JOINS[join][1](meg[m], cfg)))
    for n, parts in experts.items():  # per-expert tensors stacked back in expert order
        if sorted(parts) != list(range(cfg.num_experts)):
            raise ValueError(f"to_hf: {n} needs all {cfg.num_experts} experts' tensors, got experts {sorted(parts)}")
        out[n] = torch.stack([parts[e] for e in range(cfg.num_experts)])
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
