"""The Megatron learner's model description: which DecoderConfig features it builds, the TransformerConfig, and
the layer spec of every layer (Megatron's TransformerBlock takes one spec per layer, so layers may differ:
attention window, RoPE, dense MLP or mixture of experts).

`consistent` puts nemo_rz.ops inside every Megatron submodule (layers.py); `fast` is Megatron's own local spec.

Dense families built (consistent): Qwen3, Qwen2, Llama, Mistral (sliding windows everywhere, or per layer from
layer_types), Gemma 3 (Gemma norms; the sandwich's post norms in the layers' bias-dropout-add slots,
layers.NormAdd; GELU-tanh; the embedding scale at the first layer's input, layers.ScaledInputLayer, since
Megatron's GPTModel builds its embedding and TransformerBlock itself and the first layer is where a spec reaches;
the sliding layers' own RoPE theta; query_pre_attn_scalar) and gpt-oss's attention (learned sinks, YaRN,
o_proj bias, float32-weight RMSNorm).
The fast spec is Megatron's stock modules: what they have no such feature for is refused in one line
(`FAST_REFUSED`), not approximated.
"""
from __future__ import annotations

import dataclasses
import functools
import warnings

import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from nemo_rz.models import layers as models_layers
from nemo_rz.models.config import DecoderConfig
from nemo_rz.runtime.megatron import layers, moe

# DecoderConfig fields this model builds; any other field must keep its default (a family the Megatron
# learner does not build yet is refused, not trained wrongly).
SUPPORTED = {"vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
             "rope_theta", "rms_norm_eps", "qk_norm", "attention_bias", "tie_word_embeddings",
             "max_position_embeddings", "sliding_window", "dtype", "layer_types", "attention_sinks", "o_proj_bias",
             "query_pre_attn_scalar", "rope_scaling", "rope_local_theta", "norm", "sandwich_norm", "hidden_act",
             "embed_scale",
             # mixtures of experts (moe.py)
             "moe_layers", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "moe_kind", "norm_topk_prob",
             "swiglu_limit"}
# What Megatron's stock modules (the fast spec) have no such feature for: {field: what is missing}.
FAST_REFUSED = {
    "sliding_window": "Megatron's DotProductAttention has no sliding window",
    "attention_sinks": "Megatron's DotProductAttention has no learned sinks",
    "o_proj_bias": "Megatron's add_bias_linear would give the MLP biases too",
    "norm": "Megatron's local RMSNorm applies its weight in the model dtype only",
    "sandwich_norm": "Megatron's TransformerLayer has no post-attention / post-MLP norms",
    "embed_scale": "Megatron's embedding has no scale",
}


def check_supported(cfg: DecoderConfig, fast: bool) -> None:
    if cfg.attention_kind != "gqa" or cfg.moe_kind == "deepseek":
        raise ValueError(f"model attention_kind = {cfg.attention_kind!r}, moe_kind = {cfg.moe_kind!r} (the DeepSeek-V3 "
                         "family): the Megatron learner does not build latent attention or DeepSeek routing yet; use "
                         "runtime.learner=builtin for this model")
    moe.check(cfg, fast)
    plain = DecoderConfig(**{k: getattr(cfg, k) for k in SUPPORTED})  # the same model without other features
    for f in dataclasses.fields(cfg):
        if getattr(cfg, f.name) != getattr(plain, f.name):
            raise ValueError(f"model {f.name} = {getattr(cfg, f.name)!r}: the Megatron learner does not build this "
                             "feature yet; use runtime.learner=builtin for this model")
    if fast:
        for name, why in FAST_REFUSED.items():
            value = getattr(cfg, name)
            if value != getattr(DecoderConfig(), name):
                raise ValueError(f"model {name} = {value!r}: the Megatron learner's fast kernels cannot run it ({why}); "
                                 "use kernels=consistent or runtime.learner=builtin")


def transformer_config(cfg: DecoderConfig, tp: int) -> TransformerConfig:
    if cfg.num_kv_heads % tp:  # a rank holds whole query groups (Megatron would assert)
        raise ValueError(f"megatron.tp = {tp} does not divide the model's num_kv_heads = {cfg.num_kv_heads}; choose a tp "
                         "that divides it")
    with warnings.catch_warnings():  # a deprecation notice about CUDA graphs, which the learner does not use
        warnings.filterwarnings("ignore", message="full scope is deprecated")
        return _transformer_config(cfg, tp)


