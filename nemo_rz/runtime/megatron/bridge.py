"""nemo-rz's consistent layer spec for a GPTModel that Megatron-Bridge's model providers build (as NeMo RL's
Megatron policy does), with the forward that a stock provider and NeMo RL give it.

Megatron-Bridge (0.3.x) builds a GPTModel in `GPTModelProvider.provide(pre_process, post_process, vp_stage)`
from the provider's `transformer_layer_spec`: a ModuleSpec, or a callable that it calls as `spec(provider)` or,
when the callable has a `vp_stage` parameter, `spec(provider, vp_stage=vp_stage)`. The provider is itself a
TransformerConfig (GPTModelProvider subclasses it) with a few fields of its own: `vocab_size` (unpadded),
`rotary_base`, `seq_length`, `share_embeddings_and_output_weights`, `position_embedding_type`.

`consistent_layer_spec(provider, vp_stage=None)` is that callable. It maps the provider's fields to a DecoderConfig
(`decoder_config`), refusing in one line what the consistent spec does not build, and returns spec.block_spec of
that config: every layer's linears, norms, MLP and attention are nemo_rz.ops (layers.py), as the built-in
Decoder's and nemo-rz's vLLM model's are, with one change: the core attention (`PackedCoreAttention`) builds the
forward's tokens from what Megatron hands it when no layers.TokenParams does (MegatronPolicy passes one; a stock
provider's forward and NeMo RL's pass none):
- `packed_seq_params` None (NeMo RL without sequence packing: a dense [b, s] batch, right-padded; the causal
  mask it passes is the one the consistent attention applies anyway): every row one sequence, positions 0..s-1;
- `packed_seq_params.qkv_format == "thd"` (NeMo RL's sequence packing): the sequences' boundaries are
  `cu_seqlens_q_padded` (else `cu_seqlens_q`); a token's position counts from its sequence's start, and the
  sequences' keys and values go to a decoder.BatchKV as in Decoder.packed.
The tokens are built once per forward and shared by the layers (kept on the PackedSeqParams object, or per dense
shape).

RoPE is applied inside the core attention through ops.rope (Megatron's rotary embedding moves its table to CUDA
and is not nemo-rz's arithmetic), so the GPTModel must not add its own: the spec callable sets the provider's
`position_embedding_type` from "rope" (what the Llama / Qwen bridges set) to "none" (GPTModelProvider.provide
reads that field after calling the spec; `rotary_base` still gives ops.rope its theta). The spec covers the
decoder block; the output layer is built by the GPTModel itself (Megatron's ColumnParallelLinear):
`consistent_output_layer` is a Megatron-Bridge pre-wrap hook (`provide_distributed_model(pre_wrap_hook=...)`,
`register_pre_wrap_hook`) that puts layers.ColumnLinear (ops.linear) in its place, keeping its parameter name
`output_layer.weight`. Imported in a process with NeMo RL loaded, this module has NeMo RL's Megatron setup apply
that hook to the models it builds (nemo_rl_policy.install_output_layer, the one place that changes NeMo RL).

The parameter names are Megatron's local-spec names (`input_layernorm.weight`, `pre_mlp_layernorm.weight`, which
Megatron-Bridge's Llama / Qwen mappings list beside the Transformer Engine ones), so a Megatron checkpoint to load
must be converted with this spec (examples/nemo_rl/README.md), not with the stock Transformer Engine spec, whose
norms are `linear_qkv.layer_norm_weight` / `linear_fc1.layer_norm_weight`.

Selecting it in NeMo RL (main after 2026-08-11, `policy.megatron_cfg.model_overrides`, merged into the
provider before it is built; examples/nemo_rl/README.md):
    policy.megatron_cfg.model_overrides.transformer_layer_spec: nemo_rz.runtime.megatron.bridge:consistent_layer_spec
NeMo RL takes YAML values verbatim, so the kit's driver (examples/nemo_rl/run_grpo_reinforce_zero.py) turns the
"module:function" string into the function (`resolve_layer_spec`) before NeMo RL's setup; Ray pickles it by
reference to the Megatron policy workers, where nemo-rz is installed.
"""
from __future__ import annotations

import collections
import dataclasses
import importlib
import inspect
import sys

import torch
import torch.nn.functional as F
from megatron.core.transformer.spec_utils import ModuleSpec

