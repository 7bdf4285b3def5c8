"""Decoder hyper-parameters: the Qwen3 / Qwen2 / Llama base (RMSNorm, RoPE, GQA, SwiGLU, optional qk-norm and
tied embeddings) plus what varies per layer or per family: attention kind (full or sliding window, learned
sinks), MLP kind (dense or mixture of experts), norm / activation / embedding variants and RoPE scaling."""
from __future__ import annotations

import dataclasses
import math

import torch

from nemo_rz.ops.rope import RopeScaling

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")  # linear: models/linear_attention.py
# "rms": weight * normalized in the model dtype (Qwen/Llama); "rms_f32": weight applied in float32 (gpt-oss);
# "gemma": normalized * (1 + weight) in float32 (Gemma).
NORMS = ("rms", "rms_f32", "gemma")
ACTIVATIONS = ("silu", "gelu_tanh")
# "qwen3": softmax over all experts, top-k, optional renormalisation; SwiGLU experts without biases.
# "gpt_oss": top-k over the logits, softmax over the k; router and expert biases; clamped SwiGLU.
# "deepseek": float32 sigmoid scores, a selection-only bias, group-limited top-k, scaled weights, shared experts.
MOE_KINDS = ("qwen3", "gpt_oss", "deepseek")
# "gqa": per-head queries, keys and values (num_kv_heads key heads); "mla": multi-head latent attention
# (models/mla.py): one latent key head of kv_lora_rank + head_dim (the decoupled RoPE part) per token.
# "deepseek_v4": DeepSeek-V4's shared-KV attention over a sliding window and compressed entries, with
# hyper-connections (models/deepseek_v4.py; its own hyper-parameters in `deepseek_v4`)
ATTENTION_KINDS = ("gqa", "mla", "deepseek_v4")
# the linear_attention layers (models/linear_attention.py): "gated_deltanet": Gated DeltaNet, one decay per head
# (Qwen3-Next's fused in_proj_qkvz / in_proj_ba); "gated_deltanet_split": the same with Qwen3.5's split
# projections; "kda": Kimi Delta Attention, one decay per key channel (Kimi Linear)
LINEAR_KINDS = ("gated_deltanet", "gated_deltanet_split", "kda")


