"""Qwen3-MoE (Qwen3MoeForCausalLM): qk-norm, softmax-then-top-k routing, SwiGLU experts.

Experts are stacked in memory (transformers v5's `mlp.experts.gate_up_proj` [E, 2I, H]: gate rows, then up
rows; `mlp.experts.down_proj` [E, H, I]) while the hub and transformers' save_pretrained store one tensor per
expert (`mlp.experts.{e}.gate_proj.weight`...): both layouts load, saves write the per-expert one.
"""
import re

import torch

from nemo_rz import ops
from nemo_rz.models.families.base import Family, ModelFileError, read_int

STACKED = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
PER_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight$")


def activation(gate_up: torch.Tensor, limit=None) -> torch.Tensor:
    """The experts' activation: SiLU(gate) * up of gate_up [M, 2I] (gate columns, then up columns)."""
    i = gate_up.shape[1] // 2
    return ops.silu_and_mul(gate_up[:, :i], gate_up[:, i:])


def file_shapes(shapes: dict[str, tuple]) -> dict[str, tuple]:
    out = {}
    for name, shape in shapes.items():
        if name.endswith(STACKED[0]):
            base, (e, two_i, h) = name[: -len("gate_up_proj")], shape
            for x in range(e):
                out[f"{base}{x}.gate_proj.weight"] = out[f"{base}{x}.up_proj.weight"] = (two_i // 2, h)
        elif name.endswith(STACKED[1]):
            base, (e, h, i) = name[: -len("down_proj")], shape
            for x in range(e):
                out[f"{base}{x}.down_proj.weight"] = (h, i)
        else:
            out[name] = shape
    return out


def stack(tensors: dict[str, torch.Tensor], shapes: dict[str, tuple]) -> dict[str, torch.Tensor]:
    """Per-expert tensors -> the model's stacked parameters (gate rows, then up rows)."""
    out = {name: t for name, t in tensors.items() if not PER_EXPERT.search(name)}
    for name, shape in shapes.items():
        if name.endswith(STACKED[0]):
            base = name[: -len("gate_up_proj")]
            out[name] = torch.stack([torch.cat([tensors.pop(f"{base}{x}.gate_proj.weight"), tensors.pop(f"{base}{x}.up_proj.weight")])
                                     for x in range(shape[0])])
        elif name.endswith(STACKED[1]):
            base = name[: -len("down_proj")]
            out[name] = torch.stack([tensors.pop(f"{base}{x}.down_proj.weight") for x in range(shape[0])])
    return out


def unstack(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's stacked experts -> one tensor per expert, as transformers saves them."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(STACKED[0]):
            base, i = name[: -len("gate_up_proj")], t.shape[1] // 2
            for x in range(t.shape[0]):
                out[f"{base}{x}.gate_proj.weight"] = t[x, :i].contiguous()
                out[f"{base}{x}.up_proj.weight"] = t[x, i:].contiguous()
        elif name.endswith(STACKED[1]):
            base = name[: -len("down_proj")]
            for x in range(t.shape[0]):
                out[f"{base}{x}.down_proj.weight"] = t[x].contiguous()
        else:
            out[name] = t
    return out


class Qwen3Moe(Family):
    def natural(self, cfg) -> bool:
        return bool(cfg.num_experts) and cfg.moe_kind == self.moe_kind

    def moe(self, d, source, layers):
        from nemo_rz.models.hf_config import read_bool

        experts = d.get("num_experts", d.get("num_local_experts"))  # the hub's name, and some saves' name
        experts = read_int({"num_experts": experts}, "num_experts", source, 128, minimum=0)
        step = read_int(d, "decoder_sparse_step", source, 1)
        dense = d.get("mlp_only_layers") or []
        if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
            raise ModelFileError(f"'mlp_only_layers' in {source} is {dense!r}: expected a list of layer indices; fix config.json")
        moe_layers = [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
        out = dict(num_experts=experts, moe_kind=self.moe_kind, num_experts_per_tok=read_int(d, "num_experts_per_tok", source, 8),
                   moe_intermediate_size=read_int(d, "moe_intermediate_size", source, 768),
                   norm_topk_prob=read_bool(d, "norm_topk_prob", source, False))
        return out, moe_layers

    def write(self, cfg, out, types, sliding) -> None:
        moe = [i for i in range(cfg.num_layers) if cfg.is_moe(i)]
        out.update(use_sliding_window=sliding, sliding_window=cfg.sliding_window if sliding else None,
                   num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                   moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=cfg.norm_topk_prob,
                   decoder_sparse_step=1, mlp_only_layers=[i for i in range(cfg.num_layers) if i not in moe])

    def gguf_tensors(self):
        names = super().gguf_tensors()
        names.update({"model.layers.{i}.mlp.gate.weight": "blk.{i}.ffn_gate_inp.weight",
                      "model.layers.{i}.mlp.experts.gate_up_proj": ("blk.{i}.ffn_gate_exps.weight", "blk.{i}.ffn_up_exps.weight"),
                      "model.layers.{i}.mlp.experts.down_proj": "blk.{i}.ffn_down_exps.weight"})
        return names

    def gguf_metadata(self, cfg):
        return {**super().gguf_metadata(cfg), "expert_count": cfg.num_experts, "expert_used_count": cfg.num_experts_per_tok,
                "expert_feed_forward_length": cfg.moe_intermediate_size}

    def gguf_config(self, get, layers):
        norm = get("expert_weights_norm")
        return dict(num_experts=get("expert_count"), num_experts_per_tok=get("expert_used_count"),
                    moe_intermediate_size=get("expert_feed_forward_length"),
                    norm_topk_prob=True if norm is None else bool(norm))  # llama.cpp renormalises Qwen3-MoE's top-k

    def file_shapes(self, shapes, cfg):
        return file_shapes(shapes) if cfg.num_experts else shapes

    def stack(self, tensors, shapes):
        return stack(tensors, shapes)

    def unstack(self, tensors, cfg):
        return unstack(tensors) if cfg.num_experts else tensors


    def megatron_tensors(self):
        """The dense map (attention, norms, the dense layers' MLPs), the router and the stacked experts
        (runtime/megatron/moe.py), and Megatron's stock SequentialMLP experts of the fast kernels: expert e's
        linear_fc1 is gate_up_proj[e] ([gate; up] rows, Megatron's order too), its linear_fc2 down_proj[e]."""
        table = super().megatron_tensors()
        mlp, experts = "decoder.layers.{i}.mlp.", "model.layers.{i}.mlp.experts."
        table.update({
            mlp + "router.weight": ("same", ("model.layers.{i}.mlp.gate.weight",)),
            mlp + "experts.gate_up_proj": ("same", (experts + "gate_up_proj",)),
            mlp + "experts.down_proj": ("same", (experts + "down_proj",)),
            mlp + "experts.local_experts.{e}.linear_fc1.weight": ("expert", (experts + "gate_up_proj",)),
            mlp + "experts.local_experts.{e}.linear_fc2.weight": ("expert", (experts + "down_proj",)),
        })
        return table

FAMILY = Qwen3Moe("Qwen3MoeForCausalLM", "qwen3_moe", True, "config", 32768, None, "all_if_used", moe_kind="qwen3",
                  expert_keys=("num_experts", "num_local_experts"),
                  gguf_arch="qwen3moe", rank=20, per_expert=PER_EXPERT)
