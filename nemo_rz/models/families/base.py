"""What a model family is to nemo_rz: its config.json translation (defaults, sliding windows, RoPE, MoE keys,
the keys written back), its weight layout in files (which tensors are ignored, how experts are stored), its MoE
kind and its GGUF names. A family module (one per family, in this package) holds one `FAMILY`, an instance of
`Family` or of a subclass overriding the hooks below; the registry (families/__init__.py) collects them.

The generic parts (typed key readers, ModelFileError, the entry points config_from_hf / hf_config) stay in
models/hf_config.py, which calls these hooks.
"""
from __future__ import annotations

import dataclasses
import re

import torch

from nemo_rz.models.config import DecoderConfig
from nemo_rz.models.hf_config import ModelFileError, read_float, read_int  # noqa: F401  (re-exported for family modules)

# llama.cpp's tensor names (GGUF) for nemo_rz's (Hugging Face) parameter names; {i} is the layer index
GGUF_TENSORS = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "model.layers.{i}.input_layernorm.weight": "blk.{i}.attn_norm.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "blk.{i}.ffn_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "blk.{i}.attn_q.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "blk.{i}.attn_k.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "blk.{i}.attn_v.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "blk.{i}.attn_output.weight",
    "model.layers.{i}.self_attn.q_proj.bias": "blk.{i}.attn_q.bias",
    "model.layers.{i}.self_attn.k_proj.bias": "blk.{i}.attn_k.bias",
    "model.layers.{i}.self_attn.v_proj.bias": "blk.{i}.attn_v.bias",
    "model.layers.{i}.self_attn.o_proj.bias": "blk.{i}.attn_output.bias",
    "model.layers.{i}.self_attn.q_norm.weight": "blk.{i}.attn_q_norm.weight",
    "model.layers.{i}.self_attn.k_norm.weight": "blk.{i}.attn_k_norm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "blk.{i}.ffn_gate.weight",
    "model.layers.{i}.mlp.up_proj.weight": "blk.{i}.ffn_up.weight",
    "model.layers.{i}.mlp.down_proj.weight": "blk.{i}.ffn_down.weight",
}


# Megatron GPTModel's tensor names: {Megatron name pattern: (how its nemo_rz tensors join, their name patterns)}.
# "same": one tensor as it is; "qkv": q, k, v fused by query group; "gate_up": [gate; up] (runtime/megatron/convert.py).
MEGATRON_TENSORS = {
    "embedding.word_embeddings.weight": ("same", ("model.embed_tokens.weight",)),
    "decoder.final_layernorm.weight": ("same", ("model.norm.weight",)),
    "output_layer.weight": ("same", ("lm_head.weight",)),
    "decoder.layers.{i}.input_layernorm.weight": ("same", ("model.layers.{i}.input_layernorm.weight",)),
    "decoder.layers.{i}.pre_mlp_layernorm.weight": ("same", ("model.layers.{i}.post_attention_layernorm.weight",)),
    "decoder.layers.{i}.self_attention.q_layernorm.weight": ("same", ("model.layers.{i}.self_attn.q_norm.weight",)),
    "decoder.layers.{i}.self_attention.k_layernorm.weight": ("same", ("model.layers.{i}.self_attn.k_norm.weight",)),
    "decoder.layers.{i}.self_attention.linear_qkv.weight": ("qkv", tuple(f"model.layers.{{i}}.self_attn.{p}_proj.weight" for p in "qkv")),
    "decoder.layers.{i}.self_attention.linear_qkv.bias": ("qkv", tuple(f"model.layers.{{i}}.self_attn.{p}_proj.bias" for p in "qkv")),
    "decoder.layers.{i}.self_attention.linear_proj.weight": ("same", ("model.layers.{i}.self_attn.o_proj.weight",)),
    "decoder.layers.{i}.self_attention.linear_proj.bias": ("same", ("model.layers.{i}.self_attn.o_proj.bias",)),
    "decoder.layers.{i}.self_attention.core_attention.sinks": ("same", ("model.layers.{i}.self_attn.sinks",)),
    "decoder.layers.{i}.mlp.linear_fc1.weight": ("gate_up", ("model.layers.{i}.mlp.gate_proj.weight",
                                                             "model.layers.{i}.mlp.up_proj.weight")),
    "decoder.layers.{i}.mlp.linear_fc2.weight": ("same", ("model.layers.{i}.mlp.down_proj.weight",)),
}


