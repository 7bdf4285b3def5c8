"""Kimi Linear (KimiLinearForCausalLM): a hybrid of Kimi Delta Attention layers (`self_attn`,
models/linear_attention.py KimiDeltaAttention: the gated delta rule with a per-key-channel decay, on the same
chunk-synchronised arithmetic as Gated DeltaNet) and multi-head latent attention layers without RoPE
(models/mla.py with use_rope off: the decoupled key part is attended unrotated), with DeepSeek-V3's mixture of
experts (models/moe.py "deepseek": sigmoid scores, the selection-only bias, group-limited top-k, scaled weights,
shared experts) on the "sparse" layers of mlp_layer_types (or from first_k_dense_replace on) and a dense MLP on
the others; RMSNorms with the weight in the model dtype.

config.json: the hub's keys (`linear_attn_config` {num_heads, head_dim, short_conv_kernel_size, kda_layers,
full_attn_layers (1-indexed)}, num_experts, num_experts_per_token, moe_renormalize, num_expert_group,
num_shared_experts, first_k_dense_replace, model_max_length) or transformers' (layer_types, mlp_layer_types,
linear_num_heads, linear_head_dim, linear_conv_kernel_dim); transformers' keys are written.

Files hold the hub's layout, as transformers saves it: `block_sparse_moe.` for the model's `mlp.` (the hub's
dense layers say `mlp.`: both load), experts one tensor per expert (`experts.{e}.w1` gate, `w3` up, `w2` down;
stacked in memory as Qwen3-MoE's), and the conv in three tensors (`q_conv1d`, `k_conv1d`, `v_conv1d`; one
`conv1d` in memory). The Megatron learner and the vLLM backend do not build the linear layers: both refuse the
family (megatron_tensors None, `linear_attention` True).
"""
import re

import torch

from nemo_rz.models.families.base import Family, ModelFileError, read_float, read_int

_MOE_FILE = ".block_sparse_moe."
_CONV = ".self_attn.conv1d.weight"
_CONVS = ("q_conv1d", "k_conv1d", "v_conv1d")
_EXPERTS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
PER_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.w[123]\.weight$|\.self_attn\.[qkv]_conv1d\.weight$")
_TYPES = ("linear_attention", "full_attention")


def _linear_keys(d: dict, source: str) -> dict:
    lac = d.get("linear_attn_config")
    if lac is not None and not isinstance(lac, dict):
        raise ModelFileError(f"'linear_attn_config' in {source} is {lac!r}: expected an object; fix config.json")
    lac = lac or {}
    heads = read_int({"n": lac.get("num_heads", d.get("linear_num_heads"))}, "n", source, 32)
    dim = read_int({"n": lac.get("head_dim", d.get("linear_head_dim"))}, "n", source, 128)
    kernel = read_int({"n": lac.get("short_conv_kernel_size", d.get("linear_conv_kernel_dim"))}, "n", source, 4)
    return dict(linear_kind="kda", linear_num_key_heads=heads, linear_num_value_heads=heads, linear_key_head_dim=dim,
                linear_value_head_dim=dim, linear_conv_kernel_dim=kernel)


def _layer_types(d: dict, source: str, layers: int) -> list[str]:
    types = d.get("layer_types")
    lac = d.get("linear_attn_config") or {}
    if types is None and "full_attn_layers" in lac and "kda_layers" in lac:  # the hub's form, 1-indexed
        full, kda = lac["full_attn_layers"], lac["kda_layers"]
        numbers = list(full) + list(kda) if isinstance(full, list) and isinstance(kda, list) else None
        if numbers is None or sorted(numbers) != list(range(1, layers + 1)):
            raise ModelFileError(f"linear_attn_config's full_attn_layers {full!r} and kda_layers {kda!r} in {source} "
                                 f"must number each of the {layers} layers once, from 1; fix config.json")
        types = ["full_attention" if i + 1 in full else "linear_attention" for i in range(layers)]
    if types is None:  # transformers' default
        types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or any(t not in _TYPES for t in types):
        raise ModelFileError(f"'layer_types' in {source} is {types!r}: expected one of {', '.join(_TYPES)} per layer "
                             f"({layers}); fix config.json")
    return list(types)


