"""DeepSeek-V3 (DeepseekV3ForCausalLM; also Kimi K2, whose configs name model_type kimi_k2): multi-head latent
attention (models/mla.py: q_lora_rank null or set, the decoupled RoPE key, interleaved RoPE, YaRN with mscale /
mscale_all_dim in the softmax scale) and, from layer first_k_dense_replace on, DeepSeek's mixture of experts
(models/moe.py: sigmoid scores, the selection-only e_score_correction_bias, group-limited top-k,
routed_scaling_factor, shared experts).

Experts are stored one tensor per expert, as on the hub (`mlp.experts.{e}.gate_proj.weight`...), and stacked in
memory as Qwen3-MoE's (families/qwen3_moe.py). The checkpoint's multi-token-prediction layers
(`model.layers.{num_hidden_layers + j}`, num_nextn_predict_layers of them) are not part of the decoder and are
skipped on load, as transformers does.
"""
import re

from nemo_rz.models.families import qwen3_moe
from nemo_rz.models.families.base import Family, ModelFileError, read_float, read_int

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class DeepseekV3(Family):
    model_types = ("deepseek_v3", "kimi_k2")  # config.json model_type values of this architecture

    def natural(self, cfg) -> bool:
        return cfg.attention_kind == "mla"

    def family_keys(self, d, source):
        from nemo_rz.models.hf_config import read_bool

        super().family_keys(d, source)  # SwiGLU only
        for key, allowed in (("scoring_func", ("sigmoid",)), ("topk_method", ("noaux_tc",))):
            if d.get(key) not in (None, *allowed):
                raise ModelFileError(f"{key}={d[key]!r} in {source} is not supported: nemo_rz implements DeepSeek-V3's "
                                     f"{allowed[0]!r}; use a DeepSeek-V3-architecture checkpoint")
        if d.get("moe_layer_freq") not in (None, 1):
            raise ModelFileError(f"moe_layer_freq={d['moe_layer_freq']!r} in {source} is not supported: every layer from "
                                 "first_k_dense_replace on is a mixture of experts in nemo_rz; fix config.json")
        q_lora = d.get("q_lora_rank")
        return dict(attention_kind="mla", num_kv_heads=1,
                    head_dim=read_int(d, "qk_rope_head_dim", source, 64),
                    q_lora_rank=None if q_lora is None else read_int(d, "q_lora_rank", source),
                    kv_lora_rank=read_int(d, "kv_lora_rank", source, 512),
                    qk_nope_head_dim=read_int(d, "qk_nope_head_dim", source, 128),
                    v_head_dim=read_int(d, "v_head_dim", source, 128),
                    rope_interleave=read_bool(d, "rope_interleave", source, True))

    def moe(self, d, source, layers):
        from nemo_rz.models.hf_config import read_bool

        first = read_int(d, "first_k_dense_replace", source, 3, minimum=0)
        out = dict(num_experts=read_int(d, "n_routed_experts", source, 256, minimum=0), moe_kind=self.moe_kind,
                   num_experts_per_tok=read_int(d, "num_experts_per_tok", source, 8),
                   moe_intermediate_size=read_int(d, "moe_intermediate_size", source, 2048),
                   n_group=read_int(d, "n_group", source, 8), topk_group=read_int(d, "topk_group", source, 4),
                   routed_scaling_factor=read_float(d, "routed_scaling_factor", source, 2.5),
                   n_shared_experts=read_int(d, "n_shared_experts", source, 1, minimum=0),
                   norm_topk_prob=read_bool(d, "norm_topk_prob", source, True))
        return out, list(range(first, layers))

    def write(self, cfg, out, types, sliding) -> None:
        moe = [i for i in range(cfg.num_layers) if cfg.is_moe(i)]
        first = moe[0] if moe else cfg.num_layers
        experts = cfg.num_experts or 1
        out.update(num_key_value_heads=cfg.num_heads, head_dim=cfg.head_dim, qk_rope_head_dim=cfg.head_dim,
                   q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
                   v_head_dim=cfg.v_head_dim, rope_interleave=cfg.rope_interleave,
                   n_routed_experts=experts, num_experts_per_tok=min(cfg.num_experts_per_tok, experts),
                   moe_intermediate_size=cfg.moe_intermediate_size, n_group=cfg.n_group if cfg.num_experts else 1,
                   topk_group=cfg.topk_group if cfg.num_experts else 1, routed_scaling_factor=cfg.routed_scaling_factor,
                   n_shared_experts=cfg.n_shared_experts, norm_topk_prob=cfg.norm_topk_prob,
                   first_k_dense_replace=first, num_nextn_predict_layers=0, scoring_func="sigmoid",
                   topk_method="noaux_tc")  # MoE layers other than a suffix: hf_config's read-back refuses them

    def ignored(self, name, cfg) -> bool:
        m = _LAYER.match(name)
        return super().ignored(name, cfg) or (m is not None and int(m.group(1)) >= cfg.num_layers)

    def file_shapes(self, shapes, cfg):
        return qwen3_moe.file_shapes(shapes) if cfg.num_experts else shapes

    def stack(self, tensors, shapes):
        return qwen3_moe.stack(tensors, shapes)

    def unstack(self, tensors, cfg):
        return qwen3_moe.unstack(tensors) if cfg.num_experts else tensors

    def megatron_tensors(self):
        """None: the Megatron learner does not build multi-head latent attention or DeepSeek routing yet."""
        return None


FAMILY = DeepseekV3("DeepseekV3ForCausalLM", "deepseek_v3", False, "config", 4096, None, "none", 1e-6, False, 10000.0,
                    moe_kind="deepseek", expert_keys=("n_routed_experts",), rank=20, per_expert=qwen3_moe.PER_EXPERT)
