"""Decoder hyper-parameters (Qwen3 family: RMSNorm, RoPE, GQA, SwiGLU, optional qk-norm and tied embeddings)."""
from __future__ import annotations

import dataclasses

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


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
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    sliding_window: int | None = None
    dtype: str = "float32"

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // max(self.num_heads, 1)
        self.validate()

    def validate(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"DecoderConfig.{name} = {value!r}: must be a positive integer")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"DecoderConfig: num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}; "
                "choose num_kv_heads dividing num_heads"
            )
        if self.head_dim % 2:
            raise ValueError(f"DecoderConfig.head_dim = {self.head_dim}: RoPE needs an even head_dim")
        if self.dtype not in DTYPES:
            raise ValueError(f"DecoderConfig.dtype = {self.dtype!r}: use one of {', '.join(DTYPES)}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"DecoderConfig.sliding_window = {self.sliding_window}: must be positive or None")

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