class KimiLinear(Family):
    linear_attention = True  # engines without a linear-attention state (vLLM backend) refuse it

    def natural(self, cfg) -> bool:
        return cfg.linear_kind == "kda" and cfg.has_linear_attention

    def family_keys(self, d, source):
        super().family_keys(d, source)  # SwiGLU only
        for key, allowed in (("moe_router_activation_func", "sigmoid"), ("mla_use_nope", True)):
            if d.get(key) not in (None, allowed):
                raise ModelFileError(f"{key}={d[key]!r} in {source} is not supported: Kimi Linear's is {allowed!r} in "
                                     "nemo_rz (as in transformers); use a Kimi Linear checkpoint")
        if d.get("moe_layer_freq") not in (None, 1):
            raise ModelFileError(f"moe_layer_freq={d['moe_layer_freq']!r} in {source} is not supported: every layer from "
                                 "first_k_dense_replace on is a mixture of experts in nemo_rz; fix config.json")
        layers = read_int(d, "num_hidden_layers", source, required=True)
        q_lora = d.get("q_lora_rank")
        positions = d.get("model_max_length", d.get("max_position_embeddings"))
        return dict(attention_kind="mla", num_kv_heads=1, use_rope=False, rope_interleave=False,
                    head_dim=read_int(d, "qk_rope_head_dim", source, 64),
                    q_lora_rank=None if q_lora is None else read_int(d, "q_lora_rank", source),
                    kv_lora_rank=read_int(d, "kv_lora_rank", source, 512),
                    qk_nope_head_dim=read_int(d, "qk_nope_head_dim", source, 128),
                    v_head_dim=read_int(d, "v_head_dim", source, 128),
                    max_position_embeddings=read_int({"n": positions}, "n", source, self.max_positions),
                    layer_types=_layer_types(d, source, layers), **_linear_keys(d, source))

    def moe(self, d, source, layers):
        from nemo_rz.models.hf_config import read_bool

        kinds = d.get("mlp_layer_types")
        if kinds is None:
            first = read_int(d, "first_k_dense_replace", source, 1, minimum=0)
            kinds = ["dense" if i < first else "sparse" for i in range(layers)]
        if not isinstance(kinds, list) or len(kinds) != layers or any(k not in ("dense", "sparse") for k in kinds):
            raise ModelFileError(f"'mlp_layer_types' in {source} is {kinds!r}: expected \"dense\" or \"sparse\" per layer "
                                 f"({layers}); fix config.json")
        per_tok = d.get("num_experts_per_token", d.get("num_experts_per_tok"))
        out = dict(num_experts=read_int(d, "num_experts", source, 256, minimum=0), moe_kind=self.moe_kind,
                   num_experts_per_tok=read_int({"n": per_tok}, "n", source, 8),
                   moe_intermediate_size=read_int(d, "moe_intermediate_size", source, 1024),
                   n_group=read_int(d, "num_expert_group", source, 1), topk_group=read_int(d, "topk_group", source, 1),
                   routed_scaling_factor=read_float(d, "routed_scaling_factor", source, 2.446),
                   n_shared_experts=read_int(d, "num_shared_experts", source, 1, minimum=0),
                   norm_topk_prob=read_bool(d, "moe_renormalize", source, True))
        return out, [i for i, k in enumerate(kinds) if k == "sparse"]

    def write(self, cfg, out, types, sliding) -> None:
        for key in ("rope_theta", "rope_parameters", "rope_scaling", "max_position_embeddings"):
            out.pop(key)
        experts = cfg.num_experts or 1
        out.update(num_key_value_heads=cfg.num_heads, head_dim=cfg.head_dim, qk_rope_head_dim=cfg.head_dim,
                   q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
                   v_head_dim=cfg.v_head_dim, model_max_length=cfg.max_position_embeddings,
                   layer_types=["linear_attention" if cfg.is_linear(i) else "full_attention" for i in range(cfg.num_layers)],
                   mlp_layer_types=["sparse" if cfg.is_moe(i) else "dense" for i in range(cfg.num_layers)],
                   linear_num_heads=cfg.linear_num_value_heads, linear_head_dim=cfg.linear_value_head_dim,
                   linear_conv_kernel_dim=cfg.linear_conv_kernel_dim,
                   num_experts=experts, num_experts_per_token=min(cfg.num_experts_per_tok, experts),
                   moe_intermediate_size=cfg.moe_intermediate_size, num_expert_group=cfg.n_group if cfg.num_experts else 1,
                   topk_group=cfg.topk_group if cfg.num_experts else 1, routed_scaling_factor=cfg.routed_scaling_factor,
                   num_shared_experts=cfg.n_shared_experts, moe_renormalize=cfg.norm_topk_prob)

    # -- weights: the files' layout (module docstring) ------------------------------------------------------------
    def alias(self, name: str) -> str:
        return name.replace(_MOE_FILE, ".mlp.")

    def file_shapes(self, shapes, cfg):
        out = {}
        for name, shape in shapes.items():
            if name.endswith(_CONV):
                for part in _CONVS:
                    out[name.replace("conv1d", part)] = (shape[0] // 3, *shape[1:])
            elif name.endswith(_EXPERTS[0]):
                base, (e, two_i, h) = name[: -len("gate_up_proj")], shape
                for x in range(e):
                    out[f"{base}{x}.w1.weight"] = out[f"{base}{x}.w3.weight"] = (two_i // 2, h)
            elif name.endswith(_EXPERTS[1]):
                base, (e, h, i) = name[: -len("down_proj")], shape
                for x in range(e):
                    out[f"{base}{x}.w2.weight"] = (h, i)
            else:
                out[name] = shape
        return out

    def stack(self, tensors, shapes):
        out = {name: t for name, t in tensors.items() if not PER_EXPERT.search(name)}
        for name, shape in shapes.items():
            if name.endswith(_CONV):
                out[name] = torch.cat([tensors[name.replace("conv1d", part)] for part in _CONVS])
            elif name.endswith(_EXPERTS[0]):
                base = name[: -len("gate_up_proj")]
                out[name] = torch.stack([torch.cat([tensors[f"{base}{x}.w1.weight"], tensors[f"{base}{x}.w3.weight"]])
                                         for x in range(shape[0])])
            elif name.endswith(_EXPERTS[1]):
                base = name[: -len("down_proj")]
                out[name] = torch.stack([tensors[f"{base}{x}.w2.weight"] for x in range(shape[0])])
        return out

    def unstack(self, tensors, cfg):
        out = {}
        for name, t in tensors.items():
            if name.endswith(_CONV):
                for part, piece in zip(_CONVS, t.chunk(3)):
                    out[name.replace("conv1d", part)] = piece.contiguous()
            elif name.endswith(_EXPERTS[0]):
                base, i = name[: -len("gate_up_proj")], t.shape[1] // 2
                for x in range(t.shape[0]):
                    out[f"{base}{x}.w1.weight"], out[f"{base}{x}.w3.weight"] = t[x, :i].contiguous(), t[x, i:].contiguous()
            elif name.endswith(_EXPERTS[1]):
                base = name[: -len("down_proj")]
                for x in range(t.shape[0]):
                    out[f"{base}{x}.w2.weight"] = t[x].contiguous()
            else:
                out[name] = t
        return {name.replace(".mlp.", _MOE_FILE): t for name, t in out.items()}

    def gguf_tensors(self):
        return {}

    def megatron_tensors(self):
        """None: the Megatron learner does not build Kimi Delta Attention or multi-head latent attention."""
        return None


FAMILY = KimiLinear("KimiLinearForCausalLM", "kimi_linear", False, "config", 1048576, None, "none", 1e-5, False, 10000.0,
                    moe_kind="deepseek", expert_keys=("num_experts",), rank=4, per_expert=PER_EXPERT)