from nemo_rz.models.config import DecoderConfig
from nemo_rz.models.decoder import BatchKV, Tokens, prepared
from nemo_rz.runtime.megatron import layers, spec

SPEC_PATH = "nemo_rz.runtime.megatron.bridge:consistent_layer_spec"


def allow_in_checkpoints() -> bool:
    """Register this module with Megatron-Bridge's `_target_` allowlist, where it has one (NeMo RL main's pinned
    Megatron-Bridge, 8c46dc4: megatron/bridge/utils/instantiate_utils.py; 0.3.x has none). Megatron-Bridge saves the
    provider, its `transformer_layer_spec` included, in each checkpoint's run_config.yaml as an importable target,
    and instantiates that file's targets only from allowlisted prefixes (megatron., torch., nvidia., transformers.,
    numpy., nemo.), so without this a checkpoint saved with the consistent spec would not load again. Called at
    import: in NeMo RL's Megatron workers that is when Ray unpickles the policy config holding
    consistent_layer_spec, before the worker reads a checkpoint. True when registered."""
    try:
        from megatron.bridge.utils.instantiate_utils import register_allowed_target_prefix
    except ImportError:  # no Megatron-Bridge, or one without an allowlist
        return False
    register_allowed_target_prefix(__name__)
    return True


allow_in_checkpoints()
_WHERE = "policy.megatron_cfg.model_overrides"
_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _field(config, name: str):
    if not hasattr(config, name):
        raise ValueError(f"consistent_layer_spec: the model config {type(config).__name__} has no {name}; pass a "
                         "Megatron-Bridge GPTModelProvider (or a TransformerConfig carrying its fields)")
    return getattr(config, name)


def _refuse(what: str, why: str, fix: str) -> None:
    raise ValueError(f"consistent_layer_spec: {what}: {why}; {fix}")


def _check_provider(config) -> None:
    """The provider settings the consistent spec does not build or that would change its arithmetic."""
    pe = _field(config, "position_embedding_type")
    if pe not in ("rope", "none"):
        _refuse(f"position_embedding_type = {pe!r}", "the consistent core attention applies plain RoPE (ops.rope)",
                "use a RoPE model (rope) or NeMo RL's stock layer spec")
    refused = [
        ("normalization", config.normalization != "RMSNorm", "the consistent spec builds RMSNorm decoders"),
        ("gated_linear_unit", not config.gated_linear_unit, "the consistent MLP is gated (SwiGLU)"),
        ("activation_func", config.activation_func is not F.silu, "the consistent MLP's activation is silu"),
        ("add_bias_linear", config.add_bias_linear, "the consistent linears take q/k/v biases only"),
        ("num_moe_experts", config.num_moe_experts, "mixtures of experts are not mapped from a provider yet"),
        ("multi_latent_attention", config.multi_latent_attention, "multi-latent attention is not built"),
        ("window_size", config.window_size is not None, "sliding windows are not mapped from a provider yet"),
        ("softmax_scale", config.softmax_scale is not None, "the attention scale is head_dim ** -0.5"),
        ("rotary_percent", getattr(config, "rotary_percent", 1.0) != 1.0, "partial RoPE is not built"),
        ("rotary_interleaved", config.rotary_interleaved, "ops.rope rotates halves, not interleaved pairs"),
        ("rope_scaling", getattr(config, "rope_scaling", False), "scaled RoPE is not mapped from a provider yet"),
        ("mtp_num_layers", config.mtp_num_layers, "multi-token prediction layers are not built"),
        ("fp8", config.fp8, "the consistent linears are ops.linear, not fp8 GEMMs"),
        ("fp4", getattr(config, "fp4", None), "the consistent linears are ops.linear, not fp4 GEMMs"),
        ("sequence_parallel", config.sequence_parallel, "the consistent linears do not scatter the sequence"),
        ("tensor_model_parallel_size", config.tensor_model_parallel_size > 1,
         "the consistent linears have no Megatron sharded checkpoint layout yet (sharded_state_dict)"),
        ("pipeline_model_parallel_size", config.pipeline_model_parallel_size > 1,
         "the spec lists every layer of the model (one pipeline stage)"),
        ("context_parallel_size", config.context_parallel_size > 1,
         "the core attention sees this rank's tokens only (no ring over context-parallel ranks)"),
    ]
    for name, bad, why in refused:
        if bad:
            _refuse(f"{name} = {getattr(config, name, None)!r}", why, f"set {name} to its default or use "
                    "NeMo RL's stock layer spec")
    backend = str(getattr(config, "attention_backend", ""))
    if backend.endswith("local"):
        _refuse(f"attention_backend = {backend}", "Megatron-Bridge then replaces the core attention with its "
                "DotProductAttention", "leave policy.megatron_cfg.attention_backend unset (auto)")


