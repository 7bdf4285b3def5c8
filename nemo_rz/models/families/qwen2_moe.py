"""Qwen2-MoE (Qwen2MoeForCausalLM): Qwen2's attention (q/k/v biases unless qkv_bias is false, no qk-norm, windows
from max_window_layers on), Qwen3-MoE's routing and experts (families/qwen3_moe.py, per-expert tensors on the
hub), and a shared expert per MoE layer (`mlp.shared_expert.*`) scaled by sigmoid(`mlp.shared_expert_gate`)."""
from nemo_rz.models.families import qwen3_moe
from nemo_rz.models.families.base import read_int
from nemo_rz.models.families.qwen2 import write_qwen_windows


class Qwen2Moe(qwen3_moe.Qwen3Moe):
    def natural(self, cfg) -> bool:
        return super().natural(cfg) and cfg.shared_expert_intermediate_size > 0

    def family_keys(self, d, source):
        from nemo_rz.models.hf_config import read_bool

        out = super().family_keys(d, source)
        if not read_bool(d, "qkv_bias", source, True):
            out["attention_bias"] = False
        return out

    def moe(self, d, source, layers):
        out, moe_layers = super().moe(d, source, layers)
        out["shared_expert_intermediate_size"] = read_int(d, "shared_expert_intermediate_size", source, 5632, minimum=0)
        return out, moe_layers

    def write(self, cfg, out, types, sliding) -> None:
        super().write(cfg, out, types, sliding)
        write_qwen_windows(cfg, out, types, sliding)
        out.update(qkv_bias=cfg.attention_bias, shared_expert_intermediate_size=cfg.shared_expert_intermediate_size)

    def megatron_tensors(self):
        """None: the Megatron learner does not build the gated shared expert yet."""
        return None


FAMILY = Qwen2Moe("Qwen2MoeForCausalLM", "qwen2_moe", False, "qkv", 32768, None, "qwen", moe_kind="qwen3",
                  expert_keys=("num_experts",), rank=15, per_expert=qwen3_moe.PER_EXPERT)