@dataclasses.dataclass(frozen=True)
class Family:
    architecture: str  # the Hugging Face architecture name ("LlamaForCausalLM")
    model_type: str
    qk_norm: bool
    bias: str  # "qkv": q/k/v biases always (Qwen2); "config": attention_bias sets q/k/v/o; "none"
    max_positions: int  # transformers' default max_position_embeddings
    head_dim: int | None = None  # transformers' default head_dim (None: hidden_size // heads)
    windows: str = "none"  # which layers slide: "none", "all", "all_if_used", "qwen", "layer_types"
    rms_norm_eps: float = 1e-6
    tie: bool = False  # default tie_word_embeddings
    theta: float = 10000.0  # default rope_theta
    bias_default: bool = False  # default attention_bias (bias="config")
    local_theta: float | None = None  # default RoPE theta of the sliding layers when it is their own (Gemma 3)
    default_window: int | None = None  # default sliding_window
    window_pattern: int | None = None  # windows="layer_types": every n-th layer is full by default
    moe_kind: str | None = None  # models/moe.py KINDS key
    expert_keys: tuple[str, ...] = ()  # the config.json keys of the expert count, in the order they are read
    gguf_arch: str | None = None  # general.architecture of its GGUF files (None: nemo_rz reads none)
    rank: int = 50  # for_config: the natural family of a config is the lowest-ranked one that claims it

    # -- config.json -> DecoderConfig -------------------------------------------------------------------------
    def pattern(self, d: dict, source: str) -> int:
        """windows="layer_types": the default pattern (every n-th layer full)."""
        return self.window_pattern or 2

    def family_keys(self, d: dict, source: str) -> dict:
        """The DecoderConfig keys only some families set (norm, activation, sinks...); refuses what is not run."""
        act = d.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ModelFileError(
                f"hidden_act={act!r} in {source} is not supported: {self.architecture}'s MLP is SwiGLU (silu) in nemo_rz"
            )
        return {}

    def moe(self, d: dict, source: str, layers: int) -> tuple[dict, list[int]] | None:
        """(the DecoderConfig MoE keys, the MoE layers), None for a dense family."""
        return None

    def normalized(self, d: dict, source: str) -> dict:
        """config.json as the generic reader (hf_config.config_from_hf) takes it: a family whose keys differ
        (DeepSeek-V4) returns a translated copy; the rest return d."""
        return d

    # -- DecoderConfig -> config.json ------------------------------------------------------------------------
    def natural(self, cfg: DecoderConfig) -> bool:
        """Whether a model with `cfg` is saved as this family by default (hf_config.architecture_for)."""
        return False

    def write(self, cfg: DecoderConfig, out: dict, types: list[str], sliding: bool) -> None:
        """Add (or drop) this family's keys in the generic config.json dict `out`."""

    # -- weights -----------------------------------------------------------------------------------------------
    def ignored(self, name: str, cfg: DecoderConfig) -> bool:
        """Tensors of files that are not parameters (transformers ignores them too): RoPE buffers of old
        checkpoints, and the head of a tied model."""
        return name.endswith("rotary_emb.inv_freq") or (cfg.tie_word_embeddings and name == "lm_head.weight")

    per_expert: re.Pattern | None = None  # the names of per-expert file tensors (None: experts are stored stacked)
    integers: re.Pattern | None = None  # the names of integer file tensors (DeepSeek-V4's hash table); others are float

    def alias(self, name: str) -> str:
        """A file tensor's name as the model spells it, where a checkpoint spells the same tensor otherwise (Kimi
        Linear: `block_sparse_moe.` for `mlp.`); applied before file_shapes / stack see the names."""
        return name

    def file_shapes(self, shapes: dict[str, tuple], cfg: DecoderConfig) -> dict[str, tuple]:
        """The file names and shapes of the file layout for a model's parameter shapes."""
        return shapes

    def stack(self, tensors: dict[str, torch.Tensor], shapes: dict[str, tuple]) -> dict[str, torch.Tensor]:
        """File tensors -> the model's parameters."""
        return tensors

    def unstack(self, tensors: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
        """The model's parameters -> the tensors files hold."""
        return tensors

    # -- GGUF ------------------------------------------------------------------------------------------------
    def gguf_tensors(self) -> dict[str, str | tuple[str, ...]]:
        """{nemo_rz parameter name pattern: GGUF tensor name pattern} ({i}: layer); a tuple names the GGUF
        tensors the parameter is the concatenation of, along its rows (dim -2)."""
        return dict(GGUF_TENSORS)

    def gguf_config(self, get, layers: int) -> dict:
        """The config.json keys only this family reads from GGUF metadata; get(key) reads `{arch}.key` (None
        when absent)."""
        return {}

    def gguf_metadata(self, cfg: DecoderConfig) -> dict:
        """The `{arch}.key` metadata (keys without the prefix) llama.cpp writes for a model with `cfg`: what
        models/gguf.py's config_dict reads back."""
        out = {"context_length": cfg.max_position_embeddings, "embedding_length": cfg.hidden_size,
               "block_count": cfg.num_layers, "feed_forward_length": cfg.intermediate_size,
               "attention.head_count": cfg.num_heads, "attention.head_count_kv": cfg.num_kv_heads,
               "attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim,
               "rope.freq_base": float(cfg.rope_theta), "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
               "vocab_size": cfg.vocab_size}
        if cfg.sliding_window is not None:
            out["attention.sliding_window"] = cfg.sliding_window
        return out

    def from_gguf(self, name: str, t: torch.Tensor, cfg: DecoderConfig) -> torch.Tensor:
        """A parameter's values from its GGUF tensor (llama.cpp's converter changes some: see the families)."""
        return t

    def to_gguf(self, name: str, t: torch.Tensor, cfg: DecoderConfig) -> torch.Tensor:
        """from_gguf's inverse (what llama.cpp's converter writes)."""
        return t


    # -- Megatron ----------------------------------------------------------------------------------------------
    def megatron_tensors(self) -> dict[str, tuple[str, tuple[str, ...]]] | None:
        """{Megatron name pattern: (join, nemo_rz name patterns)} ({i}: layer), as MEGATRON_TENSORS; None where the
        Megatron learner does not build this family's layers yet."""
        return dict(MEGATRON_TENSORS)

def gguf_names(fam: Family, layers: int) -> dict[str, str | tuple[str, ...]]:
    """{parameter name: GGUF tensor name(s)} of every parameter name `fam` maps, for `layers` layers."""
    out = {}
    for hf, gg in fam.gguf_tensors().items():
        for i in range(layers) if "{i}" in hf else (None,):
            out[hf.format(i=i)] = tuple(g.format(i=i) for g in gg) if isinstance(gg, tuple) else gg.format(i=i)
    return out
