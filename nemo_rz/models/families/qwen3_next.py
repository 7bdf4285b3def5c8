"""Qwen3-Next (Qwen3NextForCausalLM): a hybrid of Gated DeltaNet layers (`linear_attn`, models/linear_attention.py)
and, every full_attention_interval-th layer (layer_types), gated full attention (q_proj doubled into each head's
query and output gate, zero-centred q/k norms, RoPE on the first partial_rotary_factor of each head); every norm
but the DeltaNet's gated one is zero-centred, x / rms(x) * (1 + w) in float32 (nemo_rz's "gemma" norm); the MLPs
are Qwen3-MoE's routing and experts (families/qwen3_moe.py) with Qwen2-MoE's sigmoid-gated shared expert, or
dense in mlp_only_layers / when num_experts is 0.

The checkpoint's multi-token-prediction weights (`mtp.*`) are skipped on load, as transformers does. The Megatron
learner and the vLLM backend do not build the linear layers: both refuse the family (megatron_tensors None,
`linear_attention` True).
"""
from nemo_rz.models.families import qwen3_moe
from nemo_rz.models.families.base import ModelFileError, read_int

_TYPES = ("linear_attention", "full_attention")
# transformers' Qwen3NextConfig defaults
_DEFAULTS = dict(linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
                 linear_num_value_heads=32)


def _factor(d: dict, source: str) -> float:
    params = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else {}
    value = params.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25))
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ModelFileError(f"partial_rotary_factor={value!r} in {source}: expected a number in (0, 1]; fix config.json")
    return float(value)


class Qwen3Next(qwen3_moe.Qwen3Moe):
    partial_rotary = True  # hf_config: the family reads partial_rotary_factor
    linear_attention = True  # engines without a linear-attention state (vLLM backend) refuse it

    def natural(self, cfg) -> bool:
        return cfg.linear_kind == "gated_deltanet" and (cfg.attention_output_gate or cfg.has_linear_attention)

    def family_keys(self, d, source):
        out = super().family_keys(d, source)  # SwiGLU only
        layers = read_int(d, "num_hidden_layers", source, required=True)
        types = d.get("layer_types")
        if types is None:
            every = read_int(d, "full_attention_interval", source, 4)
            types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(layers)]
        if not isinstance(types, list) or len(types) != layers or any(t not in _TYPES for t in types):
            raise ModelFileError(f"'layer_types' in {source} is {types!r}: expected one of {', '.join(_TYPES)} per layer "
                                 f"({layers}); fix config.json")
        out.update({key: read_int(d, key, source, default) for key, default in _DEFAULTS.items()})
        return dict(out, layer_types=list(types), norm="gemma", attention_output_gate=True,
                    partial_rotary_factor=_factor(d, source))

    def moe(self, d, source, layers):
        out, moe_layers = super().moe(d, source, layers)
        from nemo_rz.models.hf_config import read_bool

        out["norm_topk_prob"] = read_bool(d, "norm_topk_prob", source, True)
        out["num_experts"] = read_int({"n": d.get("num_experts")}, "n", source, 512, minimum=0)
        out["shared_expert_intermediate_size"] = read_int(d, "shared_expert_intermediate_size", source, 512, minimum=0)
        return out, moe_layers

    def write(self, cfg, out, types, sliding) -> None:
        super().write(cfg, out, types, sliding)
        for key in ("use_sliding_window", "sliding_window"):
            out.pop(key, None)
        out["rope_parameters"] = dict(out["rope_parameters"], partial_rotary_factor=cfg.partial_rotary_factor)
        out.update(layer_types=[("linear_attention" if cfg.is_linear(i) else "full_attention") for i in range(cfg.num_layers)],
                   partial_rotary_factor=cfg.partial_rotary_factor,
                   shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
                   **{key: getattr(cfg, key) for key in _DEFAULTS})
        if not cfg.num_experts:
            out.update(num_experts=0, mlp_only_layers=[])

    def ignored(self, name, cfg) -> bool:
        return super().ignored(name, cfg) or name.startswith("mtp.")

    def gguf_tensors(self):
        return {}

    def megatron_tensors(self):
        """None: the Megatron learner does not build Gated DeltaNet layers."""
        return None


FAMILY = Qwen3Next("Qwen3NextForCausalLM", "qwen3_next", True, "config", 32768, 256, "none", 1e-6, False, 10000.0,
                   moe_kind="qwen3", expert_keys=("num_experts",), rank=5, per_expert=qwen3_moe.PER_EXPERT)
