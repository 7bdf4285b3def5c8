"""Qwen3.5 text (Qwen3_5ForCausalLM, model_type qwen3_5_text): Qwen3-Next's layers (families/qwen3_next.py: Gated
DeltaNet, gated full attention with partial RoPE, zero-centred norms) with a dense MLP on every layer, and the
Gated DeltaNet's projections split as its files hold them: `in_proj_qkv` (all query heads, all key heads, all
value heads: the conv's channel order), `in_proj_z`, `in_proj_b`, `in_proj_a` (linear_kind
"gated_deltanet_split": models/linear_attention.py SplitGatedDeltaNet, the same layer with these four
projections; the files load as they are). Text positions give the multimodal RoPE's three position rows the same
value, so it is the plain partial RoPE here. Multimodal checkpoints (Qwen3_5ForConditionalGeneration) are not
read.
"""
from nemo_rz.models.families import qwen3_next


class Qwen3_5(qwen3_next.Qwen3Next):
    model_types = ("qwen3_5_text",)

    def natural(self, cfg) -> bool:
        return cfg.linear_kind == "gated_deltanet_split" and cfg.has_linear_attention

    def family_keys(self, d, source):
        return dict(super().family_keys(d, source), linear_kind="gated_deltanet_split")

    def moe(self, d, source, layers):
        return None  # dense

    def write(self, cfg, out, types, sliding) -> None:
        super().write(cfg, out, types, sliding)
        for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
                    "mlp_only_layers", "shared_expert_intermediate_size"):
            out.pop(key, None)

    def file_shapes(self, shapes, cfg):
        return shapes

    def unstack(self, tensors, cfg):
        return tensors


FAMILY = Qwen3_5("Qwen3_5ForCausalLM", "qwen3_5_text", True, "config", 32768, 256, "none", 1e-6, False, 10000.0,
                 rank=4)
