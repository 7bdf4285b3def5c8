"""gpt-oss (GptOssForCausalLM): attention sinks, float32 RMSNorm, top-k-then-softmax routing with a biased
router, clamped SwiGLU experts (gate and up interleaved), stored stacked in files too."""
import torch

from nemo_rz import ops
from nemo_rz.models.families.base import Family, ModelFileError, read_float, read_int

SWIGLU_ALPHA = 1.702


def activation(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """The experts' activation: clamped SwiGLU of gate_up [M, 2I] (gate and up columns interleaved)."""
    return ops.clamped_swiglu(gate_up[:, ::2], gate_up[:, 1::2], limit, SWIGLU_ALPHA)


class GptOss(Family):
    def natural(self, cfg) -> bool:
        return bool(cfg.num_experts) and cfg.moe_kind == self.moe_kind

    def family_keys(self, d, source):  # the experts ignore hidden_act
        return dict(norm="rms_f32", attention_sinks=True)

    def moe(self, d, source, layers):
        alpha = d.get("swiglu_alpha", SWIGLU_ALPHA)
        if alpha != SWIGLU_ALPHA:
            raise ModelFileError(
                f"swiglu_alpha={alpha!r} in {source} is not supported: gpt-oss experts use {SWIGLU_ALPHA}; "
                "use a gpt-oss checkpoint"
            )
        out = dict(num_experts=read_int(d, "num_local_experts", source, 128), moe_kind=self.moe_kind,
                   num_experts_per_tok=read_int(d, "num_experts_per_tok", source, 4),
                   moe_intermediate_size=read_int(d, "intermediate_size", source, 2880),
                   swiglu_limit=read_float(d, "swiglu_limit", source, 7.0))
        return out, list(range(layers))

    def write(self, cfg, out, types, sliding) -> None:
        out.pop("rope_scaling")
        out.update(layer_types=types, sliding_window=cfg.sliding_window or self.default_window,
                   num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                   intermediate_size=cfg.moe_intermediate_size, swiglu_limit=cfg.swiglu_limit, swiglu_alpha=SWIGLU_ALPHA)


    def megatron_tensors(self):
        """The dense map, the biased router and the stacked experts with their biases (runtime/megatron/moe.py)."""
        table = super().megatron_tensors()
        mlp = "decoder.layers.{i}.mlp."
        table.update({mlp + f"router.{p}": ("same", (f"model.layers.{{i}}.mlp.router.{p}",)) for p in ("weight", "bias")})
        table.update({mlp + f"experts.{p}": ("same", (f"model.layers.{{i}}.mlp.experts.{p}",))
                      for p in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")})
        return table

FAMILY = GptOss("GptOssForCausalLM", "gpt_oss", False, "config", 131072, 64, "layer_types", 1e-5, False, 150000.0,
                bias_default=True, default_window=128, window_pattern=2, moe_kind="gpt_oss", rank=20,
                expert_keys=("num_local_experts",))