@dataclasses.dataclass
class DecoderConfig:
    vocab_size: int = 32
    hidden_size: int = 64
    intermediate_size: int = 192
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None  # default hidden_size // num_heads
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    qk_norm: bool = True
    attention_bias: bool = False  # q/k/v biases
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    sliding_window: int | None = None
    dtype: str = "float32"
    # -- per layer ---------------------------------------------------------------------------------
    layer_types: list[str] | None = None  # one of LAYER_TYPES per layer; None: all sliding if sliding_window
    moe_layers: list[int] | None = None  # layers with a mixture of experts; None: all of them when num_experts
    # -- attention variants ------------------------------------------------------------------------
    attention_sinks: bool = False  # one learned logit per head in every softmax denominator (gpt-oss)
    o_proj_bias: bool = False
    query_pre_attn_scalar: float | None = None  # softmax scale = this ** -0.5 (None: head_dim)
    rope_scaling: dict | None = None  # RopeScaling fields (rope_type, factor, ...); None: plain RoPE
    rope_local_theta: float | None = None  # sliding layers' RoPE theta, unscaled (Gemma 3); None: as full layers
    # -- norm / activation / embedding variants ------------------------------------------------------
    norm: str = "rms"
    sandwich_norm: bool = False  # norms on the attention and MLP outputs too (Gemma's four norms per layer)
    hidden_act: str = "silu"
    embed_scale: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
    # -- mixture of experts ----------------------------------------------------------------------------
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int | None = None  # default intermediate_size
    moe_kind: str = "qwen3"
    norm_topk_prob: bool = True  # qwen3: renormalise the k chosen probabilities to sum to 1
    swiglu_limit: float = 7.0  # gpt_oss
    n_group: int = 1  # deepseek: expert groups; topk_group of them are searched for each token's experts
    topk_group: int = 1
    routed_scaling_factor: float = 1.0  # deepseek: the routed experts' weights times this
    n_shared_experts: int = 0  # deepseek: always-on experts, one MLP of n_shared_experts * moe_intermediate_size
    shared_expert_intermediate_size: int = 0  # qwen3: > 0 adds a sigmoid-gated shared expert (Qwen2-MoE)
    # -- multi-head latent attention (attention_kind "mla"; head_dim is then the RoPE part of a query/key head) --
    attention_kind: str = "gqa"
    q_lora_rank: int | None = None  # None: queries by one projection; else a low-rank pair with a norm between
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # the RoPE part's dimensions rotate in adjacent pairs (DeepSeek)
    use_rope: bool = True  # False: no rotary position embedding anywhere (Kimi Linear's MLA: positions come from
    #                        its linear layers; the decoupled key part is then attended unrotated)
    # -- hybrid linear attention (layer_types "linear_attention": models/linear_attention.py) -----------------
    linear_kind: str = "gated_deltanet"  # LINEAR_KINDS
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    attention_output_gate: bool = False  # full attention times sigmoid(a per-head gate from q_proj) (Qwen3-Next)
    partial_rotary_factor: float = 1.0  # RoPE on the first head_dim * this dimensions of each head
    deepseek_v4: dict | None = None  # attention_kind "deepseek_v4": models/deepseek_v4.py's V4 keys

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // max(self.num_heads, 1)
        if self.moe_intermediate_size is None:
            self.moe_intermediate_size = self.intermediate_size
        self.validate()

    def validate(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "num_experts_per_tok", "moe_intermediate_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"DecoderConfig.{name} = {value!r}: must be a positive integer")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"DecoderConfig: num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}; "
                "choose num_kv_heads dividing num_heads"
            )
        if self.head_dim % 2:
            raise ValueError(f"DecoderConfig.head_dim = {self.head_dim}: RoPE needs an even head_dim")
        for name, allowed in (("dtype", tuple(DTYPES)), ("norm", NORMS), ("hidden_act", ACTIVATIONS), ("moe_kind", MOE_KINDS),
                              ("attention_kind", ATTENTION_KINDS), ("linear_kind", LINEAR_KINDS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"DecoderConfig.{name} = {getattr(self, name)!r}: use one of {', '.join(allowed)}")
        if self.sliding_window is not None and (isinstance(self.sliding_window, bool) or self.sliding_window <= 0):
            raise ValueError(f"DecoderConfig.sliding_window = {self.sliding_window}: must be positive or None")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers or any(t not in LAYER_TYPES for t in self.layer_types):
                raise ValueError(
                    f"DecoderConfig.layer_types = {self.layer_types!r}: need one of {', '.join(LAYER_TYPES)} per layer "
                    f"({self.num_layers})"
                )
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ValueError("DecoderConfig: layer_types has sliding_attention layers but sliding_window is None; set it")
        if isinstance(self.num_experts, bool) or not isinstance(self.num_experts, int) or self.num_experts < 0:
            raise ValueError(f"DecoderConfig.num_experts = {self.num_experts!r}: must be 0 (dense) or a positive integer")
        if self.num_experts and self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"DecoderConfig: num_experts_per_tok={self.num_experts_per_tok} is more than num_experts={self.num_experts}"
            )
        if self.moe_layers is not None and any(
                isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_layers for i in self.moe_layers):
            raise ValueError(f"DecoderConfig.moe_layers = {self.moe_layers!r}: need layer indices in [0, {self.num_layers})")
        for name in ("rope_theta", "rms_norm_eps", "swiglu_limit", "query_pre_attn_scalar", "rope_local_theta"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"DecoderConfig.{name} = {value!r}: must be a positive finite number")
        if self.rope_scaling is not None:
            self.rope_scaling_rule  # noqa: B018 (validates)
        if self.moe_kind == "deepseek":
            for name in ("n_group", "topk_group"):
                value = getattr(self, name)
                if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                    raise ValueError(f"DecoderConfig.{name} = {value!r}: must be a positive integer")
            if self.num_experts and (self.num_experts % self.n_group or self.topk_group > self.n_group
                                     or self.num_experts_per_tok > self.topk_group * (self.num_experts // self.n_group)):
                raise ValueError(
                    f"DecoderConfig: {self.num_experts} experts in n_group={self.n_group} groups, topk_group="
                    f"{self.topk_group}, num_experts_per_tok={self.num_experts_per_tok}: the groups must split the "
                    "experts evenly and the chosen groups hold at least num_experts_per_tok experts"
                )
            if self.num_experts and self.num_experts // self.n_group < 2:
                raise ValueError(f"DecoderConfig: n_group={self.n_group} leaves fewer than 2 experts per group "
                                 "(a group's score is its top-2 sum); use fewer groups")
        for name in ("routed_scaling_factor",):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0):
                raise ValueError(f"DecoderConfig.{name} = {value!r}: must be a positive finite number")
        for name in ("n_shared_experts", "shared_expert_intermediate_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"DecoderConfig.{name} = {value!r}: must be 0 or a positive integer")
        if self.attention_kind == "mla":
            for name in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim") + (("q_lora_rank",) if self.q_lora_rank is not None else ()):
                value = getattr(self, name)
                if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                    raise ValueError(f"DecoderConfig.{name} = {value!r}: multi-head latent attention needs a positive integer")
            if self.num_kv_heads != 1:
                raise ValueError(f"DecoderConfig: attention_kind='mla' attends one latent key head, so num_kv_heads must "
                                 f"be 1, not {self.num_kv_heads}")
            if self.qk_norm or self.attention_sinks or self.sliding_window is not None or self.attention_output_gate:
                raise ValueError("DecoderConfig: attention_kind='mla' has no qk_norm, sinks, sliding windows or output "
                                 "gate; turn them off")

        if self.layer_types is not None and "linear_attention" in self.layer_types:
            for name in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                         "linear_conv_kernel_dim"):
                value = getattr(self, name)
                if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                    raise ValueError(f"DecoderConfig.{name} = {value!r}: linear_attention layers need a positive integer")
            if self.linear_num_value_heads % self.linear_num_key_heads:
                raise ValueError(f"DecoderConfig: linear_num_value_heads={self.linear_num_value_heads} is not a multiple "
                                 f"of linear_num_key_heads={self.linear_num_key_heads}")
            if self.linear_kind == "kda" and (self.linear_num_key_heads != self.linear_num_value_heads
                                              or self.linear_key_head_dim != self.linear_value_head_dim):
                raise ValueError("DecoderConfig: linear_kind='kda' has one head count and one head size for queries, keys "
                                 "and values; set linear_num_key_heads = linear_num_value_heads and linear_key_head_dim "
                                 "= linear_value_head_dim")
        if not isinstance(self.use_rope, bool):
            raise ValueError(f"DecoderConfig.use_rope = {self.use_rope!r}: must be true or false")
        if self.attention_kind == "deepseek_v4":
            from nemo_rz.models.deepseek_v4 import params

            params(self)  # raises on a bad deepseek_v4 dict
            if self.num_kv_heads != 1 or self.sliding_window is None or not self.num_experts:
                raise ValueError("DecoderConfig: attention_kind='deepseek_v4' needs num_kv_heads=1, a sliding_window and "
                                 "num_experts > 0 (every V4 layer is a mixture of experts)")
        elif self.deepseek_v4 is not None:
            raise ValueError("DecoderConfig.deepseek_v4 is set but attention_kind is not 'deepseek_v4'; set both or neither")
        rot = self.head_dim * self.partial_rotary_factor
        if not (0 < self.partial_rotary_factor <= 1) or rot != int(rot) or int(rot) % 2:
            raise ValueError(f"DecoderConfig.partial_rotary_factor = {self.partial_rotary_factor!r}: head_dim times it "
                             "must be an even whole number of dimensions, at most head_dim")

    # -- per-layer structure ---------------------------------------------------------------------------
    def window(self, layer: int) -> int | None:
        """Layer `layer`'s attention window (None: full attention)."""
        if self.layer_types is None:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def windows(self) -> list[int | None]:
        return [self.window(i) for i in range(self.num_layers)]

    def is_linear(self, layer: int) -> bool:
        """Whether layer `layer` is a linear-attention layer (Gated DeltaNet or Kimi Delta Attention: linear_kind)."""
        return self.layer_types is not None and self.layer_types[layer] == "linear_attention"

    @property
    def has_linear_attention(self) -> bool:
        return any(self.is_linear(i) for i in range(self.num_layers))

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe(self, layer: int) -> bool:
        return self.num_experts > 0 and (self.moe_layers is None or layer in self.moe_layers)

    @property
    def rope_scaling_rule(self) -> RopeScaling | None:
        if self.rope_scaling is None:
            return None
        try:
            return RopeScaling(**self.rope_scaling)
        except TypeError as e:
            raise ValueError(f"DecoderConfig.rope_scaling = {self.rope_scaling!r}: {e}") from None

    def rope(self, layer: int) -> tuple[float, RopeScaling | None]:
        """(theta, scaling) of layer `layer`'s RoPE."""
        if self.rope_local_theta is not None and self.window(layer) is not None:
            return float(self.rope_local_theta), None
        return float(self.rope_theta), self.rope_scaling_rule

    @property
    def attention_scale(self) -> float:
        """The softmax scale. MLA: (qk_nope_head_dim + head_dim) ** -0.5, times YaRN's mscale(factor,
        mscale_all_dim) squared when the scaling names mscale_all_dim (DeepSeek)."""
        if self.attention_kind == "mla":
            scale = (self.qk_nope_head_dim + self.head_dim) ** -0.5
            rule = self.rope_scaling_rule
            if rule is not None and rule.rope_type != "default" and rule.mscale_all_dim and rule.factor > 1:
                scale *= (0.1 * rule.mscale_all_dim * math.log(rule.factor) + 1.0) ** 2
            return scale
        return (self.query_pre_attn_scalar if self.query_pre_attn_scalar is not None else self.head_dim) ** -0.5

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DecoderConfig":
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - fields)
        if unknown:
            raise ValueError(f"DecoderConfig: unknown keys {unknown}; valid keys are {sorted(fields)}")
        return cls(**d)