def decoder_config(config) -> DecoderConfig:
    """The DecoderConfig of a Megatron-Bridge provider (a TransformerConfig with GPTModelProvider's fields):
    the same model as nemo-rz's loader reads from the checkpoint's Hugging Face config."""
    _check_provider(config)
    vocab = _field(config, "vocab_size")
    if vocab is None:
        _refuse("vocab_size = None", "the consistent spec needs the model's vocabulary", "set the provider's vocab_size")
    dtype = _DTYPES.get(config.params_dtype)
    if dtype is None:
        _refuse(f"params_dtype = {config.params_dtype}", "not a dtype nemo_rz.ops computes in",
                "use float32, bfloat16 or float16")
    return DecoderConfig(
        vocab_size=int(vocab), hidden_size=config.hidden_size, intermediate_size=config.ffn_hidden_size,
        num_layers=config.num_layers, num_heads=config.num_attention_heads,
        num_kv_heads=config.num_query_groups or config.num_attention_heads, head_dim=config.kv_channels,
        rope_theta=float(_field(config, "rotary_base")), rms_norm_eps=config.layernorm_epsilon,
        qk_norm=bool(config.qk_layernorm), attention_bias=bool(config.add_qkv_bias),
        tie_word_embeddings=bool(_field(config, "share_embeddings_and_output_weights")),
        max_position_embeddings=int(_field(config, "seq_length")), dtype=dtype)


class PackedCoreAttention(layers.CoreAttention):
    """layers.CoreAttention (consistent) whose tokens, when `packed_seq_params` carries none, are built from the
    forward's layout (dense [s, b, heads, d], or NeMo RL's packed `thd` [t, heads, d] with cu_seqlens)."""

    def __init__(self, *args, shared: dict, **kwargs):
        super().__init__(*args, **kwargs)
        self.shared = shared  # one dict for every layer of the block: the dense shapes' tokens

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if getattr(packed_seq_params, "tokens", None) is not None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            params = self._packed(packed_seq_params, query, key)
            out = super().forward(*(x.unsqueeze(1) for x in (query, key, value)), attention_mask, attn_mask_type,
                                  attention_bias, params)
            return out.squeeze(1)
        if packed_seq_params is not None:
            raise ValueError(f"PackedCoreAttention: packed_seq_params.qkv_format = {packed_seq_params.qkv_format!r}; "
                             "the consistent core attention reads thd (sequence packing) or no packed_seq_params")
        s, b, h, _ = query.shape
        k = (s, b, h, key.shape[2], str(query.device))
        params = self.shared.get(k)
        if params is None:
            t = Tokens(torch.zeros(0, dtype=torch.long, device=query.device),
                       torch.arange(s, device=query.device).repeat(b),
                       torch.arange(b, device=query.device).repeat_interleave(s), None, (b, s))
            params = layers.TokenParams(tokens=prepared(self.cfg, t, h, key.shape[2]))
            while len(self.shared) >= 16:
                self.shared.pop(next(iter(self.shared)))
            self.shared[k] = params
        return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, params)

    def _packed(self, p, query, key) -> layers.TokenParams:
        """The tokens of a thd batch, built by the first layer and kept on the PackedSeqParams for the others."""
        made = getattr(p, "_nemo_rz_tokens", None)
        if made is not None:
            return made
        bounds = p.cu_seqlens_q_padded if p.cu_seqlens_q_padded is not None else p.cu_seqlens_q
        if bounds is None:
            raise ValueError("PackedCoreAttention: a thd batch without cu_seqlens_q; pass the sequences' boundaries")
        bounds = bounds.to(device=query.device, dtype=torch.long)
        lengths = bounds[1:] - bounds[:-1]
        n = query.shape[0]
        if int(bounds[-1]) != n or int(bounds[0]) != 0 or bool((lengths < 0).any()):
            raise ValueError(f"PackedCoreAttention: cu_seqlens {bounds.tolist()} do not cover the {n} packed tokens "
                             "from 0 in order; pass boundaries of this forward's whole packed sequence")
        seq = torch.repeat_interleave(torch.arange(len(lengths), device=query.device), lengths)
        positions = torch.arange(n, device=query.device) - bounds[:-1][seq]
        longest = int(lengths.max()) if len(lengths) else 0
        t = Tokens(torch.zeros(0, dtype=torch.long, device=query.device), positions, seq, BatchKV(len(lengths), longest))
        made = layers.TokenParams(tokens=prepared(self.cfg, t, query.shape[1], key.shape[1]))
        p._nemo_rz_tokens = made
        return made


