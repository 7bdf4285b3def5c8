"""Gemma 3, text (Gemma3ForCausalLM): Gemma norms (1 + w) around both blocks, GELU-tanh MLP, scaled embeddings,
qk-norm, sliding layers with their own RoPE theta."""
from nemo_rz.models.families.base import Family, ModelFileError, read_float, read_int


class Gemma3(Family):
    def natural(self, cfg) -> bool:
        return cfg.norm == "gemma"

    def pattern(self, d, source):
        return read_int(d, "sliding_window_pattern", source, None) or read_int(d, "_sliding_window_pattern", source, self.window_pattern)

    def family_keys(self, d, source):
        from nemo_rz.models.hf_config import refuse_set

        act = d.get("hidden_activation", d.get("hidden_act")) or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise ModelFileError(
                f"hidden_activation={act!r} in {source} is not supported: Gemma 3 uses gelu_pytorch_tanh; fix config.json"
            )
        for key in ("final_logit_softcapping", "attn_logit_softcapping"):
            refuse_set(d, source, key, "nemo_rz does not implement logit soft-capping")
        refuse_set(d, source, "use_bidirectional_attention", "nemo_rz's decoder is causal")
        return dict(norm="gemma", sandwich_norm=True, hidden_act="gelu_tanh", embed_scale=True,
                    query_pre_attn_scalar=read_float(d, "query_pre_attn_scalar", source, 256.0))

    def write(self, cfg, out, types, sliding) -> None:
        from nemo_rz.models.hf_config import rope_entry

        theta = out["rope_theta"]
        for key in ("hidden_act", "rope_theta", "rope_scaling"):
            out.pop(key)
        local = cfg.rope_local_theta if cfg.rope_local_theta is not None else theta
        scalar = cfg.query_pre_attn_scalar or cfg.head_dim
        out.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,
                   layer_types=types, sliding_window=cfg.sliding_window or self.default_window, final_logit_softcapping=None,
                   attn_logit_softcapping=None, use_bidirectional_attention=False,
                   rope_parameters={"full_attention": rope_entry(theta, cfg.rope_scaling),
                                    "sliding_attention": rope_entry(local, None if cfg.rope_local_theta is not None else cfg.rope_scaling)})

    def gguf_config(self, get, layers):
        return dict(query_pre_attn_scalar=get("attention.key_length"))  # llama.cpp scales queries by head_dim

    def from_gguf(self, name, t, cfg):  # llama.cpp's converter stores Gemma's norms as 1 + w
        return t - 1 if name.endswith("norm.weight") else t

    def to_gguf(self, name, t, cfg):
        return t + 1 if name.endswith("norm.weight") else t

    def gguf_tensors(self):
        names = super().gguf_tensors()
        names["model.layers.{i}.post_attention_layernorm.weight"] = "blk.{i}.post_attention_norm.weight"
        names["model.layers.{i}.pre_feedforward_layernorm.weight"] = "blk.{i}.ffn_norm.weight"
        names["model.layers.{i}.post_feedforward_layernorm.weight"] = "blk.{i}.post_ffw_norm.weight"
        return names


    def megatron_tensors(self):
        """The sandwich's norms: the pre-MLP norm is pre_feedforward_layernorm; the post-attention and post-MLP
        norms live in the layers' bias-dropout-add slots (runtime/megatron/layers.NormAdd)."""
        names = super().megatron_tensors()
        names.update({
            "decoder.layers.{i}.pre_mlp_layernorm.weight": ("same", ("model.layers.{i}.pre_feedforward_layernorm.weight",)),
            "decoder.layers.{i}.self_attn_bda.norm.weight": ("same", ("model.layers.{i}.post_attention_layernorm.weight",)),
            "decoder.layers.{i}.mlp_bda.norm.weight": ("same", ("model.layers.{i}.post_feedforward_layernorm.weight",)),
        })
        return names

FAMILY = Gemma3("Gemma3ForCausalLM", "gemma3_text", True, "config", 131072, 256, "layer_types", 1e-6, True, 1e6,
                local_theta=10000.0, default_window=4096, window_pattern=6, gguf_arch="gemma3", rank=10)