# the fast spec's activations (the consistent MLP runs models.layers.gated)
_ACTIVATIONS = {"silu": F.silu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh")}


def _transformer_config(cfg: DecoderConfig, tp: int) -> TransformerConfig:
    return TransformerConfig(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_heads, num_query_groups=cfg.num_kv_heads, kv_channels=cfg.head_dim,
        normalization="RMSNorm", layernorm_epsilon=cfg.rms_norm_eps, gated_linear_unit=True,
        activation_func=_ACTIVATIONS[cfg.hidden_act], add_bias_linear=cfg.o_proj_bias, add_qkv_bias=cfg.attention_bias,
        qk_layernorm=cfg.qk_norm, softmax_scale=None if cfg.query_pre_attn_scalar is None else cfg.attention_scale,
        tensor_model_parallel_size=tp, params_dtype=cfg.torch_dtype, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, **moe.config_fields(cfg),
    )


def layer_spec(cfg: DecoderConfig, layer: int, fast: bool) -> ModuleSpec:
    """Layer `layer`: Megatron's local spec (fast) or the same layer with nemo_rz.ops submodules."""
    local = get_gpt_layer_local_spec(qk_layernorm=cfg.qk_norm, normalization="RMSNorm")
    attn = local.submodules.self_attention
    core = functools.partial(layers.CoreAttention, model_config=cfg, fast_attention=DotProductAttention if fast else None)
    if fast:
        attn_sub = dataclasses.replace(attn.submodules, core_attention=core)
        layer_sub = dataclasses.replace(local.submodules, self_attention=dataclasses.replace(attn, submodules=attn_sub))
        if cfg.is_moe(layer):  # Megatron's stock MoE layer
            layer_sub = dataclasses.replace(layer_sub, mlp=moe.spec(cfg, layer, fast=True))
        norm = layer_sub.input_layernorm
    else:
        norm = ModuleSpec(module=layers.Norm, params={"model_config": cfg})
        qk = norm if cfg.qk_norm else attn.submodules.q_layernorm  # IdentityOp without qk-norm
        attn_sub = dataclasses.replace(attn.submodules, linear_qkv=layers.ColumnLinear, core_attention=core,
                                       linear_proj=layers.RowLinear, q_layernorm=qk, k_layernorm=qk)
        sandwich = {}
        if cfg.sandwich_norm:  # Gemma's post norms, in the bias-dropout-add slots (layers.NormAdd)
            post = ModuleSpec(module=layers.NormAdd, params={"model_config": cfg})
            sandwich = dict(self_attn_bda=post, mlp_bda=post)
        layer_sub = dataclasses.replace(local.submodules, input_layernorm=norm, pre_mlp_layernorm=norm,
                                        self_attention=dataclasses.replace(attn, submodules=attn_sub),
                                        mlp=mlp_spec(cfg, layer), **sandwich)
    if cfg.embed_scale and layer == 0:  # the embeddings times embed_scale, at the first layer's input
        local = dataclasses.replace(local, module=layers.ScaledInputLayer,
                                    params={**local.params, "scale": models_layers.embed_scale(cfg)})
    return dataclasses.replace(local, submodules=layer_sub), norm


def mlp_spec(cfg: DecoderConfig, layer: int):
    """Layer `layer`'s MLP in the consistent spec: dense, or a mixture of experts (moe.py) where the config has one."""
    if cfg.is_moe(layer):
        return moe.spec(cfg, layer)
    return layers.MLP.of(cfg.hidden_act)


def block_spec(cfg: DecoderConfig, fast: bool) -> ModuleSpec:
    """The transformer block: one spec per layer, then the final norm."""
    specs = [layer_spec(cfg, i, fast) for i in range(cfg.num_layers)]
    return ModuleSpec(module=TransformerBlock,
                      submodules=TransformerBlockSubmodules(layer_specs=[s for s, _ in specs], layer_norm=specs[-1][1]))