def _with_packed_attention(layer: ModuleSpec, cfg: DecoderConfig, shared: dict) -> ModuleSpec:
    attn = layer.submodules.self_attention
    core = ModuleSpec(module=PackedCoreAttention, params={"model_config": cfg, "shared": shared})
    attn = dataclasses.replace(attn, submodules=dataclasses.replace(attn.submodules, core_attention=core))
    return dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, self_attention=attn))


def consistent_layer_spec(config, vp_stage: int | None = None) -> ModuleSpec:
    """Megatron-Bridge's `transformer_layer_spec` callable: nemo-rz's consistent block spec for the provider
    `config` (vp_stage: Megatron-Bridge passes it; the spec is one pipeline stage, so only None or 0). Sets the
    provider's position_embedding_type "rope" to "none": the spec's core attention applies RoPE."""
    if vp_stage not in (None, 0):
        _refuse(f"vp_stage = {vp_stage}", "the spec lists every layer of the model (one pipeline stage)",
                "set virtual_pipeline_model_parallel_size to None")
    cfg = decoder_config(config)
    if "nemo_rl" in sys.modules:  # built by NeMo RL's Megatron setup: it must also give the model nemo-rz's output layer
        from nemo_rz.runtime.megatron import nemo_rl_policy

        nemo_rl_policy.check_output_layer()
    if config.position_embedding_type == "rope":  # RoPE moves into the core attention (ops.rope)
        config.position_embedding_type = "none"
    block = spec.block_spec(cfg, fast=False)
    shared: dict = collections.OrderedDict()
    subs = dataclasses.replace(block.submodules, layer_specs=[_with_packed_attention(s, cfg, shared)
                                                              for s in block.submodules.layer_specs])
    return dataclasses.replace(block, submodules=subs)


def consistent_output_layer(model: list) -> list:
    """A Megatron-Bridge pre-wrap hook: each model chunk's output layer (Megatron's ColumnParallelLinear) replaced
    by layers.ColumnLinear (ops.linear) of the same shape and parameter name; tied embeddings stay tied (the
    GPTModel hands the layer the embedding weight)."""
    for chunk in model:
        gpt = chunk
        while not hasattr(gpt, "output_layer") and hasattr(gpt, "module"):
            gpt = gpt.module
        old = getattr(gpt, "output_layer", None)
        if old is None:  # not the last pipeline stage
            continue
        new = layers.ColumnLinear(old.input_size, old.output_size, config=gpt.config, bias=old.bias is not None,
                                  gather_output=old.gather_output, skip_weight_param_allocation=old.weight is None,
                                  tp_group=old.tp_group)
        if old.weight is not None:
            new = new.to(old.weight.device)
            with torch.no_grad():
                new.weight.copy_(old.weight)
        gpt.output_layer = new
    return model


def resolve_layer_spec(value):
    """A `module:function` (or `module.function`) string of a layer-spec callable -> the callable; other values
    as they are. Refuses a callable whose signature Megatron-Bridge cannot call (one config argument, vp_stage)."""
    if not isinstance(value, str):
        return value
    module, sep, name = value.partition(":")
    if not sep:
        module, _, name = value.rpartition(".")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"{_WHERE}.transformer_layer_spec = {value!r}: cannot import it ({e}); use "
                         f"{SPEC_PATH}") from None
    params = list(inspect.signature(fn).parameters)
    if not params or (len(params) > 1 and params[1] != "vp_stage"):
        raise ValueError(f"{_WHERE}.transformer_layer_spec = {value!r}: Megatron-Bridge calls it as spec(config) or "
                         f"spec(config, vp_stage=...), but it takes ({', '.join(params)})")
    return fn


if "nemo_rl" in sys.modules:  # inside NeMo RL (its Megatron workers unpickling the policy config): its output layer
    from nemo_rz.runtime.megatron import nemo_rl_policy

    nemo_rl_policy.install_output_layer()
